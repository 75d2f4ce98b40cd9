"""Table 1 of Chen et al. (2023), measured: ArS against SpS on a task's prompts.

A row is (task, decoding, batch, method). Both rows of a pair sample the same prompts in the same
calls, ArS and SpS taking turns call by call (`timing.time_interleaved`, compile apart), each with
keys of its own (so their scores are independent samples given the prompt), and score their
generations (`spsjax.eval.tasks`: pass@1 for HumanEval, ROUGE-2 for docstrings, chrF and next-line
exact match for code completion), plus two model-based parity columns that are informative on
every task (`spsjax.eval.likelihood`): the target's mean log-probability per generated token, and
(with a draft model) the mean of log p - log q, which moves first when SpS leaks the draft's law.
The SpS row also carries the model-based alpha: the mean of sum_x min(p, q) over the generated
positions, p and q after the processors (`eval.acceptance.pair_statistics`, which gives the log p
and log p/q columns from the same forward passes); the model alpha is the draft model's, none for
prompt lookup, and hybrid's is its draft model's, not that of the mix it proposes.

One SpS call per row is also profiled (`bench.profile`, `profile_row`): time per loop and per
phase read from the trace, and the call's time outside its loop (the prefills, which ArS pays
too).

What the rows give set against the theory, and whether their results differ, is
`bench.comparison`; the tables, `bench.table1`. The costs c and s come from `decode.measure_costs`
at `halfway_capacity`.

Invariant: each call is scored from its own outputs only (`_Pair.score`), every prompt once (the
last call's padding rows, copies of its last prompt, are timed but not scored).
"""

import dataclasses
import functools

import jax
import numpy as np
from jax.sharding import Mesh

from spsjax import models, sampling, sharding
from spsjax.bench import auto_k, profile, timing
from spsjax.data import prompts as prompts_lib
from spsjax.data.tokenizer import Tokenizer
from spsjax.eval import likelihood, metrics, tasks
from spsjax.eval.acceptance import pair_statistics
from spsjax.eval.tasks import Task, score
from spsjax.sampling import drafters, speculative

METHODS = ('ArS', 'SpS')
LOGP = 'log p'  # The parity column of the target's mean log-probability per generated token.
LOG_RATIO = 'log p/q'  # The parity column of the mean of log p - log q per generated token.


def _encode(task: Task, tok: Tokenizer, target: models.Model, draft: models.Model | None,
            k: int) -> tuple[np.ndarray, np.ndarray]:
  """The task's prompts as the rows run them: (prompts int32[N, P], lengths int32[N])."""
  sizes = [('target', target.config.max_seq_len)]
  if draft is not None:
    sizes.append(('draft', draft.config.max_seq_len))
  return tasks.encode(task, tok, sizes, speculative.headroom(k))


def calibration_prompts(task: Task, tok: Tokenizer, target: models.Model,
                        draft: models.Model | None, k: int, batch: int
                        ) -> tuple[np.ndarray, np.ndarray]:
  """The first `batch` prompts of `task` as its rows run them (k = 'auto' calibrates on them)."""
  prompts_NxP, lengths_N = _encode(task, tok, target, draft, k)
  rows = [i % len(lengths_N) for i in range(batch)]
  return prompts_NxP[rows], lengths_N[rows]


def halfway_capacity(task: Task, tok: Tokenizer, target: models.Model,
                     draft: models.Model | None, k: int, scored: int | None = None) -> int:
  """The cache size at which a row's c and s are measured (`measure_costs`): a prompt of the
  task's mean length halfway through its generation, plus the slots a score writes (k + 1, or
  `scored`: a tree's nodes and root; `decode.extend_seconds` attends over all but those).
  Attention reads every slot in use, so costs measured over the whole max_seq_len cache
  overstate a step, most at batch 8."""
  _, lengths_N = _encode(task, tok, target, draft, k)
  capacity = (int(round(float(np.mean(lengths_N)))) + task.max_new_tokens // 2 +
              (k + 1 if scored is None else scored))
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
  # Per prompt: mean log p - log q over the tokens the draft can propose (None: no draft model).
  log_ratios: list[float] | None
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


@dataclasses.dataclass(frozen=True)
class _CallScores:
  """What one call gives its method's row, for the call's real rows (the prompts `rows`)."""
  rows: tuple[int, ...]
  completions: tuple[str, ...]
  logprobs: tuple[float, ...]  # The target's mean log p per generated token.
  log_ratios: tuple[float, ...]  # Mean log p - log q (0 without a draft model).
  # SpS with a draft model: the sum of beta over the generated positions, their number, and with
  # lenience < 1 the sum of a draft slot's total variation from p (else 0).
  beta: float = 0.0
  positions: int = 0
  tv: float = 0.0


@dataclasses.dataclass(frozen=True)
class _Pair:
  """ArS and SpS on a task's prompts, in calls of `batch` rows (the last call filled up with
  copies of its last prompt): what a call samples, what it scores, and the rows they make."""
  target: models.Model
  draft: models.Model | None
  tok: Tokenizer
  task: Task
  decoding: str
  sampling_config: sampling.SamplingConfig
  batch: int
  k: int
  seed: int
  mesh: Mesh | None
  drafter: drafters.Drafter
  lenience: float
  prompts_NxP: np.ndarray
  lengths_N: np.ndarray
  policy: auto_k.Policy | None = None  # k = 'auto' (k is then its k_max).

  @property
  def num_calls(self) -> int:
    return -(-len(self.task.prompts) // self.batch)

  def rows(self, i: int) -> list[int]:
    """Call i's prompts, padded with the last one."""
    num = len(self.task.prompts)
    return [min(j, num - 1) for j in range(i * self.batch, (i + 1) * self.batch)]

  def real_rows(self, i: int) -> list[int]:
    return self.rows(i)[:len(self.task.prompts) - i * self.batch]

  def width(self, i: int) -> int:
    """Call i's padded width: one compiled program per width (`prompts.for_call`)."""
    return prompts_lib.for_call(self.prompts_NxP, self.lengths_N, self.rows(i))[0].shape[1]

  def sample(self, method: str, i: int) -> sampling.SampleOutput:
    """Call i of `method`, with keys of its own: the two methods' metrics are compared as
    independent samples."""
    prompts_BxP, lengths_B = prompts_lib.for_call(self.prompts_NxP, self.lengths_N, self.rows(i))
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(self.seed), i),
                             METHODS.index(method))
    kw = dict(max_new_tokens=self.task.max_new_tokens, sampling=self.sampling_config,
              eos_id=self.tok.eos_ids, mesh=self.mesh)
    k = self.policy.pending.k if self.policy is not None and method == 'SpS' else self.k
    if method == 'ArS' or not k:
      return sampling.autoregressive_sample(self.target, prompts_BxP, lengths_B, key, **kw)
    return sampling.speculative_sample(self.target, self.draft, prompts_BxP, lengths_B, key,
                                       k=k, drafter=self.drafter, lenience=self.lenience, **kw)

  def bucket(self, i: int):
    """Call i's compiled program: its width, and with k = 'auto' the k the policy picks."""
    return self.width(i) if self.policy is None else (self.width(i), self.policy.next().k)

  def observe(self, method: str, i: int, out: sampling.SampleOutput) -> _CallScores:
    if method == 'SpS' and self.policy is not None:
      self.policy.observe(out)
    return self.score(method, i, out)

  def score(self, method: str, i: int, out: sampling.SampleOutput) -> _CallScores:
    """Call i's completions and model-based columns, over its real rows."""
    rows = self.real_rows(i)
    tokens, n = np.asarray(out.tokens), np.asarray(out.num_generated)
    completions = tuple(self.tok.decode(tokens[r, :n[r]]) for r in range(len(rows)))
    prompts_BxP, lengths_B = prompts_lib.for_call(self.prompts_NxP, self.lengths_N, rows)
    out = sampling.SampleOutput(tokens=tokens[:len(rows)], num_generated=n[:len(rows)])
    sums = {}
    if method == 'SpS' and self.draft is not None:  # One forward pass of each model for all.
      stats = pair_statistics(self.target, self.draft, self.sampling_config, prompts_BxP,
                              lengths_B, out, self.mesh, lenience=self.lenience)
      target_logp, log_ratios = stats.logp, stats.log_ratios
      sums = dict(beta=stats.beta, positions=stats.count,
                  tv=stats.tv if self.lenience < 1 else 0.0)
    elif self.draft is not None:  # One forward pass of each model for both columns.
      target_logp, log_ratios = likelihood.log_columns(self.target, self.draft, prompts_BxP,
                                                       lengths_B, out, self.mesh)
    else:
      target_logp = likelihood.mean_logprobs(self.target, prompts_BxP, lengths_B, out, self.mesh)
      log_ratios = [0.0] * len(rows)
    return _CallScores(rows=tuple(rows), completions=completions,
                       logprobs=tuple(target_logp), log_ratios=tuple(log_ratios), **sums)

  def row(self, method: str, calls: list[_CallScores], timed: timing.Timing) -> Row:
    """`method`'s row from its calls' scores, in prompt order."""
    by_prompt = {r: (c, p, q) for call in calls for r, c, p, q in zip(
        call.rows, call.completions, call.logprobs, call.log_ratios)}
    completions, logprobs, log_ratios = (
        [by_prompt[r][j] for r in range(len(self.task.prompts))] for j in range(3))
    sps = method == 'SpS'
    positions = sum(c.positions for c in calls)
    scores = score(self.task, completions)
    return Row(task=self.task.name, decoding=self.decoding, batch=self.batch, method=method,
               scores=scores.values, logprobs=logprobs,
               log_ratios=log_ratios if self.draft is not None else None, extra=scores.extra,
               timing=timed.summary(), completions=completions,
               alpha_model=(sum((c.beta for c in calls), 0.0) / positions
                            if sps and positions else float('nan')),
               lenience=self.lenience if sps else 1.0,
               tv=(sum((c.tv for c in calls), 0.0) / positions
                   if sps and self.lenience < 1 and positions else 0.0))


def run_rows(target: models.Model, draft: models.Model | None, tok: Tokenizer, task: Task,
             decoding: str, sampling_config: sampling.SamplingConfig, batch: int, k: int,
             seed: int, mesh: Mesh | None = None,
             drafter: drafters.Drafter = drafters.ModelDrafter(),
             lenience: float = 1.0, policy: auto_k.Policy | None = None) -> tuple[Row, Row]:
  """ArS and SpS (with `drafter`; `draft` None for one without a model) on every prompt of `task`
  (in calls of `batch` rows), scored: (ArS, SpS). Lenience < 1 is LOSSY: the SpS row then carries
  the mean total variation of a draft slot's law from p along its outputs. With `policy`
  (k = 'auto', k its k_max) each SpS call runs at the policy's k (0: ArS), compiled untimed.

  The two take turns call by call (`timing.time_interleaved`), so that the machine's drift falls on
  both alike; each call is scored as it comes, outside the clock. On `mesh` (models placed on it
  beforehand, e.g. by `load_family`) the calls run sharded, rows on `data`; every process gets the
  whole outputs to score.
  """
  sharding.check_batch(batch, mesh)
  prompts_NxP, lengths_N = _encode(task, tok, target, draft, k)
  pair = _Pair(target=target, draft=draft, tok=tok, task=task, decoding=decoding,
               sampling_config=sampling_config, batch=batch, k=k, seed=seed, mesh=mesh,
               drafter=drafter, lenience=lenience, prompts_NxP=prompts_NxP, lengths_N=lengths_N,
               policy=policy)
  scored = {method: [] for method in METHODS}  # Each call's scores, in call order.
  timings = timing.time_interleaved(
      {m: functools.partial(pair.sample, m) for m in METHODS}, pair.num_calls, bucket=pair.bucket,
      ks={'SpS': k}, on_output=lambda m, i, out: scored[m].append(pair.observe(m, i, out)))
  ars, sps = (pair.row(m, scored[m], timings[m]) for m in METHODS)
  return ars, sps


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
      eos_id=tok.eos_ids, mesh=mesh, drafter=drafter, lenience=lenience)
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
