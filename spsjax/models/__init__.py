"""Transformer models: config, parameters, the reference forward and the functional KV cache."""

from spsjax.models.api import Model, extend, init_params, logits, num_params, param_shardings, prefill
from spsjax.models.config import TransformerConfig
from spsjax.models.kv_cache import KVCache, init_cache

__all__ = [
    'KVCache', 'Model', 'TransformerConfig', 'extend', 'init_cache', 'init_params', 'logits',
    'num_params', 'param_shardings', 'prefill',
]
