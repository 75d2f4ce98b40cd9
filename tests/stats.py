"""Goodness-of-fit against an exact distribution, for the sampler tests."""

import numpy as np
from scipy import stats


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
  big = expected >= min_expected
  obs = np.append(observed[big], observed[~big].sum())
  exp = np.append(expected[big], expected[~big].sum())
  if exp[-1] == 0:
    obs, exp = obs[:-1], exp[:-1]
  nonzero = obs > 0
  g = 2.0 * np.sum(obs[nonzero] * np.log(obs[nonzero] / exp[nonzero]))
  return float(stats.chi2.sf(g, df=len(obs) - 1))
