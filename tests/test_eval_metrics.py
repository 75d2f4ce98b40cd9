"""eval.metrics: ROUGE-2 against hand-counted bigrams, and the sampling-noise check."""

import math

import numpy as np
import pytest
from scipy import stats as scipy_stats

from spsjax.eval import metrics


def test_rouge2_identical_and_disjoint():
  assert metrics.rouge2(['the cat sat on the mat'], ['the cat sat on the mat']) == 1.0
  assert metrics.rouge2(['a quick brown fox'], ['lazy dogs sleep all day']) == 0.0


def test_rouge2_partial_overlap():
  # Bigrams: the-cat cat-sat sat-on on-the the-mat vs the-cat cat-lay lay-on on-the the-mat.
  # 3 of 5 shared on each side: precision = recall = F = 3/5.
  partial = metrics.rouge2(['the cat sat on the mat'], ['the cat lay on the mat'])
  assert partial == pytest.approx(0.6)
  # Lower case, no punctuation, stemmed: the-cat cat-are are-run vs the-cat cat-is is-run: F = 1/3.
  assert metrics.rouge2(['The cats are running.'], ['the cat is running']) == pytest.approx(1 / 3)
  # The mean over pairs.
  mean = metrics.rouge2(['the cat sat on the mat', 'x y z'], ['the cat lay on the mat', 'x y z'])
  assert mean == pytest.approx((0.6 + 1.0) / 2)
  assert metrics.rouge2_scores(['x y z', 'a b'], ['x y z', 'c d']) == [1.0, 0.0]


def test_rouge2_rejects_bad_input():
  with pytest.raises(ValueError, match='2 predictions but 1 references'):
    metrics.rouge2(['a b', 'c d'], ['a b'])
  with pytest.raises(ValueError, match='at least one'):
    metrics.rouge2([], [])
  with pytest.raises(TypeError):
    metrics.rouge2('a b', 'a b')


def test_mean_and_stderr():
  mean, stderr = metrics.mean_and_stderr([1.0, 2.0, 3.0, 4.0])
  assert mean == 2.5
  assert stderr == pytest.approx(math.sqrt(5 / 3) / 2)  # Sample variance 5/3, n = 4.
  assert metrics.mean_and_stderr([2.0, 2.0, 2.0]) == (2.0, 0.0)
  mean, stderr = metrics.mean_and_stderr([7.0])
  assert mean == 7.0 and math.isnan(stderr)
  with pytest.raises(ValueError):
    metrics.mean_and_stderr([])
  with pytest.raises(ValueError):
    metrics.mean_and_stderr([1.0, math.nan])


def test_chrf_is_sacrebleu_s_sentence_chrf_over_100():
  assert metrics.chrf_scores(['return x + 1', 'abc'], ['return x + 1', 'xyz']) == [1.0, 0.0]
  # Whitespace is not scored: indentation alone does not change chrF.
  assert metrics.chrf_scores(['    return x'], ['return x']) == [1.0]
  partial = metrics.chrf_scores(['return y'], ['return x + 1'])[0]
  assert 0.4 < partial < 0.7 and partial == pytest.approx(0.5361, abs=1e-4)  # sacrebleu 2.6.
  assert metrics.chrf_scores([''], ['return x']) == [0.0]
  with pytest.raises(ValueError, match='2 predictions but 1 references'):
    metrics.chrf_scores(['a', 'b'], ['a'])
  with pytest.raises(TypeError):
    metrics.chrf_scores('a', 'a')


def test_parity_is_the_paired_t_test():
  a = [0.50, 0.52, 0.48, 0.51, 0.49, 0.47]
  b = [0.53, 0.50, 0.52, 0.55, 0.49, 0.52]
  result = metrics.parity(a, b)
  want = scipy_stats.ttest_rel(b, a)
  assert result.n == 6 and result.difference == pytest.approx(np.mean(np.subtract(b, a)))
  assert result.p_value == pytest.approx(want.pvalue)
  assert result.stderr == pytest.approx(np.std(np.subtract(b, a), ddof=1) / math.sqrt(6))
  assert result.differs == (want.pvalue < 0.05)
  # Bonferroni: the same data at level 0.05 / 3.
  assert metrics.parity(a, b, tests=3).level == pytest.approx(0.05 / 3)
  assert metrics.parity(a, b, tests=3).mde > result.mde
  # A shift far beyond the noise is flagged; equal samples are not.
  assert metrics.parity(a, [v + 0.3 + 0.01 * i for i, v in enumerate(a)]).differs
  same = metrics.parity(a, a)
  assert not same.differs and same.p_value == 1.0 and same.mde == 0.0
  # Greedy decoding: every difference equal. Zero noise, so any nonzero difference counts.
  assert metrics.parity([1.0, 0.0], [1.0, 0.0]).differs is False
  assert metrics.parity([1.0, 0.0], [1.5, 0.5]).differs is True
  with pytest.raises(ValueError, match='equal sizes'):
    metrics.parity([1.0, 2.0], [1.0])
  with pytest.raises(ValueError, match='at least two'):
    metrics.parity([1.0], [1.0])
  with pytest.raises(ValueError, match='level'):
    metrics.parity(a, b, level=1.5)


def test_parity_level_and_power_hold_by_simulation():
  # Normal differences, n = 30: under equal laws the test flags about `level` of the samples; with
  # a true mean difference equal to the reported MDE it flags about `power` of them (the MDE is
  # computed from each sample's own stderr, so a sample's flag rate centres on the power).
  rng = np.random.default_rng(0)
  n, reps, sigma = 30, 2000, 0.2
  null = [metrics.parity(rng.normal(0, sigma, n), rng.normal(0, sigma, n)) for _ in range(reps)]
  false_positives = np.mean([r.differs for r in null])
  assert 0.03 < false_positives < 0.07  # 0.05, binomial sd 0.005.
  mde = float(np.median([r.mde for r in null]))
  shifted = [metrics.parity(rng.normal(0, sigma, n), rng.normal(mde, sigma, n))
             for _ in range(reps)]
  detected = np.mean([r.differs for r in shifted])
  assert 0.74 < detected < 0.86  # 0.8 by construction of the MDE; binomial sd 0.009.
