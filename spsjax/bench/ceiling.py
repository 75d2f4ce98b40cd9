"""The perfect-draft ceiling: SpS with a draft that is always right, against ArS of the same target.

Both models' output layers are zero (the embedding table, tied or not, and an untied head), so
every logit is exactly 0 and p = q = uniform: every draft is accepted (u q < p for every u < 1)
and every loop emits k + 1 tokens. What is left is the cost of a loop, so the measured speedup
should be the formula's (k + 1) / (k c + s) with c and s measured in the same run; a shortfall is
overhead of the loop itself, a low ceiling means the model steps cost too much (s, c).
"""

import dataclasses
import time

import jax
import jax.numpy as jnp

from spsjax import models, sampling
from spsjax.bench import speedup


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
class Ceiling:
  """Times in seconds (medians of whole calls, compile excluded); c and s from `extend` calls."""
  k: int
  max_new_tokens: int
  ars: float
  sps: float
  tokens_per_loop: float  # Measured: k + 1 when every draft is accepted.
  c: float
  s: float

  @property
  def speedup(self) -> float:
    return self.ars / self.sps

  @property
  def predicted(self) -> float:
    """(k + 1) / (k c + s): Leviathan et al.'s speedup at alpha = 1, scoring costing s steps."""
    return (self.k + 1) / (self.k * self.c + self.s)


def _median_call(run, repeats: int) -> tuple[float, sampling.SampleOutput]:
  out = jax.block_until_ready(run(0))  # Compile.
  times = []
  for i in range(repeats):
    start = time.perf_counter()
    out = jax.block_until_ready(run(i + 1))
    times.append(time.perf_counter() - start)
  return sorted(times)[len(times) // 2], out


def measure(target: models.Model, draft: models.Model, *, k: int = 4, prompt_len: int = 64,
            max_new_tokens: int = 128, repeats: int = 5) -> Ceiling:
  """ArS and SpS of a perfect pair (from `perfect_pair`, packed or not) at batch 1, temperature 1."""
  prompts_BxP = (jnp.arange(prompt_len, dtype=jnp.int32)[None, :] * 7 + 1) % target.config.vocab_size
  lengths_B = jnp.full((1,), prompt_len, jnp.int32)
  config = sampling.SamplingConfig(temperature=1.0)
  ars, _ = _median_call(lambda i: sampling.autoregressive_sample(
      target, prompts_BxP, lengths_B, jax.random.key(i), max_new_tokens=max_new_tokens,
      sampling=config), repeats)
  sps, out = _median_call(lambda i: sampling.speculative_sample(
      target, draft, prompts_BxP, lengths_B, jax.random.key(i), k=k,
      max_new_tokens=max_new_tokens, sampling=config), repeats)
  costs = speedup.measure_costs(target, draft, k, batch=1,
                                capacity=prompt_len + max_new_tokens + k)
  generated = int(out.num_generated[0]) - 1  # The first token comes from the prefill.
  return Ceiling(k=k, max_new_tokens=max_new_tokens, ars=ars, sps=sps,
                 tokens_per_loop=generated / max(1, int(out.num_loops[0])), c=costs.c, s=costs.s)


def report(result: Ceiling, label: str) -> list[str]:
  r = result
  return [f'[{label}] perfect draft, k={r.k}, {r.max_new_tokens} tokens, batch 1: ArS '
          f'{r.ars * 1e3:.1f} ms, SpS {r.sps * 1e3:.1f} ms ({r.tokens_per_loop:.2f} tokens per '
          f'loop): SpS/ArS {r.speedup:.2f}x; (k + 1) / (k c + s) = {r.predicted:.2f}x with '
          f'c = {r.c:.3f}, s = {r.s:.2f}']
