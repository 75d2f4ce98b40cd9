"""Wall-clock timing of sampler calls with compilation kept apart from running.

A benchmark is a list of calls (one batch of prompts each). The first call of each distinct shape
bucket (batch, padded width, ...) compiles: it is run once untimed and its time is reported as
compile time; then every call is timed, blocked until its outputs are ready. From the sampler's own
statistics come the tokens per row and, for SpS, the loops and accepted drafts.

Invariant: a timed call never includes compilation (each bucket is warmed first), and every time is
host wall time around one whole generation, the figure a user waits for.
"""

import collections
import concurrent.futures
import dataclasses
import statistics
import time
from collections.abc import Callable, Hashable, Mapping, Sequence

import jax
import numpy as np

from spsjax import distributed
from spsjax.bench import theory
from spsjax.sampling import SampleOutput


@dataclasses.dataclass(frozen=True)
class Call:
  """One timed generation: wall seconds and what the sampler reported."""
  seconds: float
  rows: int
  tokens: int  # Generated tokens, all rows.
  loops: int = 0  # SpS loops, summed over rows (0 for ArS).
  accepted: int = 0  # Accepted draft tokens, summed over rows.
  full_loops: int = 0  # Loops that accepted every draft proposed, summed over rows.
  drafted: int = 0  # Draft tokens proposed (k per loop, or fewer for ragged drafters).
  proposed: tuple[int, ...] = ()  # Loops that proposed n = 0 .. k drafts (empty if not reported).
  accepted_counts: tuple[int, ...] = ()  # Loops that accepted n = 0 .. k drafts (likewise).

  @property
  def token_time(self) -> float:
    """Seconds per generated token of one row: wall time / (tokens / rows)."""
    return self.seconds / max(self.tokens / self.rows, 1e-9)


def _percentile(values: Sequence[float], q: float) -> float:
  return float(np.percentile(np.asarray(values, np.float64), q))


@dataclasses.dataclass(frozen=True)
class Timing:
  """All calls of one method and setting, plus the compile time of each shape bucket."""
  calls: tuple[Call, ...]
  compile_seconds: tuple[float, ...]  # First call of each bucket: compile + one run.
  k: int = 0  # Drafts per loop (0 for ArS).

  def _token_times(self) -> list[float]:
    return [c.token_time for c in self.calls]

  @property
  def mean_token_time(self) -> float:
    """Mean over calls of seconds per token (the paper's ms/token at batch 1)."""
    return statistics.fmean(self._token_times())

  @property
  def pooled_token_time(self) -> float:
    """Seconds per token of a row over all calls pooled: total time / total tokens per row. Unlike
    the mean over calls, a call that stops after a token or two (its prefill spread over them)
    weighs by its tokens, not as much as a whole generation."""
    return sum(c.seconds for c in self.calls) / max(
        sum(c.tokens / c.rows for c in self.calls), 1e-9)

  @property
  def std_token_time(self) -> float:
    times = self._token_times()
    return statistics.stdev(times) if len(times) > 1 else 0.0

  def token_time_percentile(self, q: float) -> float:
    return _percentile(self._token_times(), q)

  @property
  def total_tokens(self) -> int:
    return sum(c.tokens for c in self.calls)

  @property
  def tokens_per_loop(self) -> float:
    """Mean tokens emitted per SpS loop (the first token of a row comes from the prefill), over
    the calls that ran loops (k = 'auto' may run some calls as ArS)."""
    looped = [c for c in self.calls if c.loops]
    if not looped:
      return float('nan')
    return sum(c.tokens - c.rows for c in looped) / sum(c.loops for c in looped)

  @property
  def uncut_tokens_per_loop(self) -> float:
    """Mean tokens per SpS loop before max_new_tokens or an eos cut a row's last loop short:
    accepted drafts + 1 per loop, the quantity the formulas predict from alpha (which counts
    every accepted draft, cut or not)."""
    loops = sum(c.loops for c in self.calls)
    return (sum(c.accepted for c in self.calls) + loops) / loops if loops else float('nan')

  @property
  def loops_by_proposed(self) -> tuple[int, ...]:
    """Loops that proposed n = 0 .. k drafts, over all calls (empty if a call did not say)."""
    if (not self.calls or not all(c.proposed for c in self.calls)
        or len({len(c.proposed) for c in self.calls}) > 1):  # k = 'auto': ks differ.
      return ()
    return tuple(int(x) for x in np.sum([c.proposed for c in self.calls], axis=0))

  @property
  def alpha_per_position(self) -> tuple[float, ...]:
    """Acceptance of draft position 1 .. k (`theory.alpha_per_position`), for drafters that
    propose k in every loop; empty otherwise (the loops' counts do not pair proposals with
    acceptances) or if a call did not report its counts."""
    loops = sum(c.loops for c in self.calls)
    if (not loops or not all(c.accepted_counts for c in self.calls)
        or len({len(c.accepted_counts) for c in self.calls}) > 1
        or (self.loops_by_proposed and self.loops_by_proposed[-1] != loops)):
      return ()
    return tuple(theory.alpha_per_position(
        np.sum([c.accepted_counts for c in self.calls], axis=0)))

  @property
  def proposed_per_loop(self) -> float:
    """Drafts proposed per loop (k unless the drafter is ragged)."""
    loops = sum(c.loops for c in self.calls)
    drafted = sum(c.drafted or self.k * c.loops for c in self.calls)
    return drafted / loops if loops else float('nan')

  @property
  def acceptance_rate(self) -> float:
    """Accepted drafts / proposed drafts (k per loop unless the drafter proposed fewer)."""
    drafted = sum(c.drafted or self.k * c.loops for c in self.calls)
    return sum(c.accepted for c in self.calls) / drafted if drafted else float('nan')

  @property
  def alpha(self) -> float:
    """Per-draft acceptance alpha (`theory.alpha_from_counts`): what the formulas take."""
    loops = sum(c.loops for c in self.calls)
    if not loops:
      return float('nan')
    return theory.alpha_from_counts(sum(c.accepted for c in self.calls), loops,
                                    sum(c.full_loops for c in self.calls))

  def summary(self) -> dict:
    ms = 1e3
    return dict(
        calls=len(self.calls), tokens=self.total_tokens,
        compile_s=round(sum(self.compile_seconds), 3),
        mean_ms_per_token=self.mean_token_time * ms, std_ms_per_token=self.std_token_time * ms,
        pooled_ms_per_token=self.pooled_token_time * ms,
        p50_ms=self.token_time_percentile(50) * ms, p90_ms=self.token_time_percentile(90) * ms,
        p99_ms=self.token_time_percentile(99) * ms, tokens_per_loop=self.tokens_per_loop,
        uncut_tokens_per_loop=self.uncut_tokens_per_loop,
        acceptance_rate=self.acceptance_rate, alpha=self.alpha,
        loops_by_proposed=list(self.loops_by_proposed), proposed_per_loop=self.proposed_per_loop,
        alpha_per_position=list(self.alpha_per_position))


class CompileClock:
  """Seconds JAX spends making executables while the clock is open (a context manager), by
  phase and by program name, from JAX's own monitoring events: tracing to a jaxpr, lowering to
  MLIR, and XLA's compile (on a GPU its autotuning too). A program read from the persistent
  compilation cache counts as compiled, its read timed inside XLA's compile event.

  What a benchmark's wall time is made of when most of it is not the timed calls: on an
  accelerator each new shape costs seconds of compiling and the calls themselves milliseconds.
  """
  PHASES = {'/jax/core/compile/jaxpr_trace_duration': 'tracing',
            '/jax/core/compile/jaxpr_to_mlir_module_duration': 'lowering',
            '/jax/core/compile/backend_compile_duration': 'XLA'}

  def __init__(self):
    self.phases = dict.fromkeys(self.PHASES.values(), 0.0)
    self.programs = collections.Counter()  # XLA compiles by program name.
    self.program_seconds = collections.Counter()

  def _listen(self, event: str, duration_secs: float, **kwargs) -> None:
    phase = self.PHASES.get(event)
    if phase is None:
      return
    self.phases[phase] += duration_secs
    if phase == 'XLA':
      name = str(kwargs.get('fun_name', '?'))
      self.programs[name] += 1
      self.program_seconds[name] += duration_secs

  def __enter__(self) -> 'CompileClock':
    jax.monitoring.register_event_duration_secs_listener(self._listen)
    return self

  def __exit__(self, *exc) -> None:
    jax.monitoring.unregister_event_duration_listener(self._listen)

  @property
  def seconds(self) -> float:
    return sum(self.phases.values())

  def summary(self, top: int = 3) -> str:
    """One line: the total, the phases, and the programs that took longest to compile."""
    names = sorted(self.program_seconds, key=self.program_seconds.get, reverse=True)[:top]
    slowest = ', '.join(f'{n} {self.programs[n]} x in {self.program_seconds[n]:.1f} s'
                        for n in names)
    return (f'compiling {self.seconds:.1f} s, {sum(self.programs.values())} programs ('
            + ', '.join(f'{p} {s:.1f} s' for p, s in self.phases.items())
            + (f'; slowest: {slowest}' if slowest else '') + ')')


def warm(calls: Sequence[Callable[[], object]], *, threads: int = 1) -> None:
  """Runs each call once, blocked until its outputs are ready, up to `threads` at a time (1: one
  after another). The first call of a jitted function traces it, holding the GIL, then compiles
  it with the GIL released: on a host with cores to spare, a figure's programs compile side by
  side before any of them is timed. A call's error is raised here."""
  if threads <= 1:
    for call in calls:
      jax.block_until_ready(call())
    return
  with concurrent.futures.ThreadPoolExecutor(threads) as pool:
    for future in [pool.submit(lambda c=call: jax.block_until_ready(c())) for call in calls]:
      future.result()


def medians(fns: Mapping[Hashable, Callable[[], object]], *, repeats: int,
             warmup: int = 1) -> dict[Hashable, float]:
  """Median wall time of each `fn()` (blocked until its outputs are ready), after `warmup` calls
  of each; the functions take turns within every repeat, so a slow spell of the machine falls on
  all of them alike."""
  for fn in fns.values():
    for _ in range(warmup):
      jax.block_until_ready(fn())
  samples = {key: [] for key in fns}
  for _ in range(repeats):
    for key, fn in fns.items():
      start = time.perf_counter()
      jax.block_until_ready(fn())
      samples[key].append(time.perf_counter() - start)
  return {key: statistics.median(times) for key, times in samples.items()}


def median_seconds(fn: Callable[[], object], *, repeats: int, warmup: int = 1) -> float:
  """Median wall time of `fn()` after `warmup` calls (`medians` of one function)."""
  return medians({None: fn}, repeats=repeats, warmup=warmup)[None]


def call_record(seconds: float, out: SampleOutput) -> Call:
  num_generated = np.asarray(out.num_generated)
  loops = 0 if out.num_loops is None else int(np.sum(out.num_loops))
  accepted = 0 if out.num_accepted is None else int(np.sum(out.num_accepted))
  total = lambda x: 0 if x is None else int(np.sum(x))
  if out.num_full_loops is not None:
    full_loops = total(out.num_full_loops)
  else:  # Outputs without it proposed k drafts per loop.
    histogram = out.accepted_histogram
    full_loops = 0 if histogram is None else int(np.asarray(histogram)[-1])
  return Call(seconds=seconds, rows=len(num_generated), tokens=int(num_generated.sum()),
              loops=loops, accepted=accepted, full_loops=full_loops,
              drafted=total(out.num_drafted),
              proposed=() if out.proposed_histogram is None
              else tuple(int(x) for x in np.asarray(out.proposed_histogram)),
              accepted_counts=() if out.accepted_histogram is None
              else tuple(int(x) for x in np.asarray(out.accepted_histogram)))


def time_calls(run: Callable[[int], SampleOutput], num_calls: int,
               bucket: Callable[[int], Hashable], *, k: int = 0,
               on_output: Callable[[int, SampleOutput], None] | None = None) -> Timing:
  """Times `run(i)` for i < num_calls; `bucket(i)` names call i's compiled program.

  `on_output(i, out)` sees every timed output (for scoring the generations).
  """
  seen = None if on_output is None else (lambda _, i, out: on_output(i, out))
  return time_interleaved({'': run}, num_calls, bucket, ks={'': k}, on_output=seen)['']


def time_interleaved(runs: Mapping[str, Callable[[int], SampleOutput]], num_calls: int,
                     bucket: Callable[[int], Hashable], *, ks: Mapping[str, int] | None = None,
                     on_output: Callable[[str, int, SampleOutput], None] | None = None
                     ) -> dict[str, Timing]:
  """Times several methods on the same calls, taking turns call by call: call i of every method
  runs before call i + 1 of any. This machine's speed drifts by tens of percent over minutes;
  interleaved, a slow spell falls on every method alike and their ratio stays fair.

  `ks` gives each method's drafts per loop (default 0); `on_output(name, i, out)` sees every
  timed output, as host arrays (gathered from every process after the clock stopped).
  """
  ks = ks or {}
  compile_seconds = {name: [] for name in runs}
  calls = {name: [] for name in runs}
  warmed = set()
  for i in range(num_calls):
    key = bucket(i)
    for name, run in runs.items():
      if (name, key) not in warmed:
        start = time.perf_counter()
        jax.block_until_ready(run(i))
        compile_seconds[name].append(time.perf_counter() - start)
        warmed.add((name, key))
    for name, run in runs.items():
      start = time.perf_counter()
      out = jax.block_until_ready(run(i))
      seconds = time.perf_counter() - start
      out = distributed.gather(out)
      calls[name].append(call_record(seconds, out))
      if on_output is not None:
        on_output(name, i, out)
  return {name: Timing(calls=tuple(calls[name]), compile_seconds=tuple(compile_seconds[name]),
                       k=ks.get(name, 0)) for name in runs}
