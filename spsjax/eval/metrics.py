"""Text metrics, and whether two samplers differ by more than sampling noise.

`rouge2` is the mean ROUGE-2 F-measure of `rouge_score` with Porter stemming, one score per
(prediction, reference) pair. `mean_and_stderr` and `differs` decide whether, say, ArS and SpS
outputs score differently: SpS samples the target distribution exactly, so any difference between
them should be within noise, and `differs` flags one that is not.
"""

import functools
import math
import statistics
from collections.abc import Sequence

from rouge_score import rouge_scorer


@functools.cache
def _scorer() -> rouge_scorer.RougeScorer:
  return rouge_scorer.RougeScorer(['rouge2'], use_stemmer=True)


def rouge2_scores(predictions: Sequence[str], references: Sequence[str]) -> list[float]:
  """ROUGE-2 F-measure of each prediction against the reference at the same index."""
  if isinstance(predictions, str) or isinstance(references, str):
    raise TypeError('rouge2 takes sequences of strings, not a single string')
  if len(predictions) != len(references):
    raise ValueError(
        f'{len(predictions)} predictions but {len(references)} references: pair them one to one')
  if not predictions:
    raise ValueError('rouge2 needs at least one (prediction, reference) pair')
  scorer = _scorer()
  return [scorer.score(ref, pred)['rouge2'].fmeasure for pred, ref in zip(predictions, references)]


def rouge2(predictions: Sequence[str], references: Sequence[str]) -> float:
  """Mean ROUGE-2 F-measure over (prediction, reference) pairs, in [0, 1]."""
  return math.fsum(rouge2_scores(predictions, references)) / len(predictions)


def mean_and_stderr(values: Sequence[float]) -> tuple[float, float]:
  """Mean and standard error of the mean (sample std, n - 1, over sqrt n); NaN error if n == 1."""
  if not values:
    raise ValueError('mean_and_stderr needs at least one value')
  values = [float(v) for v in values]
  if not all(math.isfinite(v) for v in values):
    raise ValueError('mean_and_stderr needs finite values')
  mean = math.fsum(values) / len(values)
  if len(values) == 1:
    return mean, math.nan
  return mean, statistics.stdev(values, mean) / math.sqrt(len(values))


def differs(a_values: Sequence[float], b_values: Sequence[float], z: float = 2.0) -> bool:
  """Whether the means of two independent samples differ by more than `z` combined std errors.

  A two-sample z-test (Welch's statistic read against the normal): True iff
  |mean_a - mean_b| > z * sqrt(se_a**2 + se_b**2). With z = 2 and a few dozen values per sample,
  two samples of the same distribution are flagged about 5% of the time. For paired samples (the
  same prompts under ArS and SpS) whose scores are positively correlated, as scores on the same
  prompt usually are, it is conservative: it ignores the correlation, which shrinks the noise of
  the difference. If both samples are constant the combined error is 0 and
  any difference in means counts.
  """
  if len(a_values) < 2 or len(b_values) < 2:
    raise ValueError('differs needs at least two values in each sample to estimate their noise')
  if z < 0:
    raise ValueError(f'z must be non-negative, got {z}')
  mean_a, se_a = mean_and_stderr(a_values)
  mean_b, se_b = mean_and_stderr(b_values)
  return abs(mean_a - mean_b) > z * math.hypot(se_a, se_b)
