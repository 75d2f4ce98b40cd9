"""A Table 1 pair set against the theory: speedup, its bounds, prediction and result parity.

A `Comparison` holds what was measured (the ArS and SpS rows of one task, decoding and batch,
`bench.speedup`; the step costs c and s, `decode.measure_costs`; the SpS call's loop profile) and
derives every statistic from it, nothing measured here. The speedup is the ratio of mean token
times measured in the same run; whether the two rows' results differ by more than sampling noise
is `metrics.parity`: a paired t-test per column over the same prompts, Bonferroni over the row's
columns, with the smallest difference it would detect.

Theory (`theory.Prediction`) is computed from the same run: alpha measured (per-draft acceptance
from the loop counts, `theory.alpha_from_counts`) and c and s from jitted `extend` calls of the
two models at the row's batch. Measured tokens per loop are set against the formula's before
max_new_tokens and eos cut a row's last loop (`timing.Timing.uncut_tokens_per_loop`), as alpha
counts every accepted draft. A drafter that proposes fewer than k drafts in some loops (prompt
lookup, dynamic k) is predicted from the measured number of loops that proposed each count
(`theory.Prediction.loops_by_proposed`) and the draft steps it runs per loop (none for prompt
lookup). A tree's s is the target's call on its nodes, and a level-by-level drafter's draft steps
its level calls' measured time over a step's (`decode.Costs.draft_steps`).

From the loop profile: what the row would give if every draft were accepted at the same costs
(`perfect_draft_speedup`: a bound on what a better draft can gain at this k, so that a row short
of a target says whether the draft or the loop's cost is what limits it), with the draft's time
in the loop removed (`free_draft_speedup`: a bound on what a cheaper draft of the same alpha can
gain), and with both (`free_perfect_draft_speedup`: no drafter does better with this target's
scoring at this k).
"""

import dataclasses
from collections.abc import Callable

from spsjax.bench import theory
from spsjax.bench.decode import Costs
from spsjax.bench.speedup import LoopProfile, Row
from spsjax.eval import metrics
from spsjax.sampling import drafters

PARITY_LEVEL = 0.05  # Family-wise, over a row's columns (Bonferroni).
PARITY_POWER = 0.8  # For the minimal detectable difference each column reports.


@dataclasses.dataclass(frozen=True)
class Comparison:
  """An ArS row and the SpS row of the same task, decoding and batch, with the theory."""
  ars: Row
  sps: Row
  costs: Costs
  k: int
  c_hat: float  # Draft / target parameters: the ratio of operations per token.
  loop_profile: LoopProfile | None = None
  drafter: drafters.Drafter = drafters.ModelDrafter()
  # k = 'auto' (`auto_k.Policy.summary`): its costs, each call's k and predicted speedup, alpha;
  # `k` is then the k its SpS calls ran most (k_max if none), at which costs were measured.
  auto: dict | None = None

  @property
  def speedup(self) -> float:
    return self.ars.timing['mean_ms_per_token'] / self.sps.timing['mean_ms_per_token']

  def _speedup_if_call_took(self, call: Callable[[LoopProfile], float]) -> float:
    """The measured speedup times the profiled call over `call(profile)`; nan without one."""
    lp = self.loop_profile
    if lp is None or not call(lp) > 0:
      return float('nan')
    return self.speedup * lp.call / call(lp)

  @property
  def perfect_draft_speedup(self) -> float:
    """What a draft accepted every time would give with this loop: the measured speedup times
    the profiled call over the same call with every draft accepted (`LoopProfile.perfect_call`),
    the cost per loop, the prefills and the first token unchanged. An upper bound on what a better
    draft can buy at this k; nan without a profile."""
    return self._speedup_if_call_took(lambda lp: lp.perfect_call)

  @property
  def free_draft_speedup(self) -> float:
    """What a draft of the same acceptance that took no time in the loop would give: the measured
    speedup times the profiled call over the same call without the draft phase's time per loop
    (`LoopProfile.free_draft_call`). The draft's prefill stays outside the loop. nan without a
    profile."""
    return self._speedup_if_call_took(lambda lp: lp.free_draft_call)

  @property
  def free_perfect_draft_speedup(self) -> float:
    """The same with every draft accepted as well (`LoopProfile.free_perfect_call`): what no
    drafter, however fast or accurate, exceeds with this target's scoring at this k (up to the
    draft's prefill, which stays). nan without a profile."""
    return self._speedup_if_call_took(lambda lp: lp.free_perfect_call)

  @property
  def pooled_speedup(self) -> float:
    """ArS / SpS in pooled ms per token (total time / total tokens; nan for rows without it)."""
    ars, sps = (r.timing.get('pooled_ms_per_token', float('nan')) for r in (self.ars, self.sps))
    return ars / sps

  @property
  def prediction(self) -> theory.Prediction:
    t = self.sps.timing
    ragged = self.drafter.ragged
    alpha = t['alpha']
    if alpha != alpha and self.auto:  # Every call ran as ArS: no loop measured alpha.
      alpha = self.auto['alpha']
    calls = self.drafter.draft_calls(self.k)
    steps = self.costs.draft_steps
    if steps is None:
      steps = self.drafter.draft_steps(self.k, t.get('proposed_per_loop', self.k))
    return theory.Prediction(
        alpha=alpha, k=self.k, c=self.costs.c, s=self.costs.s, c_hat=self.c_hat,
        loops_by_proposed=tuple(t.get('loops_by_proposed', ())) if ragged else (),
        draft_steps=steps, scored=self.costs.scored,
        draft_positions=None if calls is None else float(sum(calls)))

  @property
  def parity(self) -> dict[str, metrics.Parity]:
    """SpS - ArS for every column (`Row.columns`: the task's metrics, log p and log p/q), each
    a paired t-test at PARITY_LEVEL / (number of columns)."""
    a, b = self.ars.columns, self.sps.columns
    return {name: metrics.parity(a[name], b[name], level=PARITY_LEVEL, power=PARITY_POWER,
                                 tests=len(a)) for name in a}

  @property
  def metrics_differ(self) -> bool:
    """Whether any column differs beyond noise (family-wise level PARITY_LEVEL)."""
    return any(p.differs for p in self.parity.values())

  def summary(self) -> dict:
    """Every figure of the comparison, for `table.json`."""
    p = self.prediction
    profiled = {} if self.loop_profile is None else dict(
        loop_profile=dataclasses.asdict(self.loop_profile),
        outside_forward_passes=self.loop_profile.outside_forward_passes,
        outside_forward_ops=self.loop_profile.outside_forward_ops)
    auto = {} if self.auto is None else dict(auto=self.auto)
    return dict(**profiled, **auto, speedup=self.speedup, pooled_speedup=self.pooled_speedup,
                perfect_draft_speedup=self.perfect_draft_speedup,
                free_draft_speedup=self.free_draft_speedup,
                free_perfect_draft_speedup=self.free_perfect_draft_speedup,
                predicted_speedup=p.speedup,
                predicted_speedup_free_scoring=p.speedup_free_scoring,
                predicted_tokens_per_loop=p.tokens_per_loop, operations_factor=p.operations,
                alpha_measured=p.alpha,
                acceptance_rate=self.sps.timing['acceptance_rate'],
                alpha_model=self.sps.alpha_model, lenience=self.sps.lenience,
                total_variation=self.sps.tv, c=self.costs.c,
                s=self.costs.s, metrics_differ_beyond_noise=self.metrics_differ,
                parity={name: dict(dataclasses.asdict(p), differs=p.differs)
                        for name, p in self.parity.items()})
