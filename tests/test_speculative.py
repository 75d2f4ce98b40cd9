"""SpS: exact output law (against enumeration), greedy parity with ArS, cache invariants, edges."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spsjax import models, native
from spsjax.sampling import (PAD_ID, SamplingConfig, autoregressive_sample, drafters, speculative,
                             speculative_sample, tree_drafters)
from tests.stats import (exact_sequence_law, g_test_pvalue, scaled_model, sequence_counts,
                         truncated_at_eos)

GREEDY = SamplingConfig(temperature=0.0)
# Every G-test here fails a correct sampler with probability 1e-5 (its p-value threshold), so the
# file's law tests together with probability < 3e-4. Each test's docstring gives its power: the
# total variation from the right law that it detects at 80% (`stats.detectable_tv`).
P_MIN = 1e-5


# --- Exactness, statistically -------------------------------------------------------------------

V_SMALL, PROMPT, NEW, ROWS = 7, (1, 4, 2), 3, 100_000
# The settings whose law tests draw ROWS rows: temperature 1, top-k and top-p, the ones most runs
# use. The processors beyond them and the draft's own settings draw half as many.
FULL_POWER = ('temperature_1', 'temperature_0.7_top_k_3', 'top_p_0.8')


@pytest.fixture(scope='module')
def tiny_pair():
  target = scaled_model(models.TransformerConfig(
      vocab_size=V_SMALL, d_model=16, num_layers=2, num_heads=2, d_ff=32, max_seq_len=16,
      tie_embeddings=False), 0, 1.5)
  draft = scaled_model(models.TransformerConfig(
      vocab_size=V_SMALL, d_model=16, num_layers=1, num_heads=2, d_ff=32, max_seq_len=16,
      tie_embeddings=False), 1, 1.5)
  return target, draft


def exact_joint(model, sampling):
  """float64[V, V, V]: the law of the 3 tokens after PROMPT, by enumeration with `logits`."""
  return exact_sequence_law(model, PROMPT, NEW, sampling)


def test_laws_are_far_apart(tiny_pair):
  target, draft = tiny_pair
  p = exact_joint(target, SamplingConfig()).sum((1, 2))
  q = exact_joint(draft, SamplingConfig()).sum((1, 2))
  assert 0.3 < p.max() < 0.9 and 0.5 * np.abs(p - q).sum() > 0.3


SETTINGS = {
    'temperature_1': (SamplingConfig(), None),
    'temperature_0.7_top_k_3': (SamplingConfig(temperature=0.7, top_k=3), None),
    'top_p_0.8': (SamplingConfig(top_p=0.8), None),
    'temperature_1.2_min_p_0.1_penalty_1.8': (
        SamplingConfig(temperature=1.2, min_p=0.1, repetition_penalty=1.8), None),
    'typical_p_0.9_epsilon_0.15': (SamplingConfig(typical_p=0.9, epsilon_cutoff=0.15), None),
    'temperature_0.9_no_repeat_ngram_2': (
        SamplingConfig(temperature=0.9, no_repeat_ngram_size=2), None),
    'sequence_bias': (SamplingConfig(sequence_bias=(
        ((4,), 1.0), ((2, 3), -1.5), ((4, 2), -np.inf), ((3, 3, 0), 2.0))), None),
    # 6 and 2 banned at the first two new tokens (2 while the row holds < 5), 1 at the first:
    # total variation 0.68 from the law without.
    'bans_by_position': (SamplingConfig(ban_before_new=(((6,), 2), ((1,), 1)),
                                        ban_before_length=(((2,), 5),)), None),
    'draft_hotter': (SamplingConfig(), SamplingConfig(temperature=2.0)),
    'draft_greedy': (SamplingConfig(), GREEDY),
    'draft_is_target': (SamplingConfig(), None),
}


# Every setting at k = 4. The processors and the draft's sampling do the same work whatever k, so
# k = 1 (a bonus token after every accepted draft) and k = 2 run with temperature 1, and k = 1 with
# the draft as its own target (every loop accepts its draft and emits the bonus token); the other
# drafters' tests run k = 3.
@pytest.mark.parametrize('setting,k', [(s, 4) for s in SETTINGS] + [
    ('temperature_1', 1), ('temperature_1', 2), ('draft_is_target', 1)])
def test_output_law_is_target_law(tiny_pair, setting, k):
  """100,000 identical rows (FULL_POWER's settings; 50,000 for the others), 3 tokens each,
  against the enumerated joint law of the target. Power: detects at 80% any law within total
  variation 0.018 (temperature 1; outcomes rarer than 5 expected draws, 0.2% of the mass, pooled)
  or 0.012 (top-k 3, top-p 0.8) of the target's; at 50,000 rows 0.015 (typical-p) to 0.025 (the
  draft's settings, at the target's temperature 1; 0.4% pooled) (`stats.detectable_tv`)."""
  target, draft = tiny_pair
  sampling, draft_sampling = SETTINGS[setting]
  if setting == 'draft_is_target':
    draft = target
  rows = ROWS if setting in FULL_POWER else ROWS // 2
  prompts = np.tile(np.array(PROMPT, np.int32), (rows, 1))
  out = speculative_sample(target, draft, prompts, np.full((rows,), len(PROMPT), np.int32),
                           jax.random.key(k), k=k, max_new_tokens=NEW, sampling=sampling,
                           draft_sampling=draft_sampling)
  tokens = np.asarray(out.tokens)
  assert (np.asarray(out.num_generated) == NEW).all()
  pvalue = g_test_pvalue(sequence_counts(tokens, V_SMALL), exact_joint(target, sampling))
  assert pvalue > P_MIN, f'{setting}, k={k}: G-test p-value {pvalue:.2e}'
  if setting == 'draft_is_target':
    # The draft's one-position steps and the target's (k + 1)-position pass round apart (logits
    # within ~1e-6): a draft is then rejected with probability 1 - p/q ~ 1e-7, not 0 (one in 2.4
    # million drafts over six keys here), where a wrong acceptance rejects thousands.
    loops = int(np.sum(out.num_loops))
    assert k * loops - int(np.sum(out.num_accepted)) <= 3
    assert loops - int(out.accepted_histogram[k]) <= 3
  assert int(np.sum(out.accepted_histogram)) == int(np.sum(out.num_loops))


def test_law_with_the_ops_an_accelerator_runs(tiny_pair, monkeypatch):
  """What one GPU or TPU runs, lowered for the CPU: every `jax.lax.platform_dependent` takes its
  accelerator branch, so XLA's ops draw instead of the native kernels, top-p searches with
  `processors.ACCELERATOR_SEARCH` and prefix sums are `lax.cumsum`. Against the law enumerated
  the CPU's way. Power: as test_output_law_is_target_law's top-p 0.8 (total variation 0.012)."""
  target, draft = tiny_pair
  sampling = SamplingConfig(temperature=0.9, top_p=0.8)
  law = exact_joint(target, sampling)
  taken = []

  def accelerator_branch(*args, default=None, **_):
    taken.append(default)
    return default(*args)

  monkeypatch.setattr(jax.lax, 'platform_dependent', accelerator_branch)
  jax.clear_caches()  # No program lowered the CPU's way may be reused.
  try:
    prompts = np.tile(np.array(PROMPT, np.int32), (ROWS, 1))
    out = speculative_sample(target, draft, prompts, np.full((ROWS,), len(PROMPT), np.int32),
                             jax.random.key(11), k=4, max_new_tokens=NEW, sampling=sampling)
  finally:
    jax.clear_caches()
  assert len(taken) >= 3  # The native sampling kernels, top-p's search and prefix sums.
  pvalue = g_test_pvalue(sequence_counts(np.asarray(out.tokens), V_SMALL), law)
  assert pvalue > P_MIN, f'G-test p-value {pvalue:.2e}'


@pytest.mark.parametrize('k', [2, 4])
def test_eos_at_temperature_above_0(tiny_pair, k):
  """Rows stop at eos, keep it and hold PAD after it, also when the eos lies inside an accepted
  block (a loop's block of up to k + 1 tokens is longer than the 2 tokens left after the
  prefill's, so eos or max_new_tokens cut it); the law is the target's cut at eos. Power: 50,000
  rows detect at 80% any law within total variation 0.019 of it (`stats.detectable_tv`)."""
  target, draft = tiny_pair
  sampling, eos_id = SamplingConfig(temperature=0.9, top_p=0.95), 1
  law = exact_joint(target, sampling)
  other = [t for t in range(V_SMALL) if t != eos_id]
  assert 0.2 < 1 - law[np.ix_(other, other, other)].sum() < 0.8  # Many rows stop early, not all.
  rows = ROWS // 2
  prompts = np.tile(np.array(PROMPT, np.int32), (rows, 1))
  out = speculative_sample(target, draft, prompts, np.full((rows,), len(PROMPT), np.int32),
                           jax.random.key(10 + k), k=k, max_new_tokens=NEW, sampling=sampling,
                           eos_id=eos_id)
  tokens, n = np.asarray(out.tokens), np.asarray(out.num_generated)
  np.testing.assert_array_equal(tokens == PAD_ID, np.arange(NEW)[None, :] >= n[:, None])
  first_eos = np.where((tokens == eos_id).any(1), np.argmax(tokens == eos_id, axis=1), NEW)
  np.testing.assert_array_equal(n, np.minimum(first_eos + 1, NEW))
  # Only rows that stopped at eos on their first token (the prefill's) never looped.
  np.testing.assert_array_equal(np.asarray(out.num_loops) == 0, first_eos == 0)
  pvalue = g_test_pvalue(sequence_counts(tokens, V_SMALL, pad=True),
                         truncated_at_eos(law, eos_id))
  assert pvalue > P_MIN, f'k={k}: G-test p-value {pvalue:.2e}'


RAGGED_PROMPTS, NEW_LONG = ((1, 4, 2), (5,)), 5


def interleaved(ragged_prompts, rows):
  """`rows` right-padded prompts taking turns among `ragged_prompts` (row r holds prompt r mod n),
  and their lengths."""
  prompts = np.zeros((rows, max(map(len, ragged_prompts))), np.int32)
  lengths = np.zeros((rows,), np.int32)
  for i, prompt in enumerate(ragged_prompts):
    prompts[i::len(ragged_prompts), :len(prompt)] = prompt
    lengths[i::len(ragged_prompts)] = len(prompt)
  return prompts, lengths


def check_interleaved_law(out, target, k, sampling, label, ragged_prompts=None, new=None):
  """The checks of an SpS run on `interleaved` prompts: every row made `new` tokens, some loops
  rejected and some accepted all k, a second loop ran, and each prompt's rows pass the G-test
  against the target's enumerated law."""
  ragged_prompts = RAGGED_PROMPTS if ragged_prompts is None else ragged_prompts
  new = NEW_LONG if new is None else new
  tokens = np.asarray(out.tokens)
  assert (np.asarray(out.num_generated) == new).all()
  histogram = np.asarray(out.accepted_histogram)
  assert histogram[0] > 0 and histogram[k] > 0  # Rejections and full acceptances both occur.
  assert int(np.max(out.num_loops)) >= 2
  for i, prompt in enumerate(ragged_prompts):
    law = exact_sequence_law(target, prompt, new, sampling)
    pvalue = g_test_pvalue(sequence_counts(tokens[i::len(ragged_prompts)], V_SMALL), law)
    assert pvalue > P_MIN, f'{label}, prompt {prompt}: G-test p-value {pvalue:.2e}'


@pytest.mark.parametrize('setting,k', [('temperature_0.8_min_p_0.05', 2),
                                       ('top_p_0.8_repetition_penalty_1.5', 4),
                                       ('temperature_0.9_typical_p_0.9_eta_0.1', 3),
                                       ('top_p_0.9_no_repeat_ngram_2', 3)])
def test_law_through_the_packed_native_path_on_ragged_prompts(tiny_pair, setting, k):
  """The models packed for CPU decoding (the native products, attention and sampling kernels):
  5 tokens per row after two prompts of different lengths interleaved in one batch, so rows
  accept different numbers of drafts in the same loops and the law covers the bonus token, the
  loops after a full acceptance (k = 2: a loop emits at most 3 of the 4 tokens after the
  prefill's) and a second loop. Each prompt's joint law of 5 tokens is checked against the
  enumeration of the unpacked target. Power: 50,000 rows per prompt detect at 80% any law within
  total variation 0.035 (temperature 0.8, min-p 0.05; outcomes rarer than 5 expected draws, 7% of the mass,
  pooled) or 0.028 (top-p 0.8 after a repetition penalty of 1.5, which reads the committed
  tokens and the drafts before each slot; 0.2% pooled) of the target's (`stats.detectable_tv`)."""
  sampling = {'temperature_0.8_min_p_0.05': SamplingConfig(temperature=0.8, min_p=0.05),
              'temperature_0.9_typical_p_0.9_eta_0.1': SamplingConfig(
                  temperature=0.9, typical_p=0.9, eta_cutoff=0.1),
              'top_p_0.9_no_repeat_ngram_2': SamplingConfig(top_p=0.9, no_repeat_ngram_size=2),
              'top_p_0.8_repetition_penalty_1.5': SamplingConfig(top_p=0.8,
                                                                 repetition_penalty=1.5)}[setting]
  target, draft = (models.for_decoding(m) for m in tiny_pair)
  assert models.is_packed(target) and models.is_packed(draft) and native.available()
  prompts, lengths = interleaved(RAGGED_PROMPTS, ROWS)
  out = speculative_sample(target, draft, prompts, lengths, jax.random.key(20 + k), k=k,
                           max_new_tokens=NEW_LONG, sampling=sampling)
  check_interleaved_law(out, tiny_pair[0], k, sampling, f'{setting}, k={k}')


# --- Greedy parity with ArS ---------------------------------------------------------------------


@pytest.fixture(scope='module')
def pair():
  target = models.Model(*(lambda c: (c, models.init_params(c, jax.random.key(0))))(
      models.TransformerConfig(vocab_size=48, d_model=32, num_layers=2, num_heads=4,
                               num_kv_heads=2, d_ff=64, max_seq_len=64)))
  draft = scaled_model(models.TransformerConfig(
      vocab_size=48, d_model=24, num_layers=1, num_heads=2, d_ff=48, max_seq_len=64,
      tie_embeddings=False), 1, 1.0)
  return target, draft


def _ragged(seed, batch=5, width=7, vocab=48):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, width + 1, size=batch).astype(np.int32)
  prompts = rng.integers(0, vocab, size=(batch, width)).astype(np.int32)
  prompts[np.arange(width)[None] >= lengths[:, None]] = 3
  return prompts, lengths


@pytest.mark.parametrize('k', [1, 4, 7])
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
  # draft == target: every loop accepted all k drafts, and rows went on looping after such loops.
  np.testing.assert_array_equal(sps.num_accepted, k * np.asarray(sps.num_loops))
  assert int(np.max(sps.num_loops)) >= 2
  assert int(sps.num_loops[row]) == 1 and int(sps.num_accepted[row]) == k


def penalised_greedy_ars(target, prompts, lengths, max_new_tokens):
  """(greedy after a repetition penalty of 3, ArS's output under it), checked to differ from
  plain greedy ArS (so that a sampler ignoring the penalty fails a comparison with it)."""
  penalised = SamplingConfig(temperature=0.0, repetition_penalty=3.0)
  run = lambda sampling: autoregressive_sample(target, prompts, lengths, jax.random.key(0),
                                               max_new_tokens=max_new_tokens, sampling=sampling)
  ars = run(penalised)
  assert not np.array_equal(ars.tokens, run(GREEDY).tokens)
  return penalised, ars


def test_greedy_sps_equals_greedy_ars_with_a_repetition_penalty(pair):
  """Greedy with a penalty of 3: the argmax reads each row's prompt and generated tokens (and in
  SpS the drafts before each slot); the penalty changes the tokens (so the check can fail). A
  model drafter applies the penalty as the target does: with draft == target every draft is
  accepted (a head's laws under it: `test_feature_drafters`)."""
  target, draft = pair
  prompts, lengths = _ragged(3)
  penalised, ars = penalised_greedy_ars(target, prompts, lengths, 20)
  for the_draft, k in ((draft, 3), (target, 4), (models.for_decoding(draft), 2)):
    sps = speculative_sample(models.for_decoding(target) if k == 2 else target, the_draft,
                             prompts, lengths, jax.random.key(1), k=k, max_new_tokens=20,
                             sampling=penalised)
    np.testing.assert_array_equal(sps.tokens, ars.tokens, err_msg=f'k={k}')
    if the_draft is target:
      np.testing.assert_array_equal(sps.num_accepted, k * np.asarray(sps.num_loops))


@pytest.mark.parametrize('setting', ['no_repeat_ngram', 'sequence_bias', 'bans_by_position'])
def test_greedy_sps_equals_greedy_ars_with_context_rules(pair, setting):
  """Greedy with no repeated 3-gram (2-gram at k = 2), with sequence biases (a banned word,
  biases of 1-3 token sequences), or with bans by position (the tokens plain greedy decoding
  starts with banned at the first new tokens, its most frequent one while a row holds fewer
  than 10): all read each row's prompt and generated tokens (and in SpS the drafts before each
  slot, or a tree node's path) and change the tokens. A model drafter applies them as the
  target does: with draft == target every draft is accepted; a tree drafter and alternatives
  along each node's path."""
  target, draft = pair
  prompts, lengths = _ragged(3)
  biases = (((7,), 3.0), ((5, 9), -np.inf), ((9,), 2.5), ((20, 3), 4.0), ((1, 2, 30), 5.0))
  plain = autoregressive_sample(target, prompts, lengths, jax.random.key(0), max_new_tokens=20,
                                sampling=GREEDY)
  plain_tokens = np.asarray(plain.tokens)
  first = tuple(sorted(set(plain_tokens[:, :2].ravel().tolist())))
  frequent = int(np.bincount(plain_tokens.ravel()).argmax())
  for n, cases in ((3, [(draft, 3, drafters.ModelDrafter()), (target, 4, drafters.ModelDrafter()),
                        (draft, 3, tree_drafters.TreeDrafter(branching=(2, 2, 1))),
                        (target, 3, drafters.ModelDrafter(alternatives=2))]),
                   (2, [(models.for_decoding(draft), 2, drafters.ModelDrafter())])):
    sampling = {
        'no_repeat_ngram': SamplingConfig(temperature=0.0, no_repeat_ngram_size=n),
        'sequence_bias': SamplingConfig(temperature=0.0, sequence_bias=biases[:n + 2]),
        'bans_by_position': SamplingConfig(temperature=0.0, ban_before_new=((first, n),),
                                           ban_before_length=(((frequent,), 10),)),
    }[setting]
    ars = autoregressive_sample(target, prompts, lengths, jax.random.key(0), max_new_tokens=20,
                                sampling=sampling)
    assert not np.array_equal(ars.tokens, plain.tokens)
    for b in range(len(lengths)):
      generated = list(np.asarray(ars.tokens[b]))
      seq = list(np.asarray(prompts[b, :lengths[b]])) + generated
      if setting == 'no_repeat_ngram':
        new = [tuple(seq[i:i + n]) for i in range(len(seq) - n + 1)][lengths[b] - n + 1:]
        old = {tuple(seq[i:i + n]) for i in range(lengths[b] - n + 1)}
        assert len(set(new)) == len(new) and not old & set(new), f'row {b}: {seq}'
      elif setting == 'sequence_bias':  # The banned word (5, 9) never completed.
        assert all(seq[i:i + 2] != [5, 9] for i in range(lengths[b] - 1, len(seq) - 1)), seq
      else:
        assert not set(generated[:n]) & set(first), seq
        assert frequent not in generated[:10 - lengths[b]], seq
    for the_draft, k, drafter in cases:
      sps = speculative_sample(models.for_decoding(target) if n == 2 else target, the_draft,
                               prompts, lengths, jax.random.key(1), k=k, max_new_tokens=20,
                               sampling=sampling, drafter=drafter)
      np.testing.assert_array_equal(sps.tokens, ars.tokens, err_msg=f'n={n} k={k} {drafter}')
      if the_draft is target and drafter == drafters.ModelDrafter():
        np.testing.assert_array_equal(sps.num_accepted, k * np.asarray(sps.num_loops))


def test_greedy_sps_equals_greedy_ars_in_bfloat16():
  """bfloat16 models: SpS and ArS, both cached, emit the same greedy tokens (an uncached bfloat16
  reference may round differently, so ArS is the reference here)."""
  config = lambda layers: models.TransformerConfig(
      vocab_size=48, d_model=32, num_layers=layers, num_heads=4, num_kv_heads=2, d_ff=64,
      max_seq_len=64, dtype='bfloat16')
  # Gaussian weights drawn by numpy: this skips compiling `init_params` (seconds here).
  shapes = jax.eval_shape(lambda key: models.init_params(config(2), key), jax.random.key(0))
  rng = np.random.default_rng(0)
  target = models.Model(config(2), jax.tree.map(
      lambda x: jnp.asarray(rng.normal(0.0, 0.3, x.shape), x.dtype), shapes))
  # The draft is the target's first layer: it agrees with the target often, not always.
  draft = models.Model(config(1), {name: target.params[name]
                                   for name in ('embedding', 'final_norm', 'layer_0')})
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves((target.params, draft.params)))
  prompts, lengths = _ragged(21)
  ars = autoregressive_sample(target, prompts, lengths, jax.random.key(0), max_new_tokens=16,
                              sampling=GREEDY)
  sps = speculative_sample(target, draft, prompts, lengths, jax.random.key(1), k=3,
                           max_new_tokens=16, sampling=GREEDY)
  np.testing.assert_array_equal(sps.tokens, ars.tokens)
  assert (np.asarray(sps.num_generated) == 16).all()
  assert 0 < int(np.sum(sps.num_accepted)) < 3 * int(np.sum(sps.num_loops))  # Both outcomes.


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
      got, want = np.asarray(got), np.asarray(want)  # Slicing jax.Arrays compiles per shape.
      for b, length in enumerate(lengths):
        np.testing.assert_allclose(got[b, :length], want[b, :length], rtol=1e-4, atol=1e-5)


def _run_checking_caches(target, draft, loop, prompts, lengths, rng):
  """Steps `loop` one body at a time, checking both caches after every loop; returns the drafts
  each active row accepted, one array per loop (-1 for rows that were done)."""
  prompts_j, lengths_j = jnp.asarray(prompts), jnp.asarray(lengths)
  prompts_j = speculative.common.clean_padding(prompts_j, lengths_j)
  state = jax.jit(loop.init)(target, draft, prompts_j, lengths_j, rng)
  body = jax.jit(loop.body)
  accepted = []
  while not bool(jnp.all(state.done_B)):
    before = np.asarray(state.num_accepted_B)
    active = ~np.asarray(state.done_B)
    state = body(target, draft, prompts_j, lengths_j, state)
    accepted.append(np.where(active, np.asarray(state.num_accepted_B) - before, -1))
    rows, target_want, draft_want = [], [], []
    tokens_BxW, num_generated_B = np.asarray(state.tokens_BxW), np.asarray(state.num_generated_B)
    for b in range(len(lengths)):
      gen = tokens_BxW[b, :num_generated_B[b]]
      committed = np.concatenate([prompts[b, :lengths[b]], gen])
      rows.append(committed)
      c = len(committed)
      # Done rows keep the invariants too: they idle with lengths that stop moving.
      target_want.append({c - 1})
      draft_want.append({c - 1, c - 2})
    _check_cache(target, state.target_cache, rows, target_want)
    draft_cache = getattr(state.draft_state, 'cache', state.draft_state)  # Or a state's cache.
    _check_cache(draft, draft_cache, rows, draft_want)
  return accepted


@pytest.mark.parametrize('k', [3])
def test_caches_equal_fresh_prefill_after_every_loop(pair, k):
  target, draft = pair
  prompts, lengths = _ragged(5, batch=6)
  loop = speculative.Loop(k=k, max_new_tokens=14, sampling=SamplingConfig(temperature=1.5),
                          draft_sampling=SamplingConfig(temperature=1.5))
  accepted = _run_checking_caches(target, draft, loop, prompts, lengths, jax.random.key(4))
  seen_n = set(np.concatenate(accepted).tolist()) - {-1}
  assert seen_n == set(range(k + 1)), f'outcomes seen: {seen_n}'


def test_loops_after_all_k_drafts_were_accepted(pair):
  """k = 4, the target as its own draft sampling a little hotter: most loops accept all 4 drafts
  (the draft then never consumed the last one; the next loop feeds it with the bonus token), some
  fewer. The caches keep their invariants after every loop, and rows go on after full loops."""
  target, _ = pair
  k = 4
  prompts, lengths = _ragged(6, batch=6)
  loop = speculative.Loop(k=k, max_new_tokens=24, sampling=SamplingConfig(),
                          draft_sampling=SamplingConfig(temperature=1.2))
  accepted = np.stack(_run_checking_caches(target, target, loop, prompts, lengths,
                                           jax.random.key(5)))  # [loops, B]
  full_then_more = (accepted[:-1] == k) & (accepted[1:] >= 0)
  assert full_then_more.sum() >= 3, accepted.T
  assert ((accepted >= 0) & (accepted < k)).any(), accepted.T  # Some loops rejected a draft.


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
  program = jax.jit(chex.assert_max_traces(speculative.Loop.run.__wrapped__, n=1),
                    static_argnames=('self',))

  def run(seed):  # A new (equal) `Loop` per call, as `speculative_sample` makes.
    loop, args = speculative.prepare(target, draft, *_ragged(seed), k=3, max_new_tokens=8,
                                     sampling=SamplingConfig(top_p=0.9))
    return program(loop, *args, jax.random.key(seed))

  for seed in (0, 1, 2, 3):
    out = run(seed)
  assert (np.asarray(out.tokens)[np.arange(8)[None] >= np.asarray(out.num_generated)[:, None]]
          == PAD_ID).all()


def test_compiler_options_reach_the_program(pair):
  """XLA's options go to the program's compile (an unknown one fails it), and an option at its
  default value gives the same tokens."""
  target, draft = pair
  sample = lambda options: np.asarray(speculative_sample(
      target, draft, *_ragged(4), jax.random.key(4), k=2, max_new_tokens=6, sampling=GREEDY,
      compiler_options=options).tokens)
  with pytest.raises(jax.errors.JaxRuntimeError, match="No such compile option: 'xla_no_such'"):
    sample({'xla_no_such': True})
  with pytest.raises(ValueError, match='compiler_options must map'):
    sample([('xla_cpu_enable_fast_math', False)])
  np.testing.assert_array_equal(sample({'xla_cpu_enable_fast_math': False}), sample(None))


# --- Keys and broken models ---------------------------------------------------------------------


@pytest.mark.parametrize('method', ['ars', 'sps', 'sps_lookup'])
def test_legacy_and_typed_keys_give_the_same_tokens(pair, method):
  """`jax.random.PRNGKey(seed)` (uint32 key data) and `jax.random.key(seed)` are the same key:
  every sampler takes both and gives the same tokens; anything else is refused."""
  target, draft = pair
  prompts, lengths = _ragged(31)
  sampling = SamplingConfig(temperature=0.9, top_p=0.95)

  def run(rng):
    if method == 'ars':
      return autoregressive_sample(target, prompts, lengths, rng, max_new_tokens=10,
                                   sampling=sampling)
    lookup = method == 'sps_lookup'
    return speculative_sample(target, None if lookup else draft, prompts, lengths, rng, k=3,
                              max_new_tokens=10, sampling=sampling,
                              drafter=drafters.PromptLookup() if lookup else
                              drafters.ModelDrafter())

  legacy, typed = run(jax.random.PRNGKey(5)), run(jax.random.key(5))
  np.testing.assert_array_equal(legacy.tokens, typed.tokens)
  assert not np.array_equal(typed.tokens, run(jax.random.key(6)).tokens)  # The key matters.
  for bad in (5, np.zeros((3,), np.uint32), jax.random.split(jax.random.key(0), 2),
              np.zeros((2,), np.int32)):
    with pytest.raises(TypeError, match='rng must be one JAX key'):
      run(bad)


def _with_nan_output(model):
  """The model with NaN final-norm scales: every logit it gives is NaN."""
  params = dict(model.params, final_norm=jax.tree.map(lambda x: x * jnp.nan,
                                                      model.params['final_norm']))
  return models.Model(model.config, params)


@pytest.mark.parametrize('packed', [False, True])
def test_a_model_that_gives_nan_logits_gives_defined_tokens(pair, packed):
  """NaN logits have no distribution: a NaN target emits token 0 at every position, on every
  path, never an id outside the vocabulary; a NaN draft's drafts are all rejected, so SpS still
  gives the target's tokens (greedy SpS == greedy ArS)."""
  target, draft = pair
  prepare = models.for_decoding if packed else (lambda m: m)
  prompts, lengths = _ragged(32)
  broken_target, broken_draft = prepare(_with_nan_output(target)), prepare(_with_nan_output(draft))
  for sampling in (SamplingConfig(top_p=0.9), GREEDY):
    ars = autoregressive_sample(broken_target, prompts, lengths, jax.random.key(0),
                                max_new_tokens=6, sampling=sampling)
    sps = speculative_sample(broken_target, prepare(draft), prompts, lengths, jax.random.key(0),
                             k=3, max_new_tokens=6, sampling=sampling)
    for out in (ars, sps):
      np.testing.assert_array_equal(out.tokens, 0)
      np.testing.assert_array_equal(out.num_generated, 6)
  want = autoregressive_sample(prepare(target), prompts, lengths, jax.random.key(0),
                               max_new_tokens=6, sampling=GREEDY)
  got = speculative_sample(prepare(target), broken_draft, prompts, lengths, jax.random.key(0),
                           k=3, max_new_tokens=6, sampling=GREEDY)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  assert int(np.sum(got.num_accepted)) <= int(np.sum(
      np.asarray(want.tokens)[:, 1:] == 0))  # Only drafts of token 0 can be accepted.
