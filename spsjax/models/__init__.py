"""Transformer models: config, parameters, the reference forward and the functional KV cache."""

from spsjax.models.api import (Model, extend, extend_with_features, features, init_params, logits,
                               num_params, param_shapes, param_shardings, prefill, tree_logits,
                               truncated_params, unsharded_dims)
from spsjax.models import feature_head
from spsjax.models.config import RopeScaling, TransformerConfig
from spsjax.models.kv_cache import KVCache, init_cache
from spsjax.models.token_tree import RowTrees, TokenTree
from spsjax.models.transformer import output_logits
from spsjax.models.packing import (WEIGHT_DTYPES, for_decoding, fuse, is_fused, is_packed, pack,
                                   packable, packed_dtype, unfuse, unpack)

__all__ = [
    'KVCache', 'Model', 'RopeScaling', 'RowTrees', 'TokenTree', 'TransformerConfig',
    'WEIGHT_DTYPES', 'extend',
    'extend_with_features',
    'feature_head', 'features', 'for_decoding', 'fuse', 'is_fused',
    'init_cache', 'init_params', 'is_packed', 'logits', 'num_params', 'output_logits', 'pack',
    'packable',
    'packed_dtype', 'param_shapes', 'param_shardings', 'prefill', 'tree_logits',
    'truncated_params', 'unfuse',
    'unpack',
    'unsharded_dims',
]
