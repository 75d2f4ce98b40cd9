"""Logit processors keep the right sets with the right masses."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spsjax.sampling import SamplingConfig, probabilities, processors, sample
from tests.stats import g_test_pvalue


def _softmax(x):
  e = np.exp(x - x.max())
  return e / e.sum()


LOGITS = np.log(np.array([0.05, 0.4, 0.1, 0.25, 0.2], np.float64))


def test_temperature_one_is_softmax():
  np.testing.assert_allclose(probabilities(jnp.asarray(LOGITS), SamplingConfig()),
                             _softmax(LOGITS), rtol=1e-6)


def test_temperature_scales():
  got = probabilities(jnp.asarray(LOGITS), SamplingConfig(temperature=0.5))
  np.testing.assert_allclose(got, _softmax(LOGITS / 0.5), rtol=1e-6)


def test_greedy_is_one_hot():
  got = np.asarray(probabilities(jnp.asarray(LOGITS)[None], SamplingConfig(temperature=0)))
  np.testing.assert_array_equal(got, [[0, 1, 0, 0, 0]])


def test_top_k_keeps_k_most_likely():
  got = np.asarray(probabilities(jnp.asarray(LOGITS), SamplingConfig(top_k=2)))
  np.testing.assert_allclose(got, [0, 0.4 / 0.65, 0, 0.25 / 0.65, 0], rtol=1e-6)


def test_top_k_keeps_xlas_top_k_kernel_on_the_cpu():
  """What XLA:CPU compiles for top-k is its TopK kernel, not a sort of the row: a sort of 32k
  logits took 7 ms a row (JAX 0.10, which rewrote a top-k whose only use was its k-th value into
  one), where the whole of `probabilities` takes 0.5 ms."""
  f = jax.jit(lambda logits: probabilities(logits, SamplingConfig(temperature=0.8, top_k=50)))
  program = f.lower(jax.ShapeDtypeStruct((5, 32_000), jnp.float32)).compile().as_text()
  assert 'custom_call_target="TopK"' in program
  assert not re.search(r'\bsort\(', program), 'top-k sorts the row'


def _kept_law(kept):
  expected = np.zeros(5)
  expected[kept] = np.exp(LOGITS)[kept]
  return expected / expected.sum()


@pytest.mark.parametrize('top_p, kept', [(0.39, [1]), (0.41, [1, 3]), (0.65, [1, 3]),
                                         (0.66, [1, 3, 4]), (1.0, [0, 1, 2, 3, 4])])
def test_top_p_keeps_smallest_set_reaching_mass(top_p, kept):
  got = np.asarray(probabilities(jnp.asarray(LOGITS), SamplingConfig(top_p=top_p)))
  np.testing.assert_allclose(got, _kept_law(kept), rtol=1e-5)


def test_top_k_then_top_p_and_temperature():
  sampling = SamplingConfig(temperature=2.0, top_k=3, top_p=0.5)
  probs = _softmax(LOGITS / 2.0)
  top3 = np.argsort(-probs)[:3]
  renorm = np.zeros(5)
  renorm[top3] = probs[top3] / probs[top3].sum()
  order = np.argsort(-renorm)
  before = np.cumsum(renorm[order]) - renorm[order]
  keep = order[before < 0.5]
  expected = np.zeros(5)
  expected[keep] = probs[keep]
  got = np.asarray(probabilities(jnp.asarray(LOGITS), sampling))
  np.testing.assert_allclose(got, expected / expected.sum(), rtol=1e-5)


def test_batched_and_bfloat16_inputs_give_float32():
  logits = jax.random.normal(jax.random.key(0), (3, 4, 50)).astype(jnp.bfloat16)
  got = probabilities(logits, SamplingConfig(top_p=0.9, top_k=10))
  assert got.dtype == jnp.float32 and got.shape == (3, 4, 50)
  np.testing.assert_allclose(np.asarray(got).sum(-1), 1.0, rtol=1e-5)
  assert ((np.asarray(got) > 0).sum(-1) <= 10).all()


@pytest.mark.parametrize('probs', [[0.1, 0.0, 0.6, 0.3], [0.0, 0.25, 0.0, 0.0, 0.5, 0.25, 0.0],
                                   [0.002, 0.0, 0.001, 0.997]])
def test_sample_matches_distribution(probs):
  """A G-test against the exact law; a draw of a zero-probability token fails it outright. A
  correct `sample` fails with probability 1e-5 per case (the p-value threshold); a wrong one
  within total variation 0.02 of the law is caught at 80% (`stats.detectable_tv`)."""
  draws = np.asarray(sample(jax.random.split(jax.random.key(0), 20_000),
                            jnp.asarray([probs] * 20_000, jnp.float32)))
  counts = np.bincount(draws, minlength=len(probs))
  assert len(counts) == len(probs)  # No token outside the vocabulary.
  assert g_test_pvalue(counts, probs) > 1e-5


@pytest.mark.parametrize('min_p, kept', [(0.2, [1, 2, 3, 4]), (0.3, [1, 3, 4]), (0.7, [1]),
                                         (1.0, [1])])
def test_min_p_keeps_tokens_within_a_ratio_of_the_most_likely(min_p, kept):
  """p(x) >= min_p * max p (0.4 here): 0.08, 0.12, 0.28, 0.4."""
  got = np.asarray(probabilities(jnp.asarray(LOGITS), SamplingConfig(min_p=min_p)))
  np.testing.assert_allclose(got, _kept_law(kept), rtol=1e-5)


@pytest.mark.parametrize('settings, kept', [
    # H = 1.415; distances |-log p - H|: 1.581, 0.499, 0.888, 0.029, 0.194; by distance the
    # masses add up to 0.25, 0.45, 0.85, 0.95, 1.
    (dict(typical_p=0.3), [3, 4]), (dict(typical_p=0.5), [1, 3, 4]),
    (dict(typical_p=0.9), [1, 2, 3, 4]), (dict(typical_p=1e-9), [3]),
    (dict(epsilon_cutoff=0.15), [1, 3, 4]), (dict(epsilon_cutoff=0.9), [1]),
    # eta: min(0.1, sqrt(0.1) exp(-H)) = 0.0768; min(0.5, 0.172) = 0.172.
    (dict(eta_cutoff=0.1), [1, 2, 3, 4]), (dict(eta_cutoff=0.5), [1, 3, 4]),
    # Each on what the one before kept: typical-p drops the most likely token (0.4), so the
    # epsilon cutoff keeps 0.25 / 0.45, the most likely left, and not 0.2 / 0.45 < 0.45.
    (dict(typical_p=0.3, epsilon_cutoff=0.45), [3]),
])
def test_typical_p_and_the_epsilon_and_eta_cutoffs(settings, kept):
  got = np.asarray(probabilities(jnp.asarray(LOGITS), SamplingConfig(**settings)))
  np.testing.assert_allclose(got, _kept_law(kept), rtol=1e-5)


def test_repetition_penalty_is_transformers():
  """A present token's logit x becomes x / penalty, or x * penalty where x < 0 (transformers'
  RepetitionPenaltyLogitsProcessor), before temperature; absent tokens keep theirs."""
  logits = np.array([[2.0, -1.0, 0.5, -3.0, 1.0], [2.0, -1.0, 0.5, -3.0, 1.0]], np.float32)
  present = np.array([[True, True, False, False, False], [False, False, True, True, True]])
  s = SamplingConfig(temperature=0.7, repetition_penalty=1.3)
  want = np.where(present, np.where(logits < 0, logits * 1.3, logits / 1.3), logits)
  np.testing.assert_allclose(processors.penalise(jnp.asarray(logits), s, jnp.asarray(present)),
                             want, rtol=1e-6)
  got = probabilities(jnp.asarray(logits), s, present_xV=jnp.asarray(present))
  np.testing.assert_allclose(got, [_softmax(w / 0.7) for w in want], rtol=1e-5)
  greedy = dataclasses.replace(s, temperature=0.0, repetition_penalty=2.5)
  np.testing.assert_array_equal(  # Row 0: 2 / 2.5 < 1, token 4 wins; row 1: token 0 is absent.
      np.argmax(probabilities(jnp.asarray(logits), greedy, present_xV=jnp.asarray(present)), -1),
      [4, 0])
  with pytest.raises(ValueError, match='needs the tokens present'):
    probabilities(jnp.asarray(logits), s)


@pytest.mark.parametrize('native_kernel', [False, True])
def test_context_rules_are_refused_unshifted(native_kernel):
  """An n-gram ban or sequence biases read the tokens before the position: every entry point
  refuses them rather than sample without them (`ngrams.History` shifts the logits first)."""
  logits = jnp.asarray(LOGITS, jnp.float32)[None]
  for s in (SamplingConfig(no_repeat_ngram_size=2), SamplingConfig(sequence_bias=[[[1], -1.0]])):
    with pytest.raises(ValueError, match='without_context'):
      processors.probabilities_and_sample(jax.random.key(0)[None], logits, s,
                                          native_kernel=native_kernel)
    with pytest.raises(ValueError, match='without_context'):
      probabilities(logits, s)
    np.testing.assert_allclose(probabilities(logits, s.without_context()), [_softmax(LOGITS)],
                               rtol=1e-6)


def test_tokens_present_through_each_position():
  tokens = jnp.array([[3, 1, 3, -1], [0, 0, 4, 2]])
  got = np.asarray(processors.present_through(tokens, 5))
  want = np.zeros((2, 4, 5), bool)
  for b in range(2):
    for t in range(4):
      want[b, t, [x for x in np.asarray(tokens[b, :t + 1]) if x >= 0]] = True
  np.testing.assert_array_equal(got, want)
  marked = processors.mark_present(jnp.zeros((2, 5), bool), tokens, jnp.array([2, 4]))
  np.testing.assert_array_equal(marked, want[np.arange(2), [1, 3]])


def test_min_p_does_not_change_greedy():
  got = probabilities(jnp.asarray(LOGITS)[None], SamplingConfig(temperature=0, min_p=0.9))
  np.testing.assert_array_equal(np.asarray(got), [[0, 1, 0, 0, 0]])


@pytest.mark.parametrize('kwargs, match', [(dict(temperature=-0.1), 'temperature'),
                                           (dict(top_k=-1), 'top_k'), (dict(top_p=0.0), 'top_p'),
                                           (dict(top_p=1.5), 'top_p'), (dict(min_p=-0.1), 'min_p'),
                                           (dict(min_p=1.5), 'min_p'),
                                           (dict(min_p=float('nan')), 'min_p'),
                                           (dict(repetition_penalty=0.0), 'repetition_penalty'),
                                           (dict(typical_p=0.0), 'typical_p'),
                                           (dict(typical_p=1.5), 'typical_p'),
                                           (dict(epsilon_cutoff=-0.1), 'epsilon_cutoff'),
                                           (dict(epsilon_cutoff=1.0), 'epsilon_cutoff'),
                                           (dict(eta_cutoff=1.0), 'eta_cutoff'),
                                           (dict(eta_cutoff=float('nan')), 'eta_cutoff'),
                                           (dict(no_repeat_ngram_size=-1), 'no_repeat_ngram'),
                                           (dict(no_repeat_ngram_size=1.5), 'no_repeat_ngram'),
                                           (dict(repetition_penalty=float('inf')),
                                            'repetition_penalty')])
def test_bad_settings_raise(kwargs, match):
  with pytest.raises(ValueError, match=match):
    SamplingConfig(**kwargs)


def _reference_top_k_top_p(logits, temperature, top_k, top_p, min_p=0.0):
  """A sort-based numpy reference of transformers' warpers in their order (temperature, top-k,
  top-p, min-p): stable descending sort (ties by id), keep, renormalise; min-p keeps the
  tokens at least min_p times the most likely one of what top-k and top-p kept."""
  z = logits.astype(np.float64) / temperature
  probs = np.exp(z - z.max())
  probs /= probs.sum()
  order = np.argsort(-z, kind='stable')
  keep = np.zeros(z.shape, bool)
  keep[order[:top_k or len(z)]] = True
  kept = np.where(keep, probs, 0.0)
  kept /= kept.sum()
  before = np.cumsum(kept[order]) - kept[order]
  nucleus = np.zeros(z.shape, bool)
  nucleus[order[before < top_p]] = True
  out = np.where(keep & nucleus, probs, 0.0)
  out /= out.sum()
  out = np.where(out >= min_p * out.max(), out, 0.0)
  return out / out.sum()


@pytest.mark.parametrize('top_k, top_p, min_p', [(0, 0.9, 0.0), (0, 0.5, 0.0), (5, 1.0, 0.0),
                                                 (7, 0.8, 0.0), (1, 0.3, 0.0), (0, 1.0, 0.1),
                                                 (5, 0.9, 0.3), (0, 0.5, 0.5)])
def test_masks_match_a_sort_based_reference_with_ties(top_k, top_p, min_p):
  """Half-integer logits: min-p's cuts (log 0.1, log 0.3, log 0.5) fall between them."""
  rng = np.random.default_rng(top_k * 10 + int(top_p * 10))
  # Rounded logits make many exact ties, which must rank by id as in a stable sort.
  logits = np.round(rng.normal(size=(64, 40)) * 2) / 2
  got = np.asarray(probabilities(
      jnp.asarray(logits, jnp.float32),
      SamplingConfig(temperature=1.0, top_k=top_k, top_p=top_p, min_p=min_p)))
  for row in range(64):
    expected = _reference_top_k_top_p(logits[row], 1.0, top_k, top_p, min_p)
    # The same support, and the same values on it (float32 against float64).
    np.testing.assert_array_equal(got[row] > 0, expected > 0, err_msg=f'row {row}')
    np.testing.assert_allclose(got[row], expected, rtol=1e-5, atol=1e-7)


def _reference_later_cuts(logits, probs, typical_p, epsilon, eta):
  """transformers' TypicalLogitsWarper, EpsilonLogitsWarper and EtaLogitsWarper in numpy, on
  the processed logits (-inf where `probs`, the law the earlier cuts left, is 0): log-softmax,
  entropy, a sort by |-log p - H|, the first sorted token whose cumulative mass reaches
  typical_p and every token at its distance or nearer; then p < epsilon dropped, then p < eta's
  cut, each but the most likely token left."""
  scores = np.where(probs > 0, logits.astype(np.float64), -np.inf)

  def log_softmax(s):
    return s - s.max() - np.log(np.sum(np.exp(s - s.max())))

  def entropy(log_p):
    finite = np.isfinite(log_p)
    return -np.sum(np.exp(log_p[finite]) * log_p[finite])

  if typical_p < 1.0:
    log_p = log_softmax(scores)
    shifted = np.abs(-log_p - entropy(log_p))
    order = np.argsort(shifted, kind='stable')
    cumulative = np.cumsum(np.exp(log_p[order]))
    last = min(int(np.sum(cumulative < typical_p)), len(scores) - 1)
    remove = shifted > shifted[order[last]]
    remove[order[0]] = False
    scores = np.where(remove, -np.inf, scores)
  for cut in (epsilon, eta):
    if cut > 0.0:
      log_p = log_softmax(scores)
      if cut is eta:
        cut = min(eta, np.sqrt(eta) * np.exp(-entropy(log_p)))
      scores = np.where((np.exp(log_p) < cut) & (scores < scores.max()), -np.inf, scores)
  return np.exp(log_softmax(scores))


@pytest.mark.parametrize('settings', [
    dict(typical_p=0.2), dict(typical_p=0.6), dict(typical_p=0.95),
    dict(top_k=7, typical_p=0.5), dict(top_p=0.8, min_p=0.05, typical_p=0.7),
    dict(epsilon_cutoff=0.03), dict(top_k=12, epsilon_cutoff=0.2), dict(eta_cutoff=0.01),
    dict(eta_cutoff=0.3), dict(typical_p=0.8, epsilon_cutoff=0.05, eta_cutoff=0.02),
    dict(top_p=0.9, typical_p=0.3, epsilon_cutoff=0.4)])
def test_later_cuts_match_transformers_warpers_with_ties(settings):
  """Half-integer logits (many exact ties, and tied distances); at temperature 0.8."""
  rng = np.random.default_rng(len(str(settings)))
  logits = np.round(rng.normal(size=(64, 40)) * 2) / 2
  config = SamplingConfig(temperature=0.8, **settings)
  earlier = dataclasses.replace(config, typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0)
  before = np.asarray(probabilities(jnp.asarray(logits, jnp.float32), earlier))
  got = np.asarray(probabilities(jnp.asarray(logits, jnp.float32), config))
  cut_rows = 0
  for row in range(64):
    expected = _reference_later_cuts(logits[row] / 0.8, before[row], config.typical_p,
                                     config.epsilon_cutoff, config.eta_cutoff)
    np.testing.assert_array_equal(got[row] > 0, expected > 0, err_msg=f'row {row}')
    np.testing.assert_allclose(got[row], expected, rtol=1e-5, atol=1e-7)
    cut_rows += np.sum(got[row] > 0) < np.sum(before[row] > 0)
  assert cut_rows >= 16, f'the cuts dropped tokens in {cut_rows} rows only'


@pytest.mark.parametrize('search', [processors.CPU_SEARCH, processors.ACCELERATOR_SEARCH],
                         ids=['cpu', 'accelerator'])
@pytest.mark.parametrize('typical_p', [0.2, 0.9, 0.999])
def test_every_typical_p_search_keeps_the_sorted_set(search, typical_p):
  """Both search plans keep typical-p's set on rows of GPT-2's 50,257 tokens: every token whose
  distance to the entropy is below the cut's, none beyond, and the mass of the tokens strictly
  nearer than the farthest kept one below typical_p, the kept mass at least typical_p (within
  1e-6: float32 masses of 50k tokens)."""
  rng = np.random.default_rng(int(typical_p * 1000))
  logits = np.concatenate([rng.normal(size=(4, 50_257)) * 3,
                           np.round(rng.standard_cauchy(size=(2, 50_257)))])
  scaled = jnp.asarray(logits - logits.max(-1, keepdims=True), jnp.float32)
  probs = np.asarray(probabilities(scaled, SamplingConfig()))
  mask = np.asarray(jax.jit(lambda x, p: processors._typical_mask(x, p, typical_p, search))(
      scaled, jnp.asarray(probs)))
  for row in range(len(logits)):
    p = probs[row].astype(np.float64)
    x = np.asarray(scaled[row], np.float64)
    distance = np.abs(x - np.sum(p * x))
    kept = mask[row]
    farthest = distance[kept].max()
    assert np.all(kept[distance < farthest - 1e-5]), f'row {row}: a nearer token dropped'
    assert not np.any(kept[distance > farthest + 1e-5]), f'row {row}: a farther token kept'
    assert p[kept].sum() >= typical_p - 1e-6, row
    assert p[distance < farthest - 1e-5].sum() < typical_p + 1e-6, row


@pytest.mark.parametrize('search', [processors.CPU_SEARCH, processors.ACCELERATOR_SEARCH],
                         ids=['cpu', 'accelerator'])
@pytest.mark.parametrize('top_p', [0.3, 0.8, 0.95, 0.999])
def test_every_top_p_search_keeps_the_sort_based_nucleus(search, top_p):
  """Both search plans (the CPU's loop of 4-way steps, the accelerators' unrolled 16-way steps)
  keep the sort-based nucleus of the float32 probabilities they are given: the most likely tokens
  (ties by id) while the mass ranked before them (summed in float64) is below top_p. A token
  whose mass before lies within 1e-6 of top_p may go either way (float32 masses of 50k tokens
  round by that much). Rows with many ties (rounded logits), a flat row, peaked rows, at 40
  tokens and at GPT-2's 50,257."""
  rng = np.random.default_rng(int(top_p * 1000))
  rows = [np.round(rng.normal(size=(48, 40)) * 2) / 2, np.zeros((1, 40)),
          rng.normal(size=(6, 50_257)) * 3, rng.standard_cauchy(size=(4, 50_257))]
  for logits in rows:
    probs = np.asarray(probabilities(jnp.asarray(logits, jnp.float32), SamplingConfig()))
    mask = np.asarray(jax.jit(lambda p: processors._top_p_mask(p, top_p, search))(probs))
    for row, (p_V, mask_V) in enumerate(zip(probs, mask)):
      order = np.argsort(-p_V, kind='stable')
      kept = int(mask_V.sum())
      where = f'row {row} of {logits.shape}'
      assert mask_V[order[:kept]].all(), f'{where}: not the {kept} most likely, ties by id'
      before = np.cumsum(p_V[order].astype(np.float64)) - p_V[order]
      assert before[kept - 1] < top_p + 1e-6, where
      assert kept == len(p_V) or before[kept] >= top_p - 1e-6, where


@pytest.mark.parametrize('search', [processors.CPU_SEARCH, processors.ACCELERATOR_SEARCH],
                         ids=['cpu', 'accelerator'])
@pytest.mark.parametrize('k', [1, 5, 50])
def test_top_k_by_search_keeps_what_top_k_keeps(search, k):
  """Top-k without `lax.top_k` (a search counting the logits above its cuts, by either plan)
  keeps what it keeps: the k largest logits, ties by id. Rows with many ties (rounded logits),
  -inf logits, a flat row, at 64 tokens and at GPT-2's 50,257."""
  rng = np.random.default_rng(k)
  tied = np.round(rng.normal(size=(24, 64)) * 2) / 2
  tied[:8, ::3] = -np.inf
  rows = [tied, np.zeros((1, 64)), rng.normal(size=(4, 50_257)) * 3,
          np.round(rng.standard_cauchy(size=(2, 50_257)))]
  for logits in rows:
    scaled = jnp.asarray(logits - logits.max(axis=-1, keepdims=True), jnp.float32)
    by_search = jax.jit(lambda x: processors._top_k_mask(x, k, search))(scaled)
    np.testing.assert_array_equal(by_search, processors._top_k_mask(scaled, k))
    for row, mask_V in enumerate(np.asarray(by_search)):
      order = np.argsort(-np.asarray(scaled[row]), kind='stable')
      assert mask_V.sum() == k and mask_V[order[:k]].all(), f'row {row} of {logits.shape}'


@pytest.mark.parametrize('cumsum', [processors._blocked_cumsum,
                                    lambda x: jax.lax.cumsum(x, axis=x.ndim - 1)],
                         ids=['cpu', 'accelerator'])
def test_prefix_sums_of_both_platforms(cumsum):
  """`_cumsum`'s CPU form (blocked triangular matmuls) and the accelerators' (`lax.cumsum`):
  integer counts exactly, probabilities to float32 accuracy, at 40 tokens and at 50,257."""
  rng = np.random.default_rng(3)
  for V in (40, 50_257):
    counts = (rng.random((3, V)) < 0.3).astype(np.float32)
    np.testing.assert_array_equal(jax.jit(cumsum)(counts), np.cumsum(counts, axis=-1))
    probs = rng.dirichlet(np.full(V, 0.1), size=3).astype(np.float32)
    np.testing.assert_allclose(jax.jit(cumsum)(probs), np.cumsum(probs.astype(np.float64), -1),
                               rtol=0, atol=3e-6)
  x = jnp.asarray(rng.random((2, 4, 40)), jnp.float32)
  np.testing.assert_allclose(processors._cumsum(x), np.cumsum(np.asarray(x), -1), rtol=1e-6)


@pytest.mark.parametrize('ways', [0, 1, 3, 12])
def test_a_top_p_search_splits_in_a_power_of_two(ways):
  with pytest.raises(ValueError, match='power of two'):
    processors.CutSearch(ways=ways, unrolled=False)
  assert processors.CutSearch(ways=2, unrolled=False).steps == 32
  assert processors.ACCELERATOR_SEARCH.steps == 8 and processors.CPU_SEARCH.steps == 16


def test_the_top_p_search_is_unrolled_off_the_cpu():
  """`probabilities` lowers the CPU's search as a loop and an accelerator's as straight-line code
  (a loop on a GPU splits the SpS loop's CUDA graph): lowered for each platform, only the CPU's
  program has a while loop. (Not `jax.export`ed: from JAX 0.12 a GPU's cumulative sum is a
  `chlo.scan`, which XLA:GPU compiles to a few kernels and export rewrites as a while loop over
  the vocabulary.)"""
  f = jax.jit(lambda logits: probabilities(logits, SamplingConfig(temperature=0.8, top_p=0.95)))
  x = jax.ShapeDtypeStruct((5, 1000), jnp.float32)
  module = lambda platform, g=f: g.trace(x).lower(lowering_platforms=(platform,)).as_text()
  assert 'stablehlo.while' in module('cpu')
  assert 'stablehlo.while' not in module('cuda') and 'stablehlo.while' not in module('tpu')
  # Its prefix sums (the ties' ranks): matmuls on the CPU, a cumulative sum elsewhere.
  assert 'stablehlo.dot_general' in module('cpu') and 'dot_general' not in module('cuda')
  # Without top-p there is no search, and no loop anywhere.
  g = jax.jit(lambda logits: probabilities(logits, SamplingConfig(temperature=0.8)))
  assert 'stablehlo.while' not in module('cpu', g)


def test_draws_in_blocks_are_draw_withs_where_sums_are_exact():
  """`draw_in_blocks` (O(V): a block, then a token in it) against `draw_with` (one prefix over
  the vocabulary): integer weights (exact prefix sums in float32) give the same token for every
  u, over 300 tokens (blocks of 128, the last partial) with whole blocks of zeros; only tokens
  of positive weight, u = 0 the first of them, u -> 1 the last; no positive weight: token 0."""
  rng = np.random.default_rng(0)
  w_V = rng.integers(0, 4, size=300).astype(np.float32)
  w_V[100:290] = 0.0  # Block 1 empty, blocks 0 and 2 partly.
  u_N = np.concatenate([rng.random(4000), [0.0, 1.0 - 2.0**-24]]).astype(np.float32)
  draws = lambda draw: np.asarray(jax.jit(jax.vmap(draw, in_axes=(0, None)))(
      jnp.asarray(u_N), jnp.asarray(w_V)))
  got = draws(processors.draw_in_blocks)
  np.testing.assert_array_equal(got, draws(processors.draw_with))
  positive = np.flatnonzero(w_V)
  assert np.isin(got, positive).all() and got[-2] == positive[0] and got[-1] == positive[-1]
  assert {int(t) for t in got} == set(positive.tolist())  # 4000 draws reach every one.
  assert int(processors.draw_in_blocks(jnp.float32(0.5), jnp.zeros((300,)))) == 0


@pytest.mark.parametrize('native_kernel', [False, True])
def test_sampling_with_uniforms_drawn_ahead_is_sampling_with_keys(native_kernel):
  """`uniforms` of a [B, K] key array gives each key's own number, and sampling with them equals
  sampling with the keys (SpS draws its drafts' uniforms once per loop)."""
  keys_BxK = jax.random.split(jax.random.key(0), (3, 4))
  u_BxK = processors.uniforms(keys_BxK)
  assert u_BxK.shape == (3, 4) and len(set(np.asarray(u_BxK).ravel().tolist())) == 12
  np.testing.assert_array_equal(u_BxK[1, 2], jax.random.uniform(keys_BxK[1, 2], (), jnp.float32))
  logits_BxV = jax.random.normal(jax.random.key(1), (3, 50)) * 3
  for settings in (dict(temperature=0.8, top_p=0.9), dict(temperature=0.0)):
    config = SamplingConfig(**settings)
    want = processors.probabilities_and_sample(keys_BxK[:, 2], logits_BxV, config,
                                               native_kernel=native_kernel)
    got = processors.probabilities_and_sample_with(u_BxK[:, 2], logits_BxV, config,
                                                   native_kernel=native_kernel)
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_allclose(got[0], want[0])
