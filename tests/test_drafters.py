"""Drafters (`spsjax.sampling.drafters`): prompt lookup against a reference search, and every
drafter in the SpS loop: exact output law (G-test against enumeration), greedy parity with ArS,
the draft cache's invariant, ragged proposals and their statistics."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spsjax import models
from spsjax.sampling import (SamplingConfig, autoregressive_sample, drafter_config, drafters,
                             rejection, speculative)
from spsjax.sampling import speculative_sample
from tests.stats import exact_sequence_law, g_test_pvalue, scaled_model, sequence_counts
from tests.test_speculative import _ragged, _run_checking_caches

GREEDY = SamplingConfig(temperature=0.0)
P_MIN = 1e-5  # Each G-test fails a correct sampler with this probability.


def test_every_drafter_implements_the_interface():
  """The loop's contract is `drafters.Drafter`: each kind implements it, and a drafter missing a
  method cannot be made."""
  for kind in drafter_config.KINDS:
    assert isinstance(drafter_config.build(kind), drafters.Drafter), kind

  class Incomplete(drafters.Drafter):  # No init, propose, rollback or draft_steps.
    needs_model = False
    ragged = False

  with pytest.raises(TypeError, match='abstract'):
    Incomplete()


def _reference_lookup(seq, k, max_ngram, min_ngram):
  """The latest earlier occurrence of the longest matching suffix n-gram, by plain search, and
  the k tokens after it, copied one at a time (a copy may read tokens it wrote)."""
  c = len(seq)
  for n in range(max_ngram, min_ngram - 1, -1):
    for j in range(c - n - 1, -1, -1):
      if list(seq[j:j + n]) == list(seq[c - n:]):
        out = list(seq)
        for i in range(k):
          out.append(out[j + n + i])
        return out[c:]
  return []


@pytest.mark.parametrize('max_ngram,min_ngram', [(3, 1), (2, 2), (1, 1)])
def test_lookup_finds_the_latest_longest_match(max_ngram, min_ngram):
  rng = np.random.default_rng(max_ngram * 10 + min_ngram)
  B, P, W, k, V = 64, 9, 8, 4, 4  # A small vocabulary: many matches, of every length.
  lengths = rng.integers(1, P + 1, size=B).astype(np.int32)
  prompts = rng.integers(0, V, size=(B, P)).astype(np.int32)
  num_generated = rng.integers(0, W + 1, size=B).astype(np.int32)
  tokens = np.where(np.arange(W)[None] < num_generated[:, None],
                    rng.integers(0, V, size=(B, W)), -1).astype(np.int32)
  committed = drafters.Committed(jnp.asarray(prompts), jnp.asarray(lengths), jnp.asarray(tokens),
                                 jnp.asarray(num_generated), V)
  got, count = jax.jit(lambda c: drafters.PromptLookup(max_ngram, min_ngram).lookup(c, k))(
      committed)
  got, count = np.asarray(got), np.asarray(count)
  sizes = set()
  for b in range(B):
    seq = list(prompts[b, :lengths[b]]) + list(tokens[b, :num_generated[b]])
    np.testing.assert_array_equal(np.asarray(committed.sequence())[b, :len(seq)], seq)
    want = _reference_lookup(seq, k, max_ngram, min_ngram)
    assert int(count[b]) == len(want), (b, seq)
    assert list(got[b, :len(want)]) == want, (b, seq)
    sizes.add(len(want))
  assert sizes == {0, k}  # Rows without a match, and full proposals.


def test_bad_settings_are_refused(pair):
  target, draft = pair
  with pytest.raises(ValueError, match='min_ngram <= max_ngram'):
    drafters.PromptLookup(max_ngram=1, min_ngram=2)
  with pytest.raises(ValueError, match='stop_below'):
    drafters.ModelDrafter(stop_below=1.5)
  prompts, lengths = _ragged(0)
  with pytest.raises(ValueError, match='pass draft=None'):
    speculative_sample(target, draft, prompts, lengths, jax.random.key(0), k=2, max_new_tokens=4,
                       drafter=drafters.PromptLookup())
  with pytest.raises(ValueError, match='needs a draft model'):
    speculative_sample(target, None, prompts, lengths, jax.random.key(0), k=2, max_new_tokens=4,
                       drafter=drafters.Hybrid())


# --- Exactness, statistically -------------------------------------------------------------------

V_SMALL, PROMPT, NEW, ROWS = 7, (1, 4, 2, 1, 4), 3, 50_000  # The prompt repeats: lookup matches.

DRAFTERS = {  # name: (drafter, trim_score)
    'lookup': (drafters.PromptLookup(max_ngram=2), False),
    'lookup_trimmed': (drafters.PromptLookup(max_ngram=2), True),
    'hybrid': (drafters.Hybrid(max_ngram=2), False),
    'dynamic_k': (drafters.ModelDrafter(stop_below=0.5), False),
    'dynamic_k_trimmed': (drafters.ModelDrafter(stop_below=0.5), True),
}


@pytest.fixture(scope='module')
def tiny_pair():
  config = lambda layers: models.TransformerConfig(
      vocab_size=V_SMALL, d_model=16, num_layers=layers, num_heads=2, d_ff=32, max_seq_len=16,
      tie_embeddings=False)
  return scaled_model(config(2), 0, 1.5), scaled_model(config(1), 1, 1.5)


SAMPLINGS = {'temperature_1': SamplingConfig(),
             'top_p_0.8': SamplingConfig(temperature=0.7, top_p=0.8)}


@pytest.mark.parametrize('name,setting', [
    ('lookup', 'top_p_0.8'), ('lookup_trimmed', 'top_p_0.8'),
    ('hybrid', 'top_p_0.8'), ('dynamic_k', 'temperature_1'), ('dynamic_k', 'top_p_0.8'),
    ('dynamic_k_trimmed', 'temperature_1')])
def test_output_law_is_target_law(tiny_pair, name, setting):
  """50,000 rows, 3 tokens, against the enumerated law of the target. Power: detects at 80% any
  law within total variation 0.024 (temperature 1; 0.4% of the mass pooled) or 0.016 (top-p 0.8)
  of it (`stats.detectable_tv`; test_speculative's temperature 1 and top-p draw twice as many
  rows)."""
  target, draft = tiny_pair
  drafter, trim_score = DRAFTERS[name]
  sampling = SAMPLINGS[setting]
  prompts = np.tile(np.array(PROMPT, np.int32), (ROWS, 1))
  out = speculative_sample(target, draft if drafter.needs_model else None, prompts,
                           np.full((ROWS,), len(PROMPT), np.int32), jax.random.key(7), k=3,
                           max_new_tokens=NEW, sampling=sampling, drafter=drafter,
                           trim_score=trim_score)
  assert (np.asarray(out.num_generated) == NEW).all()
  law = exact_sequence_law(target, PROMPT, NEW, sampling)
  pvalue = g_test_pvalue(sequence_counts(np.asarray(out.tokens), V_SMALL), law)
  assert pvalue > P_MIN, f'{name}: G-test p-value {pvalue:.2e}'
  # Lookup and dynamic k proposed fewer than k in some loops (hybrid's model fills every slot).
  loops, drafted = int(np.sum(out.num_loops)), int(np.sum(out.num_drafted))
  assert (drafted == 3 * loops) if name == 'hybrid' else (0 < drafted < 3 * loops)
  proposed_N = np.asarray(out.proposed_histogram)  # Loops that proposed n = 0 .. k drafts.
  assert proposed_N.sum() == loops and (proposed_N * np.arange(4)).sum() == drafted
  assert int(np.sum(out.num_accepted)) > 0
  assert int(np.sum(out.num_full_loops)) <= loops


def test_lenient_sps_follows_its_own_law(tiny_pair):
  """l = 0.4, two new tokens: the first comes from the target's prefill (p), the second from the
  first loop's first draft position, so the pair's law is p(t1) lenient_law(p(.|t1), q(.|t1)).
  Power: detects at 80% any law within total variation 0.018 of it (`stats.detectable_tv`, 49
  outcomes, 50,000 rows)."""
  target, draft = tiny_pair
  sampling = SamplingConfig(temperature=0.8)
  prompts = np.tile(np.array(PROMPT, np.int32), (ROWS, 1))
  out = speculative_sample(target, draft, prompts, np.full((ROWS,), len(PROMPT), np.int32),
                           jax.random.key(8), k=3, max_new_tokens=2, sampling=sampling,
                           lenience=0.4)
  p_VxV = exact_sequence_law(target, PROMPT, 2, sampling)
  q_VxV = exact_sequence_law(draft, PROMPT, 2, sampling)
  p1_V = p_VxV.sum(1)
  conditional = lambda joint: joint / joint.sum(1, keepdims=True)
  law = p1_V[:, None] * np.asarray(rejection.lenient_law(
      jnp.asarray(conditional(p_VxV)), jnp.asarray(conditional(q_VxV)), 0.4), np.float64)
  counts = sequence_counts(np.asarray(out.tokens), V_SMALL)
  assert g_test_pvalue(counts, law) > P_MIN
  assert g_test_pvalue(counts, p_VxV) < 1e-20  # Lossy, detectably.


# --- Greedy parity, caches ----------------------------------------------------------------------


@pytest.fixture(scope='module')
def pair():
  config = lambda layers, d: models.TransformerConfig(
      vocab_size=48, d_model=d, num_layers=layers, num_heads=2, d_ff=2 * d, max_seq_len=64,
      tie_embeddings=False)
  return scaled_model(config(2, 32), 0, 1.0), scaled_model(config(1, 24), 1, 1.0)


@pytest.mark.parametrize('drafter,k', [
    (drafters.PromptLookup(), 1), (drafters.PromptLookup(), 4), (drafters.Hybrid(), 4),
    (drafters.ModelDrafter(stop_below=0.3), 4)], ids=str)
def test_greedy_sps_equals_greedy_ars(pair, drafter, k):
  target, draft = pair
  prompts, lengths = _ragged(k + 30, batch=6)
  ars = autoregressive_sample(target, prompts, lengths, jax.random.key(0), max_new_tokens=24,
                              sampling=GREEDY, eos_id=5)
  for trim_score in (False, True) if drafter.ragged else (False,):
    sps = speculative_sample(target, draft if drafter.needs_model else None, prompts, lengths,
                             jax.random.key(1), k=k, max_new_tokens=24, sampling=GREEDY, eos_id=5,
                             drafter=drafter, trim_score=trim_score)
    np.testing.assert_array_equal(sps.tokens, ars.tokens)
    np.testing.assert_array_equal(sps.num_generated, ars.num_generated)
  assert int(np.sum(sps.num_accepted)) > 0  # Greedy text repeats itself: lookup hits too.


def check_unrolled_drafts(target, draft, drafter, prompts, lengths, k=3):
  """SpS at temperature 1 with the drafter's steps unrolled (`Loop.drafts_unrolled`, forced here
  on the CPU) and in their `fori_loop`: the same tokens and loop counts, and the unrolled program
  has no loop left inside the draft phase."""
  loop, args = speculative.prepare(target, draft, prompts, lengths, k=k, max_new_tokens=10,
                                   drafter=drafter)
  assert not loop.drafts_unrolled  # The default on a CPU: the loop.
  outs = []
  for unrolled in (False, True):
    program = speculative.Loop.run.lower(
        dataclasses.replace(loop, unroll_drafts=unrolled), *args, jax.random.key(2)).compile()
    draft_loops = [line for line in program.as_text().splitlines()
                   if ' while(' in line and '/draft/while' in line]
    assert bool(draft_loops) != unrolled, draft_loops
    outs.append(program(*args, jax.random.key(2)))
  rolled, unrolled = outs
  np.testing.assert_array_equal(unrolled.tokens, rolled.tokens)
  np.testing.assert_array_equal(unrolled.num_accepted, rolled.num_accepted)
  np.testing.assert_array_equal(unrolled.num_loops, rolled.num_loops)
  assert 0 < int(np.sum(rolled.num_accepted)) < k * int(np.sum(rolled.num_loops))


@pytest.mark.parametrize('drafter', [drafters.ModelDrafter(), drafters.Hybrid()], ids=str)
def test_unrolled_draft_steps_give_the_same_tokens(pair, drafter):
  check_unrolled_drafts(*pair, drafter, *_ragged(9, batch=4))


def test_draft_steps_unroll_by_default_off_a_cpu():
  loop = speculative.Loop(k=2, max_new_tokens=4, sampling=SamplingConfig(),
                          draft_sampling=SamplingConfig())
  on = lambda platform: types.SimpleNamespace(devices=np.array([types.SimpleNamespace(
      platform=platform)]))
  assert not loop.drafts_unrolled and loop.platform == 'cpu'
  assert dataclasses.replace(loop, mesh=on('gpu')).drafts_unrolled
  assert dataclasses.replace(loop, mesh=on('tpu')).drafts_unrolled
  assert not dataclasses.replace(loop, mesh=on('tpu'), unroll_drafts=False).drafts_unrolled
  assert dataclasses.replace(loop, unroll_drafts=True).drafts_unrolled


@pytest.mark.parametrize('drafter,trim_score', [(drafters.Hybrid(), False),
                                                (drafters.ModelDrafter(stop_below=0.3), True)],
                         ids=str)
def test_caches_equal_fresh_prefill_after_every_loop(pair, drafter, trim_score):
  target, draft = pair
  prompts, lengths = _ragged(8, batch=6)
  loop = speculative.Loop(k=3, max_new_tokens=14, sampling=SamplingConfig(temperature=1.5),
                          draft_sampling=SamplingConfig(temperature=1.5), drafter=drafter,
                          trim_score=trim_score)
  accepted = _run_checking_caches(target, draft, loop, prompts, lengths, jax.random.key(4))
  assert len(set(np.concatenate(accepted).tolist()) - {-1}) >= 2
