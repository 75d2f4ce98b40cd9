"""The built native library: found next to this file, loaded once, its FFI targets registered.

`pip install` (setup.py) compiles `packed_matmul.cc`, `decode_attention.cc`, `sampling.cc` and
`lookup.cc` into one shared library, `_kernels*.so`, with every kernel in three variants (AVX-512,
AVX2 + FMA, the compiler's baseline); the best variant this CPU runs is picked at call time. Without the library (a checkout
that was never installed, a failed build) `available()` is False and callers use XLA's ops.

The library loaded is the one built for the running interpreter (its extension suffix, e.g.
`.cpython-311-x86_64-linux-gnu.so`; a checkout built by two Pythons holds two), or the file that
`SPSJAX_NATIVE_LIBRARY` names (a sanitizer build, `tests/test_native_sanitized.py`).
"""

import ctypes
import functools
import importlib.machinery
import logging
import os
import re

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
  path = path_to_load()
  if path is None:
    logging.warning('spsjax.native: no kernel library built for this Python in %s (install the '
                    'package with pip to build it); XLA ops are used instead.',
                    os.path.dirname(__file__))
    return None
  try:
    lib = ctypes.CDLL(path)
  except OSError as e:
    logging.warning('spsjax.native: cannot load %s (%s); XLA ops are used instead.', path, e)
    return None
  if reason := ffi_api_mismatch(_library_ffi_api(lib), runtime_ffi_api()):
    logging.warning('spsjax.native: %s cannot run here: %s. XLA ops are used instead; `pip install '
                    '--no-build-isolation -e .` (or without -e) in this environment builds the '
                    'kernels against its own jaxlib.', path, reason)
    return None
  for target, symbol in TARGETS.items():
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform='cpu')
  cap = os.environ.get('SPSJAX_NATIVE_THREADS')
  if cap is not None and not re.fullmatch(r'[ \t\n\r]*[0-9]*[1-9][0-9]*[ \t\n\r]*', cap):
    logging.warning('spsjax.native: SPSJAX_NATIVE_THREADS=%r is not a positive integer; '
                    'ignored (the kernels use every usable CPU).', cap)
  return lib


def _library_ffi_api(lib: ctypes.CDLL) -> tuple[int, int] | None:
  """The XLA FFI API version the library's handlers were compiled for, None if it does not say
  (a build from before it did)."""
  try:
    version = lib.spsjax_ffi_api_version()
  except AttributeError:
    return None
  return divmod(version, 1000)


def runtime_ffi_api(header: str | None = None) -> tuple[int, int] | None:
  """The XLA FFI API version of the running jaxlib, read from the C API header it ships (the
  headers it was built from; `header`: another copy of that file), or None if unreadable."""
  if header is None:
    import jaxlib  # pylint: disable=g-import-not-at-top
    header = os.path.join(os.path.dirname(jaxlib.__file__), 'include', 'xla', 'ffi', 'api',
                          'c_api.h')
  try:
    with open(header) as f:
      text = f.read()
  except OSError:
    return None
  found = [re.search(rf'^#define XLA_FFI_API_{part}\s+(\d+)\s*$', text, re.M)
           for part in ('MAJOR', 'MINOR')]
  return None if None in found else (int(found[0].group(1)), int(found[1].group(1)))


def ffi_api_mismatch(built: tuple[int, int] | None, running: tuple[int, int] | None) -> str | None:
  """Why handlers compiled for FFI API `built` cannot run under an XLA of API `running` (another
  major version, or a newer minor one: XLA refuses them when it compiles a program that calls
  them), or None if they can or either version is unknown."""
  if built is None or running is None:
    return None
  if built[0] != running[0] or built[1] > running[1]:
    return (f'its kernels were compiled for XLA FFI API {built[0]}.{built[1]} (a newer jaxlib\'s '
            f'headers, as pip\'s build isolation fetches) and this jaxlib runs '
            f'{running[0]}.{running[1]}')
  return None


def path_to_load(here: str = os.path.dirname(__file__)) -> str | None:
  """`SPSJAX_NATIVE_LIBRARY` if set, else the library in `here` whose name ends in one of this
  interpreter's extension suffixes (most specific first), or None."""
  explicit = os.environ.get('SPSJAX_NATIVE_LIBRARY')
  if explicit:
    return explicit
  for suffix in importlib.machinery.EXTENSION_SUFFIXES:
    path = os.path.join(here, '_kernels' + suffix)
    if os.path.isfile(path):
      return path
  return None


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


def threads() -> int:
  """Threads a kernel call may use, the caller and `threads() - 1` helper threads; 0 without the
  library. The CPUs this process may run on (affinity mask, cgroup CPU quota rounded up), capped
  by `SPSJAX_NATIVE_THREADS` when that is a positive integer (other values are ignored); read once,
  when the library first needs it (parallel.h, `UsableCpus`)."""
  lib = load()
  return 0 if lib is None else lib.spsjax_native_threads()


def helpers_started() -> int:
  """Helper threads the library has started: none before a call that splits its work, and none
  ever when `threads()` is 1."""
  lib = load()
  return 0 if lib is None else lib.spsjax_native_helpers()


def isa_code(isa: str) -> int:
  if isa not in ISAS:
    raise ValueError(f'Unknown instruction set {isa!r}; known: {sorted(ISAS)}.')
  return ISAS[isa]


def on_cpu(x: jax.Array, kernel, fallback):
  """kernel(x) where the program is lowered for the CPU, fallback(x) on any other platform."""
  return jax.lax.platform_dependent(x, cpu=kernel, default=fallback)
