"""Hugging Face `config.json` and spsjax's `TransformerConfig`, both ways.

`config_from_hf` maps a Llama-family (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 1-3), GPT-2 or
GPT-NeoX config to ours, refusing by name every field whose value would make a different model
than ours computes (rope scalings other than linear, Llama 3's, YaRN and LongRoPE within its
original length; attention other than full or sliding; biases we do not have; other
activations), with transformers' defaults and its placement of sliding windows. `hf_config` is
the other way for a `model_type` (`save_type` picks the plainest that has a model's options): it
refuses a type whose JSON would not read back through `config_from_hf` as exactly the model.

Invariant: `config_from_hf(hf_config(config, t)) == config` (compute fields aside) for every
config `hf_config` accepts.
"""

import dataclasses
import json
import math

from spsjax import storage
from spsjax.models.config import COMPUTE_FIELDS, RopeScaling, TransformerConfig

CONFIG = 'config.json'
GEMMA_TYPES = ('gemma', 'gemma2', 'gemma3_text')
LLAMA_TYPES = ('llama', 'mistral', 'qwen2', 'qwen3', 'phi3') + GEMMA_TYPES
MODEL_TYPES = LLAMA_TYPES + ('gpt2', 'gpt_neox')


class UnsupportedCheckpoint(ValueError):
  """A checkpoint whose config asks for something this transformer does not compute."""


def read_config(path: str) -> dict:
  file = storage.path(path) / CONFIG
  if not file.is_file():
    raise FileNotFoundError(f'{path} is not a Hugging Face checkpoint directory: no {CONFIG}.')
  return json.loads(file.read_text(encoding='utf-8'))


def _refuse(hf: dict, field: str, allowed, why: str) -> None:
  value = hf.get(field)
  if value not in allowed:
    raise UnsupportedCheckpoint(f'{CONFIG}: {field}={value!r} is not supported ({why}); '
                                f'supported: {allowed}.')


# rope_type -> the RopeScaling fields it needs from config.json, by their names there.
_ROPE_SCALING_FIELDS = {
    'linear': dict(factor='factor'),
    'llama3': dict(factor='factor', low_freq_factor='low_freq_factor',
                   high_freq_factor='high_freq_factor',
                   original_max_len='original_max_position_embeddings'),
    'yarn': dict(factor='factor', original_max_len='original_max_position_embeddings',
                 beta_fast='beta_fast', beta_slow='beta_slow', attention_factor='attention_factor',
                 truncate='truncate'),
    'longrope': dict(factor='factor', original_max_len='original_max_position_embeddings',
                     attention_factor='attention_factor', short_factor='short_factor',
                     long_factor='long_factor'),
}
# Fields a scaling may leave out (transformers' defaults: RopeScaling's).
_ROPE_SCALING_OPTIONAL = ('beta_fast', 'beta_slow', 'attention_factor', 'truncate',
                          'long_factor')


def _local_rope_base(hf: dict) -> float | None:
  """The sliding layers' own rotary base (Gemma 3: `rope_local_base_freq`, or transformers 5's
  `rope_parameters['sliding_attention']`, which must be unscaled), None where they have none."""
  params = hf.get('rope_parameters') or {}
  local = params.get('sliding_attention')
  if isinstance(local, dict):
    if local.get('rope_type', local.get('type', 'default')) != 'default':
      raise UnsupportedCheckpoint(f'{CONFIG}: scaled rope parameters of the sliding layers '
                                  f'({local}) are not supported.')
    return float(local.get('rope_theta', 10_000.0))
  base = hf.get('rope_local_base_freq', 10_000.0 if hf.get('model_type') == 'gemma3_text'
                else None)
  return None if base is None else float(base)


def _rope(hf: dict) -> tuple[float, RopeScaling | None]:
  """The rotary base and scaling, from `rope_theta` and `rope_scaling` (Llama 3.1 and 3.2 on the
  Hub) or from `rope_parameters` (transformers 5 writes that; per layer type, the global layers'
  `full_attention` entry: the sliding ones' is `_local_rope_base`); as in transformers, llama3's
  `original_max_position_embeddings` is the config's own where it has one, then the scaling's,
  then `max_position_embeddings`. 'longrope' (Phi-3's old 'su' and 'yarn' too) is read for
  positions up to the original length (`config_from_hf` caps max_seq_len there). Other scalings
  ('dynamic' changes with the length), parameters of other layer types and partial rotations
  (but Phi-3's) are refused."""
  params = hf.get('rope_parameters') or {}
  if any(isinstance(value, dict) for value in params.values()):
    if set(params) - {'full_attention', 'sliding_attention'}:
      raise UnsupportedCheckpoint(f'{CONFIG}: rope_parameters per layer type '
                                  f'({sorted(params)}) are not supported (full_attention and '
                                  f'sliding_attention are).')
    params = params.get('full_attention') or {}
  scaling = params if params.get('rope_type', params.get('type', 'default')) != 'default' else (
      hf.get('rope_scaling') or {})
  kind = scaling.get('rope_type', scaling.get('type', 'default'))
  if hf.get('model_type') == 'phi3' and kind in ('su', 'yarn'):
    kind = 'longrope'  # transformers reads Phi-3's old names so.
  if kind not in ('default',) + tuple(_ROPE_SCALING_FIELDS):
    raise UnsupportedCheckpoint(f'{CONFIG}: rope scaling of type {kind!r} is not supported '
                                f'(supported: default, {", ".join(_ROPE_SCALING_FIELDS)}).')
  for where in (hf, params):
    if where.get('partial_rotary_factor', 1.0) != 1.0 and hf.get('model_type') != 'phi3':
      raise UnsupportedCheckpoint(f'{CONFIG}: partial_rotary_factor='
                                  f'{where["partial_rotary_factor"]!r} is not supported (every '
                                  f'head dim is rotated).')
  default = 1_000_000.0 if hf.get('model_type') == 'gemma3_text' else 10_000.0
  base = float(params.get('rope_theta', hf.get('rope_theta', default)))
  if kind == 'default':
    return base, None
  original = 'original_max_position_embeddings'
  scaling = dict(scaling, **{original: hf.get(original, scaling.get(
      original, hf.get('max_position_embeddings')))})
  if kind in ('yarn', 'longrope'):
    scaling = _resolved_scaling(hf, scaling)
  missing = [theirs for theirs in _ROPE_SCALING_FIELDS[kind].values()
             if scaling.get(theirs) is None and theirs not in _ROPE_SCALING_OPTIONAL]
  if missing:
    raise UnsupportedCheckpoint(f'{CONFIG}: {kind} rope scaling without {missing}.')
  return base, RopeScaling(kind, **{ours: scaling[theirs]
                                    for ours, theirs in _ROPE_SCALING_FIELDS[kind].items()
                                    if scaling.get(theirs) is not None})


def _resolved_scaling(hf: dict, scaling: dict) -> dict:
  """YaRN's and LongRoPE's fields as transformers resolves them: no factor means
  max_position_embeddings / original_max_position_embeddings; no attention_factor with mscale and
  mscale_all_dim (DeepSeek's) means their ratio of 0.1 m ln(factor) + 1."""
  scaling = dict(scaling)
  original = scaling['original_max_position_embeddings']
  if scaling.get('factor') is None and original:  # YaRN's and LongRoPE's.
    scaling['factor'] = hf['max_position_embeddings'] / original
  factor, mscale, mscale_all = (scaling.get(k) for k in ('factor', 'mscale', 'mscale_all_dim'))
  if scaling.get('attention_factor') is None and mscale and mscale_all and factor:
    m = lambda m: 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0
    scaling['attention_factor'] = m(mscale) / m(mscale_all)
  return scaling


def _rope_scaling_json(scaling: RopeScaling | None) -> dict:
  """config.json's `rope_scaling` of a RopeScaling (transformers' names), {} for none."""
  if scaling is None:
    return {}
  fields = _ROPE_SCALING_FIELDS[scaling.kind]
  return dict(rope_scaling=dict(rope_type=scaling.kind, **{
      theirs: getattr(scaling, ours) for ours, theirs in fields.items()
      if getattr(scaling, ours) is not None}))


def _layer_kinds(hf: dict, model_type: str) -> tuple[int | None, tuple[int, ...]]:
  """(the sliding window, the layers that attend globally), as transformers places them: none for
  Llama and Gemma 1, every layer for Mistral and Phi-3; for Qwen (with `use_sliding_window`),
  Gemma 2 and 3 the layers `layer_types` name (transformers 5 writes them), else the layers from
  `max_window_layers` on (Qwen), every other one from the first (Gemma 2), all but every
  `sliding_window_pattern`-th (Gemma 3)."""
  if model_type in ('llama', 'gemma'):
    return None, ()  # transformers' Llama and Gemma attend globally whatever the config says.
  window = hf.get('sliding_window', 4096 if model_type in ('gemma2', 'gemma3_text') else None)
  L = hf['num_hidden_layers']
  # transformers' Mistral and Phi-3 slide on every layer, whatever layer_types say.
  kinds = None if model_type in ('mistral', 'phi3') else hf.get('layer_types')
  if model_type in ('qwen2', 'qwen3') and not hf.get('use_sliding_window'):
    window = None  # Qwen's window applies only with use_sliding_window.
  if kinds is None and window is not None:
    sliding = {
        'gemma2': lambda i: i % 2 == 0,
        'gemma3_text': lambda i: (i + 1) % hf.get('sliding_window_pattern', 6) != 0,
        'qwen2': lambda i: i >= hf.get('max_window_layers', 0),
        'qwen3': lambda i: i >= hf.get('max_window_layers', 0),
    }.get(model_type, lambda i: True)
    kinds = ['sliding_attention' if sliding(i) else 'full_attention' for i in range(L)]
  kinds = list(kinds or ['full_attention'] * L)
  if set(kinds) - {'full_attention', 'sliding_attention'} or len(kinds) != L or (
      'sliding_attention' in kinds and window is None):
    raise UnsupportedCheckpoint(f'{CONFIG}: layer_types={sorted(set(kinds))} for {L} layers is '
                                f'not supported (full attention, or sliding attention with a '
                                f'sliding_window).')
  if 'sliding_attention' not in kinds:
    return None, ()
  return int(window), tuple(i for i, kind in enumerate(kinds) if kind == 'full_attention')


def config_from_hf(hf: dict, dtype: str = 'float32') -> TransformerConfig:
  """Our config for a Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma (1, 2, 3's text models) or GPT-2
  `config.json` (a dict). Sliding windows are the model's, on its layers (`_layer_kinds`)."""
  model_type = hf.get('model_type')
  if model_type == 'gemma3':
    raise UnsupportedCheckpoint(f'{CONFIG}: model_type=\'gemma3\' is Gemma 3\'s image and text '
                                f'model; its text-only checkpoints (gemma3_text: Gemma 3 1B, '
                                f'Gemma3ForCausalLM) are supported.')
  if model_type not in MODEL_TYPES:
    raise UnsupportedCheckpoint(f'{CONFIG}: model_type={model_type!r} is not supported; '
                                f'supported: {list(MODEL_TYPES)}.')
  if model_type == 'gpt2':
    return _gpt2_config(hf, dtype)
  if model_type == 'gpt_neox':
    return _neox_config(hf, dtype)
  gemma = model_type in GEMMA_TYPES
  if gemma:  # transformers reads Gemma's legacy 'gelu' as the tanh form too.
    _refuse(dict(hidden_act=hf.get('hidden_activation') or hf.get('hidden_act')), 'hidden_act',
            ('gelu', 'gelu_pytorch_tanh'), "Gemma's gated MLP is GELU's tanh form")
  else:
    _refuse(hf, 'hidden_act', ('silu',), 'the gated MLP is SiLU-gated')
  _refuse(hf, 'mlp_bias', (None, False), 'the MLP has no biases')
  _refuse(hf, 'attention_bias', (None, False), 'q/k/v biases only come with Qwen2, o_proj has none')
  window, global_layers = _layer_kinds(hf, model_type)
  rope_base, rope_scaling = _rope(hf)
  local_rope_base = _local_rope_base(hf) if window is not None else None
  num_heads = hf['num_attention_heads']
  num_kv_heads = hf.get('num_key_value_heads') or num_heads
  head_dim = hf.get('head_dim')
  if head_dim == hf['hidden_size'] // num_heads:
    head_dim = None
  dims_per_head = head_dim or hf['hidden_size'] // num_heads
  max_seq_len = hf['max_position_embeddings']
  if rope_scaling is not None and rope_scaling.kind == 'longrope':  # Its short factors' range.
    max_seq_len = min(max_seq_len, rope_scaling.original_max_len)
  partial = (hf.get('rope_parameters') or {}).get('partial_rotary_factor',
                                                  hf.get('partial_rotary_factor', 1.0))
  rope_dims = int(dims_per_head * partial) if partial != 1.0 else None
  query_scalar, caps = None, {}
  if model_type in ('gemma2', 'gemma3_text'):  # transformers' defaults where a field is absent.
    _refuse(hf, 'use_bidirectional_attention', (None, False), 'attention is causal')
    query_scalar = hf.get('query_pre_attn_scalar', 256)
    defaults = (50.0, 30.0) if model_type == 'gemma2' else (None, None)
    caps = {ours: hf.get(theirs, default) for ours, theirs, default in zip(
        ('attn_softcap', 'logit_softcap'),
        ('attn_logit_softcapping', 'final_logit_softcapping'), defaults)}
    caps = {ours: None if cap is None else float(cap) for ours, cap in caps.items()}
  return TransformerConfig(
      vocab_size=hf['vocab_size'], d_model=hf['hidden_size'], num_layers=hf['num_hidden_layers'],
      num_heads=num_heads, num_kv_heads=None if num_kv_heads == num_heads else num_kv_heads,
      d_ff=hf['intermediate_size'], max_seq_len=max_seq_len, dtype=dtype,
      head_dim=head_dim, mlp='gated_gelu' if gemma else 'gated_silu', rope_dims=rope_dims,
      tie_embeddings=bool(hf.get('tie_word_embeddings', gemma)),
      rope_base=rope_base, rope_scaling=rope_scaling, norm_eps=float(hf['rms_norm_eps']),
      qkv_bias=model_type == 'qwen2', qk_norm=model_type in ('qwen3', 'gemma3_text'),
      embed_scale=gemma, sliding_window=window, global_layers=global_layers,
      local_rope_base=local_rope_base,
      query_scale=(None if query_scalar is None or query_scalar == dims_per_head
                   else float(query_scalar)**-0.5),
      post_norms=model_type in ('gemma2', 'gemma3_text'), **caps)


def _gpt2_config(hf: dict, dtype: str) -> TransformerConfig:
  _refuse(hf, 'activation_function', ('gelu_new', 'gelu_pytorch_tanh'),
          'the MLP uses the tanh approximation of GELU')
  _refuse(hf, 'scale_attn_weights', (None, True), 'attention scores are scaled by 1/sqrt(head dim)')
  _refuse(hf, 'scale_attn_by_inverse_layer_idx', (None, False), 'no per-layer score scaling')
  _refuse(hf, 'add_cross_attention', (None, False), 'a decoder-only model has no cross-attention')
  d_model = hf['n_embd']
  return TransformerConfig(
      vocab_size=hf['vocab_size'], d_model=d_model, num_layers=hf['n_layer'],
      num_heads=hf['n_head'], d_ff=hf.get('n_inner') or 4 * d_model,
      max_seq_len=hf['n_positions'], dtype=dtype, mlp='gelu',
      tie_embeddings=bool(hf.get('tie_word_embeddings', True)),
      norm_eps=float(hf.get('layer_norm_epsilon', 1e-5)), qkv_bias=True, dense_bias=True,
      norm='layer', position='learned')


def _neox_config(hf: dict, dtype: str) -> TransformerConfig:
  """GPT-NeoX (Pythia): LayerNorm, biases everywhere, GELU (erf, or its tanh form), a rotation of
  the first `rotary_pct` / `partial_rotary_factor` of each head's dims (transformers' default a
  quarter), attention and MLP in parallel (`use_parallel_residual`, default on)."""
  _refuse(hf, 'hidden_act', ('gelu', 'gelu_new', 'gelu_pytorch_tanh'),
          "GPT-NeoX's MLP is GELU (erf) or its tanh form")
  _refuse(hf, 'attention_bias', (None, True), 'GPT-NeoX has biases on every product')
  params = hf.get('rope_parameters') or {}
  kind = params.get('rope_type', params.get('type', 'default'))
  if kind != 'default' or hf.get('rope_scaling'):
    raise UnsupportedCheckpoint(f'{CONFIG}: rope scaling of a GPT-NeoX model ({kind!r}, '
                                f'{hf.get("rope_scaling")}) is not supported.')
  d_model, num_heads = hf['hidden_size'], hf['num_attention_heads']
  head_dim = d_model // num_heads
  rotated = int(head_dim * params.get('partial_rotary_factor', hf.get('rotary_pct', 0.25)))
  return TransformerConfig(
      vocab_size=hf['vocab_size'], d_model=d_model, num_layers=hf['num_hidden_layers'],
      num_heads=num_heads, d_ff=hf['intermediate_size'],
      max_seq_len=hf['max_position_embeddings'], dtype=dtype,
      mlp='gelu_exact' if hf.get('hidden_act', 'gelu') == 'gelu' else 'gelu',
      tie_embeddings=bool(hf.get('tie_word_embeddings', False)),
      rope_base=float(params.get('rope_theta', hf.get('rotary_emb_base', 10_000.0))),
      norm_eps=float(hf.get('layer_norm_eps', 1e-5)), qkv_bias=True, dense_bias=True,
      norm='layer', rope_dims=None if rotated == head_dim else rotated,
      parallel_residual=bool(hf.get('use_parallel_residual', True)))


# model_type -> its architecture, for the types `save` writes.
SAVE_TYPES = {'llama': 'LlamaForCausalLM', 'mistral': 'MistralForCausalLM',
              'qwen2': 'Qwen2ForCausalLM', 'qwen3': 'Qwen3ForCausalLM', 'phi3': 'Phi3ForCausalLM',
              'gemma': 'GemmaForCausalLM', 'gemma2': 'Gemma2ForCausalLM',
              'gemma3_text': 'Gemma3ForCausalLM', 'gpt2': 'GPT2LMHeadModel',
              'gpt_neox': 'GPTNeoXForCausalLM'}


def save_type(config: TransformerConfig) -> str:
  """The model_type `save` writes a model as where none is asked: the plainest that has its
  options (Llama without any)."""
  if config.position == 'learned':
    return 'gpt2'
  if config.norm == 'layer' or config.parallel_residual:
    return 'gpt_neox'
  if config.rope_dims is not None or (config.rope_scaling is not None
                                      and config.rope_scaling.kind == 'longrope'):
    return 'phi3'
  if config.post_norms:
    return 'gemma3_text' if config.qk_norm or config.local_rope_base is not None else 'gemma2'
  if config.embed_scale or config.mlp == 'gated_gelu':
    return 'gemma'
  if config.qk_norm:
    return 'qwen3'
  if config.qkv_bias:
    return 'qwen2'
  return 'mistral' if config.sliding_window is not None else 'llama'


def _rope_json(config: TransformerConfig, model_type: str) -> dict:
  """config.json's rotary fields: rope_theta and rope_scaling (as the Hub writes them), or for
  Gemma 3 transformers' rope_parameters per layer type."""
  if model_type != 'gemma3_text':
    return dict(rope_theta=config.rope_base, **_rope_scaling_json(config.rope_scaling))
  full = dict(rope_type='default', rope_theta=config.rope_base)
  if config.rope_scaling is not None:
    full.update(_rope_scaling_json(config.rope_scaling)['rope_scaling'])
  local = config.rope_base if config.local_rope_base is None else config.local_rope_base
  return dict(rope_parameters=dict(full_attention=full, sliding_attention=dict(
      rope_type='default', rope_theta=local)))


def hf_config(config: TransformerConfig, model_type: str = 'llama', **extra) -> dict:
  """The config.json of a model as `model_type` (one of SAVE_TYPES); `extra` adds fields such as
  token ids. Raises UnsupportedCheckpoint where that type cannot express the model: the JSON
  must read back (`config_from_hf`, which follows transformers) as exactly this config."""
  if model_type not in SAVE_TYPES:
    raise UnsupportedCheckpoint(f'save writes model_type one of {sorted(SAVE_TYPES)}, not '
                                f'{model_type!r}.')
  gemma = model_type in GEMMA_TYPES
  if model_type in ('gpt2', 'gpt_neox'):
    hf = _gpt_config_json(config, model_type)
  else:
    hf = _llama_config_json(config, model_type, gemma)
  hf.update(extra)
  try:
    back = config_from_hf(hf, config.dtype)
  except UnsupportedCheckpoint as error:
    raise UnsupportedCheckpoint(f'model_type {model_type!r} cannot express this model: '
                                f'{error}') from error
  differ = [f'{field.name}={getattr(config, field.name)!r} (read back: '
            f'{getattr(back, field.name)!r})' for field in dataclasses.fields(config)
            if field.name not in COMPUTE_FIELDS
            and getattr(config, field.name) != getattr(back, field.name)]
  if differ:
    raise UnsupportedCheckpoint(f'model_type {model_type!r} cannot express this model: '
                                f'{", ".join(differ)}.')
  return hf


def _gpt_config_json(config: TransformerConfig, model_type: str) -> dict:
  """GPT-2's or GPT-NeoX's config.json fields for a model (`hf_config` checks they read back)."""
  common = dict(architectures=[SAVE_TYPES[model_type]], model_type=model_type,
                vocab_size=config.vocab_size, tie_word_embeddings=config.tie_embeddings,
                torch_dtype='float32')
  if model_type == 'gpt2':
    return dict(common, n_embd=config.d_model, n_layer=config.num_layers,
                n_head=config.num_heads, n_inner=config.ff_dim, n_positions=config.max_seq_len,
                layer_norm_epsilon=config.norm_eps, activation_function='gelu_new')
  return dict(common, hidden_size=config.d_model, num_hidden_layers=config.num_layers,
              num_attention_heads=config.num_heads, intermediate_size=config.ff_dim,
              max_position_embeddings=config.max_seq_len, layer_norm_eps=config.norm_eps,
              hidden_act='gelu' if config.mlp == 'gelu_exact' else 'gelu_new',
              rotary_pct=config.rotary_dims / config.dims_per_head,
              rotary_emb_base=config.rope_base, use_parallel_residual=config.parallel_residual,
              attention_bias=True)


def _llama_config_json(config: TransformerConfig, model_type: str, gemma: bool) -> dict:
  """A Llama-family config.json's fields for a model (`hf_config` checks they read back)."""
  hf = dict(
      architectures=[SAVE_TYPES[model_type]], model_type=model_type,
      vocab_size=config.vocab_size, hidden_size=config.d_model,
      intermediate_size=config.ff_dim, num_hidden_layers=config.num_layers,
      num_attention_heads=config.num_heads, num_key_value_heads=config.kv_heads,
      head_dim=config.dims_per_head, max_position_embeddings=config.max_seq_len,
      rms_norm_eps=config.norm_eps, **_rope_json(config, model_type),
      tie_word_embeddings=config.tie_embeddings, torch_dtype='float32')
  hf.update(dict(hidden_activation='gelu_pytorch_tanh') if gemma else dict(hidden_act='silu'))
  if model_type in ('llama', 'gemma'):
    hf.update(attention_bias=False, mlp_bias=False)
  if model_type not in ('llama', 'gemma'):
    hf.update(sliding_window=config.sliding_window)
  if model_type not in ('llama', 'gemma', 'mistral', 'phi3'):
    hf.update(layer_types=['full_attention' if config.window(i) is None else 'sliding_attention'
                           for i in range(config.num_layers)])
  if model_type in ('qwen2', 'qwen3'):
    hf.update(use_sliding_window=config.sliding_window is not None, max_window_layers=0)
  if model_type in ('gemma2', 'gemma3_text'):
    hf.update(query_pre_attn_scalar=(config.dims_per_head if config.query_scale is None
                                     else round(config.query_scale**-2)),  # An int there.
              attn_logit_softcapping=config.attn_softcap,
              final_logit_softcapping=config.logit_softcap)
  if model_type == 'phi3':
    hf.update(partial_rotary_factor=config.rotary_dims / config.dims_per_head)
    if config.rope_scaling is not None and config.rope_scaling.kind == 'longrope':
      hf.update(original_max_position_embeddings=config.rope_scaling.original_max_len)
  return hf
