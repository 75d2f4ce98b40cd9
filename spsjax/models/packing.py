"""A model's projection weights laid out for decoding: packed for the few-row CPU kernel
(`spsjax.native`), or fused for XLA's products; and back.

Packing is part of placing a model: done once, after loading, for a float32 model on one CPU
device, and undone before sharding on a mesh (sharded models multiply with XLA's dots, which the
partitioner splits the Megatron way). In a packed parameter tree each layer's attention holds
`wqkv` (wq, wk, wv side by side: one product, output [N + 2K, H]) and `wo`; a gated MLP holds
`w_gate_in` (gate and input: output [2, F]) and `w_out`, a GELU MLP `w_in` and `w_out`; the
output layer is `head`, for tied embeddings a packed copy of the table (the lookup keeps reading
rows of `embedding`). A feature head (`models.feature_head`) packed in bfloat16, int8 or w8a8
beside its target holds `output`, a copy of the target's output layer stored as its own weights
(`pack`'s `target`). Everything else (norms, the embedding table) is unchanged. A packed model's
config says so (`kernels='native'`, `unpack` sets 'xla' back): the transformer reads the setting,
not the type of its parameters, to choose its kernels.

Fusing (`fuse`, kernels 'xla_fused'; `unfuse`) gives XLA fewer and larger products a step, for
accelerators, where a decoding step at small batch is many small kernels: each layer's attention
holds `wqkv` [D, K, G + 2, H] (for each kv head its G query heads, then its key, then its value:
a Megatron split of the kv heads over `model` keeps each group whole on one device, so a fused
model shards by the same rules) in place of wq, wk and wv, and a gated MLP `w_gate_in` [D, 2, F]
(gate, then input) in place of w_gate and w_in; nothing else changes. A decoding layout, not a
training one (training's backward pass is slower on stacked weights: `transformer.Mlp`).

Invariant: `unpack(pack(model))` and `unfuse(fuse(model))` have exactly the parameters of
`model`, and a packed or fused model's forward equals the plain one's up to float reassociation.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from spsjax import native
from spsjax.models import feature_head
from spsjax.models.api import Model
from spsjax.models.config import GATED_MLPS, TransformerConfig

WEIGHT_DTYPES = native.WEIGHT_DTYPES


def _check_weights(weights: str) -> None:
  if weights not in native.WEIGHT_DTYPES:
    raise ValueError(f'Packed weights are one of {native.WEIGHT_DTYPES}, not {weights!r}.')


def _is_packed_weight(x) -> bool:
  return isinstance(x, native.PackedWeight)


def is_packed(model: Model) -> bool:
  return model.config.kernels == 'native'


def _with_kernels(model: Model, kernels: str, params: dict) -> Model:
  return model.replace(config=dataclasses.replace(model.config, kernels=kernels), params=params)


def _pack_mlp(config: TransformerConfig, pack, mlp: dict) -> dict:
  mlp = dict(mlp)
  if config.mlp in GATED_MLPS:
    w_gate_in_Dx2xF = jnp.stack([mlp.pop('w_gate'), mlp.pop('w_in')], axis=1)
    mlp['w_gate_in'] = pack(w_gate_in_Dx2xF)
  else:
    mlp['w_in'] = pack(mlp['w_in'])
  mlp['w_out'] = pack(mlp['w_out'])
  return mlp


def _unpack_mlp(config: TransformerConfig, mlp: dict) -> dict:
  mlp = dict(mlp)
  if config.mlp in GATED_MLPS:
    w_gate_in_Dx2xF = native.unpack(mlp.pop('w_gate_in'))
    mlp.update(w_gate=w_gate_in_Dx2xF[:, 0], w_in=w_gate_in_Dx2xF[:, 1])
  else:
    mlp['w_in'] = native.unpack(mlp['w_in'])
  mlp['w_out'] = native.unpack(mlp['w_out'])
  return mlp


@functools.partial(jax.jit, static_argnums=(0, 1))
def _pack_layer(config: TransformerConfig, dtype: str, layer: dict) -> dict:
  attn = dict(layer['attn'])
  pack = functools.partial(native.pack, dtype=dtype)
  wqkv_DxMxH = jnp.concatenate([attn.pop('wq'), attn.pop('wk'), attn.pop('wv')], axis=1)
  attn.update(wqkv=pack(wqkv_DxMxH), wo=pack(attn['wo'], in_dims=2))
  return dict(layer, attn=attn, mlp=_pack_mlp(config, pack, layer['mlp']))


@functools.partial(jax.jit, static_argnums=0)
def _unpack_layer(config: TransformerConfig, layer: dict) -> dict:
  attn = dict(layer['attn'])
  N, K = config.num_heads, config.kv_heads
  wq, wk, wv = jnp.split(native.unpack(attn.pop('wqkv')), [N, N + K], axis=1)
  attn.update(wq=wq, wk=wk, wv=wv, wo=native.unpack(attn['wo']))
  return dict(layer, attn=attn, mlp=_unpack_mlp(config, layer['mlp']))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _pack_head(config: TransformerConfig, dtype: str, params: dict) -> dict:
  """A feature head's own products (`feature_head`): its fuse, its taps' product, a Falcon
  head's cells, its parallel heads' MLPs, an MLP speculator's stages and its draft vocabulary's
  output layer (its decoder blocks are layers, packed as a transformer's)."""
  pack = functools.partial(native.pack, dtype=dtype)
  params = dict(params)
  if 'cells' in params:
    params['cells'] = dict(params['cells'], cell_0=pack(params['cells']['cell_0'], in_dims=2),
                           cell_1=pack(params['cells']['cell_1']))
  for name in _INPUT_PRODUCTS:
    if name in params:
      params[name] = dict(params[name], **{name: pack(params[name][name], in_dims=2)})
  if 'draft_vocab' in params:
    params['draft_vocab'] = dict(params['draft_vocab'],
                                 output=pack(params['draft_vocab']['output']))
  for name in [n for n in params if n.startswith('stage_')]:  # An MLP speculator's stages.
    params[name] = dict(params[name], proj=pack(params[name]['proj']),
                        out=pack(params[name]['out']))
  for name in [n for n in params if n.startswith('head_') and not n.endswith('_norm')]:
    params[name] = _pack_mlp(config, pack, params[name])
  return params


@functools.partial(jax.jit, static_argnums=0)
def _unpack_head(config: TransformerConfig, params: dict) -> dict:
  params = dict(params)
  if 'cells' in params:
    params['cells'] = dict(params['cells'], cell_0=native.unpack(params['cells']['cell_0']),
                           cell_1=native.unpack(params['cells']['cell_1']))
  for name in _INPUT_PRODUCTS:
    if name in params:
      params[name] = dict(params[name], **{name: native.unpack(params[name][name])})
  if 'draft_vocab' in params:
    params['draft_vocab'] = dict(params['draft_vocab'],
                                 output=native.unpack(params['draft_vocab']['output']))
  for name in [n for n in params if n.startswith('stage_')]:
    params[name] = dict(params[name], proj=native.unpack(params[name]['proj']),
                        out=native.unpack(params[name]['out']))
  for name in [n for n in params if n.startswith('head_') and not n.endswith('_norm')]:
    params[name] = _unpack_mlp(config, params[name])
  return params


# A head's products over several inputs side by side, [n, D, D] (`feature_head._normed_product`).
_INPUT_PRODUCTS = ('fuse', 'taps')


def _layer_names(config: TransformerConfig) -> list[str]:
  return [f'layer_{i}' for i in range(config.num_layers)]


def _output_copy(target: Model, weights: str):
  """The target's output layer [D, V] packed as `weights`, marked a copy (not counted)."""
  params = target.params
  if is_packed(target):
    w_DxV = native.unpack(params['head'])
  else:
    w_DxV = params['embedding'].T if target.config.tie_embeddings else params['head']
  return native.pack(w_DxV.astype(jnp.float32), tied_to='target', dtype=weights)


def pack(model: Model, weights: str = 'float32', target: Model | None = None) -> Model:
  """The model with its projection weights packed (module docstring). Needs float32 weights.

  `weights='bfloat16'` stores the packed weights in bfloat16 (`native.pack(dtype=)`): half the
  bytes a step reads, the products still float32 arithmetic, the weights rounded; `'int8'` in
  int8 with a scale per output column: a quarter of the bytes, the weights quantized; `'w8a8'`
  int8's weights, multiplied by the inputs quantized to int8 in integer arithmetic (a third to
  a half of int8's time a draft step where the CPU has AVX-512 VNNI). Meant for drafts: SpS
  stays exact whatever the draft computes, and a draft that reads fewer bytes costs less and
  leaves more of the cache to its target (its proposals, hence alpha, may move a little). The
  embedding table and norms stay float32. A model already packed is returned as it is.

  `target`: for a feature head (`models.feature_head`) packed in bfloat16, int8 or w8a8, the
  target it drafts for: the head gets a copy of the target's output layer stored as `weights`
  (`output`), so that a draft step reads the vocabulary's weights in the draft's precision, not
  the target's float32 (the target's final norm still applies). Made here, never saved; `unpack`
  drops it. A head with its own output layer (a draft vocabulary) packs that one instead.
  """
  config = model.config
  if config.dtype != 'float32':
    raise ValueError(f'Only float32 models can be packed, got {config.dtype}.')
  _check_weights(weights)
  if is_packed(model):
    return model
  model = unfuse(model)
  params = dict(model.params)
  for name in _layer_names(config) if 'layer_0' in params else ():
    params[name] = _pack_layer(config, weights, params[name])
  if feature_head.is_head(model):  # No embedding, no output layer: the target's serve them.
    params = _pack_head(config, weights, params)
    if target is not None and weights != 'float32' and not config.draft_vocab_size:
      feature_head.check_pair(target, model)
      params['output'] = jax.jit(_output_copy, static_argnums=1)(target, weights)
    return _with_kernels(model, 'native', params)
  if config.tie_embeddings:
    params['head'] = jax.jit(lambda e: native.pack(e.T, tied_to='embedding', dtype=weights))(
        params['embedding'])
  else:
    params['head'] = jax.jit(lambda w: native.pack(w, dtype=weights))(params['head'])
  return _with_kernels(model, 'native', params)


def unpack(model: Model) -> Model:
  """The model with plain parameters again (a tied model's packed head copy dropped; weights
  packed in bfloat16 or int8 come back float32 with their rounded or quantized values)."""
  if not is_packed(model):
    return model
  config, params = model.config, dict(model.params)
  for name in _layer_names(config) if 'layer_0' in params else ():
    params[name] = _unpack_layer(config, params[name])
  if feature_head.is_head(model):
    params.pop('output', None)  # A copy of the target's output layer (`pack`'s `target`).
    return _with_kernels(model, 'xla', _unpack_head(config, params))
  head = params.pop('head')
  if not config.tie_embeddings:
    params['head'] = jax.jit(native.unpack)(head)
  return _with_kernels(model, 'xla', params)


def packable(model: Model) -> str | None:
  """Why `model` is not packed for decoding on this machine, or None when it can be."""
  if model.config.dtype != 'float32':
    return f'its dtype is {model.config.dtype} (the kernels are float32)'
  if not native.available():
    return 'the native kernel library is not built'
  devices = {d for x in jax.tree.leaves(model.params) for d in x.devices()}
  if len(devices) != 1 or next(iter(devices)).platform != 'cpu':
    return f'its parameters are on {sorted(str(d) for d in devices)}, not one CPU device'
  return None


def packed_dtype(model: Model) -> str | None:
  """How a packed model's weights are stored (one of `WEIGHT_DTYPES`); None if not packed."""
  leaves = jax.tree.leaves(model.params, is_leaf=_is_packed_weight)
  for x in leaves:
    if _is_packed_weight(x):
      return x.dtype
  return None


def for_decoding(model: Model, weights: str = 'float32', target: Model | None = None) -> Model:
  """The model as decoding wants it here: packed where `packable` (its products' weights stored
  as `weights`, a feature head's output copy made from `target`, see `pack`), unchanged otherwise
  (`weights` is checked either way: a wrong value is an error on every machine, not only where
  the model gets packed)."""
  _check_weights(weights)
  return model if packable(model) else pack(model, weights, target)


def is_fused(model: Model) -> bool:
  return model.config.kernels == 'xla_fused'


@functools.partial(jax.jit, static_argnums=0)
def _fuse_layer(config: TransformerConfig, layer: dict) -> dict:
  attn, mlp = dict(layer['attn']), dict(layer['mlp'])
  D, N, K, H = config.d_model, config.num_heads, config.kv_heads, config.dims_per_head
  wq_DxKxGxH = attn.pop('wq').reshape(D, K, N // K, H)
  attn['wqkv'] = jnp.concatenate(
      [wq_DxKxGxH, attn.pop('wk')[:, :, None], attn.pop('wv')[:, :, None]], axis=2)
  if config.mlp in GATED_MLPS:
    mlp['w_gate_in'] = jnp.stack([mlp.pop('w_gate'), mlp.pop('w_in')], axis=1)
  return dict(layer, attn=attn, mlp=mlp)


@functools.partial(jax.jit, static_argnums=0)
def _unfuse_layer(config: TransformerConfig, layer: dict) -> dict:
  attn, mlp = dict(layer['attn']), dict(layer['mlp'])
  D, N, K, H = config.d_model, config.num_heads, config.kv_heads, config.dims_per_head
  G = N // K
  wqkv_DxKxCxH = attn.pop('wqkv')
  attn.update(wq=wqkv_DxKxCxH[:, :, :G].reshape(D, N, H), wk=wqkv_DxKxCxH[:, :, G],
              wv=wqkv_DxKxCxH[:, :, G + 1])
  if config.mlp in GATED_MLPS:
    w_gate_in_Dx2xF = mlp.pop('w_gate_in')
    mlp.update(w_gate=w_gate_in_Dx2xF[:, 0], w_in=w_gate_in_Dx2xF[:, 1])
  return dict(layer, attn=attn, mlp=mlp)


def fuse(model: Model) -> Model:
  """The model with its products fused for XLA (module docstring); a fused model is returned as
  it is. Fuse before placing on a mesh: `sampling.place_params` then shards the fused weights by
  their logical names."""
  if is_fused(model):
    return model
  if is_packed(model):
    raise ValueError('A model packed for the native CPU kernels cannot be fused: `unpack` it '
                     'first (fused products are XLA\'s).')
  if feature_head.is_head(model):
    raise ValueError('Feature heads are not fused (their products are few already); fuse the '
                     'target they draft for.')
  params = dict(model.params)
  for name in _layer_names(model.config):
    params[name] = _fuse_layer(model.config, params[name])
  return _with_kernels(model, 'xla_fused', params)


def unfuse(model: Model) -> Model:
  """The model with XLA's plain layout again (exactly the parameters before `fuse`)."""
  if not is_fused(model):
    return model
  params = dict(model.params)
  for name in _layer_names(model.config):
    params[name] = _unfuse_layer(model.config, params[name])
  return _with_kernels(model, 'xla', params)
