"""Text metrics, and whether two samplers differ by more than sampling noise.

`rouge2` is the mean ROUGE-2 F-measure of `rouge_score` with Porter stemming, `chrf_scores`
sacrebleu's sentence-level chrF, one score per (prediction, reference) pair. `mean_and_stderr` and
`parity` decide whether, say, ArS and SpS outputs score differently: SpS samples the target
distribution exactly, so any difference between them should be within noise; `parity` flags one
that is not and says how large a difference it could have seen (its power).

rouge_score (which imports nltk) and scipy.stats are imported on first use, not with the module:
~2 s that every binary importing the harness (speedup_table, sweep, evaluate) would otherwise
spend at start, before it parses its flags.
"""

import dataclasses
import functools
import math
import statistics
from collections.abc import Sequence

from sacrebleu import metrics as sacrebleu_metrics


@functools.cache
def _scorer():
  """rouge_score's ROUGE-2 scorer (a `RougeScorer`)."""
  from rouge_score import rouge_scorer  # pylint: disable=import-outside-toplevel
  return rouge_scorer.RougeScorer(['rouge2'], use_stemmer=True)


def _check_pairs(predictions: Sequence[str], references: Sequence[str], metric: str) -> None:
  if isinstance(predictions, str) or isinstance(references, str):
    raise TypeError(f'{metric} takes sequences of strings, not a single string')
  if len(predictions) != len(references):
    raise ValueError(
        f'{len(predictions)} predictions but {len(references)} references: pair them one to one')
  if not predictions:
    raise ValueError(f'{metric} needs at least one (prediction, reference) pair')


def rouge2_scores(predictions: Sequence[str], references: Sequence[str]) -> list[float]:
  """ROUGE-2 F-measure of each prediction against the reference at the same index."""
  _check_pairs(predictions, references, 'rouge2')
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


def chrf_scores(predictions: Sequence[str], references: Sequence[str]) -> list[float]:
  """Sentence-level chrF of each prediction against the reference at the same index, in [0, 1]:
  sacrebleu's CHRF with its defaults (character n-grams up to 6, recall weighted by beta = 2,
  whitespace ignored), divided by 100."""
  _check_pairs(predictions, references, 'chrF')
  chrf = _chrf()
  return [chrf.sentence_score(pred, [ref]).score / 100.0
          for pred, ref in zip(predictions, references)]


@functools.cache
def _chrf() -> sacrebleu_metrics.CHRF:
  return sacrebleu_metrics.CHRF()


@dataclasses.dataclass(frozen=True)
class Parity:
  """Paired comparison of two samplers' per-prompt scores: b - a over the same prompts, each
  sampled with keys of its own (independent samples given the prompt).

  The test: Student's paired t-test, two-sided, at `level` (already divided by the number of
  tests it shares a decision with: Bonferroni). `mde` is its power: the smallest true mean
  difference it detects with probability `power` at this n, (t_{1 - level/2} + t_{power}) x stderr
  with n - 1 degrees of freedom. When every difference is the same (greedy decoding gives equal
  outputs) the stderr is 0: then any nonzero difference counts and mde is 0.
  """
  n: int
  difference: float  # Mean of b - a.
  stderr: float
  p_value: float
  level: float
  mde: float
  power: float

  @property
  def differs(self) -> bool:
    return self.p_value < self.level


def parity(a_values: Sequence[float], b_values: Sequence[float], *, level: float = 0.05,
           power: float = 0.8, tests: int = 1) -> Parity:
  """The paired t-test of b - a at level / tests (see `Parity`)."""
  if len(a_values) != len(b_values):
    raise ValueError(f'Paired samples need equal sizes, got {len(a_values)} and {len(b_values)}')
  if len(a_values) < 2:
    raise ValueError('parity needs at least two pairs to estimate the noise of their difference')
  if not 0 < level < 1 or not 0 < power < 1 or tests < 1:
    raise ValueError(f'Need 0 < level < 1, 0 < power < 1 and tests >= 1; got level={level}, '
                     f'power={power}, tests={tests}')
  diffs = [float(b) - float(a) for a, b in zip(a_values, b_values)]
  mean, stderr = mean_and_stderr(diffs)
  n, level = len(diffs), level / tests
  if stderr == 0.0:
    return Parity(n, mean, 0.0, 1.0 if mean == 0.0 else 0.0, level, 0.0, power)
  df = n - 1
  from scipy import stats as scipy_stats  # pylint: disable=import-outside-toplevel
  p_value = float(2.0 * scipy_stats.t.sf(abs(mean) / stderr, df))
  mde = float((scipy_stats.t.ppf(1.0 - level / 2.0, df) + scipy_stats.t.ppf(power, df)) * stderr)
  return Parity(n, mean, stderr, p_value, level, mde, power)
