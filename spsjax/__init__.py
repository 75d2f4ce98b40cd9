"""spsjax: speculative sampling (Chen et al., 2023) of transformer language models in JAX."""

__version__ = '0.1.0'
