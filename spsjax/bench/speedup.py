"""Table 1 of Chen et al. (2023) for our models: ArS against SpS, with the theory beside it.

A row is (task, decoding, batch, method). Both rows of a pair sample the same prompts in the same
calls, ArS and SpS taking turns call by call (`timing.time_interleaved`, compile apart), each with
keys of its own (so their scores are independent samples given the prompt), and score their
generations (`spsjax.eval.tasks`: pass@1 for HumanEval, ROUGE-2 for docstrings, chrF and next-line
exact match for code completion), plus two model-based parity columns that are informative on
every task (`spsjax.eval.likelihood`): the target's mean log-probability per generated token, and
(with a draft model) the mean of log p - log q, which moves first when SpS leaks the draft's law.
A pair of rows (ArS, SpS) of the same task, decoding and batch gives the speedup (ratio of mean
token times measured in the same run) and says whether their results differ by more than
sampling noise (`metrics.parity`: a paired t-test per column over the same prompts, Bonferroni
over the row's columns, with the smallest difference it would detect). Measured tokens per loop are
set against the formula's before max_new_tokens and eos cut a row's last loop (`timing.Timing.
uncut_tokens_per_loop`), as alpha counts every accepted draft.

Theory (`theory.Prediction`) is computed from the same run: alpha measured (per-draft
acceptance from the loop counts, `theory.alpha_from_counts`) and model-based (mean of
sum_x min(p, q) over the generated positions, p and q after the processors:
`eval.acceptance.pair_statistics`, which gives the log p and log p/q columns from the same
forward passes); c and s from jitted
`extend` calls of the two models at the row's batch, attending over the slots a loop sees halfway
through a generation (`halfway_capacity`). One SpS call per row is also
profiled (`bench.profile`): time per loop and per phase read from the trace, and the call's time
outside its loop (the prefills, which ArS pays too: a bound on what any loop can gain), and what
the row would give if every draft were accepted at the same costs (`Comparison.
perfect_draft_speedup`: a bound on what a better draft can gain at this k, so that a row short of
a target says whether the draft or the loop's cost is what limits it), what it would give with
the draft's time in the loop removed (`free_draft_speedup`: a bound on what a cheaper draft of
the same alpha can gain), and with both (`free_perfect_draft_speedup`: no drafter does better
with this target's scoring at this k).

A drafter that proposes fewer than k drafts in some loops (prompt lookup, dynamic k) is predicted
from the measured number of loops that proposed each count (`theory.Prediction.loops_by_proposed`)
and the draft steps it runs per loop (none for prompt lookup). The model alpha is the draft
model's; prompt lookup has none ("-"), and hybrid's is its draft model's, not that of the mix of
lookup and model tokens it proposes (marked "draft model").
"""

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from spsjax import models, sampling, sharding
from spsjax.bench import decode, profile, theory, timing
from spsjax.bench.decode import Costs, measure_costs
from spsjax.data import prompts as prompts_lib
from spsjax.data.tokenizer import Tokenizer
from spsjax.eval import likelihood, metrics, tasks
from spsjax.eval.acceptance import pair_statistics
from spsjax.eval.tasks import Task, score
from spsjax.sampling import drafters, speculative

LOGP = 'log p'  # The parity column of the target's mean log-probability per generated token.
LOG_RATIO = 'log p/q'  # The parity column of the mean of log p - log q per generated token.
PARITY_LEVEL = 0.05  # Family-wise, over a row's columns (Bonferroni).
PARITY_POWER = 0.8  # For the minimal detectable difference each column reports.


def _encode(task: Task, tok: Tokenizer, target: models.Model, draft: models.Model | None,
            k: int) -> tuple[np.ndarray, np.ndarray]:
  """The task's prompts as the rows run them: (prompts int32[N, P], lengths int32[N])."""
  sizes = [('target', target.config.max_seq_len)]
  if draft is not None:
    sizes.append(('draft', draft.config.max_seq_len))
  return tasks.encode(task, tok, sizes, speculative.headroom(k))


def halfway_capacity(task: Task, tok: Tokenizer, target: models.Model,
                     draft: models.Model | None, k: int) -> int:
  """The cache size at which a row's c and s are measured (`measure_costs`): a prompt of the
  task's mean length halfway through its generation, plus the k + 1 slots a score writes
  (`decode.extend_seconds` attends over all but those). Attention reads every slot in use, so
  costs measured over the whole max_seq_len cache overstate a step, most at batch 8."""
  _, lengths_N = _encode(task, tok, target, draft, k)
  capacity = int(round(float(np.mean(lengths_N)))) + task.max_new_tokens // 2 + k + 1
  limits = [m.config.max_seq_len for m in (target, draft) if m is not None]
  return min([capacity] + limits)


@dataclasses.dataclass
class Row:
  task: str
  decoding: str
  batch: int
  method: str  # 'ArS' | 'SpS'
  scores: dict[str, list[float]]  # Per prompt, each of the task's metrics (headline first).
  logprobs: list[float]  # Per prompt: the target's mean log p per generated token (nats).
  log_ratios: list[float] | None  # Per prompt: mean log p - log q (None: no draft model).
  extra: dict
  timing: dict
  completions: list[str]
  alpha_model: float = float('nan')
  lenience: float = 1.0  # < 1: LOSSY (SpS rows only).
  tv: float = 0.0  # Lenient draft slot's law against p, mean along the outputs.

  @property
  def metric(self) -> str:
    """The task's headline metric."""
    return next(iter(self.scores))

  @property
  def values(self) -> list[float]:
    return self.scores[self.metric]

  @property
  def columns(self) -> dict[str, list[float]]:
    """Every per-prompt column the parity test compares: the task's metrics, 'log p' and (with a
    draft model) 'log p/q'."""
    ratios = {} if self.log_ratios is None else {LOG_RATIO: self.log_ratios}
    return {**self.scores, LOGP: self.logprobs, **ratios}

  @property
  def metric_mean(self) -> float:
    return metrics.mean_and_stderr(self.values)[0]

  @property
  def metric_stderr(self) -> float:
    return metrics.mean_and_stderr(self.values)[1]


def run_rows(target: models.Model, draft: models.Model | None, tok: Tokenizer, task: Task,
             decoding: str, sampling_config: sampling.SamplingConfig, batch: int, k: int,
             seed: int, mesh: Mesh | None = None,
             drafter: drafters.Drafter = drafters.ModelDrafter(),
             lenience: float = 1.0) -> tuple[Row, Row]:
  """ArS and SpS (with `drafter`; `draft` None for one without a model) on every prompt of `task`
  (in calls of `batch` rows), scored: (ArS, SpS). Lenience < 1 is LOSSY: the SpS row then carries
  the mean total variation of a draft slot's law from p along its outputs.

  The two take turns call by call (`timing.time_interleaved`), so that the machine's drift falls on
  both alike. On `mesh` (models placed on it beforehand, e.g. by `load_family`) the calls run
  sharded, rows on `data`; every process gets the whole outputs to score.
  """
  sharding.check_batch(batch, mesh)
  prompts_NxP, lengths_N = _encode(task, tok, target, draft, k)
  num = len(task.prompts)
  num_calls = -(-num // batch)
  rows_of = lambda i: [min(j, num - 1) for j in range(i * batch, (i + 1) * batch)]  # Pad: repeat.
  completions = {'ArS': [''] * num, 'SpS': [''] * num}
  logprobs = {'ArS': [0.0] * num, 'SpS': [0.0] * num}
  log_ratios = {'ArS': [0.0] * num, 'SpS': [0.0] * num}
  beta, tv = [0.0, 0], [0.0, 0]

  def run(method, i):
    prompts_BxP, lengths_B = prompts_lib.for_call(prompts_NxP, lengths_N, rows_of(i))
    # Independent keys for the two methods: their metrics are compared as independent samples.
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), i),
                             ('ArS', 'SpS').index(method))
    kw = dict(max_new_tokens=task.max_new_tokens, sampling=sampling_config, eos_id=tok.eos_id,
              mesh=mesh)
    if method == 'ArS':
      return sampling.autoregressive_sample(target, prompts_BxP, lengths_B, key, **kw)
    return sampling.speculative_sample(target, draft, prompts_BxP, lengths_B, key, k=k,
                                       drafter=drafter, lenience=lenience, **kw)

  def collect(method, i, out):
    rows = rows_of(i)
    tokens, n = np.asarray(out.tokens), np.asarray(out.num_generated)
    for r, row in enumerate(rows[:num - i * batch]):
      completions[method][row] = tok.decode(tokens[r, :n[r]])
    # Model-based columns over the call's real rows (the last call's padding rows repeat one).
    real = len(rows[:num - i * batch])
    prompts_BxP, lengths_B = prompts_lib.for_call(prompts_NxP, lengths_N, rows[:real])
    out = sampling.SampleOutput(tokens=tokens[:real], num_generated=n[:real])
    if method == 'SpS' and draft is not None:  # One forward pass of each model for all columns.
      stats = pair_statistics(target, draft, sampling_config, prompts_BxP, lengths_B, out, mesh,
                              lenience=lenience)
      target_logp, draft_logp = stats.logp, stats.logq
      beta[0] += stats.beta
      beta[1] += stats.count
      if lenience < 1:
        tv[0] += stats.tv
        tv[1] += stats.count
    else:
      target_logp = likelihood.mean_logprobs(target, prompts_BxP, lengths_B, out, mesh)
      draft_logp = (likelihood.mean_logprobs(draft, prompts_BxP, lengths_B, out, mesh)
                    if draft is not None else target_logp)
    for row, logp, logq in zip(rows[:real], target_logp, draft_logp):
      logprobs[method][row] = logp
      log_ratios[method][row] = logp - logq

  # One compiled program per padded width (`prompts.for_call`), compiled before it is timed.
  width = lambda i: prompts_lib.for_call(prompts_NxP, lengths_N, rows_of(i))[0].shape[1]
  timings = timing.time_interleaved(
      {m: functools.partial(run, m) for m in ('ArS', 'SpS')}, num_calls, bucket=width,
      ks={'SpS': k}, on_output=collect)
  out = []
  for method in ('ArS', 'SpS'):
    scores = score(task, completions[method])
    out.append(Row(task=task.name, decoding=decoding, batch=batch, method=method,
                   scores=scores.values, logprobs=logprobs[method],
                   log_ratios=log_ratios[method] if draft is not None else None,
                   extra=scores.extra,
                   timing=timings[method].summary(),
                   completions=completions[method],
                   alpha_model=(beta[0] / beta[1] if beta[1] else float('nan'))
                   if method == 'SpS' else float('nan'),
                   lenience=lenience if method == 'SpS' else 1.0,
                   tv=tv[0] / tv[1] if method == 'SpS' and tv[1] else 0.0))
  return out[0], out[1]


@dataclasses.dataclass
class Comparison:
  """An ArS row and the SpS row of the same task, decoding and batch, with the theory."""
  ars: Row
  sps: Row
  costs: Costs
  k: int
  c_hat: float  # Draft / target parameters: the ratio of operations per token.
  loop_profile: 'LoopProfile | None' = None
  drafter: drafters.Drafter = drafters.ModelDrafter()

  @property
  def speedup(self) -> float:
    return self.ars.timing['mean_ms_per_token'] / self.sps.timing['mean_ms_per_token']

  def _speedup_if_call_took(self, call: Callable[['LoopProfile'], float]) -> float:
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
    return theory.Prediction(
        alpha=t['alpha'], k=self.k, c=self.costs.c, s=self.costs.s, c_hat=self.c_hat,
        loops_by_proposed=tuple(t.get('loops_by_proposed', ())) if ragged else (),
        draft_steps=self.drafter.draft_steps(self.k, t.get('proposed_per_loop', self.k)))

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
    p = self.prediction
    profiled = {} if self.loop_profile is None else dict(
        loop_profile=dataclasses.asdict(self.loop_profile),
        outside_forward_passes=self.loop_profile.outside_forward_passes,
        outside_forward_ops=self.loop_profile.outside_forward_ops)
    return dict(**profiled, speedup=self.speedup, pooled_speedup=self.pooled_speedup,
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


@dataclasses.dataclass(frozen=True)
class LoopProfile:
  """Per-loop times of one SpS call, read from its profiler trace (seconds)."""
  trace_dir: str
  loops: int
  loop: float  # Mean wall time of a main-loop iteration.
  # Wall time per loop in each named scope: its ops' shares of wall time
  # (`PhaseProfile.phase_wall_s`) plus the idle gaps between two of its ops (`phase_gap_s`).
  draft: float
  score: float
  accept: float
  forward_gaps: float  # The idle gaps inside drafting and scoring (included in draft and score).
  # The whole call, first op to last, and its part outside the main loop: the prefills of both
  # models and the first token before it, the outputs after it. ArS pays the target's share too,
  # so at batch 8, where it is half the call, it bounds what any loop can gain.
  call: float
  outside_loop: float
  # The loops the call would take if every draft were accepted: each row's tokens after the
  # first (which comes from the prefill), k + 1 a loop, for the slowest row.
  perfect_loops: int

  @property
  def perfect_call(self) -> float:
    """The call with every draft accepted at the same cost per loop and outside it."""
    return self.outside_loop + self.perfect_loops * self.loop

  @property
  def free_draft_call(self) -> float:
    """The call with the draft phase's time removed from every loop, the loops unchanged."""
    return self.outside_loop + self.loops * (self.loop - self.draft)

  @property
  def free_perfect_call(self) -> float:
    """The call with every draft accepted and the draft phase's time removed from every loop."""
    return self.outside_loop + self.perfect_loops * (self.loop - self.draft)

  @property
  def outside_forward_passes(self) -> float:
    """Share of the loop spent neither drafting nor scoring: accept phase and bookkeeping."""
    return 1.0 - (self.draft + self.score) / self.loop

  @property
  def outside_forward_ops(self) -> float:
    """The same with every idle gap counted outside: the share not running a draft or score op."""
    return 1.0 - (self.draft + self.score - self.forward_gaps) / self.loop


def profile_row(target: models.Model, draft: models.Model | None, tok: Tokenizer, task: Task,
                sampling_config: sampling.SamplingConfig, batch: int, k: int, seed: int,
                log_dir: str, mesh: Mesh | None = None,
                drafter: drafters.Drafter = drafters.ModelDrafter(),
                lenience: float = 1.0) -> LoopProfile:
  """Profiles the SpS call on the first `batch` prompts of `task` (after a warm-up run); on a mesh,
  the events of this process's first device."""
  texts = [task.prompts[i % len(task.prompts)] for i in range(batch)]
  prompts_NxP, lengths_N = prompts_lib.encode_prompts(
      tok, texts, max_len=target.config.max_seq_len - task.max_new_tokens - k)
  out, trace = profile.profile_speculative(
      target, draft, prompts_NxP, lengths_N, jax.random.key(seed), k=k,
      max_new_tokens=task.max_new_tokens, log_dir=log_dir, sampling=sampling_config,
      eos_id=tok.eos_id, mesh=mesh, drafter=drafter, lenience=lenience)
  if not trace.loops:
    raise profile.ProfileError('The profiled call ran no loop.')
  its = trace.iterations
  if not its:
    raise profile.ProfileError(f'Main-loop iterations not found in the trace: '
                               f'{trace.iterations_note}')
  # Wall-time shares, not summed op durations (ops that ran concurrently, as XLA's CPU thunks do,
  # would count twice), plus the dispatch gaps between a phase's own ops.
  gaps = lambda phase: sum(it.phase_gap_s[phase] for it in its) / len(its)
  per_loop = lambda phase: sum(it.phase_wall_s[phase] for it in its) / len(its) + gaps(phase)
  in_loop = sum(it.wall_s for it in its)
  after_first_B = np.maximum(np.asarray(out.num_generated) - 1, 0)
  perfect_loops = int(np.max(-(-after_first_B // (k + 1))))
  return LoopProfile(trace_dir=trace.trace_dir, loops=len(its), loop=in_loop / len(its),
                     draft=per_loop('draft'), score=per_loop('score'), accept=per_loop('accept'),
                     forward_gaps=gaps('draft') + gaps('score'), call=trace.total_s,
                     outside_loop=trace.total_s - in_loop, perfect_loops=perfect_loops)


PARITY_NOTE = (
    f'log p: the target\'s mean log-probability per generated token; log p/q: the mean of log p - '
    f'log q (target minus draft, the log-likelihood ratio that moves first when SpS leaks the '
    f'draft\'s law); raw logits, nats. Results differ beyond noise: for each column (the task\'s '
    f'metrics, log p and log p/q), Student\'s paired t-test of SpS - ArS over the same prompts, '
    f'which the two sample with independent keys; two-sided at '
    f'{PARITY_LEVEL} / m for a row of m columns (Bonferroni), so a row is flagged with probability '
    f'at most {PARITY_LEVEL} when the laws are equal. In brackets the test\'s power: the smallest '
    f'true difference it detects with probability {PARITY_POWER} at the row\'s number of prompts '
    f'(0 when all differences are equal, as greedy decoding gives: then any difference counts). '
    f'ms/token: the mean over calls of each call\'s seconds per token; speedup per call is its '
    f'ratio, pooled the ratio of total time over total tokens, in which a call that stops after '
    f'a token or two weighs by its tokens (at nucleus ArS and SpS draw different lengths).')


def _mean_se(values: Sequence[float]) -> str:
  mean, stderr = metrics.mean_and_stderr(values)
  return f'{mean:.3f} ± {stderr:.3f}'


def _differences(parity: dict[str, metrics.Parity]) -> str:
  """'chrF +0.004 (0.021), log p -0.010 (0.030)': each column's mean difference and MDE."""
  return ', '.join(f'{name} {p.difference:+.3f} ({p.mde:.3f}){" *" if p.differs else ""}'
                   for name, p in parity.items())


def markdown(comparisons: Sequence[Comparison]) -> str:
  """Table 1 as Markdown: the measurement, then the theory from the same run."""
  head = ('| task | decoding | batch | method | result | parses | log p / token | log p/q / token | '
          'ms/token (std) | p90 ms | speedup (per call / pooled) | acceptance | tokens/loop |\n'
          '|---|---|---|---|---|---|---|---|---|---|---|---|---|')
  lines = [head]
  for cmp in comparisons:
    for row in (cmp.ars, cmp.sps):
      t = row.timing
      sps = row.method == 'SpS'
      method = row.method + (f' (LOSSY: lenience {row.lenience}, TV {row.tv:.3f})'
                             if row.lenience < 1 else '')
      parses = f'{row.extra["parse_rate"]:.0%}' if 'parse_rate' in row.extra else ''
      speed = f'{cmp.speedup:.2f}x / {cmp.pooled_speedup:.2f}x' if sps else '1x'
      accept = f'{t["acceptance_rate"]:.3f}' if sps else ''
      per_loop = f'{t["tokens_per_loop"]:.2f}' if sps else ''
      result = ', '.join(f'{name} {_mean_se(values)}' for name, values in row.scores.items())
      lines.append(
          f'| {row.task} | {row.decoding} | {row.batch} | {method} | {result} | {parses} | '
          f'{_mean_se(row.logprobs)} | '
          f'{"-" if row.log_ratios is None else _mean_se(row.log_ratios)} | '
          f'{t["mean_ms_per_token"]:.3f} ({t["std_ms_per_token"]:.3f}) | {t["p90_ms"]:.3f} | '
          f'{speed} | {accept} | {per_loop} |')
  lines += ['', '| task | decoding | batch | alpha (measured / model) | c | s | '
            'tokens/loop (measured / predicted) | speedup (measured / predicted / with s = 1) | '
            'measured / predicted | operations | SpS - ArS, paired (MDE) | '
            'results differ beyond noise |',
            '|---|---|---|---|---|---|---|---|---|---|---|---|']
  for cmp in comparisons:
    p, t = cmp.prediction, cmp.sps.timing
    model_alpha = ('-' if np.isnan(cmp.sps.alpha_model) else f'{cmp.sps.alpha_model:.3f}'
                   + (' (draft model)' if isinstance(cmp.drafter, drafters.Hybrid) else ''))
    lines.append(
        f'| {cmp.sps.task} | {cmp.sps.decoding} | {cmp.sps.batch} | {p.alpha:.3f} / '
        f'{model_alpha} | {p.c:.3f} | {p.s:.2f} | {t["uncut_tokens_per_loop"]:.2f} / '
        f'{p.tokens_per_loop:.2f} | {cmp.speedup:.2f}x / {p.speedup:.2f}x / '
        f'{p.speedup_free_scoring:.2f}x | {cmp.speedup / p.speedup:.2f} | {p.operations:.2f}x | '
        f'{_differences(cmp.parity)} | {"yes" if cmp.metrics_differ else "no"} |')
  if comparisons:
    lines += ['', PARITY_NOTE]
  profiled = [cmp for cmp in comparisons if cmp.loop_profile is not None]
  if profiled:
    lines += ['', '| task | decoding | batch | loops traced | ms per loop | draft | score | accept '
              '| outside draft and score | not running draft or score ops | ms per call | '
              'outside the loop (prefills) | speedup with every draft accepted | '
              'with a free draft (and every draft accepted) |',
              '|---|---|---|---|---|---|---|---|---|---|---|---|---|---|']
    for cmp in profiled:
      lp, ms = cmp.loop_profile, lambda x: f'{x * 1e3:.3f}'
      lines.append(f'| {cmp.sps.task} | {cmp.sps.decoding} | {cmp.sps.batch} | {lp.loops} | '
                   f'{ms(lp.loop)} | {ms(lp.draft)} | {ms(lp.score)} | {ms(lp.accept)} | '
                   f'{lp.outside_forward_passes:.1%} | {lp.outside_forward_ops:.1%} | '
                   f'{ms(lp.call)} | {ms(lp.outside_loop)} ({lp.outside_loop / lp.call:.0%}) | '
                   f'{cmp.perfect_draft_speedup:.2f}x ({lp.perfect_loops} loops) | '
                   f'{cmp.free_draft_speedup:.2f}x ({cmp.free_perfect_draft_speedup:.2f}x) |')
  return '\n'.join(lines)
