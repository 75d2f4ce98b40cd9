"""A model's rotary frequencies: the one float32[R / 2] array every path rotates by (R the rotated
dims of a head: all H of them, or GPT-NeoX's first `rope_dims`).

`frequencies(config)` is base^(-i / half) for i < half (`native.rope_frequencies`), rescaled as
`config.rope_scaling` says (`RopeScaling`), with Hugging Face's definitions of each `rope_type`
(transformers' `modeling_rope_utils`), in float32:
- 'linear': f / factor.
- 'llama3': with wavelength w = 2 pi / f and L = original_max_len, a frequency whose w is under
  L / high_freq_factor is kept, one whose w is over L / low_freq_factor becomes f / factor, and one
  between becomes (1 - a) f / factor + a f with a = (L / w - low_freq_factor) / (high_freq_factor -
  low_freq_factor), which joins the two ends continuously.
- 'yarn': `_yarn`; 'longrope': f / short_factor. Both also scale the rotated dims of queries and
  keys (`attention_factor`).
XLA's rotation (`native.rope`) and the native attention kernel take the array as it is, so both
paths rotate by the same numbers.
"""

import math

import jax
import jax.numpy as jnp

from spsjax import native
from spsjax.models.config import TransformerConfig


def frequencies(config: TransformerConfig, layer: int | None = None) -> jax.Array:
  """float32[R / 2], R the rotated dims (`rotary_dims`: H, or GPT-NeoX's part of it): the rotary
  frequencies of `config` (module docstring); a sliding layer
  `layer` of a model with a `local_rope_base` (Gemma 3) rotates by that base's, unscaled."""
  if (layer is not None and config.local_rope_base is not None
      and config.window(layer) is not None):
    return native.rope_frequencies(config.rotary_dims, config.local_rope_base)
  freqs_H2 = native.rope_frequencies(config.rotary_dims, config.rope_base)
  scaling = config.rope_scaling
  if scaling is None:
    return freqs_H2
  if scaling.kind == 'linear':
    return freqs_H2 / scaling.factor
  if scaling.kind == 'yarn':
    return _yarn(freqs_H2, config.rotary_dims, config.rope_base, scaling)
  if scaling.kind == 'longrope':  # The short factors: positions up to original_max_len.
    return freqs_H2 / jnp.asarray(scaling.short_factor, jnp.float32)
  wavelengths_H2 = 2 * math.pi / freqs_H2
  long_wavelength = scaling.original_max_len / scaling.low_freq_factor
  short_wavelength = scaling.original_max_len / scaling.high_freq_factor
  ramp_H2 = ((scaling.original_max_len / wavelengths_H2 - scaling.low_freq_factor)
             / (scaling.high_freq_factor - scaling.low_freq_factor))
  between_H2 = (1 - ramp_H2) * freqs_H2 / scaling.factor + ramp_H2 * freqs_H2
  return jnp.where(wavelengths_H2 > long_wavelength, freqs_H2 / scaling.factor,
                   jnp.where(wavelengths_H2 < short_wavelength, freqs_H2, between_H2))


def _yarn(freqs_R2: jax.Array, R: int, base: float, scaling) -> jax.Array:
  """YaRN's frequencies (transformers' `_compute_yarn_parameters`): dim pair i keeps its
  frequency below the ramp, is divided by `factor` above it; the ramp runs over the pairs between
  the ones turning beta_fast and beta_slow times over original_max_len."""
  def pair(turns):  # The (fractional) pair index whose frequency turns `turns` times.
    return R * math.log(scaling.original_max_len / (turns * 2 * math.pi)) / (2 * math.log(base))
  low, high = pair(scaling.beta_fast), pair(scaling.beta_slow)
  if scaling.truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, R - 1)
  if low == high:
    high += 0.001  # transformers' guard against a zero-width ramp.
  ramp_R2 = jnp.clip((jnp.arange(R // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
  return freqs_R2 / scaling.factor * ramp_R2 + freqs_R2 * (1 - ramp_R2)


def attention_factor(config: TransformerConfig, layer: int | None = None) -> float:
  """What YaRN and LongRoPE scale the rotated dims of queries and keys by at layer `layer` (as
  transformers' cos and sin carry it; with every dim rotated, the scores by its square); 1 for
  every other rotation."""
  scaling = config.rope_scaling
  if (scaling is None or scaling.kind not in ('yarn', 'longrope') or config.position != 'rope'
      or (layer is not None and config.local_rope_base is not None
          and config.window(layer) is not None)):
    return 1.0
  if scaling.attention_factor is not None:
    return scaling.attention_factor
  if scaling.factor <= 1:
    return 1.0
  if scaling.kind == 'yarn':
    return 0.1 * math.log(scaling.factor) + 1.0
  return math.sqrt(1 + math.log(scaling.factor) / math.log(scaling.original_max_len))
