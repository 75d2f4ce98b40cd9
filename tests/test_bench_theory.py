"""The speedup formulas against THEORY.md's worked values and their limiting cases."""

import numpy as np
import pytest

from spsjax.bench import theory, timing


@pytest.mark.parametrize('alpha,k,expected', [(0.6, 3, 2.18), (0.6, 4, 2.31), (0.8, 3, 2.95),
                                              (0.8, 4, 3.36), (0.8, 5, 3.69)])
def test_expected_tokens_per_loop_matches_the_worked_examples(alpha, k, expected):
  assert theory.expected_tokens_per_loop(alpha, k) == pytest.approx(expected, abs=0.005)


def test_limits_and_k_equal_one():
  assert theory.expected_tokens_per_loop(0.0, 4) == 1.0
  assert theory.expected_tokens_per_loop(1.0, 4) == 5.0
  alpha, c = 0.7, 0.1  # k = 1 gives (1 + alpha) / (1 + c) (Leviathan et al., Corollary 3.9).
  assert theory.expected_speedup(alpha, 1, c) == pytest.approx((1 + alpha) / (1 + c))
  # A scoring call that costs s steps divides the speedup accordingly.
  assert theory.expected_speedup(0.8, 4, 0.05, s=2.0) == pytest.approx(3.3616 / 2.2, rel=1e-4)
  # No acceptance: every loop costs k draft steps plus a target call and emits one token.
  assert theory.expected_speedup(0.0, 3, 0.1) == pytest.approx(1 / 1.3)


def test_operations_and_best_k():
  # alpha = 1: k + 1 tokens for k c_hat + k + 1 operations.
  assert theory.operations_factor(1.0, 4, 0.1) == pytest.approx((0.4 + 5) / 5)
  assert theory.operations_factor(0.0, 2, 0.5) == pytest.approx(4.0)
  assert theory.best_k(0.8, 0.05) > theory.best_k(0.5, 0.05) >= 1
  assert theory.best_k(0.9, 0.01, s_of_k=lambda k: 1 + k) < theory.best_k(0.9, 0.01)
  p = theory.Prediction(alpha=0.8, k=4, c=0.05, s=2.0, c_hat=0.05)
  assert p.speedup < p.speedup_free_scoring and p.tokens_per_loop == pytest.approx(3.3616)


def test_bad_arguments():
  for bad in (dict(alpha=1.2, k=2), dict(alpha=0.5, k=0)):
    with pytest.raises(ValueError):
      theory.expected_tokens_per_loop(**bad)
  with pytest.raises(ValueError, match='s > 0'):
    theory.expected_speedup(0.5, 2, 0.1, s=0.0)


def test_alpha_from_counts_recovers_iid_alpha_where_the_drafted_fraction_does_not():
  rng = np.random.default_rng(0)
  alpha, k, loops = 0.7, 4, 20_000
  accepted_L = np.minimum(rng.geometric(1 - alpha, loops) - 1, k)  # Trials until a rejection.
  full_loops = int(np.sum(accepted_L == k))
  estimate = theory.alpha_from_counts(int(accepted_L.sum()), loops, full_loops)
  assert estimate == pytest.approx(alpha, abs=0.01)
  assert theory.expected_tokens_per_loop(estimate, k) == pytest.approx(
      np.mean(accepted_L + 1), rel=0.01)
  assert accepted_L.sum() / (k * loops) < alpha - 0.1  # The naive rate is biased low.
  assert theory.alpha_from_counts(8, 2, 2) == 1.0 and theory.alpha_from_counts(0, 3, 0) == 0.0
  with pytest.raises(ValueError, match='full_loops'):
    theory.alpha_from_counts(4, 2, 3)


def test_ragged_proposals_predict_from_the_loops_that_proposed_each_count():
  """A drafter proposing n = 0 .. k drafts: each loop yields E(alpha, n) tokens (1 for n = 0), and
  a simulation of i.i.d. acceptances with those proposal counts agrees; the cost per loop counts
  only the draft steps run."""
  alpha, loops_by_proposed = 0.6, (10, 0, 30, 60)  # k = 3.
  expected = (10 * 1 + 30 * (1 + 0.6 + 0.36) + 60 * (1 + 0.6 + 0.36 + 0.216)) / 100
  assert theory.expected_tokens_per_loop_proposed(alpha, loops_by_proposed) == pytest.approx(
      expected)
  rng = np.random.default_rng(1)
  proposed_L = rng.choice(4, size=40_000, p=np.array(loops_by_proposed) / 100)
  accepted_L = np.minimum(rng.geometric(1 - alpha, proposed_L.size) - 1, proposed_L)
  assert np.mean(accepted_L + 1) == pytest.approx(expected, rel=0.01)
  # Full loops (every proposal accepted, including the loops that proposed none) recover alpha.
  estimate = theory.alpha_from_counts(int(accepted_L.sum()), proposed_L.size,
                                      int(np.sum(accepted_L == proposed_L)))
  assert estimate == pytest.approx(alpha, abs=0.01)
  lookup = theory.Prediction(alpha=alpha, k=3, c=0.2, s=1.25, c_hat=0.1,
                             loops_by_proposed=loops_by_proposed, draft_steps=0.0)
  assert lookup.tokens_per_loop == pytest.approx(expected)
  assert lookup.speedup == pytest.approx(expected / 1.25)  # No draft model steps: c plays no part.
  assert lookup.speedup_free_scoring == pytest.approx(expected)
  assert lookup.operations == pytest.approx(4 / expected)
  dynamic = theory.Prediction(alpha=alpha, k=3, c=0.2, s=1.25, c_hat=0.1,
                              loops_by_proposed=loops_by_proposed, draft_steps=2.4)
  assert dynamic.speedup == pytest.approx(expected / (2.4 * 0.2 + 1.25))
  # Every loop proposing k is the fixed-k formula.
  fixed = theory.Prediction(alpha=alpha, k=3, c=0.2, s=1.25, c_hat=0.1, loops_by_proposed=(0, 0,
                                                                                          0, 5))
  assert fixed.speedup == pytest.approx(theory.expected_speedup(alpha, 3, 0.2, 1.25))
  with pytest.raises(ValueError, match='loop counts'):
    theory.expected_tokens_per_loop_proposed(alpha, (0, 0, 0))


def test_alpha_per_position_from_the_loops_accepted_counts():
  """Loops that accepted 0, 1, 2 of k = 2 drafts: 4, 2, 6. Position 1 was tried by all 12 loops
  and accepted by 8; position 2 by those 8, accepted by 6. A ragged drafter's counts give none."""
  assert theory.alpha_per_position([4, 2, 6]) == pytest.approx([8 / 12, 6 / 8])
  assert np.isnan(theory.alpha_per_position([3, 0, 0])[1])  # Nobody reached position 2.
  call = lambda accepted, proposed: timing.Call(
      seconds=1.0, rows=1, tokens=1 + sum(accepted), loops=sum(accepted),
      accepted=int(np.dot(accepted, range(3))), proposed=proposed, accepted_counts=accepted)
  fixed = timing.Timing(calls=(call((4, 2, 6), (0, 0, 12)), call((0, 0, 2), (0, 0, 2))),
                        compile_seconds=(), k=2)
  assert fixed.alpha_per_position == pytest.approx((10 / 14, 8 / 10))
  assert fixed.summary()['alpha_per_position'] == pytest.approx([10 / 14, 8 / 10])
  ragged = timing.Timing(calls=(call((4, 2, 6), (3, 0, 9)),), compile_seconds=(), k=2)
  assert ragged.alpha_per_position == ()
