"""The built native library: found next to this file, loaded once, its FFI targets registered.

`pip install` (setup.py) compiles `packed_matmul.cc`, `decode_attention.cc`, `sampling.cc` and
`lookup.cc` into one shared library, `_kernels*.so`, with every kernel in three variants (AVX-512,
AVX2 + FMA, the compiler's baseline); the best variant this CPU runs is picked at call time. Without the library (a checkout
that was never installed, a failed build) `available()` is False and callers use XLA's ops.
"""

import ctypes
import functools
import glob
import logging
import os

import jax

# FFI target name -> handler symbol in the library.
TARGETS = {
    'spsjax_packed_matmul': 'SpsjaxPackedMatmul',
    'spsjax_cached_attention': 'SpsjaxCachedAttention',
    'spsjax_probabilities': 'SpsjaxProbabilities',
    'spsjax_accept': 'SpsjaxAccept',
    'spsjax_take_rows': 'SpsjaxTakeRows',
}
# Instruction sets by the numbers the C++ side uses (parallel.h); 'best' is the best this CPU runs.
ISAS = {'best': 0, 'baseline': 1, 'avx2': 2, 'avx512': 3}


@functools.cache
def load() -> ctypes.CDLL | None:
  """The library with its targets registered for the CPU platform, or None if it is not built."""
  paths = sorted(glob.glob(os.path.join(os.path.dirname(__file__), '_kernels*.so')))
  if not paths:
    logging.warning('spsjax.native: no built kernel library in %s (install the package with pip '
                    'to build it); XLA ops are used instead.', os.path.dirname(__file__))
    return None
  try:
    lib = ctypes.CDLL(paths[0])
  except OSError as e:
    logging.warning('spsjax.native: cannot load %s (%s); XLA ops are used instead.', paths[0], e)
    return None
  for target, symbol in TARGETS.items():
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform='cpu')
  return lib


def available() -> bool:
  """Whether the native kernels are built and loadable (they then run on any CPU, see `isas`)."""
  return load() is not None


def isas() -> list[str]:
  """The instruction-set variants of the kernels that this CPU runs, best last."""
  lib = load()
  if lib is None:
    return []
  return [name for name, code in ISAS.items()
          if code and lib.spsjax_isa_supported(ctypes.c_int(code))]


def isa_code(isa: str) -> int:
  if isa not in ISAS:
    raise ValueError(f'Unknown instruction set {isa!r}; known: {sorted(ISAS)}.')
  return ISAS[isa]


def on_cpu(x: jax.Array, kernel, fallback):
  """kernel(x) where the program is lowered for the CPU, fallback(x) on any other platform."""
  return jax.lax.platform_dependent(x, cpu=kernel, default=fallback)
