"""What speculative sampling should achieve, from alpha, k and measured costs (Leviathan et al.).

Notation (shared/THEORY.md): alpha = E[sum_x min(p(x), q(x))], the expected acceptance of one draft
token; k drafts per loop; c = draft step time / target step time; s = time of one target call on
k + 1 positions / time of one target step on 1 position (s = 1 on hardware where scoring is free
because decoding is memory-bound; measured here). Acceptances are treated as i.i.d. with rate alpha,
as the formulas assume; the measured tokens per loop checks that assumption.
"""

import dataclasses

import numpy as np


def _check(alpha: float, k: int) -> None:
  if not 0.0 <= alpha <= 1.0:
    raise ValueError(f'alpha must be in [0, 1], got {alpha}.')
  if int(k) != k or k < 1:
    raise ValueError(f'k must be an integer >= 1, got {k}.')


def expected_tokens_per_loop(alpha: float, k: int) -> float:
  """E[tokens per loop] = (1 - alpha^(k+1)) / (1 - alpha): a capped geometric count, in [1, k+1]."""
  _check(alpha, k)
  if alpha == 1.0:
    return float(k + 1)
  return (1.0 - alpha**(k + 1)) / (1.0 - alpha)


def expected_tokens_per_loop_proposed(alpha: float, loops_by_proposed) -> float:
  """E[tokens per loop] for a drafter that proposes a varying number of drafts (prompt lookup,
  dynamic k): `loops_by_proposed[n]` loops proposed n drafts (n = 0 .. k), and a loop with n
  proposed yields (1 - alpha^(n+1)) / (1 - alpha) tokens in expectation (1 when n = 0)."""
  counts = [float(c) for c in loops_by_proposed]
  if not counts or min(counts) < 0 or sum(counts) <= 0:
    raise ValueError(f'Need non-negative loop counts by drafts proposed, not all zero; got '
                     f'{list(loops_by_proposed)}.')
  per_n = [1.0] + [expected_tokens_per_loop(alpha, n) for n in range(1, len(counts))]
  return sum(c * e for c, e in zip(counts, per_n)) / sum(counts)


def alpha_from_counts(accepted: int, loops: int, full_loops: int) -> float:
  """The per-draft acceptance alpha estimated from SpS loop counts (maximum likelihood).

  Under the formulas' model each loop runs Bernoulli(alpha) trials left to right and stops at the
  first rejection or after k acceptances, so a loop that accepted all k drafts had no failed trial
  and every other loop had exactly one: alpha = accepted / (accepted + loops - full_loops).
  Not the same as accepted / (k loops), the fraction of drafted tokens accepted, which is biased
  low (E = alpha (1 - alpha^k) / (k (1 - alpha)) < alpha) and under-predicts tokens per loop.
  """
  if not 0 <= full_loops <= loops or accepted < 0:
    raise ValueError(f'Need 0 <= full_loops <= loops and accepted >= 0, got '
                     f'accepted={accepted}, loops={loops}, full_loops={full_loops}.')
  trials = accepted + loops - full_loops
  return accepted / trials if trials else float('nan')


def alpha_per_position(loops_by_accepted) -> list[float]:
  """The acceptance rate of draft position i = 1 .. k, from the loops that accepted n = 0 .. k
  drafts (each proposing k): of the loops that tried draft i (accepted the i - 1 before it),
  the fraction that accepted it. NaN where no loop tried it. The formulas' alpha assumes these
  equal; a draft that drifts from the target over its own drafts shows falling values."""
  counts = np.asarray(loops_by_accepted, np.int64)
  reached = counts[::-1].cumsum()[::-1]  # reached[n]: loops that accepted at least n.
  return [float(reached[i] / reached[i - 1]) if reached[i - 1] else float('nan')
          for i in range(1, len(counts))]


def expected_speedup(alpha: float, k: int, c: float, s: float = 1.0) -> float:
  """Wall-time improvement over ArS (Theorem 3.8), a loop costing k c + s target steps."""
  if c < 0 or s <= 0:
    raise ValueError(f'c must be >= 0 and s > 0, got c={c}, s={s}.')
  return expected_tokens_per_loop(alpha, k) / (k * c + s)


def operations_factor(alpha: float, k: int, c_hat: float) -> float:
  """Arithmetic operations relative to ArS (Theorem 3.11); c_hat = draft/target ops per token."""
  if c_hat < 0:
    raise ValueError(f'c_hat must be >= 0, got {c_hat}.')
  return (k * c_hat + k + 1) / expected_tokens_per_loop(alpha, k)


def best_k(alpha: float, c: float, s_of_k=lambda k: 1.0, k_max: int = 16) -> int:
  """The k in [1, k_max] with the largest expected speedup; `s_of_k(k)` is the scoring cost."""
  return max(range(1, k_max + 1), key=lambda k: expected_speedup(alpha, k, c, s_of_k(k)))


@dataclasses.dataclass(frozen=True)
class Prediction:
  """Theory for one setting, to print beside the measurement.

  A drafter that proposes fewer than k drafts in some loops (prompt lookup, dynamic k) gives the
  measured `loops_by_proposed` (loops that proposed n = 0 .. k drafts; empty: k in every loop)
  and the draft model steps it runs per loop, `draft_steps` (None: k; 0 without a draft model).
  The loop's cost is then draft_steps c + s, scoring still k + 1 positions.
  A tree of drafts (depth k) gives s of the target's call on its nodes, the positions it scores
  (`scored`) and its draft calls' positions (`draft_positions`; a level's call reads several),
  both for the operations; alpha is then the acceptance per depth (`alpha_from_counts` of its
  loops: accepted drafts are the path's), whose expected tokens per loop are a chain's.
  """
  alpha: float
  k: int
  c: float
  s: float
  c_hat: float
  loops_by_proposed: tuple[int, ...] = ()
  draft_steps: float | None = None
  scored: int | None = None  # None: k + 1.
  draft_positions: float | None = None  # None: the draft steps.

  @property
  def tokens_per_loop(self) -> float:
    if self.loops_by_proposed:
      return expected_tokens_per_loop_proposed(self.alpha, self.loops_by_proposed)
    return expected_tokens_per_loop(self.alpha, self.k)

  @property
  def _steps(self) -> float:
    return self.k if self.draft_steps is None else self.draft_steps

  def _speedup(self, s: float) -> float:
    if self.c < 0 or s <= 0:
      raise ValueError(f'c must be >= 0 and s > 0, got c={self.c}, s={s}.')
    return self.tokens_per_loop / (self._steps * self.c + s)  # Theorem 3.8 with k fixed.

  @property
  def speedup(self) -> float:
    return self._speedup(self.s)

  @property
  def speedup_free_scoring(self) -> float:
    """The speedup if scoring k + 1 positions cost one step (s = 1), as on TPUs in the paper."""
    return self._speedup(1.0)

  @property
  def operations(self) -> float:
    """Operations relative to ArS: draft_steps c_hat + k + 1 per loop over the tokens it yields
    (Theorem 3.11 with k fixed); a tree's draft positions c_hat + its scored positions."""
    if self.c_hat < 0:
      raise ValueError(f'c_hat must be >= 0, got {self.c_hat}.')
    draft = self._steps if self.draft_positions is None else self.draft_positions
    scored = self.k + 1 if self.scored is None else self.scored
    return (draft * self.c_hat + scored) / self.tokens_per_loop
