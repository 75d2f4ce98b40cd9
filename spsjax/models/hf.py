"""Hugging Face checkpoints in and out: Llama-family, Qwen2, Qwen3, Phi-3, Gemma (1, 2 and 3's
text models), GPT-2 and GPT-NeoX (Pythia) directories as `Model`s, and back (`save`).

A checkpoint directory holds `config.json` and safetensors weights: `model.safetensors`, or shards
listed by `model.safetensors.index.json`. `load` maps the config to a `TransformerConfig`
(`spsjax.models.hf_config`, which refuses by name what we do not compute), reads each tensor
(`spsjax.models.hf_files`), puts it into our layout (this module's `_layout`) and onto the mesh
by the rules table one tensor at a time (each process builds only its own devices' shards).
`save` writes a model as a directory of the plainest type that has its options (`save_type`:
Llama for our presets) or of a type asked for, refusing one whose config.json would not read
back as the model (`hf_config`); each tensor is checked to load back as its parameter.

Layouts. HF linear weights are [out, in]; ours are [in, out] with heads split:
q_proj [N H, D] -> wq [D, N, H]; k_proj, v_proj [K H, D] -> [D, K, H]; o_proj [D, N H] ->
wo [N, H, D]; gate_proj, up_proj [F, D] -> w_gate, w_in [D, F]; down_proj [D, F] -> w_out [F, D];
lm_head [V, D] -> head [D, V]; Qwen3's (and Gemma 3's) q_norm, k_norm [H] -> q_norm, k_norm;
Gemma's norms scale by 1 + weight, which is stored as our scale, and Gemma 2's and 3's four a
layer are attn_norm, attn_post_norm, mlp_norm, mlp_post_norm. Both use the
half-split rotary convention (rotate_half), so q and k need no permutation. GPT-2's Conv1D
weights are already [in, out]: c_attn [D, 3 D] splits into wq, wk, wv; c_proj, c_fc and the
MLP's c_proj map to wo, w_in and w_out; biases, LayerNorm biases and the position table (wpe) map
to the model's GPT-2 options (`TransformerConfig.norm`, `position`, `dense_bias`). GPT-NeoX's
query_key_value [N 3 H, D] holds each head's q, k and v in turn (`_neox_layout`).

Invariant: `load(save(model))` has `model`'s parameters (exactly; Gemma's norm scales to float32
rounding), and a loaded model's logits are transformers' (tests/test_hf.py against fixtures
transformers wrote; the fixture script checks that transformers loads what `save` writes).
"""

import jax
import numpy as np
from jax.sharding import Mesh
import safetensors.numpy

from spsjax import sharding, storage
from spsjax.models.api import Model, param_shapes, param_shardings
from spsjax.models.config import TransformerConfig
from spsjax.models.hf_config import (CONFIG, GEMMA_TYPES, LLAMA_TYPES, MODEL_TYPES, SAVE_TYPES,
                                     UnsupportedCheckpoint, config_from_hf, hf_config,
                                     read_config, save_type)
from spsjax.models.hf_files import INDEX, WEIGHTS, read_tensors
from spsjax.models.packing import unfuse, unpack

__all__ = ['CONFIG', 'GEMMA_TYPES', 'INDEX', 'LLAMA_TYPES', 'MODEL_TYPES', 'SAVE_TYPES',
           'UnsupportedCheckpoint', 'WEIGHTS', 'config_from_hf', 'hf_config', 'load',
           'read_config', 'save', 'save_llama', 'save_type']


Entry = tuple[tuple[str, ...], object]  # Our parameter path, HF array -> our array.


def _layout(config: TransformerConfig, model_type: str = 'llama'
            ) -> dict[str, tuple[Entry, ...]]:
  """HF tensor name -> the parameters it fills (one, or several from a fused tensor: GPT-2's
  c_attn, Phi-3's qkv_proj and gate_up_proj)."""
  if model_type == 'gpt_neox':
    return _neox_layout(config)
  if model_type == 'gpt2':
    return _gpt2_layout(config)
  if model_type in GEMMA_TYPES:
    return _gemma_layout(config)
  return _phi3_layout(config) if model_type == 'phi3' else _llama_layout(config)


def _llama_layout(config: TransformerConfig) -> dict[str, tuple[Entry, ...]]:
  D, N, K, H = config.d_model, config.num_heads, config.kv_heads, config.dims_per_head
  heads = lambda n: (lambda w: w.T.reshape(D, n, H))
  out = {'model.embed_tokens.weight': (('embedding',), lambda w: w),
         'model.norm.weight': (('final_norm', 'scale'), lambda w: w)}
  if not config.tie_embeddings:
    out['lm_head.weight'] = (('head',), lambda w: w.T)
  for i in range(config.num_layers):
    hf, ours = f'model.layers.{i}.', f'layer_{i}'
    out.update({
        hf + 'self_attn.q_proj.weight': ((ours, 'attn', 'wq'), heads(N)),
        hf + 'self_attn.k_proj.weight': ((ours, 'attn', 'wk'), heads(K)),
        hf + 'self_attn.v_proj.weight': ((ours, 'attn', 'wv'), heads(K)),
        hf + 'self_attn.o_proj.weight': ((ours, 'attn', 'wo'), lambda w: w.T.reshape(N, H, D)),
        hf + 'mlp.gate_proj.weight': ((ours, 'mlp', 'w_gate'), lambda w: w.T),
        hf + 'mlp.up_proj.weight': ((ours, 'mlp', 'w_in'), lambda w: w.T),
        hf + 'mlp.down_proj.weight': ((ours, 'mlp', 'w_out'), lambda w: w.T),
        hf + 'input_layernorm.weight': ((ours, 'attn_norm', 'scale'), lambda w: w),
        hf + 'post_attention_layernorm.weight': ((ours, 'mlp_norm', 'scale'), lambda w: w),
    })
    if config.qk_norm:
      out.update({hf + 'self_attn.q_norm.weight': ((ours, 'attn', 'q_norm'), lambda w: w),
                  hf + 'self_attn.k_norm.weight': ((ours, 'attn', 'k_norm'), lambda w: w)})
    if config.qkv_bias:
      out.update({
          hf + 'self_attn.q_proj.bias': ((ours, 'attn', 'bq'), lambda b: b.reshape(N, H)),
          hf + 'self_attn.k_proj.bias': ((ours, 'attn', 'bk'), lambda b: b.reshape(K, H)),
          hf + 'self_attn.v_proj.bias': ((ours, 'attn', 'bv'), lambda b: b.reshape(K, H)),
      })
  return {name: (entry,) for name, entry in out.items()}


def _rows(start: int, stop: int, total: int, shape: tuple[int, ...]):
  """A fused [total, D] tensor's rows [start, stop), transposed to [D, ...] `shape`; a tensor of
  another row count raises ValueError (`load` names it)."""
  def convert(w):
    if w.shape[0] != total:
      raise ValueError(f'{w.shape[0]} rows, not {total}')
    return w[start:stop].T.reshape(shape)
  return convert


def _phi3_layout(config: TransformerConfig) -> dict[str, tuple[Entry, ...]]:
  """Llama's, but q, k and v stored as one qkv_proj [(N + 2K) H, D] and the MLP's gate and input
  as one gate_up_proj [2F, D], gate first."""
  D, N, K, H, F = (config.d_model, config.num_heads, config.kv_heads, config.dims_per_head,
                   config.ff_dim)
  out = _llama_layout(config)
  for i in range(config.num_layers):
    hf, ours = f'model.layers.{i}.', f'layer_{i}'
    for part in ('self_attn.q_proj', 'self_attn.k_proj', 'self_attn.v_proj', 'mlp.gate_proj',
                 'mlp.up_proj'):
      del out[f'{hf}{part}.weight']
    M = (N + 2 * K) * H
    out[hf + 'self_attn.qkv_proj.weight'] = (
        ((ours, 'attn', 'wq'), _rows(0, N * H, M, (D, N, H))),
        ((ours, 'attn', 'wk'), _rows(N * H, (N + K) * H, M, (D, K, H))),
        ((ours, 'attn', 'wv'), _rows((N + K) * H, M, M, (D, K, H))))
    out[hf + 'mlp.gate_up_proj.weight'] = (((ours, 'mlp', 'w_gate'), _rows(0, F, 2 * F, (D, F))),
                                           ((ours, 'mlp', 'w_in'), _rows(F, 2 * F, 2 * F, (D, F))))
  return out


def _gemma_layout(config: TransformerConfig) -> dict[str, tuple[Entry, ...]]:
  """Llama's, but each RMSNorm scales by 1 + its stored weight (float32, as transformers adds
  it); with post-norms (Gemma 2 and 3) post_attention_layernorm norms the attention's output and
  pre_ / post_feedforward_layernorm the MLP's input and output."""
  one_plus = lambda w: np.float32(1.0) + w.astype(np.float32)
  out = _llama_layout(config)
  if config.post_norms:
    for i in range(config.num_layers):
      hf, ours = f'model.layers.{i}.', f'layer_{i}'
      out.update({
          hf + 'post_attention_layernorm.weight': (((ours, 'attn_post_norm', 'scale'), None),),
          hf + 'pre_feedforward_layernorm.weight': (((ours, 'mlp_norm', 'scale'), None),),
          hf + 'post_feedforward_layernorm.weight': (((ours, 'mlp_post_norm', 'scale'), None),)})
  for name, ((ours, _),) in list(out.items()):
    if name.endswith(('norm.weight', 'layernorm.weight')):
      out[name] = ((ours, one_plus),)
  return out


def _gpt2_layout(config: TransformerConfig) -> dict[str, tuple[Entry, ...]]:
  D, N, H = config.d_model, config.num_heads, config.dims_per_head
  same = lambda w: w
  third = lambda j, shape: (lambda w: np.split(w, 3, axis=-1)[j].reshape(shape))
  out = {'wte.weight': ((('embedding',), same),),
         'wpe.weight': ((('position_embedding',), same),),
         'ln_f.weight': ((('final_norm', 'scale'), same),),
         'ln_f.bias': ((('final_norm', 'bias'), same),)}
  if not config.tie_embeddings:
    out['lm_head.weight'] = ((('head',), lambda w: w.T),)
  for i in range(config.num_layers):
    hf, ours = f'h.{i}.', f'layer_{i}'
    out.update({
        hf + 'ln_1.weight': (((ours, 'attn_norm', 'scale'), same),),
        hf + 'ln_1.bias': (((ours, 'attn_norm', 'bias'), same),),
        hf + 'ln_2.weight': (((ours, 'mlp_norm', 'scale'), same),),
        hf + 'ln_2.bias': (((ours, 'mlp_norm', 'bias'), same),),
        hf + 'attn.c_attn.weight': tuple(((ours, 'attn', w), third(j, (D, N, H)))
                                         for j, w in enumerate(('wq', 'wk', 'wv'))),
        hf + 'attn.c_attn.bias': tuple(((ours, 'attn', b), third(j, (N, H)))
                                       for j, b in enumerate(('bq', 'bk', 'bv'))),
        hf + 'attn.c_proj.weight': (((ours, 'attn', 'wo'), lambda w: w.reshape(N, H, D)),),
        hf + 'attn.c_proj.bias': (((ours, 'attn', 'bo'), same),),
        hf + 'mlp.c_fc.weight': (((ours, 'mlp', 'w_in'), same),),
        hf + 'mlp.c_fc.bias': (((ours, 'mlp', 'b_in'), same),),
        hf + 'mlp.c_proj.weight': (((ours, 'mlp', 'w_out'), same),),
        hf + 'mlp.c_proj.bias': (((ours, 'mlp', 'b_out'), same),),
    })
  return out


def _neox_layout(config: TransformerConfig) -> dict[str, tuple[Entry, ...]]:
  """GPT-NeoX's names: query_key_value [N 3 H, D] holds each head's query, key and value in turn
  (and its bias [N 3 H] alike); the rest are [out, in] linears with biases and LayerNorms."""
  D, N, H = config.d_model, config.num_heads, config.dims_per_head
  same = lambda w: w
  qkv = lambda j: (lambda w: w.reshape(N, 3, H, D)[:, j].transpose(2, 0, 1))
  bias = lambda j: (lambda b: b.reshape(N, 3, H)[:, j])
  out = {'gpt_neox.embed_in.weight': ((('embedding',), same),),
         'gpt_neox.final_layer_norm.weight': ((('final_norm', 'scale'), same),),
         'gpt_neox.final_layer_norm.bias': ((('final_norm', 'bias'), same),)}
  if not config.tie_embeddings:
    out['embed_out.weight'] = ((('head',), lambda w: w.T),)
  for i in range(config.num_layers):
    hf, ours = f'gpt_neox.layers.{i}.', f'layer_{i}'
    out.update({
        hf + 'input_layernorm.weight': (((ours, 'attn_norm', 'scale'), same),),
        hf + 'input_layernorm.bias': (((ours, 'attn_norm', 'bias'), same),),
        hf + 'post_attention_layernorm.weight': (((ours, 'mlp_norm', 'scale'), same),),
        hf + 'post_attention_layernorm.bias': (((ours, 'mlp_norm', 'bias'), same),),
        hf + 'attention.query_key_value.weight': tuple(
            ((ours, 'attn', w), qkv(j)) for j, w in enumerate(('wq', 'wk', 'wv'))),
        hf + 'attention.query_key_value.bias': tuple(
            ((ours, 'attn', b), bias(j)) for j, b in enumerate(('bq', 'bk', 'bv'))),
        hf + 'attention.dense.weight': (((ours, 'attn', 'wo'), lambda w: w.T.reshape(N, H, D)),),
        hf + 'attention.dense.bias': (((ours, 'attn', 'bo'), same),),
        hf + 'mlp.dense_h_to_4h.weight': (((ours, 'mlp', 'w_in'), lambda w: w.T),),
        hf + 'mlp.dense_h_to_4h.bias': (((ours, 'mlp', 'b_in'), same),),
        hf + 'mlp.dense_4h_to_h.weight': (((ours, 'mlp', 'w_out'), lambda w: w.T),),
        hf + 'mlp.dense_4h_to_h.bias': (((ours, 'mlp', 'b_out'), same),),
    })
  return out


def _hf_name(name: str, config: TransformerConfig) -> str | None:
  """The layout's name for a tensor, or None for one that carries nothing of the model
  (GPT-2's and GPT-NeoX's causal-mask buffers, old checkpoints' rotary frequencies)."""
  if name.endswith(('attn.bias', 'attn.masked_bias')) and '.c_attn' not in name:
    return None
  if name.endswith(('.attention.bias', '.attention.masked_bias')):
    return None
  if name.endswith('rotary_emb.inv_freq'):
    return None
  if config.gpt2_style and name.startswith('transformer.'):
    return name[len('transformer.'):]  # GPT2LMHeadModel's prefix; GPT2Model has none.
  return name


def _get(tree: dict, path: tuple[str, ...]):
  for key in path:
    tree = tree[key]
  return tree


def _set(tree: dict, path: tuple[str, ...], value) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def load(path: str, *, mesh: Mesh | None = None, rules: sharding.Rules = sharding.DEFAULT_RULES,
         dtype: str = 'float32') -> Model:
  """The checkpoint at `path` as a Model in `dtype`, placed on `mesh` by `rules` if given.

  Every tensor the layout expects must be present with its shape, and every tensor present must
  be used (a tied checkpoint may carry a copy of the embedding as lm_head).
  """
  hf = read_config(path)
  config = config_from_hf(hf, dtype)
  layout = _layout(config, hf['model_type'])
  abstract = param_shapes(config)
  shardings = param_shardings(config, mesh, rules) if mesh is not None else None
  params, seen = {}, set()
  for stored, array in read_tensors(path):
    name = _hf_name(stored, config)
    if name is None:
      continue
    if name not in layout:
      if name == 'lm_head.weight' and config.tie_embeddings:
        continue  # A tied checkpoint's copy of the embedding.
      raise UnsupportedCheckpoint(f'{path}: tensor {stored} has no place in a {hf["model_type"]} '
                                  f'model of this config.')
    for ours, convert in layout[name]:
      want = _get(abstract, ours).shape
      try:
        value = convert(array)
      except ValueError:  # A reshape that the stored size cannot make.
        value = None
      if value is None or value.shape != want:
        raise UnsupportedCheckpoint(f'{path}: tensor {stored} has shape {array.shape}, which '
                                    f'does not give {"/".join(ours)} its shape {want}.')
      value = np.asarray(value, config.jnp_dtype)
      if shardings is None:
        _set(params, ours, jax.device_put(value))
      else:
        _set(params, ours, sharding.put(value, _get(shardings, ours)))
    seen.add(name)
  missing = sorted(set(layout) - seen)
  if missing:
    raise UnsupportedCheckpoint(f'{path}: missing tensors {missing[:4]}'
                                + (f' and {len(missing) - 4} more' if len(missing) > 4 else '')
                                + '.')
  return Model(config, params)


def _stored(name: str, value: np.ndarray, D: int, gemma: bool) -> np.ndarray:
  """A parameter as the tensor `name` of a Llama-named checkpoint ([out, in] linears, flat q/k/v
  biases, Gemma's norms as weight = scale - 1): the inverse of `_llama_layout`'s and
  `_gemma_layout`'s conversions."""
  if name.endswith(('q_proj.weight', 'k_proj.weight', 'v_proj.weight')):
    return value.reshape(D, -1).T
  if name.endswith('o_proj.weight'):
    return value.reshape(-1, D).T
  if name.endswith('_proj.weight') or name == 'lm_head.weight':
    return value.T
  if name.endswith('_proj.bias'):
    return value.reshape(-1)
  if gemma and name.endswith('norm.weight'):
    return value - np.float32(1.0)
  return value


def _fused_stored(name: str, values: list[np.ndarray], config: TransformerConfig) -> np.ndarray:
  """A tensor several parameters fill (`_layout`'s fused entries): Phi-3's qkv_proj and
  gate_up_proj, GPT-2's c_attn, GPT-NeoX's query_key_value, from their parts in order."""
  D, N, H = config.d_model, config.num_heads, config.dims_per_head
  if name.endswith('query_key_value.weight'):  # [N, 3, H, D] from wq, wk, wv [D, N, H].
    return np.stack([w.transpose(1, 2, 0) for w in values], axis=1).reshape(N * 3 * H, D)
  if name.endswith('query_key_value.bias'):
    return np.stack(values, axis=1).reshape(-1)
  if name.endswith('c_attn.bias'):
    return np.concatenate([b.reshape(-1) for b in values])
  wide = np.concatenate([w.reshape(D, -1) for w in values], axis=1)  # [D, parts' outputs].
  return wide if name.endswith('c_attn.weight') else wide.T  # Conv1D keeps [in, out].


def _gpt_stored(name: str, value: np.ndarray, config: TransformerConfig) -> np.ndarray:
  """A GPT-2 or GPT-NeoX parameter as its tensor (`_gpt2_layout`, `_neox_layout` inverted)."""
  D = config.d_model
  if name.endswith('attn.c_proj.weight'):
    return value.reshape(-1, D)  # Conv1D [in, out].
  if name.endswith('attention.dense.weight'):
    return value.reshape(-1, D).T
  if name.endswith(('dense_h_to_4h.weight', 'dense_4h_to_h.weight', 'embed_out.weight',
                    'lm_head.weight')):
    return value.T
  return value


def save(model: Model, path: str, model_type: str | None = None, **extra) -> str:
  """Writes `model` (unpacked and unfused, gathered to the host) as a Hugging Face directory of
  `model_type` (None: `save_type`'s choice): config.json and model.safetensors, in float32
  whatever the model's dtype; `path` local or a URI, written by process 0 (`storage`). Each
  tensor is checked to load back as the parameter it came from. Returns `path`."""
  model = unfuse(unpack(model))
  config = model.config
  model_type = model_type or save_type(config)
  hf = hf_config(config, model_type, **extra)
  tensors = {}
  get = lambda ours: np.asarray(jax.device_get(_get(model.params, ours)), np.float32)
  for name, entries in _layout(config, model_type).items():
    values = [get(ours) for ours, _ in entries]
    if len(entries) > 1:
      stored = _fused_stored(name, values, config)
    elif model_type in ('gpt2', 'gpt_neox'):
      stored = _gpt_stored(name, values[0], config)
    else:
      stored = _stored(name, values[0], config.d_model, model_type in GEMMA_TYPES)
    stored = np.ascontiguousarray(stored)
    for (ours, convert), value in zip(entries, values, strict=True):
      np.testing.assert_allclose(convert(stored), value, rtol=1e-6, atol=0,
                                 err_msg=f'{name} would not load back as {"/".join(ours)}')
    tensors[('transformer.' if model_type == 'gpt2' and name != 'lm_head.weight' else '')
            + name] = stored
  storage.write_bytes(storage.join(path, WEIGHTS),
                      safetensors.numpy.save(tensors, metadata={'format': 'pt'}))
  storage.write_json(storage.join(path, CONFIG), hf, indent=1)
  return path


def save_llama(model: Model, path: str, **extra) -> str:
  """`save` as a Llama directory (a model with options Llama lacks is refused by name)."""
  return save(model, path, 'llama', **extra)
