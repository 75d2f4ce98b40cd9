"""AdamW with linear warm-up, cosine decay and global-norm gradient clipping."""

import dataclasses

import jax
import optax


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  learning_rate: float = 3e-3
  warmup_steps: int = 100
  total_steps: int = 1000
  final_fraction: float = 0.1  # Cosine decays to this fraction of the peak rate.
  weight_decay: float = 0.1
  clip_norm: float = 1.0
  b1: float = 0.9
  b2: float = 0.95

  def __post_init__(self):
    if self.learning_rate <= 0:
      raise ValueError(f'learning_rate must be > 0, got {self.learning_rate}.')
    if not 0 <= self.warmup_steps < self.total_steps:
      raise ValueError(f'warmup_steps ({self.warmup_steps}) must be in [0, total_steps='
                       f'{self.total_steps}).')


def schedule(config: OptimizerConfig) -> optax.Schedule:
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=config.learning_rate, warmup_steps=config.warmup_steps,
      decay_steps=config.total_steps, end_value=config.learning_rate * config.final_fraction)


def make(config: OptimizerConfig) -> optax.GradientTransformation:
  return optax.chain(
      optax.clip_by_global_norm(config.clip_norm),
      optax.adamw(schedule(config), b1=config.b1, b2=config.b2, weight_decay=config.weight_decay,
                  mask=_decay_mask))


def _decay_mask(params):
  """Weight decay on matrices only, not on 1-D norm scales."""
  return jax.tree.map(lambda x: x.ndim > 1, params)
