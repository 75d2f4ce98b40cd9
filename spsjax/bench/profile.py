"""Where one jitted program spends its time, by named scope, read from a `jax.profiler` trace.

`profile_compiled` runs a compiled program once under `jax.profiler.trace` (after warm-up calls),
reads back the trace JAX wrote and charges every XLA op event to a phase (`draft`, `score`,
`accept`, else `other`) through the op metadata of the same compiled HLO. `profile_speculative`
does it for the SpS program (`speculative.Loop.run`).

The HLO side (which phase an instruction is in) is `bench.hlo`; recording and reading the
trace is `bench.trace`.

Control flow. A `while` (also `conditional`, or a `call` not compiled into one kernel) has an event
spanning its sub-computations, whose thunks have events of their own. Only leaf events are summed:
an event is a container if some instruction of a computation it calls has events in the same run.
Fusions (fused instructions never have events) and small calls (one kernel) are leaves.

Invariants: `phase_s` sums leaf-op durations, so sum(phase_s) == busy_s + overlap_s, where `busy_s`
is the time at least one op ran and `overlap_s` > 0 only if ops ran concurrently. `phase_wall_s`
splits each instant of busy time equally among the ops running then, so sum(phase_wall_s) ==
busy_s <= total_s; the rest is `idle_s` (dispatch, loop control, thread hand-offs, preemption).
`phase_gap_s` charges an idle gap to a phase when the op that ended last before it and the op
that starts it both belong to that phase (the dispatch gaps inside a forward pass are part of
its wall time); a gap at a change of phase goes to none. So a phase's wall time is
phase_wall_s + phase_gap_s, and sum over phases <= total_s.

CUDA graphs. A GPU kernel run by a CUDA graph names no instruction, only its kernel, which every
fusion of equal code launches (`hlo.Hlo.kernel_owners`). Such an event is an op of the fusion its
kernel is named after, charged to the phase its owners share. Owners of several phases make it
mixed: it goes to the phase of the nearest ops before and after it whose phase is sure when they
agree on one of its owners' phases, else to the named fusion's phase. Library kernels (cuBLAS and
cuDNN products, a graph's memcpy) name nothing: they go to the phase of such neighbours when they
agree, else to `other`, and are counted as `unnamed`. In the loop marks below a class of k equal
fusions in the loop's body counts as one op run k times an iteration.

Loops. The main loop is the `while` whose body holds phased instructions (the outermost one; with no
phases, the largest). Each top-level instruction of its body runs once per iteration, so the i-th
event of each marks iteration i, which runs from its first body op to the next iteration's first
body op (the last iteration to the loop's last op), loop condition included. XLA may hoist
loop-invariant code out of the loop; it keeps its scope name, so it counts in the phase totals
(and in total / loops) but in no iteration.
"""

import bisect
import collections
import dataclasses
import os
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from spsjax import sharding, storage
from spsjax.bench.hlo import OTHER, PHASES, Hlo, Instruction, hlo_phases, parse_hlo
from spsjax.bench.trace import OpEvent, ProfileError, read_op_events, record
from spsjax.models import Model
from spsjax.sampling import common, speculative
from spsjax.sampling.drafters import Drafter, ModelDrafter
from spsjax.sampling.processors import SamplingConfig

__all__ = ['PHASES', 'OTHER', 'ProfileError', 'Hlo', 'Instruction', 'OpEvent', 'parse_hlo',
           'hlo_phases', 'record', 'read_op_events', 'Iteration', 'PhaseProfile', 'attribute',
           'profile_compiled', 'profile_speculative']


@dataclasses.dataclass(frozen=True)
class Iteration:
  """One iteration of the main loop: from its first body op to the next iteration's first."""
  wall_s: float
  phase_s: Mapping[str, float]  # Summed durations of the ops that started in it, per phase.
  phase_wall_s: Mapping[str, float]  # Their shares of wall time (see `PhaseProfile`).
  phase_gap_s: Mapping[str, float]  # Idle time between two consecutive ops of one phase.


@dataclasses.dataclass(frozen=True)
class PhaseProfile:
  """One run of one program on one device. Times in seconds, all read from the trace.

  `phase_s` sums op durations: sum(phase_s) == busy_s + overlap_s. `phase_wall_s` splits the busy
  time instead, each instant equally among the ops running then: sum(phase_wall_s) == busy_s.
  The two differ only where ops ran concurrently (CPU thread pool). `phase_gap_s` charges idle
  time to a phase when the ops on both sides of it belong to that phase (dispatch gaps inside a
  forward pass); idle time at a change of phase is charged to none:
  sum(phase_wall_s) + sum(phase_gap_s) <= total_s.
  """
  trace_dir: str  # Holds `<host>.xplane.pb` and `<host>.trace.json.gz`.
  module: str
  device: str
  phases: tuple[str, ...]  # The scopes, in order; `other` is everything else.
  total_s: float  # First op start to last op end.
  busy_s: float  # Time in which at least one op ran.
  overlap_s: float  # Summed op time minus busy time: > 0 only if ops ran concurrently.
  phase_s: Mapping[str, float]  # Summed leaf-op durations per phase, `other` included.
  phase_wall_s: Mapping[str, float]
  phase_gap_s: Mapping[str, float]
  phase_ops: Mapping[str, int]  # Leaf-op events per phase.
  loop_other_s: float  # The part of phase_s['other'] run by the main loop (body and condition).
  mixed_s: float  # Op time of ops whose code comes from several phases, or of GPU kernels that
  mixed_ops: int  # fusions of several phases share (each charged by the rules above).
  num_loops: int | None  # Program loops as the caller counted them (None: not given).
  iterations: tuple[Iteration, ...] | None  # Main-loop iterations found in the trace, or None,
  iterations_note: str  # and then why.
  unnamed_s: float = 0.0  # GPU library kernels in CUDA graphs, naming no instruction (see above).
  unnamed_ops: int = 0

  @property
  def idle_s(self) -> float:
    return self.total_s - self.busy_s

  @property
  def loops(self) -> int | None:
    """The caller's loop count, else the iterations found in the trace, else None."""
    if self.num_loops is not None:
      return self.num_loops
    return len(self.iterations) if self.iterations is not None else None

  def per_loop_s(self, phase: str) -> float:
    """Phase total / `loops`; for `other`, only its part in the main loop."""
    if not self.loops:
      raise ProfileError('No loop count (none given, none found in the trace, or 0).')
    return (self.loop_other_s if phase == OTHER else self.phase_s[phase]) / self.loops

  def per_loop(self) -> dict[str, float]:
    """`per_loop_s` of every phase, `other` last."""
    return {p: self.per_loop_s(p) for p in self.phases + (OTHER,)}

  def per_loop_ops(self) -> dict[str, float]:
    """Op events per loop of each phase but `other` (whose events in the loop are not counted
    apart from those outside it). On a GPU, about its kernel launches."""
    self.per_loop_s(self.phases[0])  # The same error without a loop count.
    return {p: self.phase_ops[p] / self.loops for p in self.phases}

  def report(self) -> list[str]:
    """Readable lines: totals, per-loop time and share per phase, the loop's spread, the rest."""
    ms = lambda s: f'{s * 1e3:.3f} ms'
    keys, its = self.phases + (OTHER,), self.iterations
    lines = [f'{self.module} on device {self.device}: {ms(self.total_s)} from first to last op; '
             f'ops ran {ms(self.busy_s)} ({self.busy_s / self.total_s:.0%}), '
             f'{ms(self.idle_s)} between ops' +
             (f'; ops overlapped for {ms(self.overlap_s)}' if self.overlap_s > 0 else ''),
             'op time per phase: ' + ', '.join(
                 f'{p} {ms(self.phase_s[p])} ({self.phase_ops[p]} ops)' for p in keys)]
    if its is None:
      lines.append(f'loop iterations not identified in the trace: {self.iterations_note}')
    elif self.num_loops is not None and len(its) != self.num_loops:
      lines.append(f'MISMATCH: the trace shows {len(its)} loop iterations, the caller counted '
                   f'{self.num_loops}; per-loop times use the caller\'s count')
    walls = [it.wall_s for it in its or ()]
    if walls:
      lines.append(f'main loop: {ms(sum(walls))} ({sum(walls) / self.total_s:.0%} of the run) in '
                   f'{len(walls)} iterations; before and after it {ms(self.total_s - sum(walls))}')
    if self.loops:
      source = 'from the caller' if self.num_loops is not None else 'found in the trace'
      lines.append(f'per loop ({self.loops} loops, {source}): op time' + (
          ', share of loop wall time, range over iterations:' if walls else
          ' (shares unknown: iterations not found):'))
      for p in keys:
        line = f'  {p if p != OTHER else "other (in loop)"}: {ms(self.per_loop_s(p))}/loop'
        if walls:
          each = [it.phase_s[p] for it in its]
          line += (f', {sum(it.phase_wall_s[p] for it in its) / sum(walls):.0%}, '
                   f'{ms(min(each))} to {ms(max(each))}')
        lines.append(line)
      if walls:
        idle = sum(walls) - sum(sum(it.phase_wall_s.values()) for it in its)
        within = {p: sum(it.phase_gap_s[p] for it in its) for p in keys}
        std = statistics.stdev(walls) if len(walls) > 1 else 0.0
        lines += [f'  between ops: {ms(idle / len(walls))}/loop, {idle / sum(walls):.0%}; within '
                  'a phase (both neighbours in it): ' + ', '.join(
                      f'{p} {within[p] / sum(walls):.0%}' for p in keys) +
                  f'; at a change of phase: {(idle - sum(within.values())) / sum(walls):.0%}',
                  f'  loop wall: mean {ms(statistics.mean(walls))}, std {ms(std)}, min '
                  f'{ms(min(walls))}, max {ms(max(walls))}']
    outside = self.phase_s[OTHER] - self.loop_other_s
    lines += [f'outside the {"/".join(self.phases)} scopes: {ms(self.phase_s[OTHER])} in '
              f'{self.phase_ops[OTHER]} ops; {ms(self.loop_other_s)} in the main loop (its '
              f'condition, unscoped body code), {ms(outside)} outside it',
              f'{self.mixed_ops} op events ({ms(self.mixed_s)}) hold code of several phases '
              '(or run a GPU kernel that fusions of several phases share); each is charged to one '
              'by the rules of spsjax.bench.profile']
    if self.unnamed_ops:
      lines.append(f'{self.unnamed_ops} GPU kernels ({ms(self.unnamed_s)}) name no instruction '
                   '(library kernels in CUDA graphs): charged to the phase of the kernels on both '
                   'sides where they agree, else to other')
    return lines


def _wall_shares_ns(events: Sequence[OpEvent]) -> list[float]:
  """Each event's share of wall time: every instant split equally among the events running."""
  points = sorted([(e.start_ns, 0, i) for i, e in enumerate(events)] +
                  [(e.end_ns, 1, i) for i, e in enumerate(events)])
  shares, running, last = [0.0] * len(events), set(), None
  for t, is_end, i in points:
    if running:
      for j in running:
        shares[j] += (t - last) / len(running)
    last = t
    (running.discard if is_end else running.add)(i)
  return shares


def _gaps_ns(events: Sequence[OpEvent], phases: Sequence[str]
             ) -> list[tuple[float, str | None]]:
  """Per event (sorted by start; `phases[i]` is event i's): the idle time just before it, and the
  phase it is charged to.

  The phase is the event's own if the op that ended last before the gap has the same phase (a gap
  inside one phase's stretch of ops), else None (a change of phase).
  """
  gaps, last = [], None  # `last`: the index of the event with the latest end so far.
  for i, e in enumerate(events):
    if last is None or e.start_ns <= events[last].end_ns:
      gaps.append((0.0, None))
    else:
      same = phases[last] == phases[i]
      gaps.append((float(e.start_ns - events[last].end_ns), phases[i] if same else None))
    if last is None or e.end_ns > events[last].end_ns:
      last = i
  return gaps


def _iterations(hlo: Hlo, loop: Instruction | None, in_loop: set[str], run: Sequence[OpEvent],
                owners: Sequence[tuple[str, ...]], leaves: Sequence[OpEvent],
                leaf_phase: Sequence[str], leaf_inside: Sequence[bool],
                wall_ns: Sequence[float], gaps: Sequence[tuple[float, str | None]]
                ) -> tuple[tuple[Iteration, ...] | None, str]:
  """(iterations, '') of the main loop, or (None, why not); see the module docstring. `in_loop`:
  the loop's instructions, nested ones included; `owners[i]`: the instructions that may have run
  `run[i]`; `leaf_inside[i]`: whether leaf i is loop code."""
  if loop is None:
    return None, 'the program has no while loop'
  body = set(hlo.computations.get(loop.body, ()))
  by_owners = collections.defaultdict(list)
  for e, own in zip(run, owners):
    if own and all(n in body for n in own):
      by_owners[own].append(e.start_ns)
  if not by_owners:
    return None, f'no op of {loop.name}\'s body has events'
  # An op XLA:CPU runs in parallel parts has an event a part: a multiple of the iterations.
  counts = {len(v) / len(own) for own, v in by_owners.items()}
  fewest = min(counts)
  if not fewest.is_integer() or any(c % fewest for c in counts):
    return None, f'the ops of {loop.name}\'s body ran different numbers of times ({sorted(counts)})'
  marks = [sorted(v)[::len(own)] for own, v in by_owners.items() if len(v) / len(own) == fewest]
  starts = [min(ith) for ith in zip(*marks)]
  n = len(starts)
  if starts != sorted(starts):
    return None, f'iterations of {loop.name} overlap in time'
  bounds = starts + [max(e.end_ns for e, own in zip(run, owners)
                         if own and all(n in in_loop for n in own))]
  keys = hlo.phases + (OTHER,)
  op_s = [dict.fromkeys(keys, 0.0) for _ in range(n)]
  wall_s = [dict.fromkeys(keys, 0.0) for _ in range(n)]
  gap_s = [dict.fromkeys(keys, 0.0) for _ in range(n)]
  for e, p, inside, wall, (gap, gap_phase) in zip(leaves, leaf_phase, leaf_inside, wall_ns, gaps):
    if inside and e.start_ns >= starts[0]:
      i = bisect.bisect_right(starts, e.start_ns) - 1
      op_s[i][p] += (e.end_ns - e.start_ns) * 1e-9
      wall_s[i][p] += wall * 1e-9
      # The gap ends at this op: it lies in the iteration where it starts (an iteration starts
      # at an op, so a gap never straddles two).
      j = bisect.bisect_right(starts, e.start_ns - gap) - 1
      if gap_phase is not None and j >= 0:
        gap_s[j][gap_phase] += gap * 1e-9
  return tuple(Iteration((bounds[i + 1] - bounds[i]) * 1e-9, op_s[i], wall_s[i], gap_s[i])
               for i in range(n)), ''


def _nearest(flags: Sequence[bool]) -> tuple[list[int | None], list[int | None]]:
  """For each index, the nearest index before it and after it whose flag is set (None: none)."""
  before, after, last = [], [None] * len(flags), None
  for i, flag in enumerate(flags):
    before.append(last)
    last = i if flag else last
  last = None
  for i in range(len(flags) - 1, -1, -1):
    after[i] = last
    last = i if flags[i] else last
  return before, after


def _name_kernels(events: Sequence[OpEvent], hlo: Hlo
                  ) -> tuple[list[OpEvent], list[tuple[str, ...]]]:
  """(events, owners): a GPU kernel run by a CUDA graph renamed to the fusion its kernel is named
  after ('' if none), owned by that fusion's class; any other event owned by its instruction."""
  kernels = hlo.kernel_owners() if any(e.kernel for e in events) else {}
  named, owners = [], []
  for e in events:
    own = kernels.get(e.kernel, ()) if e.kernel else (e.name,)
    name = next((n for n in own if n.replace('.', '_') == e.kernel), '') if e.kernel else e.name
    named.append(dataclasses.replace(e, name=name))
    owners.append(own)
  return named, owners


def attribute(events: Sequence[OpEvent], hlo: Hlo, *, num_loops: int | None = None,
              trace_dir: str = '', device: str | None = None) -> PhaseProfile:
  """Charges op events (one run, one device) to phases; see the module docstring for the rules."""
  devices = sorted({e.device for e in events}, key=lambda d: (len(d), d))
  device = devices[0] if device is None else device
  events = [e for e in events if e.device == device]
  if not events:
    raise ProfileError(f'No op events on device {device}; devices in the trace: {devices}.')
  runs = {e.run for e in events}
  if len(runs) != 1:
    raise ProfileError(f'The trace holds {len(runs)} runs of {hlo.module} on device {device}; '
                       'profile a single call.')
  events, owners = _name_kernels(events, hlo)
  traced = {e.name for e in events if e.name}
  unknown = traced - set(hlo.instructions)
  kernels = [e.kernel for e in events if e.kernel]
  if unknown or (kernels and not any(e.name for e in events if e.kernel)):
    example = sorted(unknown)[:3] or sorted(set(kernels))[:3]
    raise ProfileError(f'{len(unknown) or len(set(kernels))} traced ops or kernels name nothing in '
                       f'the HLO of {hlo.module} (e.g. {example}): the trace and the HLO come '
                       'from different compilations.')

  ran = set().union(*owners)  # What may have run: a kernel's event, for each of its owners.

  def container(name):
    i = hlo.instructions.get(name)
    return i is not None and any(n in ran for c in i.called + i.applied + i.control
                                 for n in hlo.computations.get(c, ()))

  loop = hlo.main_loop()
  in_loop = hlo.subtree(list(loop.control)) if loop is not None else set()
  order = sorted((i for i, e in enumerate(events) if not container(e.name)),
                 key=lambda i: events[i].start_ns)
  leaves = [events[i] for i in order]
  leaf_owners = [owners[i] for i in order]
  owned = [{hlo.phase[n] for n in own} for own in leaf_owners]  # The phases a leaf may be of.
  sure = [len(ps) == 1 for ps in owned]
  phases = [next(iter(ps)) if len(ps) == 1 else None for ps in owned]
  inside = [bool(own) and all(n in in_loop for n in own) for own in leaf_owners]
  sure_before, sure_after = _nearest(sure)
  for i, (e, ps) in enumerate(zip(leaves, owned)):  # Else the sure neighbours decide (see above).
    if not sure[i]:
      before, after = sure_before[i], sure_after[i]
      agree = (before is not None and after is not None and phases[before] == phases[after] and
               (not ps or phases[before] in ps))
      phases[i] = phases[before] if agree else hlo.phase[e.name] if ps else OTHER
      if not ps:
        inside[i] = before is not None and after is not None and inside[before] and inside[after]
  wall_ns = _wall_shares_ns(leaves)
  gaps = _gaps_ns(leaves, phases)
  keys = hlo.phases + (OTHER,)
  phase_s, phase_wall_s, phase_gap_s, phase_ops = (
      dict.fromkeys(keys, 0.0), dict.fromkeys(keys, 0.0), dict.fromkeys(keys, 0.0),
      dict.fromkeys(keys, 0))
  loop_other_s = mixed_s = unnamed_s = 0.0
  mixed_ops = unnamed_ops = 0
  for e, p, own, phases_owned, in_it, wall, (gap, gap_phase) in zip(
      leaves, phases, leaf_owners, owned, inside, wall_ns, gaps):
    seconds = (e.end_ns - e.start_ns) * 1e-9
    phase_s[p] += seconds
    phase_wall_s[p] += wall * 1e-9
    if gap_phase is not None:
      phase_gap_s[gap_phase] += gap * 1e-9
    phase_ops[p] += 1
    loop_other_s += seconds if p == OTHER and in_it else 0.0
    if len(phases_owned) > 1 or any(n in hlo.mixed for n in own):
      mixed_s, mixed_ops = mixed_s + seconds, mixed_ops + 1
    if not own:
      unnamed_s, unnamed_ops = unnamed_s + seconds, unnamed_ops + 1
  busy_ns = sum(wall_ns)
  overlap_ns = sum(e.end_ns - e.start_ns for e in leaves) - busy_ns
  iterations, note = _iterations(hlo, loop, in_loop, events, owners, leaves, phases, inside,
                                 wall_ns, gaps)
  return PhaseProfile(
      trace_dir=trace_dir, module=hlo.module, device=device, phases=hlo.phases,
      total_s=(max(e.end_ns for e in events) - min(e.start_ns for e in events)) * 1e-9,
      busy_s=busy_ns * 1e-9, overlap_s=max(0.0, overlap_ns * 1e-9), phase_s=phase_s,
      phase_wall_s=phase_wall_s, phase_gap_s=phase_gap_s, phase_ops=phase_ops,
      loop_other_s=loop_other_s,
      mixed_s=mixed_s, mixed_ops=mixed_ops, num_loops=num_loops, iterations=iterations,
      iterations_note=note, unnamed_s=unnamed_s, unnamed_ops=unnamed_ops)


# --- Entry points -------------------------------------------------------------------------------

def profile_compiled(compiled: jax.stages.Compiled, *args, log_dir: str,
                     num_loops: int | Callable[[Any], int] | None = None,
                     phases: Sequence[str] = PHASES, warmup: int = 1,
                     device: str | None = None) -> tuple[Any, PhaseProfile]:
  """Runs `compiled(*args)` `warmup` times, then once under the profiler; (outputs, profile).

  `compiled` comes from `jitted.lower(...).compile()` and `args` are its non-static arguments; the
  traced executable is exactly the one whose HLO is parsed. `num_loops` may be a function of the
  outputs. `device`: which device's events to use (default: the lowest ordinal seen).
  """
  for _ in range(warmup):
    jax.block_until_ready(compiled(*args))
  outputs, xplane, xspace = record(lambda: compiled(*args), log_dir)
  hlo = parse_hlo(compiled.as_text(), phases)
  loops = num_loops(outputs) if callable(num_loops) else num_loops
  return outputs, attribute(read_op_events(xspace, hlo.module), hlo, num_loops=loops,
                            trace_dir=os.fspath(storage.path(xplane).parent), device=device)


def profile_speculative(target: Model, draft: Model, prompts, prompt_lengths, rng: jax.Array, *,
                        k: int, max_new_tokens: int, log_dir: str,
                        sampling: SamplingConfig = SamplingConfig(),
                        draft_sampling: SamplingConfig | None = None,
                        eos_id: int | tuple[int, ...] | None = None,
                        mesh: Mesh | None = None, rules: sharding.Rules = sharding.DEFAULT_RULES,
                        warmup: int = 1, drafter: Drafter = ModelDrafter(),
                        lenience: float = 1.0) -> tuple[common.SampleOutput, PhaseProfile]:
  """`speculative_sample` (same checks and placement), profiled; loops = the program's iterations
  (the most loops any row took part in)."""
  loop, placed = speculative.prepare(
      target, draft, prompts, prompt_lengths, k=k, max_new_tokens=max_new_tokens,
      sampling=sampling, draft_sampling=draft_sampling, eos_id=eos_id, mesh=mesh, rules=rules,
      drafter=drafter, lenience=lenience)
  args = placed + (rng,)
  compiled = speculative.Loop.run.lower(loop, *args).compile()
  return profile_compiled(compiled, *args, log_dir=log_dir, warmup=warmup,
                          num_loops=lambda out: int(jnp.max(out.num_loops)))
