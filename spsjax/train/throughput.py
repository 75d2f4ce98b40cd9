"""How fast training runs: tokens per second and model flops utilisation (MFU).

MFU = (model flops per token x tokens per second) / peak, where
- model flops per token are PaLM's (Chowdhery et al. 2022, appendix B): 6 N for the matrix
  products of the forward and backward passes, N the parameters that multiply (every weight
  matrix but the embedding table, plus that table again when it is also the output head; norm
  scales are not counted), and
  12 L T (heads x head_dim) for attention's scores and mixing at sequence length T (counted in
  full, not halved for the causal mask); norms, softmax and the optimizer are not counted;
- the peak is not a data sheet's: it is measured in the same run, the best of a few large float32
  matrix products on the devices the run uses (`matmul_peak`), so MFU says how much of what this
  machine's dot reaches the training step gets.

A distilled draft's teacher forward passes are extra work not counted in its MFU (they are
2 N_teacher per token: `teacher_flops_per_token`); nor is the frozen target's forward a draft
head trains over, whose own count (`head_flops_per_token`) has the output layer it reads.
"""

import dataclasses
import time

import jax
import jax.numpy as jnp

from spsjax.models import TransformerConfig, feature_head, param_shapes


def _multiplying_params(config: TransformerConfig) -> int:
  """Parameters that take part in a matrix product per token."""
  shapes = param_shapes(config)
  matrices = sum(x.size for x in jax.tree.leaves(shapes) if x.ndim >= 2)  # Norm scales are not.
  embedding = config.vocab_size * config.d_model
  head = embedding if config.tie_embeddings else 0  # An untied head is among the matrices.
  return matrices - embedding + head


def flops_per_token(config: TransformerConfig, seq_len: int) -> float:
  """Training flops per token (forward and backward), PaLM's count (module docstring)."""
  attention = 12 * config.num_layers * seq_len * config.num_heads * config.dims_per_head
  return 6.0 * _multiplying_params(config) + attention


def head_flops_per_token(kind: str, config: TransformerConfig, seq_len: int,
                         own_steps: int = 0) -> float:
  """Training flops per token of a draft head of `kind` (`models.feature_head`, its
  `config`) over a frozen target: 6 N for its own matrices, and for each law it gives per pair
  (one, or one per parallel head) 6 x its own output layer over a draft vocabulary, or 4 x the
  target's (frozen: the forward and the gradient to its input, no weight gradient); an EAGLE
  head's attention as a transformer's; all of it again for each own-step run, but the taps'
  product (run 0 only). The target's forward pass is not counted."""
  params = feature_head.param_shapes(kind, config)
  matrices = sum(x.size for x in jax.tree.leaves(params) if x.ndim >= 2)
  taps = params['taps']['taps'].size if 'taps' in params else 0
  own = params['draft_vocab']['output'].size if 'draft_vocab' in params else 0
  per_law = 6 * own if own else 4 * config.vocab_size * config.d_model
  laws = config.num_layers if kind == 'heads' else 1
  attention = (12 * config.num_layers * seq_len * config.num_heads * config.dims_per_head
               if kind in ('feature', 'falcon') else 0)
  run = 6.0 * (matrices - taps - own) + laws * per_law + attention
  return 6.0 * taps + (1 + own_steps) * run


def teacher_flops_per_token(config: TransformerConfig, seq_len: int) -> float:
  """A forward pass only: a third of `flops_per_token`."""
  return flops_per_token(config, seq_len) / 3.0


def run_peak(mesh_devices: int) -> float:
  """The peak a run on `mesh_devices` devices is measured against: `matmul_peak` of one device
  times the devices, except on CPUs, where a process's devices share its cores (each process's
  one-device figure already uses them all), so times the processes."""
  per_device = matmul_peak()
  if jax.devices()[0].platform == 'cpu':
    return per_device * jax.process_count()
  return per_device * mesh_devices


def matmul_peak(size: int = 2048, repeats: int = 5) -> float:
  """Flops per second of the best of `repeats` float32 [size, size] x [size, size] products on
  the default device (compiled and run once first)."""
  a = jnp.ones((size, size), jnp.float32)
  b = jnp.full((size, size), 0.5, jnp.float32)
  dot = jax.jit(jnp.dot)
  jax.block_until_ready(dot(a, b))
  best = float('inf')
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(dot(a, b))
    best = min(best, time.perf_counter() - start)
  return 2.0 * size**3 / best


@dataclasses.dataclass
class Meter:
  """Tokens per second between two readings, and MFU against `peak_flops`.

  `tick(steps_done)` after the host has seen a step finish; the first interval starts at the first
  tick, so a step's compilation is never counted.
  """
  tokens_per_step: int
  flops_per_token: float
  peak_flops: float
  _last: tuple[int, float] | None = None

  def tick(self, steps_done: int) -> dict[str, float]:
    """{'tokens_per_second', 'mfu'} since the last tick ({} at the first, or with no new step)."""
    now = time.perf_counter()
    last, self._last = self._last, (steps_done, now)
    if last is None or steps_done <= last[0]:
      return {}
    tokens_per_second = (steps_done - last[0]) * self.tokens_per_step / (now - last[1])
    return dict(tokens_per_second=tokens_per_second,
                mfu=tokens_per_second * self.flops_per_token / self.peak_flops)


def describe(peak_flops: float, flops_per_token_: float) -> str:
  return (f'matmul peak {peak_flops / 1e9:.0f} GFLOP/s (float32 2048^3, this run); '
          f'{flops_per_token_ / 1e6:.1f} MFLOP per token trained')

