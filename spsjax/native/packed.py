"""Weights packed in panels for the few-row CPU kernel, and the product that dispatches to it.

`pack(w)` lays a weight `[*in_shape, *out_shape]` out as panels of `PANEL` output columns,
`float32[P, I, PANEL]` (or bfloat16, or int8 with a float32 scale per output column,
`pack(dtype=)`) with I = prod(in_shape), P = ceil(F / PANEL), F = prod(out_shape), the last panel
zero-padded. `matmul(x, packed)` computes
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
bfloat16; int8 panels: `w` quantized, each column to 255 levels of its largest magnitude), and
`matmul(x, pack(w))` equals `x @ unpack(pack(w))` up to float reassociation whichever path runs.
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
  int8 (module docstring).

  `tied_to` names the parameter this one is a packed copy of (the output layer of a model with
  tied embeddings keeps its embedding table for the lookup): counting parameters skips it.
  `scales_PxC`: for int8 panels, float32[P, PANEL], the weight of output column p * PANEL + c is
  panels[p, :, c] * scales[p, c]; None for the other dtypes.
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
  def size(self) -> int:
    """Parameters of the unpacked weight (padding excluded)."""
    return self.in_dim * self.out_dim


WEIGHT_DTYPES = ('float32', 'bfloat16', 'int8')


def pack(w: jax.Array, in_dims: int = 1, *, tied_to: str | None = None,
         dtype: str = 'float32') -> PackedWeight:
  """Packs `w` whose first `in_dims` dimensions are contracted with the input.

  `dtype`: how the panels are stored, 'float32', 'bfloat16' (half the bytes to read per call;
  the weights rounded to bfloat16) or 'int8' (a quarter; each output column quantized
  symmetrically to integers in [-127, 127] times a float32 scale, its largest magnitude / 127).
  The products are float32 arithmetic in every case.
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
  scales_PxC = None
  if dtype == 'int8':
    scales_F = jnp.max(jnp.abs(w_IxF), axis=0) / 127.0
    scales_F = jnp.where(scales_F > 0, scales_F, 1.0)  # An all-zero column: any scale.
    w_IxF = jnp.clip(jnp.round(w_IxF / scales_F[None, :]), -127, 127)
    scales_PxC = scales_F.reshape(P, PANEL)
  panels = jnp.transpose(w_IxF.reshape(I, P, PANEL), (1, 0, 2)).astype(dtype)
  return PackedWeight(panels, in_shape, out_shape, tied_to, scales_PxC)


def _dense_panels(packed: PackedWeight) -> jax.Array:
  """The panels as float32 weights (int8 panels times their scales)."""
  panels = packed.panels_PxIxC.astype(jnp.float32)
  if packed.scales_PxC is not None:
    panels = panels * packed.scales_PxC[:, None, :]
  return panels


def unpack(packed: PackedWeight) -> jax.Array:
  """The float32 weight `[*in_shape, *out_shape]` that `packed` was made from (for bfloat16
  panels: its values rounded to bfloat16; for int8 panels: quantized)."""
  P, I, C = packed.panels_PxIxC.shape
  w_IxF = jnp.transpose(_dense_panels(packed), (1, 0, 2)).reshape(I, P * C)[:, :packed.out_dim]
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
  y_RxPxC = jnp.einsum('RI,PIC->RPC', x_RxI, _dense_panels(packed))
  R, P, C = y_RxPxC.shape
  y_RxF = y_RxPxC.reshape(R, P * C)[:, :packed.out_dim]
  return y_RxF if residual_RxF.size == 0 else residual_RxF + y_RxF


def _kernel_matmul(x_RxI, packed, scale_I, residual_RxF, counts_B, prologue, eps,
                   isa) -> jax.Array:
  out = jax.ShapeDtypeStruct((x_RxI.shape[0], packed.out_dim), jnp.float32)
  w_scales = (jnp.zeros((0,), jnp.float32) if packed.scales_PxC is None
              else packed.scales_PxC.reshape(-1))
  return jax.ffi.ffi_call('spsjax_packed_matmul', out, vmap_method='sequential')(
      x_RxI, scale_I, residual_RxF, packed.panels_PxIxC, w_scales, counts_B,
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
