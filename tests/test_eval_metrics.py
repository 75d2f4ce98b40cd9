"""eval.metrics: ROUGE-2 against hand-counted bigrams, and the sampling-noise check."""

import math

import pytest

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


def test_differs():
  a = [0.50, 0.52, 0.48, 0.51, 0.49]
  assert not metrics.differs(a, a)
  assert not metrics.differs(a, [v + 0.001 for v in a])  # Far inside the noise.
  assert metrics.differs(a, [v + 0.3 for v in a])
  assert metrics.differs([1.0, 1.0], [0.0, 0.0])  # No noise: any gap counts.
  assert not metrics.differs([1.0, 1.0], [1.0, 1.0])
  # Means 0 and 1, each stderr 1, combined sqrt(2): the gap is 1 / sqrt(2) = 0.707 combined errors.
  assert metrics.differs([-1.0, 1.0], [0.0, 2.0], z=0.70)
  assert not metrics.differs([-1.0, 1.0], [0.0, 2.0], z=0.71)
  with pytest.raises(ValueError, match='at least two'):
    metrics.differs([1.0], [1.0, 2.0])
