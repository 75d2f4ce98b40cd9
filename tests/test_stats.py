"""The statistics the sampler tests rely on: the G-test's level and the power `detectable_tv`
states, checked by simulation (numpy draws with a fixed seed: deterministic)."""

import numpy as np

from tests import stats

LAW = np.array([0.4, 0.1, 0.2, 0.15, 0.08, 0.05, 0.02])  # Cells 0, 1 hold half the mass.


def _rejections(law, n, p_min, trials=400, seed=0):
  rng = np.random.default_rng(seed)
  return np.mean([stats.g_test_pvalue(rng.multinomial(n, law), LAW) < p_min
                  for _ in range(trials)])


def test_g_test_level():
  assert abs(_rejections(LAW, 20_000, 0.05) - 0.05) < 0.03


def test_detectable_tv_is_the_power_against_the_hardest_change():
  """At tv, the change hardest to see (mass moved in proportion between two halves of the law)
  is detected about 80% of the time; a change of the same tv on one cell, more often; half the
  tv, much less often."""
  n, p_min = 20_000, 1e-5
  tv, pooled = stats.detectable_tv(n, LAW, p_min)
  assert pooled == 0 and 0.005 < tv < 0.05
  half = np.arange(len(LAW)) < 2
  hardest = lambda tv: LAW * np.where(half, 1 + tv / 0.5, 1 - tv / 0.5)
  assert 0.7 < _rejections(hardest(tv), n, p_min) < 0.9
  assert _rejections(hardest(tv / 2), n, p_min) < 0.2
  one_cell = LAW + tv * (np.eye(len(LAW))[6] - np.eye(len(LAW))[0])
  assert _rejections(one_cell, n, p_min) > 0.9


def test_detectable_tv_reports_the_pooled_mass():
  law = np.array([0.5, 0.49] + [0.001] * 10)
  tv, pooled = stats.detectable_tv(1000, law, 1e-5)  # 1 expected per rare outcome: pooled.
  assert abs(pooled - 0.01) < 1e-12
  assert tv > 0


def test_two_sample_test_level_and_power():
  """Two samples of one law are flagged at about the level asked; of laws at total variation
  0.05 apart (mass moved between the halves), nearly always at these sizes."""
  rng = np.random.default_rng(1)
  same = np.mean([stats.two_sample_pvalue(rng.multinomial(20_000, LAW),
                                          rng.multinomial(20_000, LAW)) < 0.05
                  for _ in range(400)])
  assert abs(same - 0.05) < 0.03
  other = LAW * np.where(np.arange(len(LAW)) < 2, 1 + 0.05 / 0.5, 1 - 0.05 / 0.5)
  apart = np.mean([stats.two_sample_pvalue(rng.multinomial(20_000, LAW),
                                           rng.multinomial(20_000, other)) < 1e-5
                   for _ in range(100)])
  assert apart > 0.9
