"""Weights packed in panels for the few-row CPU kernel, and the product that dispatches to it.

`pack(w)` lays a weight `[*in_shape, *out_shape]` out as panels of `PANEL` output columns,
`float32[P, I, PANEL]` with I = prod(in_shape), P = ceil(F / PANEL), F = prod(out_shape), the last
panel zero-padded. `matmul(x, packed)` computes `x[..., I] @ w -> [..., *out_shape]`:

- on the CPU, with the native library built, through the C++ kernel (`packed_matmul.cc`, called
  by `jax.ffi`), which reads each panel front to back once per call, so 1 to 8 rows cost about
  what one row costs; more rows re-read the panel from cache 8 at a time (a 128-token prefill of
  `reference_target` takes 42 ms so, 38 ms with XLA's dots on unpacked weights, 58 ms with XLA's
  dots on the panels);
- otherwise (another platform, no native library, or `use_kernel=False`) as an XLA dot on the
  panels, which gives the same numbers up to float reassociation.

Invariant: `unpack(pack(w))` is `w` exactly, and `matmul(x, pack(w))` equals `x @ w` up to float
reassociation whichever path runs.
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
  """A weight `[*in_shape, *out_shape]` stored as `float32[P, I, PANEL]` panels (module docstring).

  `tied_to` names the parameter this one is a packed copy of (the output layer of a model with
  tied embeddings keeps its embedding table for the lookup): counting parameters skips it.
  """
  panels_PxIxC: jax.Array
  in_shape: tuple[int, ...] = flax.struct.field(pytree_node=False)
  out_shape: tuple[int, ...] = flax.struct.field(pytree_node=False)
  tied_to: str | None = flax.struct.field(pytree_node=False, default=None)

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


def pack(w: jax.Array, in_dims: int = 1, *, tied_to: str | None = None) -> PackedWeight:
  """Packs `w` whose first `in_dims` dimensions are contracted with the input."""
  if w.dtype != jnp.float32:
    raise ValueError(f'Only float32 weights can be packed, got {w.dtype}.')
  if not 1 <= in_dims < w.ndim:
    raise ValueError(f'in_dims must be in [1, {w.ndim - 1}] for a weight of shape {w.shape}.')
  in_shape, out_shape = tuple(w.shape[:in_dims]), tuple(w.shape[in_dims:])
  I, F = math.prod(in_shape), math.prod(out_shape)
  P = -(-F // PANEL)
  w_IxF = jnp.pad(w.reshape(I, F), ((0, 0), (0, P * PANEL - F)))
  panels = jnp.transpose(w_IxF.reshape(I, P, PANEL), (1, 0, 2))
  return PackedWeight(panels, in_shape, out_shape, tied_to)


def unpack(packed: PackedWeight) -> jax.Array:
  """The weight `[*in_shape, *out_shape]` that `packed` was made from."""
  P, I, C = packed.panels_PxIxC.shape
  w_IxF = jnp.transpose(packed.panels_PxIxC, (1, 0, 2)).reshape(I, P * C)[:, :packed.out_dim]
  return w_IxF.reshape(packed.in_shape + packed.out_shape)


def _xla_matmul(x_RxI: jax.Array, packed: PackedWeight) -> jax.Array:
  y_RxPxC = jnp.einsum('RI,PIC->RPC', x_RxI, packed.panels_PxIxC)
  return y_RxPxC.reshape(x_RxI.shape[0], -1)[:, :packed.out_dim]


def _kernel_matmul(x_RxI: jax.Array, packed: PackedWeight, isa: str) -> jax.Array:
  out = jax.ShapeDtypeStruct((x_RxI.shape[0], packed.out_dim), jnp.float32)
  return jax.ffi.ffi_call('spsjax_packed_matmul', out, vmap_method='sequential')(
      x_RxI, packed.panels_PxIxC, isa=np.int32(library.isa_code(isa)))


def matmul(x: jax.Array, packed: PackedWeight, *, isa: str = 'best',
           use_kernel: bool | None = None) -> jax.Array:
  """`x[..., I] @ w -> float32[..., *out_shape]` (module docstring for the path taken).

  `use_kernel`: force the kernel (True; an error where it cannot run) or the XLA dot (False);
  None: the kernel wherever it is built. `isa` picks the kernel's instruction set (`library.ISAS`), for
  tests.
  """
  if x.shape[-1] != packed.in_dim:
    raise ValueError(f'Input of width {x.shape[-1]} for a packed weight of input shape '
                     f'{packed.in_shape}.')
  lead = x.shape[:-1]
  x_RxI = x.reshape(-1, packed.in_dim).astype(jnp.float32)
  if use_kernel is None:
    use_kernel = library.available()
  elif use_kernel and not library.available():
    raise RuntimeError('The native kernel library is not built (see spsjax/native/library.py).')
  if use_kernel:
    y_RxF = library.on_cpu(x_RxI, lambda x: _kernel_matmul(x, packed, isa),
                           lambda x: _xla_matmul(x, packed))
  else:
    y_RxF = _xla_matmul(x_RxI, packed)
  return y_RxF.reshape(lead + packed.out_shape)
