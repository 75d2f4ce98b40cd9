"""Weights packed in panels for the few-row CPU kernel, and the product that dispatches to it.

`pack(w)` lays a weight `[*in_shape, *out_shape]` out as panels of `PANEL` output columns,
`float32[P, I, PANEL]` (or bfloat16, or int8 with a float32 scale per output column,
`pack(dtype=)`) with I = prod(in_shape), P = ceil(F / PANEL), F = prod(out_shape), the last panel
zero-padded. 'w8a8' panels hold the int8 weights q as uint8 q + 128 in groups of 4 depths,
`uint8[P, ceil(I / 4), PANEL, 4]`: the kernel quantizes each input row to int8 too
(`quantize_rows`) and sums in int32 (AVX-512 VNNI's `vpdpbusd`). `matmul(x, packed)` computes
`x[..., I] @ w -> [..., *out_shape]`, optionally
`rms_norm(x) @ w`, `silu_gate(x) @ w` and `+ residual`: the elementwise work around a decoder's
products, done by the kernel as it reads its input and writes its output (each XLA op it replaces
costs a dispatch and a pass over memory, a fifth of a small model's decode step):

- on the CPU, with the native library built, through the C++ kernel (`packed_matmul.cc`, called
  by `jax.ffi`), which reads each panel front to back once per call, so 1 to 8 rows cost about
  what one row costs; more rows re-read the panel from cache 8 at a time (a 128-token prefill of
  `reference_target` takes 42 ms so, 38 ms with XLA's dots on unpacked weights, 58 ms with XLA's
  dots on the panels);
- otherwise (another platform, no native library, or `use_kernel=False`) as an XLA dot on the
  panels, which gives the same numbers up to float reassociation.

A prefill of right-padded prompts passes `counts` (each row's prompt length): the kernel computes
those rows only (8 prompts padded to their longest are about half padding on Table 1's tasks).

Invariant: `unpack(pack(w))` is `w` exactly (float32 panels; bfloat16 panels: `w` rounded to
bfloat16; int8 and w8a8 panels: `w` quantized, each column to 255 levels of its largest
magnitude), and `matmul(x, pack(w))` equals `x @ unpack(pack(w))` up to float reassociation
whichever path runs; for w8a8, `quantized(x) @ unpack(pack(w))`, the same bit for bit on every
path (integer sums).
"""

import math

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from spsjax.native import library

PANEL = 16


@flax.struct.dataclass
class PackedWeight:
  """A weight `[*in_shape, *out_shape]` stored as `[P, I, PANEL]` panels, float32, bfloat16 or
  int8, or as w8a8 panels `uint8[P, ceil(I / 4), PANEL, 4]` (module docstring).

  `tied_to` names the parameter this one is a packed copy of (the output layer of a model with
  tied embeddings keeps its embedding table for the lookup): counting parameters skips it.
  `scales_PxC`: for int8 and w8a8 panels, float32[P, PANEL], the weight of output column
  p * PANEL + c is its integer (int8 panels[p, :, c]; w8a8 panels[p, :, c, :] - 128) times
  scales[p, c]; None for the other dtypes.
  """
  panels_PxIxC: jax.Array
  in_shape: tuple[int, ...] = flax.struct.field(pytree_node=False)
  out_shape: tuple[int, ...] = flax.struct.field(pytree_node=False)
  tied_to: str | None = flax.struct.field(pytree_node=False, default=None)
  scales_PxC: jax.Array | None = None

  @property
  def in_dim(self) -> int:
    return math.prod(self.in_shape)

  @property
  def out_dim(self) -> int:
    return math.prod(self.out_shape)

  @property
  def dtype(self) -> str:
    """How the weights are stored: one of `WEIGHT_DTYPES`."""
    return 'w8a8' if self.panels_PxIxC.dtype == jnp.uint8 else str(self.panels_PxIxC.dtype)

  @property
  def size(self) -> int:
    """Parameters of the unpacked weight (padding excluded)."""
    return self.in_dim * self.out_dim


WEIGHT_DTYPES = ('float32', 'bfloat16', 'int8', 'w8a8')
MAX_W8A8_DEPTH = 65536  # int32 sums of (q + 128) xq stay exact (the kernel's bound).


def pack(w: jax.Array, in_dims: int = 1, *, tied_to: str | None = None,
         dtype: str = 'float32') -> PackedWeight:
  """Packs `w` whose first `in_dims` dimensions are contracted with the input.

  `dtype`: how the panels are stored, 'float32', 'bfloat16' (half the bytes to read per call;
  the weights rounded to bfloat16) or 'int8' (a quarter; each output column quantized
  symmetrically to integers in [-127, 127] times a float32 scale, its largest magnitude / 127):
  the products are float32 arithmetic. 'w8a8': int8's weights, and the products multiply them by
  each input row quantized to int8 (`quantize_rows`) in integer arithmetic (module docstring).
  """
  if w.dtype != jnp.float32:
    raise ValueError(f'Only float32 weights can be packed, got {w.dtype}.')
  if dtype not in WEIGHT_DTYPES:
    raise ValueError(f'Packed weights are stored as one of {WEIGHT_DTYPES}, not {dtype!r}.')
  if not 1 <= in_dims < w.ndim:
    raise ValueError(f'in_dims must be in [1, {w.ndim - 1}] for a weight of shape {w.shape}.')
  in_shape, out_shape = tuple(w.shape[:in_dims]), tuple(w.shape[in_dims:])
  I, F = math.prod(in_shape), math.prod(out_shape)
  P = -(-F // PANEL)
  w_IxF = jnp.pad(w.reshape(I, F), ((0, 0), (0, P * PANEL - F)))
  if dtype == 'w8a8' and I > MAX_W8A8_DEPTH:
    raise ValueError(f'w8a8 weights take at most {MAX_W8A8_DEPTH} input depths, got {I}.')
  scales_PxC = None
  if dtype in ('int8', 'w8a8'):
    scales_F = jnp.max(jnp.abs(w_IxF), axis=0) / 127.0
    scales_F = jnp.where(scales_F > 0, scales_F, 1.0)  # An all-zero column: any scale.
    w_IxF = jnp.clip(jnp.round(w_IxF / scales_F[None, :]), -127, 127)
    scales_PxC = scales_F.reshape(P, PANEL)
  if dtype == 'w8a8':  # [P, G, PANEL, 4]: depth 4 g + j of column c at [p, g, c, j].
    G = -(-I // 4)
    q_GxJxPxC = jnp.pad(w_IxF, ((0, 4 * G - I), (0, 0))).reshape(G, 4, P, PANEL)
    panels = (jnp.transpose(q_GxJxPxC, (2, 0, 3, 1)) + 128).astype(jnp.uint8)
  else:
    panels = jnp.transpose(w_IxF.reshape(I, P, PANEL), (1, 0, 2)).astype(dtype)
  return PackedWeight(panels, in_shape, out_shape, tied_to, scales_PxC)


def _integer_panels(packed: PackedWeight) -> jax.Array:
  """int8 or w8a8 panels as their integers, int8[P, I, PANEL]."""
  panels = packed.panels_PxIxC
  if packed.dtype != 'w8a8':
    return panels
  P, G, C, J = panels.shape
  q_PxGxJxC = jnp.transpose(panels.astype(jnp.int32) - 128, (0, 1, 3, 2))
  return q_PxGxJxC.reshape(P, G * J, C)[:, :packed.in_dim].astype(jnp.int8)


def quantize_rows(x_RxI: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(xq int8[R, I], scale float32[R]): each row to integers in [-127, 127] of its largest
  magnitude m, xq = round(x * (127 / m)) (ties to even), scale = m * (1 / 127), as the w8a8 kernel
  quantizes its inputs. A zero row: xq 0, scale 0; a row holding an infinity or a NaN: xq 0,
  scale NaN."""
  x_RxI = x_RxI.astype(jnp.float32)
  m_R = jnp.max(jnp.abs(x_RxI), axis=-1)
  finite_R = jnp.isfinite(m_R)
  inv_R = jnp.where(finite_R & (m_R > 0), jnp.float32(127.0) / jnp.where(m_R > 0, m_R, 1.0), 0.0)
  xq_RxI = jnp.round(jnp.clip(x_RxI * inv_R[:, None], -127.0, 127.0))
  xq_RxI = jnp.where(finite_R[:, None], xq_RxI, 0.0).astype(jnp.int8)
  # m times float32(1 / 127), not m / 127: XLA turns a division by a constant into that product.
  return xq_RxI, jnp.where(finite_R, m_R * jnp.float32(1.0 / 127.0), jnp.nan)


def _dense_panels(packed: PackedWeight) -> jax.Array:
  """The panels as float32 weights [P, I, PANEL] (int8 and w8a8 panels times their scales)."""
  panels = _integer_panels(packed).astype(jnp.float32)
  if packed.scales_PxC is not None:
    panels = panels * packed.scales_PxC[:, None, :]
  return panels


def unpack(packed: PackedWeight) -> jax.Array:
  """The float32 weight `[*in_shape, *out_shape]` that `packed` was made from (for bfloat16
  panels: its values rounded to bfloat16; for int8 and w8a8 panels: quantized)."""
  dense_PxIxC = _dense_panels(packed)
  P, I, C = dense_PxIxC.shape
  w_IxF = jnp.transpose(dense_PxIxC, (1, 0, 2)).reshape(I, P * C)[:, :packed.out_dim]
  return w_IxF.reshape(packed.in_shape + packed.out_shape)


def rms_norm(x_xD: jax.Array, scale_D: jax.Array, eps: float) -> jax.Array:
  """RMSNorm in float32: x / sqrt(mean(x^2) + eps) * scale (the model's, and the kernel's)."""
  x_xD = x_xD.astype(jnp.float32)
  x_xD = x_xD * jax.lax.rsqrt(jnp.mean(x_xD * x_xD, axis=-1, keepdims=True) + eps)
  return x_xD * scale_D.astype(jnp.float32).reshape((1,) * (x_xD.ndim - 1) + scale_D.shape)


def silu_gate(gate_xF: jax.Array, in_xF: jax.Array) -> jax.Array:
  """A gated MLP's hidden units from its gate and input: silu(gate) * in (the kernel's gated
  prologue reads them stacked, [..., 2, F], gate first)."""
  return jax.nn.silu(gate_xF) * in_xF


# Prologue codes of the kernel (packed_matmul.cc).
_NONE, _RMS_NORM, _SILU_GATE = 0, 1, 2


def _xla_matmul(x_RxI, packed, scale_I, residual_RxF, prologue, eps) -> jax.Array:
  if prologue == _RMS_NORM:
    x_RxI = rms_norm(x_RxI, scale_I, eps)
  elif prologue == _SILU_GATE:
    R, I2 = x_RxI.shape  # Not reshape(R, 2, -1), nor below: ambiguous for R = 0 rows.
    gate_in_Rx2xI = x_RxI.reshape(R, 2, I2 // 2)
    x_RxI = silu_gate(gate_in_Rx2xI[:, 0], gate_in_Rx2xI[:, 1])
  if packed.dtype == 'w8a8':  # Integer sums, scaled as the kernel scales them.
    xq_RxI, scale_R = quantize_rows(x_RxI)
    sums_RxPxC = jnp.einsum('RI,PIC->RPC', xq_RxI, _integer_panels(packed),
                            preferred_element_type=jnp.int32)
    y_RxPxC = sums_RxPxC.astype(jnp.float32) * (scale_R[:, None, None] * packed.scales_PxC[None])
  else:
    y_RxPxC = jnp.einsum('RI,PIC->RPC', x_RxI, _dense_panels(packed))
  R, P, C = y_RxPxC.shape
  y_RxF = y_RxPxC.reshape(R, P * C)[:, :packed.out_dim]
  return y_RxF if residual_RxF.size == 0 else residual_RxF + y_RxF


def _kernel_matmul(x_RxI, packed, scale_I, residual_RxF, counts_B, prologue, eps,
                   isa) -> jax.Array:
  out = jax.ShapeDtypeStruct((x_RxI.shape[0], packed.out_dim), jnp.float32)
  w_scales = (jnp.zeros((0,), jnp.float32) if packed.scales_PxC is None
              else packed.scales_PxC.reshape(-1))
  panels = packed.panels_PxIxC
  if packed.dtype == 'w8a8':  # The kernel takes [P, ceil(I / 4), 4 PANEL].
    panels = panels.reshape(panels.shape[0], panels.shape[1], -1)
  return jax.ffi.ffi_call('spsjax_packed_matmul', out, vmap_method='sequential')(
      x_RxI, scale_I, residual_RxF, panels, w_scales, counts_B,
      isa=np.int32(library.isa_code(isa)), prologue=np.int32(prologue), eps=np.float32(eps))


def matmul(x: jax.Array, packed: PackedWeight, *, norm: tuple[jax.Array, float] | None = None,
           gated: bool = False, residual: jax.Array | None = None,
           counts: jax.Array | None = None, isa: str = 'best',
           use_kernel: bool | None = None) -> jax.Array:
  """`f(x)[..., I] @ w (+ residual) -> float32[..., *out_shape]` (module docstring for the path).

  `norm=(scale[I], eps)`: f = `rms_norm`; `gated`: x is `[..., 2, I]` (gate, input) and f =
  `silu_gate`; else f is the identity. `residual` (shaped like the output) is added to it.
  `counts` (int32[B], x `[B, T, ...]`: right-padded rows, a prefill's prompts): the outputs at
  positions t >= counts[b] are padding, left unspecified; the kernel skips them (they come out as
  the residual, or 0) and XLA's dot computes them.
  `use_kernel`: force the kernel (True; an error where it cannot run) or the XLA dot (False);
  None: the kernel wherever it is built. `isa` picks the kernel's instruction set
  (`library.ISAS`), for tests.
  """
  if norm is not None and gated:
    raise ValueError('A product takes one prologue: norm or gated, not both.')
  width = x.shape[-1] * (x.shape[-2] if gated else 1)
  if width != packed.in_dim * (2 if gated else 1) or (gated and x.shape[-2] != 2):
    raise ValueError(f'Input of shape {x.shape} (width {width}, gated={gated}) for a packed '
                     f'weight of input shape {packed.in_shape}.')
  lead = x.shape[:-2] if gated else x.shape[:-1]
  x_RxI = x.reshape(-1, width).astype(jnp.float32)
  R = x_RxI.shape[0]
  prologue, scale_I, eps = _NONE, jnp.zeros((0,), jnp.float32), 0.0
  if norm is not None:
    prologue, (scale_I, eps) = _RMS_NORM, norm
    scale_I = scale_I.astype(jnp.float32)
    if scale_I.shape != (packed.in_dim,):
      raise ValueError(f'Norm scale of shape {scale_I.shape} for an input of width '
                       f'{packed.in_dim}.')
  elif gated:
    prologue = _SILU_GATE
  residual_RxF = jnp.zeros((0, 0), jnp.float32)
  if residual is not None:
    if residual.shape != lead + packed.out_shape:
      raise ValueError(f'Residual of shape {residual.shape} for an output of shape '
                       f'{lead + packed.out_shape}.')
    residual_RxF = residual.reshape(R, packed.out_dim).astype(jnp.float32)
  if use_kernel is None:
    use_kernel = library.available()
  elif use_kernel and not library.available():
    raise RuntimeError('The native kernel library is not built (see spsjax/native/library.py).')
  counts_B = jnp.zeros((0,), jnp.int32)
  if counts is not None:
    if counts.ndim != 1 or not lead or lead[0] != counts.shape[0]:
      raise ValueError(f'counts of shape {counts.shape} for an input of shape {x.shape}: want '
                       'one count per row of the leading dimension.')
    counts_B = counts.astype(jnp.int32)
  operands = (x_RxI, scale_I, residual_RxF, counts_B)
  xla = lambda ops: _xla_matmul(ops[0], packed, ops[1], ops[2], prologue, eps)
  if use_kernel:
    y_RxF = library.on_cpu(
        operands,
        lambda ops: _kernel_matmul(ops[0], packed, ops[1], ops[2], ops[3], prologue, eps, isa),
        xla)
  else:
    y_RxF = xla(operands)
  return y_RxF.reshape(lead + packed.out_shape)
