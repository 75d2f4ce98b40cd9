"""k = 'auto': per call, the lookahead (0 = plain ArS) that maximizes predicted tokens per second,
from a measured cost model of this machine and model pair and the acceptance seen so far.

Cost model (`LoopCosts`, per batch): the seconds of one ArS step and of one SpS loop at k = 1 and
at k = k_max, each from whole calls of the real samplers (draft steps, scoring, acceptance and
bookkeeping: what isolated `extend` timings miss; a draft step costs ~1.5x more in a loop than
alone), a loop at another k interpolated linearly (k draft steps, and a scoring whose cost grows
about linearly with its positions, barely at batch 1: a model drafter's alternatives, k (1 + m)
nodes, too); and each sampler's fixed cost per call
(the prefills: SpS also prefills the draft). Calibration runs the workload's own prompts at its
own `max_new_tokens`, and again at one new token: the difference gives a step or a loop at the
workload's context lengths (a batch's attention reads its caches once per step or score, so the
loop / step ratio falls as they grow), the short call the fixed cost. A policy's prediction is
for whole calls, as measured. Calibrating a batch compiles and times six programs (seconds to
tens of seconds at the reference sizes); the result is cached on disk per machine, JAX version,
models, drafter and sampling settings (`cache_key`): costs depend on shapes, the prior's alpha on
the weights too.

Acceptance (`Acceptance`): the alpha whose expected tokens per loop (`theory`) match each SpS
call's, averaged over the calls so far by their loops, starting from the calibration's SpS call.
Inverting tokens per loop, rather than counting trials, covers drafters that propose fewer than k
drafts (prompt lookup) and the rows of a batch alike.

Policy (`choose`): k* = argmax over k in 0 .. k_max of the predicted tokens per second of a call,
N / (sps_fixed + N / E[tokens per loop](alpha, k) * loop(k)), against N / (ars_fixed +
N * ars_step) for k = 0 (N = `new_tokens`). Each call is exact whatever its k: it is one ArS
or one SpS call. ArS calls see no acceptances, so after `PROBE_EVERY` ArS calls in a row the next
call probes at k = 1, the cheapest loop (`decide`): its counts are what can bring speculation back
when the text turns easier for the draft. At worst (a useless draft) a probe costs one call at
~0.5-0.85x ArS in `PROBE_EVERY` + 1, i.e. 0.5-1.5%.
"""

import dataclasses
import hashlib
import json
import os
import platform
import time
import jax
import jax.numpy as jnp
import numpy as np

from spsjax import models, sampling
from spsjax.bench import theory
from spsjax.sampling import drafters

# ArS calls in a row after which the next call probes at k = 1 (`decide`).
PROBE_EVERY = 32


def cache_dir() -> str:
  """Where calibrations are kept: $SPSJAX_CACHE_DIR/costs, default ~/.cache/spsjax/costs."""
  root = os.environ.get('SPSJAX_CACHE_DIR') or os.path.join(os.path.expanduser('~'), '.cache',
                                                            'spsjax')
  return os.path.join(root, 'costs')


@dataclasses.dataclass(frozen=True)
class LoopCosts:
  """One batch's measured costs, seconds (`module docstring`)."""
  batch: int
  k_max: int
  ars_step: float  # One ArS token per row.
  loop_1: float  # One SpS loop at k = 1.
  loop_max: float  # One SpS loop at k = k_max.
  alpha: float = 0.0  # The calibration's SpS call at k_max (`Acceptance`): the prior.
  prior_loops: int = 0
  new_tokens: int = 1  # Per row in a call: what the fixed costs are spread over.
  ars_fixed: float = 0.0  # An ArS call's cost beside its steps (the prefill).
  sps_fixed: float = 0.0  # An SpS call's beside its loops (the target's and draft's prefills).

  def __post_init__(self):
    if self.k_max < 1 or min(self.ars_step, self.loop_1, self.loop_max) <= 0:
      raise ValueError(f'Need k_max >= 1 and positive times, got {self}.')
    if self.new_tokens < 1 or min(self.ars_fixed, self.sps_fixed) < 0:
      raise ValueError(f'Need new_tokens >= 1 and fixed costs >= 0, got {self}.')

  def loop(self, k: int) -> float:
    """Seconds of one SpS loop at k (1 <= k <= k_max), linear between the two measured, and at
    least an ArS step (a loop runs the target once and drafts: less is timing noise)."""
    if not 1 <= k <= self.k_max:
      raise ValueError(f'k must be in [1, {self.k_max}], got {k}.')
    if self.k_max == 1:
      return max(self.loop_1, self.ars_step)
    return max(self.loop_1 + (k - 1) * (self.loop_max - self.loop_1) / (self.k_max - 1),
               self.ars_step)

  def call(self, k: int, alpha: float) -> float:
    """Predicted seconds of a call of `new_tokens` per row: ArS (k = 0), or SpS at k whose
    loops make E[tokens per loop](alpha, k) each."""
    if k == 0:
      return self.ars_fixed + self.new_tokens * self.ars_step
    loops = self.new_tokens / theory.expected_tokens_per_loop(alpha, k)
    return self.sps_fixed + loops * self.loop(k)


def alpha_for(tokens_per_loop: float, k: int) -> float:
  """The alpha whose expected tokens per loop at k is `tokens_per_loop` (clipped to [1, k + 1]):
  `theory.expected_tokens_per_loop` inverted (it increases with alpha)."""
  t = min(max(tokens_per_loop, 1.0), k + 1.0)
  lo, hi = 0.0, 1.0
  for _ in range(50):
    mid = (lo + hi) / 2
    lo, hi = (mid, hi) if theory.expected_tokens_per_loop(mid, k) < t else (lo, mid)
  return (lo + hi) / 2


@dataclasses.dataclass(frozen=True)
class Acceptance:
  """The acceptance seen so far: each SpS call's effective alpha (`alpha_for` its tokens per loop
  and k: what a ragged drafter's short proposals and a batch's rows do to a loop are in it),
  weighted by the call's loops."""
  weighted_alpha: float = 0.0  # Sum over calls of alpha * loops.
  loops: int = 0
  ars_calls: int = 0  # ArS calls since the last SpS call.

  @property
  def alpha(self) -> float:
    """The estimate; 0 before any loop (no evidence that drafts are accepted)."""
    return self.weighted_alpha / self.loops if self.loops else 0.0

  def observe(self, out: sampling.SampleOutput, k: int) -> 'Acceptance':
    """Adds an SpS call's counts at lookahead k (an ArS call only counts as one)."""
    if out.num_loops is None:
      return dataclasses.replace(self, ars_calls=self.ars_calls + 1)
    loops = int(np.sum(out.num_loops))
    if not loops:
      return dataclasses.replace(self, ars_calls=0)
    tokens_per_loop = (int(np.sum(out.num_accepted)) + loops) / loops
    return Acceptance(self.weighted_alpha + alpha_for(tokens_per_loop, k) * loops,
                      self.loops + loops)


@dataclasses.dataclass(frozen=True)
class Choice:
  """A call's k (0: ArS) and each candidate's predicted tokens per second per row."""
  k: int
  alpha: float
  rates: tuple[float, ...]  # rates[k], k = 0 .. k_max.
  probe: bool = False  # k = 1 although ArS rates higher (`decide`).

  @property
  def predicted_speedup(self) -> float:
    """The chosen k's predicted rate over ArS's."""
    return self.rates[self.k] / self.rates[0]


def choose(costs: LoopCosts, alpha: float) -> Choice:
  """The k in 0 .. k_max with the highest predicted tokens per second (ties: the smaller k)."""
  alpha = min(max(alpha, 0.0), 1.0)
  rates = [costs.new_tokens / costs.call(k, alpha) for k in range(costs.k_max + 1)]
  return Choice(k=int(np.argmax(rates)), alpha=alpha, rates=tuple(rates))


def decide(costs: LoopCosts, acceptance: Acceptance, probe_every: int = PROBE_EVERY) -> Choice:
  """`choose` at the acceptance so far, except that after `probe_every` ArS calls in a row
  (`Acceptance.ars_calls`) the call probes at k = 1 (0: never)."""
  choice = choose(costs, acceptance.alpha)
  if choice.k == 0 and probe_every and acceptance.ars_calls >= probe_every:
    return dataclasses.replace(choice, k=1, probe=True)
  return choice


def _cpu() -> str:
  try:
    with open('/proc/cpuinfo', encoding='utf-8') as f:
      info = f.read()
  except OSError:
    return platform.processor() or platform.machine()
  name = next((l.split(':', 1)[1].strip() for l in info.splitlines()
               if l.startswith('model name')), platform.machine())
  flags = next((l.split(':', 1)[1].split() for l in info.splitlines()
                if l.startswith('flags')), [])
  return f'{name} [{" ".join(sorted(f for f in flags if f.startswith(("avx", "fma"))))}]'


def cache_key(target: models.Model, draft: models.Model | None, drafter: drafters.Drafter,
              sampling_config: sampling.SamplingConfig, batch: int, k_max: int,
              max_new_tokens: int) -> str:
  """What a calibration depends on: machine (CPU and its vector extensions, or the
  accelerator), JAX, the models' shapes and kernels (packed weight types), drafter, sampling;
  and, for the prior's alpha, the weights (a checksum: the sum of their magnitudes)."""
  def shape(m):
    if m is None:
      return None
    checksum = sum(float(jnp.sum(jnp.abs(x.astype(jnp.float32))))
                   for x in jax.tree.leaves(m.params))
    return dict(config=repr(m.config), packed=models.packed_dtype(m),
                output_copy='output' in m.params, weights=f'{checksum:.6e}')
  device = jax.devices()[0]
  what = dict(model='whole calls, fixed costs',  # What `measure` measures.
              cpu=_cpu(), device=f'{device.platform}:{device.device_kind}:{jax.device_count()}',
              jax=jax.__version__, target=shape(target), draft=shape(draft),
              drafter=repr(drafter), sampling=repr(sampling_config), batch=batch, k_max=k_max,
              max_new_tokens=max_new_tokens)
  return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:20]


def _fastest_calls(runs: dict, repeats: int) -> dict:
  """{name: (the fastest of `repeats` timed calls, seconds; its output)}, each run compiled
  first, the runs taking turns within every repeat (a slow spell falls on all of them)."""
  outs = {name: jax.block_until_ready(run()) for name, run in runs.items()}  # Compiles.
  best = {name: float('inf') for name in runs}
  for _ in range(repeats):
    for name, run in runs.items():
      start = time.perf_counter()
      outs[name] = jax.block_until_ready(run())
      best[name] = min(best[name], time.perf_counter() - start)  # Noise only adds.
  return {name: (best[name], outs[name]) for name in runs}


def measure(target: models.Model, draft: models.Model | None, prompts_BxP, lengths_B, *,
            k_max: int, drafter: drafters.Drafter = drafters.ModelDrafter(),
            sampling_config: sampling.SamplingConfig = sampling.SamplingConfig(),
            max_new_tokens: int = 48, repeats: int = 5, seed: int = 0) -> LoopCosts:
  """Times ArS, and SpS at k = 1 and k_max, on these prompts (their rows are the batch; no eos),
  each at `max_new_tokens` and at one new token (each the fastest of `repeats` calls, all taking
  turns, after one that compiles). A step or loop is the two calls' difference over the steps or
  loops per row between them; the fixed cost, the one-token call less its step or loop."""
  if k_max < 1 or max_new_tokens < 2:
    raise ValueError(f'Need k_max >= 1 and max_new_tokens >= 2, got {k_max}, {max_new_tokens}.')
  key = jax.random.key(seed)
  batch = len(lengths_B)
  prompts_BxP, lengths_B = np.asarray(prompts_BxP), np.asarray(lengths_B)
  runs = {}
  for n in (max_new_tokens, 1):
    runs[0, n] = lambda n=n: sampling.autoregressive_sample(
        target, prompts_BxP, lengths_B, key, max_new_tokens=n, sampling=sampling_config)
    for k in sorted({1, k_max}):
      runs[k, n] = lambda k=k, n=n: sampling.speculative_sample(
          target, draft, prompts_BxP, lengths_B, key, k=k, max_new_tokens=n,
          sampling=sampling_config, drafter=drafter)
  timed = _fastest_calls(runs, repeats)

  def per_row(k, n):  # Steps (k = 0) or loops per row of a call.
    out = timed[k, n][1]
    return n if k == 0 else float(np.sum(out.num_loops)) / batch

  unit, fixed = {}, {}
  for k in sorted({0, 1, k_max}):
    long, short = timed[k, max_new_tokens][0], timed[k, 1][0]
    between = per_row(k, max_new_tokens) - per_row(k, 1)
    unit[k] = max(long - short, 1e-9) / max(between, 1.0)
    fixed[k] = max(short - per_row(k, 1) * unit[k], 0.0)
  counts = Acceptance().observe(timed[k_max, max_new_tokens][1], k_max)
  return LoopCosts(batch=batch, k_max=k_max, ars_step=unit[0], loop_1=unit[1],
                   loop_max=unit[k_max], alpha=counts.alpha, prior_loops=counts.loops,
                   new_tokens=max_new_tokens, ars_fixed=fixed[0], sps_fixed=fixed[1])


def calibrated(target: models.Model, draft: models.Model | None, prompts_BxP, lengths_B, *,
               k_max: int, drafter: drafters.Drafter = drafters.ModelDrafter(),
               sampling_config: sampling.SamplingConfig = sampling.SamplingConfig(),
               max_new_tokens: int = 48, recalibrate: bool = False,
               directory: str | None = None) -> tuple[LoopCosts, str]:
  """`measure`'s costs for this batch (the prompts' rows), from the disk cache when this machine
  measured the same shapes and settings before (unless `recalibrate`); also returns where they
  are kept."""
  key = cache_key(target, draft, drafter, sampling_config, len(lengths_B), k_max, max_new_tokens)
  path = os.path.join(directory or cache_dir(), f'{key}.json')
  if not recalibrate and os.path.exists(path):
    with open(path, encoding='utf-8') as f:
      return LoopCosts(**json.load(f)), path
  costs = measure(target, draft, prompts_BxP, lengths_B, k_max=k_max, drafter=drafter,
                  sampling_config=sampling_config, max_new_tokens=max_new_tokens)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  tmp = f'{path}.{os.getpid()}.tmp'
  with open(tmp, 'w', encoding='utf-8') as f:
    json.dump(dataclasses.asdict(costs), f)
  os.replace(tmp, path)
  return costs, path


def prior(costs: LoopCosts) -> Acceptance:
  """The acceptance the calibration calls saw: where a policy starts."""
  return Acceptance(costs.alpha * costs.prior_loops, costs.prior_loops)


def sample(costs: LoopCosts, acceptance: Acceptance, target: models.Model,
           draft: models.Model | None, prompts, prompt_lengths, rng: jax.Array, *,
           max_new_tokens: int, drafter: drafters.Drafter = drafters.ModelDrafter(),
           probe_every: int = PROBE_EVERY,
           **kwargs) -> tuple[sampling.SampleOutput, Choice, Acceptance]:
  """One call at the k `decide` picks for `acceptance` (0: `autoregressive_sample`, else
  `speculative_sample` with `drafter`; `kwargs` go to the sampler: sampling, eos_id, mesh, ...):
  (its output, the choice, the acceptance with this call's counts added)."""
  choice = decide(costs, acceptance, probe_every)
  if choice.k == 0:
    out = sampling.autoregressive_sample(target, prompts, prompt_lengths, rng,
                                         max_new_tokens=max_new_tokens, **kwargs)
  else:
    out = sampling.speculative_sample(target, draft, prompts, prompt_lengths, rng, k=choice.k,
                                      max_new_tokens=max_new_tokens, drafter=drafter, **kwargs)
  return out, choice, acceptance.observe(out, choice.k)


class Policy:
  """k = 'auto' over a run of calls on the host, for harnesses that call the samplers themselves:
  `next()` before a call gives its k (`decide` at the acceptance so far), `observe(out)` after it
  adds its counts at that k; `choices` lists every observed call's choice."""

  def __init__(self, costs: LoopCosts, acceptance: Acceptance | None = None,
               probe_every: int = PROBE_EVERY):
    self.costs = costs
    self.probe_every = probe_every
    self.acceptance = prior(costs) if acceptance is None else acceptance
    self.choices: list[Choice] = []
    self._pending: Choice | None = None

  @property
  def pending(self) -> Choice:
    """The choice of the last `next()`."""
    if self._pending is None:
      raise ValueError('No call chosen yet: call next() first.')
    return self._pending

  def next(self) -> Choice:
    self._pending = decide(self.costs, self.acceptance, self.probe_every)
    return self._pending

  def observe(self, out: sampling.SampleOutput) -> None:
    if self._pending is None:
      raise ValueError('observe() follows next(): which k made this output?')
    self.acceptance = self.acceptance.observe(out, self._pending.k)
    self.choices.append(self._pending)

  def summary(self) -> dict:
    """What a results file keeps: the costs, each call's k and predicted speedup, alpha."""
    return dict(costs=dataclasses.asdict(self.costs), ks=[c.k for c in self.choices],
                predicted_speedups=[c.predicted_speedup for c in self.choices],
                probes=sum(c.probe for c in self.choices),
                alpha=self.acceptance.alpha)


def report(costs: LoopCosts, acceptance: Acceptance) -> list[str]:
  """The cost model and what the policy makes of it, as lines to print."""
  choice = choose(costs, acceptance.alpha)
  per_k = ', '.join(f'k={k} {costs.loop(k) * 1e3:.2f} ms ({choice.rates[k] / choice.rates[0]:.2f}x)'
                    for k in range(1, costs.k_max + 1))
  return [f'cost model, batch {costs.batch}, {costs.new_tokens} tokens per row: ArS '
          f'{costs.ars_step * 1e3:.3f} ms/token + {costs.ars_fixed * 1e3:.1f} ms per call, SpS '
          f'{costs.sps_fixed * 1e3:.1f} ms per call + per loop (predicted speedup per call at '
          f'alpha {choice.alpha:.3f}, over {acceptance.loops} loops): {per_k}',
          f'auto chooses k = {choice.k}' + (' (ArS)' if choice.k == 0 else '')
          + f': predicted {choice.predicted_speedup:.2f}x ArS']
