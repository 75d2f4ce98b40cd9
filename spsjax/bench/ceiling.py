"""The perfect-draft ceiling: SpS with a draft that is always right, against ArS of the same target.

Both models' output layers are zero (the embedding table, tied or not, and an untied head), so
every logit is exactly 0 and p = q = uniform: every draft is accepted (u q < p for every u < 1)
and every loop emits k + 1 tokens. What is left is the cost of a loop, so the measured speedup
should be the formula's (k + 1) / (k c + s) with c and s measured in the same run; a shortfall is
overhead of the loop itself, a low ceiling means the model steps cost too much (s, c).

With `profile_dir`, one SpS call is also profiled (`bench.profile`): a loop's wall time and its
ops' time per phase, to hold against the k c + s steps the formula charges a loop.

A tree drafter (`drafter`, e.g. a dynamic tree at EAGLE-2's 60 nodes, depth 6, width 10) has
its own ceiling: every first child is accepted (p = q), so a loop still emits k + 1 tokens, and
what it costs beyond a chain's is the tree: its draft calls (d one-position draft steps: the
level calls' positions, `Drafter.draft_calls`) and the target's score call on its nodes and root
(s). The formula is then (k + 1) / (d c + s); d = k for a chain.

The formula counts loops only; a whole call also prefills the prompt (ArS the target, SpS both
models), which at 128 prompt and 128 new tokens is a tenth of an ArS call. So the same interleaved
run also times calls that stop after the prefill's token (max_new_tokens = 1): subtracted, they
give the decoding alone, the figure to hold against the formula, beside the whole calls a user
waits for.
"""

import dataclasses
import functools
import statistics
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from spsjax import models, sampling
from spsjax.bench import decode, profile, timing
from spsjax.sampling import common, drafters


def perfect_pair(target: models.Model, draft: models.Model) -> tuple[models.Model, models.Model]:
  """The pair with zero output layers (module docstring); pack it afterwards, not before."""

  def zero_outputs(model: models.Model) -> models.Model:
    if models.is_packed(model):
      raise ValueError('Zero the output layers before packing (the packed head is a copy).')
    params = dict(model.params)
    for name in ('embedding', 'head'):
      if name in params:
        params[name] = jnp.zeros_like(params[name])
    return model.replace(params=params)

  return zero_outputs(target), zero_outputs(draft)


@dataclasses.dataclass(frozen=True)
class LoopProfile:
  """One profiled SpS call of the pair; seconds per loop."""
  loops: int
  wall: float | None  # Mean wall time of the loop's iterations in the trace (None: not found).
  phase: Mapping[str, float]  # Op time per phase (`profile.PhaseProfile.per_loop`).
  error: str = ''  # Why the call could not be profiled (then no figures); the timings stand.
  ops: Mapping[str, float] = dataclasses.field(default_factory=dict)  # `per_loop_ops`.

  def phase_text(self, phase: str) -> str:
    """'0.520' ms of op time a loop, and ' (302 ops)' where the ops are counted."""
    ops = f' ({self.ops[phase]:.0f} ops)' if phase in self.ops else ''
    return f'{self.phase[phase] * 1e3:.3f}{ops}'


@dataclasses.dataclass(frozen=True)
class Ceiling:
  """Times in seconds: medians of whole calls (compile excluded), every method timed call by call
  in turn; `*_prefill` are calls that stop after the prefill's token. c and s from `extend`."""
  k: int
  max_new_tokens: int
  ars: float
  sps: float
  ars_prefill: float
  sps_prefill: float
  tokens_per_loop: float  # Measured: k + 1 when every draft is accepted.
  c: float
  s: float
  target_step: float = float('nan')  # The target's one-position step, which c and s divide.
  top_p: float = 1.0  # Both methods' sampling: temperature 1 and this top-p.
  loop: LoopProfile | None = None
  drafter: str = ''  # A tree drafter's name (module docstring); '' for the chain.
  draft_steps: float | None = None  # d: a tree's draft calls in one-position steps; None: k.

  @property
  def d(self) -> float:
    """A loop's draft calls in one-position draft steps: k for a chain."""
    return float(self.k) if self.draft_steps is None else self.draft_steps

  @property
  def formula_loop(self) -> float:
    """What the formula charges a loop: d c + s target steps, in seconds."""
    return (self.d * self.c + self.s) * self.target_step

  @property
  def speedup(self) -> float:
    """Whole calls, prefills included."""
    return self.ars / self.sps

  @property
  def decode_speedup(self) -> float:
    """The tokens after the prefill's: (ArS - its prefill) / (SpS - its prefills); NaN when SpS's
    decoding did not take measurably longer than its prefill call (a tiny model on a busy
    machine): there is no ratio to report then."""
    sps_decode = self.sps - self.sps_prefill
    return (self.ars - self.ars_prefill) / sps_decode if sps_decode > 0 else float('nan')

  @property
  def predicted(self) -> float:
    """(k + 1) / (d c + s): Leviathan et al.'s speedup at alpha = 1 (d = k), scoring costing s
    steps."""
    return (self.k + 1) / (self.d * self.c + self.s)

  @property
  def predicted_whole(self) -> float:
    """Whole calls if every loop cost k c + s ArS steps: the measured prefills plus the decoding
    at `predicted`, an ArS step being what ArS measured."""
    decode = self.ars - self.ars_prefill
    return self.ars / (self.sps_prefill + decode / self.predicted)


def measure(target: models.Model, draft: models.Model, *, k: int = 4, prompt_len: int = 64,
            max_new_tokens: int = 128, repeats: int = 5, mesh: Mesh | None = None,
            capacity: int | None = None, compile_threads: int = 1,
            profile_dir: str | None = None, top_p: float = 1.0,
            drafter: drafters.Drafter | None = None) -> Ceiling:
  """ArS and SpS of a perfect pair (from `perfect_pair`, packed or not) at batch 1, temperature 1
  and `top_p` (below 1 every call also pays nucleus sampling's work, which the formula's c and s
  leave out; p = q stays uniform on the kept tokens, so every draft is still accepted; uniform
  laws are the native CPU kernel's slowest case, every token in its crossing bucket) (on
  `mesh`, if given: the pair is placed on it before anything is timed). c and s are measured
  at a cache of `capacity` slots (default: prompt, new tokens and k; another run's capacity
  reuses its compiled `extend` programs). Its four programs compile `compile_threads` at a time
  (`timing.warm`). With `profile_dir` (local or a URI), one more SpS call is profiled there.
  `drafter`: a tree drafter's ceiling (module docstring; default the chain of k), its tree's
  nodes and root within `capacity`."""
  drafter = drafter or drafters.ModelDrafter()
  target, draft = (common.place_params(m, mesh) for m in (target, draft))
  prompts_BxP = (jnp.arange(prompt_len, dtype=jnp.int32)[None, :] * 7 + 1) % target.config.vocab_size
  lengths_B = jnp.full((1,), prompt_len, jnp.int32)
  config = sampling.SamplingConfig(temperature=1.0, top_p=top_p)
  def ars(n):
    return lambda i: sampling.autoregressive_sample(
        target, prompts_BxP, lengths_B, jax.random.key(i), max_new_tokens=n, sampling=config,
        mesh=mesh)

  def sps(n):
    return lambda i: sampling.speculative_sample(
        target, draft, prompts_BxP, lengths_B, jax.random.key(i), k=k, max_new_tokens=n,
        sampling=config, mesh=mesh, drafter=drafter)

  runs = {'ars': ars(max_new_tokens), 'sps': sps(max_new_tokens), 'ars_prefill': ars(1),
          'sps_prefill': sps(1)}
  if compile_threads > 1:
    timing.warm([functools.partial(run, 0) for run in runs.values()], threads=compile_threads)
  timings = timing.time_interleaved(runs, repeats, bucket=lambda i: 0, ks={'sps': k})
  median = {name: statistics.median(c.seconds for c in t.calls) for name, t in timings.items()}
  tree = drafter.tree(k)
  costs = decode.measure_costs(
      target, draft, k, batch=1, mesh=mesh, tree=tree, draft_calls=drafter.draft_calls(k),
      capacity=capacity or prompt_len + max_new_tokens + (k if tree is None else tree.num_nodes))
  loop = None
  if profile_dir is not None:
    try:
      _, prof = profile.profile_speculative(
          target, draft, prompts_BxP, lengths_B, jax.random.key(0), k=k,
          max_new_tokens=max_new_tokens, log_dir=profile_dir, sampling=config, mesh=mesh,
          drafter=drafter)
      its = prof.iterations
      loop = LoopProfile(loops=prof.loops, wall=statistics.mean(it.wall_s for it in its)
                         if its else None,
                         phase=prof.per_loop(), ops=prof.per_loop_ops())
    except Exception as e:  # pylint: disable=broad-except
      loop = LoopProfile(loops=0, wall=None, phase={}, error=f'{type(e).__name__}: {e}'[:300])
  return Ceiling(k=k, max_new_tokens=max_new_tokens, top_p=top_p, **median,
                 tokens_per_loop=timings['sps'].tokens_per_loop, c=costs.c, s=costs.s,
                 target_step=costs.target_step, loop=loop,
                 drafter='' if tree is None else repr(drafter), draft_steps=costs.draft_steps)


def report(result: Ceiling, label: str) -> list[str]:
  r, ms = result, 1e3
  draft = '' if not r.drafter else f', {r.drafter} (d = {r.d:.1f} draft steps a loop)'
  return [f'[{label}] perfect draft{draft}, k={r.k}, {r.max_new_tokens} tokens, batch 1'
          + (f', top-p {r.top_p:g}' if r.top_p < 1 else '') + ' '
          f'({r.tokens_per_loop:.2f} tokens per loop), c = {r.c:.3f}, s = {r.s:.2f}: '
          f'decoding (prefill calls subtracted) SpS/ArS {r.decode_speedup:.2f}x, formula '
          f'(k + 1) / (d c + s) = {r.predicted:.2f}x; whole calls ArS {r.ars * ms:.1f} ms, SpS '
          f'{r.sps * ms:.1f} ms (prefills {r.ars_prefill * ms:.1f} / {r.sps_prefill * ms:.1f} ms): '
          f'{r.speedup:.2f}x, formula with these prefills {r.predicted_whole:.2f}x'
          + ('' if r.loop is None else f'; profile failed: {r.loop.error}' if r.loop.error else
             f'; profiled: {r.loop.loops} loops, ' + (
                 '' if r.loop.wall is None else f'{r.loop.wall * ms:.3f} ms a loop ') +
             f'(d c + s steps: {r.formula_loop * ms:.3f} ms), op time (ms) ' + ', '.join(
                 f'{p} {r.loop.phase_text(p)}' for p in r.loop.phase))]
