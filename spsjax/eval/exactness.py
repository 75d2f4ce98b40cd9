"""Goodness-of-fit against an exact distribution, and that exact distribution: what the sampler
tests and `experiments/accelerator_check.py` judge exactness by.

`exact_sequence_law` enumerates every continuation with the uncached reference forward
(`models.logits`), so a sampler's output law is checked against something it does not share: not
its cache, not its loop, not its draws. `g_test_pvalue` compares counts with such a law,
`two_sample_pvalue` two samplers' counts with each other (where no exact law is at hand:
bfloat16, whose cached and uncached forwards round differently), and `detectable_tv` says how far
from the law a test notices.

scipy.stats is imported where a p-value is computed, not with the module (~1 s that a binary
importing it would otherwise spend at start, before it parses its flags).
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from spsjax import models
from spsjax.sampling import PAD_ID, SamplingConfig, ngrams, probabilities
from spsjax.sampling.processors import present_through


def _cells(probs, n: float, min_expected: float):
  """The test's cells: each outcome expected >= min_expected times in n draws, the rest pooled."""
  big = probs * n >= min_expected
  return big, np.append(probs[big], probs[~big].sum())


def g_test_pvalue(observed, expected_probs, min_expected: float = 5.0) -> float:
  """G-test p-value of counts against exact probabilities; sparse cells are pooled.

  Also fails outright (returns 0) when an outcome of probability 0 was observed.
  """
  observed = np.asarray(observed, np.float64).ravel()
  probs = np.asarray(expected_probs, np.float64).ravel()
  probs = probs / probs.sum()
  if observed[probs <= 0].sum() > 0:
    return 0.0
  expected = probs * observed.sum()
  big, _ = _cells(probs, observed.sum(), min_expected)
  obs = np.append(observed[big], observed[~big].sum())
  exp = np.append(expected[big], expected[~big].sum())
  if exp[-1] == 0:
    obs, exp = obs[:-1], exp[:-1]
  nonzero = obs > 0
  g = 2.0 * np.sum(obs[nonzero] * np.log(obs[nonzero] / exp[nonzero]))
  from scipy import stats  # pylint: disable=import-outside-toplevel
  return float(stats.chi2.sf(g, df=len(obs) - 1))


def two_sample_pvalue(counts_a, counts_b, min_expected: float = 5.0) -> float:
  """G-test p-value that two samples of counts over the same outcomes come from one law; outcomes
  expected fewer than `min_expected` times in either sample (under that law) are pooled."""
  a = np.asarray(counts_a, np.float64).ravel()
  b = np.asarray(counts_b, np.float64).ravel()
  total = a + b
  n_a, n_b = a.sum(), b.sum()
  shared = total / (n_a + n_b)
  big = shared * min(n_a, n_b) >= min_expected
  table = np.stack([np.append(a[big], a[~big].sum()), np.append(b[big], b[~big].sum())])
  table = table[:, table.sum(0) > 0]
  if table.shape[1] < 2:
    return 1.0
  expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
  nonzero = table > 0
  g = 2.0 * np.sum(table[nonzero] * np.log(table[nonzero] / expected[nonzero]))
  from scipy import stats  # pylint: disable=import-outside-toplevel
  return float(stats.chi2.sf(g, df=table.shape[1] - 1))


def detectable_tv(n: int, expected_probs, p_min: float, power: float = 0.8,
                  min_expected: float = 5.0) -> tuple[float, float]:
  """(tv, pooled): `g_test_pvalue` on n draws, failing below p_min, detects with probability
  >= `power` any law whose total-variation distance from `expected_probs` on the test's cells is
  >= tv; `pooled` is the mass of the rare outcomes pooled into one cell, within which a change is
  invisible.

  Why: a law at total variation tv has chi-square divergence sum(d^2 / p) >= (sum |d|)^2 = 4 tv^2
  (Cauchy-Schwarz), and the statistic is then noncentral chi-square with noncentrality >= 4 n tv^2
  (asymptotically); tv is where that noncentrality gives the power asked.
  """
  probs = np.asarray(expected_probs, np.float64).ravel()
  probs = probs / probs.sum()
  big, cells = _cells(probs, n, min_expected)
  cells = cells[cells > 0]
  df = len(cells) - 1
  from scipy import optimize, stats  # pylint: disable=import-outside-toplevel
  critical = stats.chi2.isf(p_min, df)
  noncentrality = optimize.brentq(lambda lam: stats.ncx2.sf(critical, df, lam) - power, 1e-9, 1e6)
  return float(np.sqrt(noncentrality / (4 * n))), float(probs[~big].sum())


def scaled_model(config: models.TransformerConfig, seed: int, scale: float) -> models.Model:
  """Random weights with a scaled LM head: far-from-uniform next-token laws."""
  assert not config.tie_embeddings
  params = models.init_params(config, jax.random.key(seed))
  params = dict(params, head=params['head'] * scale)
  return models.Model(config, params)


@functools.partial(jax.jit, static_argnums=(0, 3, 4))
def _probabilities(config, params, tokens_BxT, sampling, prompt_length):
  present_BxTxV = (present_through(tokens_BxT, config.vocab_size) if sampling.penalised
                   else None)
  logits_BxTxV = models.logits(config, params, tokens_BxT)
  if sampling.reads_context:
    prompt_lengths_B = jnp.full(tokens_BxT.shape[:1], prompt_length, jnp.int32)
    logits_BxTxV = ngrams.shift(logits_BxTxV, ngrams.offsets_through(
        tokens_BxT, sampling, config.vocab_size, prompt_lengths_B))
  return probabilities(logits_BxTxV, sampling.without_context(), present_xV=present_BxTxV)


def exact_sequence_law(model: models.Model, prompt, num_tokens: int,
                       sampling: SamplingConfig) -> np.ndarray:
  """float64[V] * num_tokens: the law of the `num_tokens` tokens sampled after `prompt`.

  Enumerates all V^(num_tokens - 1) continuations in one call of `models.logits` (keep V and
  num_tokens small) and chains the conditional laws `probabilities` gives.
  """
  V, P = model.config.vocab_size, len(prompt)
  seqs = np.array([tuple(prompt) + rest
                   for rest in itertools.product(range(V), repeat=num_tokens - 1)], np.int32)
  probs = np.asarray(_probabilities(model.config, model.params, jnp.asarray(seqs), sampling, P),
                     np.float64)  # [V^(n-1), P + n - 1, V]
  joint = np.ones((1,))
  for i in range(num_tokens):
    # Rows are in lexicographic order: those whose tokens after position i are all 0 hold the law
    # of token i given each prefix, in the prefix's order.
    cond = probs[::V ** (num_tokens - 1 - i), P - 1 + i]  # [V^i, V]
    joint = (joint[:, None] * cond).ravel()
  return joint.reshape((V,) * num_tokens)


def truncated_at_eos(joint: np.ndarray, eos_id: int) -> np.ndarray:
  """The law of what a sampler outputs when it stops at `eos_id` (kept) and pads the rest with
  PAD_ID: `joint` over (V + 1)^n outcomes, index V standing for PAD_ID (as in `sequence_counts`)."""
  V, n = joint.shape[0], joint.ndim
  out = np.zeros((V + 1,) * n)
  for seq in itertools.product(range(V), repeat=n):
    cut = seq.index(eos_id) + 1 if eos_id in seq else n
    out[seq[:cut] + (V,) * (n - cut)] += joint[seq]
  return out


def sequence_counts(tokens, vocab_size: int, pad: bool = False) -> np.ndarray:
  """Counts of each row of int[rows, n] `tokens` as a flat index in the layout of
  `exact_sequence_law` (or of `truncated_at_eos` when `pad`: PAD_ID counts as V)."""
  tokens = np.asarray(tokens, np.int64)
  base = vocab_size + 1 if pad else vocab_size
  if pad:
    tokens = np.where(tokens == PAD_ID, vocab_size, tokens)
  assert ((tokens >= 0) & (tokens < base)).all(), 'a token outside the vocabulary'
  index = np.zeros(len(tokens), np.int64)
  for column in tokens.T:
    index = index * base + column
  return np.bincount(index, minlength=base ** tokens.shape[1])
