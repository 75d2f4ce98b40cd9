"""SpS: exact output law (against enumeration), greedy parity with ArS, cache invariants, edges."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spsjax import models
from spsjax.sampling import (PAD_ID, SamplingConfig, autoregressive_sample, probabilities,
                             speculative, speculative_sample)
from tests.stats import g_test_pvalue

GREEDY = SamplingConfig(temperature=0.0)


def _scaled_model(config, seed, scale):
  """Random weights with a scaled LM head: far-from-uniform next-token laws."""
  assert not config.tie_embeddings
  params = models.init_params(config, jax.random.key(seed))
  params = dict(params, head=params['head'] * scale)
  return models.Model(config, params)


# --- Exactness, statistically -------------------------------------------------------------------

V_SMALL, PROMPT, NEW, ROWS = 7, (1, 4, 2), 3, 100_000


@pytest.fixture(scope='module')
def tiny_pair():
  target = _scaled_model(models.TransformerConfig(
      vocab_size=V_SMALL, d_model=16, num_layers=2, num_heads=2, d_ff=32, max_seq_len=16,
      tie_embeddings=False), 0, 1.5)
  draft = _scaled_model(models.TransformerConfig(
      vocab_size=V_SMALL, d_model=16, num_layers=1, num_heads=2, d_ff=32, max_seq_len=16,
      tie_embeddings=False), 1, 1.5)
  return target, draft


def exact_joint(model, sampling):
  """float64[V, V, V]: the law of the 3 tokens after PROMPT, by enumeration with `logits`."""
  seqs = np.array([PROMPT + pair for pair in itertools.product(range(V_SMALL), repeat=2)])
  probs = np.asarray(probabilities(models.logits(model.config, model.params, jnp.asarray(seqs)),
                                   sampling), np.float64)  # [V*V, P+2, V]
  P = len(PROMPT)
  p1 = probs[0, P - 1]
  p2 = probs[::V_SMALL, P].reshape(V_SMALL, V_SMALL)  # [x1, x2], from rows with x2 = 0.
  p3 = probs[:, P + 1].reshape(V_SMALL, V_SMALL, V_SMALL)
  return p1[:, None, None] * p2[:, :, None] * p3


def test_laws_are_far_apart(tiny_pair):
  target, draft = tiny_pair
  p = exact_joint(target, SamplingConfig()).sum((1, 2))
  q = exact_joint(draft, SamplingConfig()).sum((1, 2))
  assert 0.3 < p.max() < 0.9 and 0.5 * np.abs(p - q).sum() > 0.3


SETTINGS = {
    'temperature_1': (SamplingConfig(), None),
    'temperature_0.7_top_k_3': (SamplingConfig(temperature=0.7, top_k=3), None),
    'top_p_0.8': (SamplingConfig(top_p=0.8), None),
    'draft_hotter': (SamplingConfig(), SamplingConfig(temperature=2.0)),
    'draft_greedy': (SamplingConfig(), GREEDY),
    'draft_is_target': (SamplingConfig(), None),
}


@pytest.mark.parametrize('k', [1, 2, 4])
@pytest.mark.parametrize('setting', list(SETTINGS))
def test_output_law_is_target_law(tiny_pair, setting, k):
  target, draft = tiny_pair
  sampling, draft_sampling = SETTINGS[setting]
  if setting == 'draft_is_target':
    draft = target
  prompts = np.tile(np.array(PROMPT, np.int32), (ROWS, 1))
  out = speculative_sample(target, draft, prompts, np.full((ROWS,), len(PROMPT), np.int32),
                           jax.random.key(k), k=k, max_new_tokens=NEW, sampling=sampling,
                           draft_sampling=draft_sampling)
  tokens = np.asarray(out.tokens)
  assert (np.asarray(out.num_generated) == NEW).all()
  counts = np.bincount((tokens[:, 0] * V_SMALL + tokens[:, 1]) * V_SMALL + tokens[:, 2],
                       minlength=V_SMALL**3)
  pvalue = g_test_pvalue(counts, exact_joint(target, sampling))
  assert pvalue > 1e-3, f'{setting}, k={k}: G-test p-value {pvalue:.2e}'
  if setting == 'draft_is_target':
    assert int(np.sum(out.num_accepted)) == k * int(np.sum(out.num_loops))
    assert int(out.accepted_histogram[k]) == int(np.sum(out.num_loops))
  assert int(np.sum(out.accepted_histogram)) == int(np.sum(out.num_loops))


# --- Greedy parity with ArS ---------------------------------------------------------------------


@pytest.fixture(scope='module')
def pair():
  target = models.Model(*(lambda c: (c, models.init_params(c, jax.random.key(0))))(
      models.TransformerConfig(vocab_size=48, d_model=32, num_layers=2, num_heads=4,
                               num_kv_heads=2, d_ff=64, max_seq_len=64)))
  draft = _scaled_model(models.TransformerConfig(
      vocab_size=48, d_model=24, num_layers=1, num_heads=2, d_ff=48, max_seq_len=64,
      tie_embeddings=False), 1, 1.0)
  return target, draft


def _ragged(seed, batch=5, width=7, vocab=48):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, width + 1, size=batch).astype(np.int32)
  prompts = rng.integers(0, vocab, size=(batch, width)).astype(np.int32)
  prompts[np.arange(width)[None] >= lengths[:, None]] = 3
  return prompts, lengths


@pytest.mark.parametrize('k', [1, 3, 4, 7])
def test_greedy_sps_equals_greedy_ars(pair, k):
  target, draft = pair
  prompts, lengths = _ragged(k)
  ars = autoregressive_sample(target, prompts, lengths, jax.random.key(0), max_new_tokens=20,
                              sampling=GREEDY)
  # An eos that some row emits first at position j in 1..k: with draft == target every draft of
  # the first loop is accepted, so the eos sits inside an accepted block and the rest is dropped.
  tokens = np.asarray(ars.tokens)
  row, j = next((b, j) for j in range(min(k, 4), 0, -1) for b in range(len(lengths))
                if tokens[b, j] not in tokens[b, :j])
  eos_id = int(tokens[row, j])
  ars = autoregressive_sample(target, prompts, lengths, jax.random.key(0), max_new_tokens=20,
                              sampling=GREEDY, eos_id=eos_id)
  assert int(ars.num_generated[row]) == j + 1
  for the_draft in (draft, target):
    sps = speculative_sample(target, the_draft, prompts, lengths, jax.random.key(1), k=k,
                             max_new_tokens=20, sampling=GREEDY, eos_id=eos_id)
    np.testing.assert_array_equal(sps.tokens, ars.tokens)
    np.testing.assert_array_equal(sps.num_generated, ars.num_generated)
  assert int(sps.num_loops[row]) == 1 and int(sps.num_accepted[row]) == k


def test_max_new_tokens_below_k_plus_1(pair):
  target, draft = pair
  prompts, lengths = _ragged(11)
  ars = autoregressive_sample(target, prompts, lengths, jax.random.key(0), max_new_tokens=2,
                              sampling=GREEDY)
  for max_new in (1, 2):
    sps = speculative_sample(target, target, prompts, lengths, jax.random.key(0), k=4,
                             max_new_tokens=max_new, sampling=GREEDY)
    np.testing.assert_array_equal(sps.tokens, ars.tokens[:, :max_new])
    assert (np.asarray(sps.num_generated) == max_new).all()


# --- Cache invariants ---------------------------------------------------------------------------


_prefill = jax.jit(models.prefill, static_argnums=(0, 4))


def _check_cache(model, cache, committed_rows, want_lengths):
  """Each row's valid cache slots equal a fresh prefill of that row's first `length` tokens."""
  lengths = np.asarray(cache.lengths)
  for b, length in enumerate(lengths):
    assert length in want_lengths[b], (b, length, want_lengths[b])
  width = 64
  padded = np.zeros((len(committed_rows), width), np.int32)
  for b, tokens in enumerate(committed_rows):
    padded[b, :len(tokens)] = tokens
  _, fresh = _prefill(model.config, model.params, jnp.asarray(padded), jnp.asarray(lengths), width)
  for layer in range(model.config.num_layers):
    for got, want in ((cache.k[layer], fresh.k[layer]), (cache.v[layer], fresh.v[layer])):
      for b, length in enumerate(lengths):
        np.testing.assert_allclose(got[b, :length], want[b, :length], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize('k', [2, 3])
def test_caches_equal_fresh_prefill_after_every_loop(pair, k):
  target, draft = pair
  prompts, lengths = _ragged(5, batch=6)
  loop = speculative.Loop(k=k, max_new_tokens=14, sampling=SamplingConfig(temperature=1.5),
                          draft_sampling=SamplingConfig(temperature=1.5))
  prompts_j, lengths_j = jnp.asarray(prompts), jnp.asarray(lengths)
  prompts_j = speculative.common.clean_padding(prompts_j, lengths_j)
  state = jax.jit(loop.init)(target, draft, prompts_j, lengths_j, jax.random.key(4))
  body = jax.jit(loop.body)
  seen_n = set()
  while not bool(jnp.all(state.done_B)):
    before = np.asarray(state.num_accepted_B)
    active = ~np.asarray(state.done_B)
    state = body(target, draft, prompts_j, lengths_j, state)
    seen_n |= set((np.asarray(state.num_accepted_B) - before)[active].tolist())
    rows, target_want, draft_want = [], [], []
    for b in range(len(lengths)):
      gen = np.asarray(state.tokens_BxW[b, :int(state.num_generated_B[b])])
      committed = np.concatenate([prompts[b, :lengths[b]], gen])
      rows.append(committed)
      c = len(committed)
      target_want.append({c - 1} if not state.done_B[b] else set(range(c + 1)))
      draft_want.append({c - 1, c - 2} if not state.done_B[b] else set(range(c + 1)))
    _check_cache(target, state.target_cache, rows, target_want)
    _check_cache(draft, state.draft_cache, rows, draft_want)
  assert seen_n == set(range(k + 1)), f'outcomes seen: {seen_n}'


# --- Edges, errors, compilation -----------------------------------------------------------------


def test_headroom_near_max_seq_len(pair):
  target, draft = pair
  k, max_new = 4, 6
  width = 64 - max_new - speculative.headroom(k)  # Longest prompt that fits.
  prompts = np.ones((2, width), np.int32)
  lengths = np.array([width, 3], np.int32)
  ars = autoregressive_sample(target, prompts, lengths, jax.random.key(0), max_new_tokens=max_new,
                              sampling=GREEDY)
  sps = speculative_sample(target, draft, prompts, lengths, jax.random.key(0), k=k,
                           max_new_tokens=max_new, sampling=GREEDY)
  np.testing.assert_array_equal(sps.tokens, ars.tokens)
  with pytest.raises(ValueError, match='headroom'):
    speculative_sample(target, draft, np.ones((2, width + 1), np.int32),
                       np.array([width + 1, 3], np.int32), jax.random.key(0), k=k,
                       max_new_tokens=max_new)


@pytest.mark.parametrize('k', [0, -1])
def test_bad_k(pair, k):
  target, draft = pair
  with pytest.raises(ValueError, match='k'):
    speculative_sample(target, draft, np.ones((1, 2), np.int32), np.array([2], np.int32),
                       jax.random.key(0), k=k, max_new_tokens=4)


def test_vocab_mismatch(pair):
  target, _ = pair
  config = models.TransformerConfig(vocab_size=50, d_model=16, num_layers=1, num_heads=2,
                                    max_seq_len=64)
  draft = models.Model(config, models.init_params(config, jax.random.key(0)))
  with pytest.raises(ValueError, match='vocab_size'):
    speculative_sample(target, draft, np.ones((1, 2), np.int32), np.array([2], np.int32),
                       jax.random.key(0), k=2, max_new_tokens=4)


def test_one_compilation_across_prompts_and_rngs(pair):
  target, draft = pair
  run = lambda seed: speculative_sample(target, draft, *_ragged(seed), jax.random.key(seed), k=3,
                                        max_new_tokens=8, sampling=SamplingConfig(top_p=0.9))
  run(0)
  before = speculative.trace_count
  for seed in (1, 2, 3):
    out = run(seed)
  assert speculative.trace_count == before
  assert (np.asarray(out.tokens)[np.arange(8)[None] >= np.asarray(out.num_generated)[:, None]]
          == PAD_ID).all()
