"""Hugging Face checkpoints: tiny random Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma (1, 2, 3),
GPT-2 and GPT-NeoX models that transformers saved (with rope scalings, sliding windows) load into
spsjax and compute transformers' logits (full and cached paths, packed for the CPU kernels and
sharded),
greedy ArS and SpS give transformers' greedy `generate`, unsupported configs are refused by name,
and an exported model (with Llama 3's rope scaling) is what transformers computed from the same
export.

The expected values were recorded by tests/fixtures/make_hf_fixtures.py with transformers (see
its docstring for why they are fixtures).
"""

import dataclasses
import functools
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spsjax import models, sharding
from spsjax.models import hf, hf_files, presets, rope
from spsjax.sampling import SamplingConfig, autoregressive_sample, drafters, speculative_sample
from tests.fixtures import make_hf_fixtures as fixtures

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'fixtures', 'hf')
NAMES = list(fixtures.MODELS)
GREEDY = SamplingConfig(temperature=0.0)
RTOL = 1e-4  # Relative to the largest logit of the row.

_logits = jax.jit(models.logits, static_argnums=0)
_prefill = jax.jit(models.prefill, static_argnums=0, static_argnames=('capacity',))
_extend = jax.jit(models.extend, static_argnums=0)


def _expected(name):
  return dict(np.load(os.path.join(FIXTURES, name, 'expected.npz')))


def _check_logits(got_BxPxV, want, what):
  for b, n in enumerate(want['lengths']):
    expected = want['logits'][b, :n]
    np.testing.assert_allclose(np.asarray(got_BxPxV[b, :n]), expected, rtol=0,
                               atol=RTOL * np.abs(expected).max(), err_msg=f'{what}, row {b}')


def _worst_row_error(got_BxPxV, want) -> float:
  """The largest error of logits against a fixture's, relative to each row's largest logit."""
  return max(np.abs(got_BxPxV[b, :n] - want['logits'][b, :n]).max()
             / np.abs(want['logits'][b, :n]).max() for b, n in enumerate(want['lengths']))


@pytest.fixture(scope='module')
def loaded():
  return {name: hf.load(os.path.join(FIXTURES, name)) for name in NAMES}


def test_configs_map_every_field(loaded):
  gqa, mqa, qwen, mistral, gpt2, llama3, linear = (loaded[n].config for n in (
      'llama_gqa', 'llama_tied_mqa', 'qwen2', 'mistral', 'gpt2', 'llama_rope_llama3',
      'mistral_rope_linear'))
  assert gqa.rope_scaling is None and gpt2.rope_scaling is None
  assert llama3.rope_scaling == models.RopeScaling('llama3', factor=8.0, low_freq_factor=1.0,
                                                   high_freq_factor=4.0, original_max_len=64)
  assert llama3.rope_base == 500_000.0 and linear.rope_scaling == models.RopeScaling('linear', 4.0)
  qwen3 = loaded['qwen3'].config
  assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.dims_per_head == 16 and not qwen.qk_norm
  assert loaded['qwen3'].params['layer_1']['attn']['k_norm'].shape == (16,)
  phi3 = loaded['phi3'].config
  assert (phi3.max_seq_len, phi3.sliding_window, phi3.global_layers) == (64, 32, ())
  assert not phi3.tie_embeddings
  assert loaded['mistral_window'].config.sliding_window == 4 and mistral.sliding_window is None
  gemma2, gemma3 = loaded['gemma2'].config, loaded['gemma3'].config
  assert (gemma2.sliding_window, gemma2.global_layers, gemma2.attn_softcap, gemma2.logit_softcap,
          gemma2.query_scale, gemma2.post_norms, gemma2.qk_norm) == (5, (1,), 2.0, 8.0, 0.5, True,
                                                                    False)
  assert (gemma3.sliding_window, gemma3.global_layers, gemma3.local_rope_base, gemma3.rope_base,
          gemma3.rope_scaling, gemma3.query_scale, gemma3.attn_softcap, gemma3.qk_norm) == (
              4, (2,), 100.0, 50_000.0, models.RopeScaling('linear', 2.0), None, None, True)
  stored = dict(hf_files.read_tensors(os.path.join(FIXTURES, 'gemma2')))
  layer = loaded['gemma2'].params['layer_1']
  for theirs, ours in (('post_attention_layernorm', 'attn_post_norm'),
                       ('pre_feedforward_layernorm', 'mlp_norm'),
                       ('post_feedforward_layernorm', 'mlp_post_norm')):
    np.testing.assert_array_equal(layer[ours]['scale'],
                                  1 + stored[f'model.layers.1.{theirs}.weight'])
  gemma = loaded['gemma'].config
  assert (gemma.mlp, gemma.embed_scale, gemma.tie_embeddings, gemma.kv_heads) == (
      'gated_gelu', True, True, 1)
  stored = hf_files.read_tensors(os.path.join(FIXTURES, 'gemma'))
  norm = dict(stored)['model.layers.0.input_layernorm.weight']
  np.testing.assert_array_equal(loaded['gemma'].params['layer_0']['attn_norm']['scale'], 1 + norm)
  assert (gqa.num_kv_heads, gqa.tie_embeddings, gqa.rope_base, gqa.norm_eps) == (
      2, False, 500_000.0, 1e-5)
  assert (mqa.num_kv_heads, mqa.dims_per_head, mqa.tie_embeddings) == (1, 16, True)
  assert mqa.head_dim == 16 and mqa.d_model == 48  # 48 / 4 heads would be 12.
  assert qwen.qkv_bias and qwen.rope_base == 1e6 and qwen.tie_embeddings
  assert (mistral.num_kv_heads, mistral.tie_embeddings, mistral.qkv_bias) == (2, False, False)
  assert 'head' not in loaded['qwen2'].params and 'head' in loaded['llama_gqa'].params
  assert (gpt2.norm, gpt2.position, gpt2.mlp, gpt2.qkv_bias, gpt2.dense_bias) == (
      'layer', 'learned', 'gelu', True, True)
  assert gpt2.ff_dim == 4 * 48 and gpt2.norm_eps == 1e-5 and gpt2.tie_embeddings
  assert loaded['gpt2'].params['position_embedding'].shape == (64, 48)
  neox = loaded['gpt_neox'].config
  assert (neox.norm, neox.mlp, neox.rope_dims, neox.rotary_dims, neox.parallel_residual,
          neox.rope_base, neox.qkv_bias, neox.dense_bias, neox.tie_embeddings) == (
              'layer', 'gelu_exact', 4, 4, True, 500.0, True, True, False)


@pytest.mark.parametrize('name', NAMES)
def test_logits_equal_transformers_full_cached_and_packed(loaded, name):
  """Packed for the CPU kernels (`models.for_decoding`) too."""
  model, want = loaded[name], _expected(name)
  prompts, lengths = jnp.asarray(want['prompts']), jnp.asarray(want['lengths'])
  _check_logits(_logits(model.config, model.params, prompts), want, f'{name} full forward')
  for placed in (model, models.for_decoding(model)):
    # Cached: the first 3 positions (or fewer) by prefill, the rest one extend per position.
    first = jnp.minimum(lengths, 3)
    out_BxPxV, cache = _prefill(placed.config, placed.params, prompts, first, capacity=16)
    got = np.array(out_BxPxV)
    for t in range(3, prompts.shape[1]):
      step_Bx1xV, cache = _extend(placed.config, placed.params,
                                  cache.with_lengths(jnp.full_like(lengths, t)),
                                  prompts[:, t:t + 1])
      got[:, t] = np.asarray(step_Bx1xV[:, 0])
    _check_logits(got, want, f'{name} cached, packed={models.is_packed(placed)}')


@pytest.mark.parametrize('name,draft', [('llama_gqa', 'llama_tied_mqa'), ('qwen2', 'llama_gqa'),
                                        ('mistral', 'gpt2'), ('gpt2', None),
                                        ('llama_rope_llama3', 'mistral_rope_linear'),
                                        ('qwen3', 'qwen2'), ('phi3', 'mistral'),
                                        ('gemma', 'qwen3'), ('mistral_window', 'gemma3'),
                                        ('gemma2', 'mistral_window'), ('gemma3', 'gemma2'),
                                        ('gpt_neox', 'gpt2'), ('qwen2_yarn', 'qwen2'),
                                        ('phi3_longrope', 'llama_gqa')])
def test_greedy_ars_and_sps_equal_transformers_generate(loaded, name, draft):
  model, want = loaded[name], _expected(name)
  assert want['margin'] >= fixtures.MIN_MARGIN  # No argmax is closer than float noise.
  args = (want['prompts'], want['lengths'], jax.random.key(0))
  kw = dict(max_new_tokens=fixtures.NEW, sampling=GREEDY)
  ars = autoregressive_sample(models.for_decoding(model), *args, **kw)
  np.testing.assert_array_equal(np.asarray(ars.tokens), want['greedy'], err_msg=f'{name} ArS')
  if draft is None:
    sps = speculative_sample(model, None, *args, k=3, drafter=drafters.PromptLookup(), **kw)
  else:
    sps = speculative_sample(model, loaded[draft], *args, k=3, **kw)
  np.testing.assert_array_equal(np.asarray(sps.tokens), want['greedy'], err_msg=f'{name} SpS')


def test_loads_sharded_on_a_mesh_by_the_rules():
  mesh = sharding.make_mesh(data=4, model=2)
  model = hf.load(os.path.join(FIXTURES, 'qwen2'), mesh=mesh)
  wq = model.params['layer_0']['attn']['wq']
  bq = model.params['layer_0']['attn']['bq']
  assert wq.sharding.spec == jax.sharding.PartitionSpec(None, 'model', None)
  assert bq.sharding.spec == jax.sharding.PartitionSpec('model', None)
  want = _expected('qwen2')
  _check_logits(_logits(model.config, model.params, jnp.asarray(want['prompts'])), want,
                'qwen2 on a 4x2 mesh')


def _copy_with(tmp_path, name, **changes):
  """A copy of fixture `name` whose config.json has `changes` (None deletes a field)."""
  path = tmp_path / name
  shutil.copytree(os.path.join(FIXTURES, name), path)
  config = json.loads((path / 'config.json').read_text())
  for key, value in changes.items():
    if value is None:
      config.pop(key, None)
    else:
      config[key] = value
  (path / 'config.json').write_text(json.dumps(config))
  return str(path)


@pytest.mark.parametrize('name,changes,message', [
    ('llama_tied_mqa', dict(rope_parameters={'rope_type': 'dynamic', 'factor': 2.0}),
     "rope scaling of type 'dynamic' is not supported"),
    ('llama_tied_mqa', dict(rope_scaling={'type': 'longrope', 'factor': 4.0}),
     "longrope rope scaling without ['short_factor']"),
    ('llama_rope_llama3', dict(rope_parameters={'rope_type': 'llama3', 'factor': 8.0}),
     "llama3 rope scaling without ['low_freq_factor', 'high_freq_factor']"),
    ('llama_tied_mqa', dict(partial_rotary_factor=0.5), 'partial_rotary_factor=0.5'),
    ('llama_tied_mqa', dict(rope_parameters={'chunked_attention': {'rope_type': 'default'}}),
     'rope_parameters per layer type'),
    ('gemma3', dict(rope_parameters={'full_attention': {'rope_type': 'default'},
                                     'sliding_attention': {'rope_type': 'linear', 'factor': 2.0}}),
     'scaled rope parameters of the sliding layers'),
    ('gemma3', dict(model_type='gemma3'), "Gemma 3's image and text model"),
    ('gemma3', dict(use_bidirectional_attention=True), 'use_bidirectional_attention=True'),
    ('gemma2', dict(layer_types=['sliding_attention', 'full_attention']),
     'for 3 layers is not supported'),
    ('qwen2', dict(layer_types=['full_attention', 'chunked_attention']),
     "layer_types=['chunked_attention', 'full_attention'] for 2 layers is not supported"),
    ('qwen3', dict(layer_types=['full_attention', 'sliding_attention']),
     "layer_types=['full_attention', 'sliding_attention'] for 2 layers is not supported"),
    ('phi3', dict(num_key_value_heads=4), 'self_attn.qkv_proj.weight has shape (96, 48)'),
    ('gemma', dict(hidden_act='relu'), "hidden_act='relu' is not supported"),
    ('llama_tied_mqa', dict(hidden_act='gelu'), "hidden_act='gelu' is not supported"),
    ('llama_tied_mqa', dict(attention_bias=True), 'attention_bias=True is not supported'),
    ('llama_tied_mqa', dict(model_type='falcon'), "model_type='falcon' is not supported"),
    ('llama_tied_mqa', dict(num_key_value_heads=2), 'has shape (16, 48), which does not give'),
    ('llama_gqa', dict(num_hidden_layers=3), "missing tensors ['model.layers.2."),
    ('gpt2', dict(activation_function='gelu'), "activation_function='gelu' is not supported"),
    ('gpt2', dict(scale_attn_by_inverse_layer_idx=True),
     'scale_attn_by_inverse_layer_idx=True is not supported'),
    ('gpt2', dict(n_inner=64), 'tensor transformer.h.0.mlp.c_fc.'),
    ('gpt_neox', dict(rope_parameters={'rope_type': 'linear', 'factor': 2.0}),
     "rope scaling of a GPT-NeoX model ('linear'"),
    ('gpt_neox', dict(hidden_act='relu'), "hidden_act='relu' is not supported"),
    ('gpt_neox', dict(intermediate_size=64), 'which does not give layer_0/mlp/w_'),
])
def test_unsupported_or_inconsistent_checkpoints_are_refused_by_name(tmp_path, name, changes,
                                                                     message):
  with pytest.raises(hf.UnsupportedCheckpoint) as error:
    hf.load(_copy_with(tmp_path, name, **changes))
  assert message in str(error.value)


def test_rope_scaling_reads_the_hubs_format_and_changes_the_logits(tmp_path, loaded):
  """Llama 3.1 / 3.2 on the Hub write `rope_theta` and `rope_scaling` (the fixture, written by
  transformers 5, has `rope_parameters`): both read as the same model. Without its scaling the
  fixture's logits are far from transformers' (the bands the fixture puts its frequencies in
  matter at these positions)."""
  name = 'llama_rope_llama3'
  params = json.loads(open(os.path.join(FIXTURES, name, 'config.json'), encoding='utf-8').read())[
      'rope_parameters']
  hub = hf.load(_copy_with(tmp_path, name, rope_parameters=None, rope_theta=params['rope_theta'],
                           rope_scaling={k: v for k, v in params.items() if k != 'rope_theta'}))
  assert hub.config == loaded[name].config
  hub_style = dict(hf.read_config(os.path.join(FIXTURES, name)), rope_parameters=None,
                   rope_theta=500_000.0, original_max_position_embeddings=32,
                   rope_scaling=dict(rope_type='llama3', factor=8.0, low_freq_factor=1.0,
                                     high_freq_factor=4.0, original_max_position_embeddings=64))
  assert hf.config_from_hf(hub_style).rope_scaling.original_max_len == 32  # The config's own.
  plain = hf.load(_copy_with(tmp_path / 'plain', name, rope_parameters=dict(
      rope_type='default', rope_theta=params['rope_theta'])))
  assert plain.config.rope_scaling is None
  want = _expected(name)
  got = np.asarray(_logits(plain.config, plain.params, jnp.asarray(want['prompts'])))
  worst = _worst_row_error(got, want)
  assert worst > 100 * RTOL


# Llama-3.2-1B's config.json as the Hub has it (no weights: nothing can be downloaded here).
LLAMA_3_2_1B = {
    'architectures': ['LlamaForCausalLM'], 'attention_bias': False, 'attention_dropout': 0.0,
    'bos_token_id': 128000, 'eos_token_id': 128001, 'head_dim': 64, 'hidden_act': 'silu',
    'hidden_size': 2048, 'initializer_range': 0.02, 'intermediate_size': 8192,
    'max_position_embeddings': 131072, 'mlp_bias': False, 'model_type': 'llama',
    'num_attention_heads': 32, 'num_hidden_layers': 16, 'num_key_value_heads': 8,
    'pretraining_tp': 1, 'rms_norm_eps': 1e-05,
    'rope_scaling': {'factor': 32.0, 'high_freq_factor': 4.0, 'low_freq_factor': 1.0,
                     'original_max_position_embeddings': 8192, 'rope_type': 'llama3'},
    'rope_theta': 500000.0, 'tie_word_embeddings': True, 'torch_dtype': 'bfloat16',
    'use_cache': True, 'vocab_size': 128256}


def test_yarn_reads_as_transformers_resolves_it(loaded):
  """The fixture's YaRN (its defaults filled in), and its attention factor; DeepSeek's mscale
  pair and a missing factor resolved as transformers does. Without its scaling the fixture's
  logits are far from transformers' (so the fixture's check can fail)."""
  config = loaded['qwen2_yarn'].config
  assert config.rope_scaling == models.RopeScaling('yarn', 4.0, original_max_len=64)
  assert rope.attention_factor(config) == pytest.approx(0.1 * np.log(4.0) + 1)
  hub = dict(hf.read_config(os.path.join(FIXTURES, 'qwen2_yarn')), rope_parameters=None,
             rope_theta=500.0, rope_scaling=dict(type='yarn', original_max_position_embeddings=32,
                                                 mscale=1.0, mscale_all_dim=0.5, truncate=False))
  scaling = hf.config_from_hf(hub).rope_scaling
  assert (scaling.factor, scaling.original_max_len, scaling.truncate) == (8.0, 32, False)
  assert scaling.attention_factor == pytest.approx((0.1 * np.log(8) + 1) / (0.05 * np.log(8) + 1))
  plain = dataclasses.replace(config, rope_scaling=None)
  want = _expected('qwen2_yarn')
  got = np.asarray(_logits(plain, loaded['qwen2_yarn'].params, jnp.asarray(want['prompts'])))
  worst = _worst_row_error(got, want)
  assert worst > 100 * RTOL


# Phi-3.5-mini-instruct's config.json as the Hub has it, its 48 factors shortened to their range.
PHI_3_5_MINI = {
    'architectures': ['Phi3ForCausalLM'], 'attention_bias': False, 'bos_token_id': 1,
    'eos_token_id': 32000, 'hidden_act': 'silu', 'hidden_size': 3072,
    'intermediate_size': 8192, 'max_position_embeddings': 131072, 'model_type': 'phi3',
    'num_attention_heads': 32, 'num_hidden_layers': 32, 'num_key_value_heads': 32,
    'original_max_position_embeddings': 4096, 'rms_norm_eps': 1e-05,
    'rope_scaling': {'long_factor': [1.08] * 24 + [64.9] * 24,
                     'short_factor': [1.0] * 24 + [1.1] * 24, 'type': 'longrope'},
    'rope_theta': 10000.0, 'sliding_window': 262144, 'tie_word_embeddings': False,
    'torch_dtype': 'bfloat16', 'vocab_size': 32064}


def test_longrope_reads_its_short_factors_up_to_the_original_length(loaded):
  """Within original_max_position_embeddings transformers rotates by the short factors and
  scales queries and keys by sqrt(1 + ln(factor) / ln(original)): the model is capped there.
  Without its scaling the fixture's logits are far from transformers'."""
  config = loaded['phi3_longrope'].config
  assert (config.max_seq_len, config.rope_dims, config.rope_scaling) == (32, 8, models.RopeScaling(
      'longrope', 4.0, original_max_len=32, short_factor=(1.0, 1.5, 3.0, 7.0),
      long_factor=(2.0, 4.0, 8.0, 16.0)))
  assert rope.attention_factor(config) == pytest.approx(np.sqrt(1 + np.log(4) / np.log(32)))
  phi35 = hf.config_from_hf(PHI_3_5_MINI)
  assert (phi35.max_seq_len, phi35.rope_dims, phi35.rope_scaling.factor, phi35.sliding_window,
          phi35.rope_scaling.short_factor[-1]) == (4096, None, 32.0, 262144, 1.1)
  with pytest.raises(ValueError, match='longrope scaling is computed up to'):
    dataclasses.replace(config, max_seq_len=33)
  plain = dataclasses.replace(config, rope_scaling=None)
  want = _expected('phi3_longrope')
  got = np.asarray(_logits(plain, loaded['phi3_longrope'].params, jnp.asarray(want['prompts'])))
  worst = _worst_row_error(got, want)
  assert worst > 100 * RTOL


def test_llama_3_2_1b_is_the_llama1b_preset_with_its_rope_scaling():
  config = hf.config_from_hf(LLAMA_3_2_1B)
  preset = models.TransformerConfig(**presets.get('llama1b'))
  scaling = models.RopeScaling('llama3', 32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                original_max_len=8192)
  assert config == dataclasses.replace(preset, max_seq_len=131072, norm_eps=1e-5,
                                       rope_scaling=scaling)


# Qwen3-0.6B's config.json as the Hub has it.
QWEN3_0_6B = {
    'architectures': ['Qwen3ForCausalLM'], 'attention_bias': False, 'attention_dropout': 0.0,
    'bos_token_id': 151643, 'eos_token_id': 151645, 'head_dim': 128, 'hidden_act': 'silu',
    'hidden_size': 1024, 'initializer_range': 0.02, 'intermediate_size': 3072,
    'max_position_embeddings': 40960, 'max_window_layers': 28, 'model_type': 'qwen3',
    'num_attention_heads': 16, 'num_hidden_layers': 28, 'num_key_value_heads': 8,
    'rms_norm_eps': 1e-06, 'rope_scaling': None, 'rope_theta': 1000000, 'sliding_window': None,
    'tie_word_embeddings': True, 'torch_dtype': 'bfloat16', 'use_cache': True,
    'use_sliding_window': False, 'vocab_size': 151936}


def test_qwen3_0_6b_maps_every_field():
  assert hf.config_from_hf(QWEN3_0_6B, dtype='bfloat16') == models.TransformerConfig(
      vocab_size=151936, d_model=1024, num_layers=28, num_heads=16, num_kv_heads=8, d_ff=3072,
      max_seq_len=40960, dtype='bfloat16', head_dim=128, tie_embeddings=True,
      rope_base=1_000_000.0, norm_eps=1e-6, qk_norm=True)


# Gemma-2-2b's and Gemma-3-1b's config.json as the Hub has them (no layer_types, rope_parameters).
GEMMA_2_2B = {
    'architectures': ['Gemma2ForCausalLM'], 'attention_bias': False, 'attention_dropout': 0.0,
    'attn_logit_softcapping': 50.0, 'bos_token_id': 2, 'cache_implementation': 'hybrid',
    'eos_token_id': [1, 107], 'final_logit_softcapping': 30.0, 'head_dim': 256,
    'hidden_act': 'gelu_pytorch_tanh', 'hidden_activation': 'gelu_pytorch_tanh',
    'hidden_size': 2304, 'initializer_range': 0.02, 'intermediate_size': 9216,
    'max_position_embeddings': 8192, 'model_type': 'gemma2', 'num_attention_heads': 8,
    'num_hidden_layers': 26, 'num_key_value_heads': 4, 'pad_token_id': 0,
    'query_pre_attn_scalar': 256, 'rms_norm_eps': 1e-06, 'rope_theta': 10000.0,
    'sliding_window': 4096, 'torch_dtype': 'float32', 'use_cache': True, 'vocab_size': 256000}
GEMMA_3_1B = {
    'architectures': ['Gemma3ForCausalLM'], 'attention_bias': False, 'attention_dropout': 0.0,
    'attn_logit_softcapping': None, 'bos_token_id': 2, 'cache_implementation': 'hybrid',
    'eos_token_id': [1, 106], 'final_logit_softcapping': None, 'head_dim': 256,
    'hidden_activation': 'gelu_pytorch_tanh', 'hidden_size': 1152, 'initializer_range': 0.02,
    'intermediate_size': 6912, 'max_position_embeddings': 32768, 'model_type': 'gemma3_text',
    'num_attention_heads': 4, 'num_hidden_layers': 26, 'num_key_value_heads': 1,
    'pad_token_id': 0, 'query_pre_attn_scalar': 256, 'rms_norm_eps': 1e-06,
    'rope_local_base_freq': 10000, 'rope_scaling': None, 'rope_theta': 1000000,
    'sliding_window': 512, 'sliding_window_pattern': 6, 'torch_dtype': 'bfloat16',
    'use_cache': True, 'vocab_size': 262144}


def test_gemma_hub_configs_map_every_field():
  """Without layer_types the windows sit where transformers puts them: Gemma 2's on every other
  layer from the first, Gemma 3's on all but every sliding_window_pattern-th."""
  common = dict(mlp='gated_gelu', tie_embeddings=True, embed_scale=True, post_norms=True,
                norm_eps=1e-6, head_dim=256)
  assert hf.config_from_hf(GEMMA_2_2B) == models.TransformerConfig(
      vocab_size=256000, d_model=2304, num_layers=26, num_heads=8, num_kv_heads=4, d_ff=9216,
      max_seq_len=8192, sliding_window=4096, global_layers=tuple(range(1, 26, 2)),
      attn_softcap=50.0, logit_softcap=30.0, **common)
  assert hf.config_from_hf(GEMMA_3_1B) == models.TransformerConfig(
      vocab_size=262144, d_model=1152, num_layers=26, num_heads=4, num_kv_heads=1, d_ff=6912,
      max_seq_len=32768, rope_base=1e6, sliding_window=512, global_layers=(5, 11, 17, 23),
      local_rope_base=10_000.0, qk_norm=True, **common)
  bare = {k: v for k, v in GEMMA_2_2B.items() if 'softcapping' not in k}
  assert hf.config_from_hf(bare) == hf.config_from_hf(GEMMA_2_2B)  # transformers' defaults.
  for hub in (GEMMA_2_2B, GEMMA_3_1B):  # What `save` writes reads back as the same model.
    config = hf.config_from_hf(hub)
    assert hf.config_from_hf(hf.hf_config(config, hub['model_type'])) == config
  with pytest.raises(hf.UnsupportedCheckpoint, match='attn_softcap=50.0'):
    hf.hf_config(hf.config_from_hf(GEMMA_2_2B), 'gemma')


# Pythia-70m's config.json as the Hub has it (transformers 4.24's names: rotary_pct,
# rotary_emb_base).
PYTHIA_70M = {
    'architectures': ['GPTNeoXForCausalLM'], 'bos_token_id': 0, 'eos_token_id': 0,
    'hidden_act': 'gelu', 'hidden_size': 512, 'initializer_range': 0.02,
    'intermediate_size': 2048, 'layer_norm_eps': 1e-05, 'max_position_embeddings': 2048,
    'model_type': 'gpt_neox', 'num_attention_heads': 8, 'num_hidden_layers': 6,
    'rotary_emb_base': 10000, 'rotary_pct': 0.25, 'tie_word_embeddings': False,
    'torch_dtype': 'float16', 'transformers_version': '4.24.0', 'use_cache': True,
    'use_parallel_residual': True, 'vocab_size': 50304}


def test_pythia_70m_maps_every_field():
  assert hf.config_from_hf(PYTHIA_70M) == models.TransformerConfig(
      vocab_size=50304, d_model=512, num_layers=6, num_heads=8, d_ff=2048, max_seq_len=2048,
      mlp='gelu_exact', tie_embeddings=False, norm_eps=1e-5, qkv_bias=True, dense_bias=True,
      norm='layer', rope_dims=16, parallel_residual=True)
  sequential = hf.config_from_hf(dict(PYTHIA_70M, use_parallel_residual=False, rotary_pct=1.0))
  assert not sequential.parallel_residual and sequential.rope_dims is None


def test_sliding_windows_sit_where_transformers_puts_them():
  """Every layer (Mistral 7B v0.1's 4096, Phi-3's), from max_window_layers on with Qwen's
  use_sliding_window (none without it), or where layer_types say; the fixture's window changes
  transformers' logits, so the check of `test_logits_equal_transformers_full_cached_and_packed`
  on it can fail."""
  mistral = dict(hf.read_config(os.path.join(FIXTURES, 'mistral')), sliding_window=4096)
  assert (hf.config_from_hf(mistral).sliding_window,
          hf.config_from_hf(mistral).global_layers) == (4096, ())
  qwen = dict(hf.read_config(os.path.join(FIXTURES, 'qwen2')), sliding_window=8)
  qwen.pop('layer_types', None)
  assert hf.config_from_hf(qwen).sliding_window is None
  windowed = hf.config_from_hf(dict(qwen, use_sliding_window=True, max_window_layers=1))
  assert (windowed.sliding_window, windowed.global_layers) == (8, (0,))
  plain, windowed = _expected('mistral_window'), hf.load(os.path.join(FIXTURES, 'mistral_window'))
  unwindowed = dataclasses.replace(windowed.config, sliding_window=None)
  got = np.asarray(_logits(unwindowed, windowed.params, jnp.asarray(plain['prompts'])))
  b = int(np.argmax(plain['lengths']))
  n = plain['lengths'][b]
  assert np.abs(got[b, :n] - plain['logits'][b, :n]).max() > 100 * RTOL * np.abs(
      plain['logits'][b, :n]).max()


@pytest.mark.parametrize('dtype', ['bfloat16', 'float16'])
def test_half_precision_checkpoints_load_exactly(tmp_path, dtype):
  """Most checkpoints on the Hub are bfloat16, which safetensors' numpy reader refuses: the loader
  parses the files itself; a half-precision copy of a fixture loads as its weights rounded."""
  from safetensors.flax import save_file  # pylint: disable=g-import-not-at-top
  path = tmp_path / 'qwen3'
  shutil.copytree(os.path.join(FIXTURES, 'qwen3'), path)
  read, parse = hf_files.read_tensors, hf_files.parse
  stored = {name: jnp.asarray(w, dtype) for name, w in read(str(path))}
  save_file(stored, str(path / 'model.safetensors'))
  want = jax.tree.map(lambda x: np.asarray(jnp.asarray(x, dtype), np.float32),
                      hf.load(os.path.join(FIXTURES, 'qwen3')).params)
  jax.tree.map(np.testing.assert_array_equal, hf.load(str(path)).params, want)
  as_bf16 = hf.load(str(path), dtype='bfloat16')
  assert as_bf16.params['embedding'].dtype == jnp.bfloat16
  header = json.dumps({'w': {'dtype': 'C64', 'shape': [1], 'data_offsets': [0, 8]}}).encode()
  with pytest.raises(hf.UnsupportedCheckpoint, match='tensor w has dtype C64'):
    list(parse(len(header).to_bytes(8, 'little') + header + bytes(8), 'x'))


def test_a_truncated_weights_file_is_refused_by_tensor(tmp_path):
  path = _copy_with(tmp_path, 'qwen3')
  weights = os.path.join(path, 'model.safetensors')
  data = open(weights, 'rb').read()
  with open(weights, 'wb') as f:
    f.write(data[:-100])
  with pytest.raises(hf.UnsupportedCheckpoint, match="do not hold F32"):
    hf.load(path)


def test_a_directory_without_a_checkpoint_is_a_clear_error(tmp_path):
  with pytest.raises(FileNotFoundError, match='no config.json'):
    hf.load(str(tmp_path))
  (tmp_path / 'config.json').write_text(
      (open(os.path.join(FIXTURES, 'qwen2', 'config.json'), encoding='utf-8')).read())
  with pytest.raises(FileNotFoundError, match='no model.safetensors'):
    hf.load(str(tmp_path))


def test_export_round_trips_and_is_what_transformers_computed(tmp_path):
  model = fixtures.export_model()
  path = hf.save_llama(models.pack(model), str(tmp_path / 'export'))  # Packed: unpacked first.
  config = json.loads(open(os.path.join(path, 'config.json'), encoding='utf-8').read())
  assert config['architectures'] == ['LlamaForCausalLM'] and config['num_key_value_heads'] == 2
  assert config['rope_scaling'] == dict(rope_type='llama3', factor=4.0, low_freq_factor=1.0,
                                        high_freq_factor=16.0,
                                        original_max_position_embeddings=128)
  back = hf.load(path)
  assert back.config == model.config
  jax.tree.map(np.testing.assert_array_equal, back.params, model.params)
  want = _expected('export')
  _check_logits(_logits(back.config, back.params, jnp.asarray(want['prompts'])), want,
                'exported model against transformers')
  with pytest.raises(hf.UnsupportedCheckpoint, match='qk_norm=True'):
    hf.save_llama(hf.load(os.path.join(FIXTURES, 'qwen3')), str(tmp_path / 'qwen3'))
  with pytest.raises(hf.UnsupportedCheckpoint, match='embed_scale=True'):
    hf.save_llama(hf.load(os.path.join(FIXTURES, 'gemma')), str(tmp_path / 'gemma'))
  with pytest.raises(hf.UnsupportedCheckpoint, match="mlp='gelu'"):
    hf.save_llama(models.Model(
        models.TransformerConfig(vocab_size=8, d_model=8, num_layers=1, num_heads=2, mlp='gelu'),
        {}), str(tmp_path / 'gelu'))


SAVED = ['llama_gqa', 'llama_tied_mqa', 'qwen2', 'mistral', 'llama_rope_llama3',
         'mistral_rope_linear', 'qwen3', 'gemma', 'mistral_window', 'gemma2', 'gemma3',
         'qwen2_yarn', 'phi3', 'phi3_longrope', 'gpt2', 'gpt_neox']


@pytest.mark.parametrize('name', SAVED)
def test_save_writes_the_checkpoint_it_loaded(tmp_path, loaded, name):
  """`save` as the fixture's model_type writes its tensors (Gemma's norms back as scale - 1, to
  float32 rounding) and a config.json that loads as the same model, whose logits are
  transformers'. (tests/fixtures/make_hf_fixtures.py checks that transformers loads each of
  these directories to its own logits.)"""
  model = loaded[name]
  model_type = hf.read_config(os.path.join(FIXTURES, name))['model_type']
  path = hf.save(models.for_decoding(model), str(tmp_path / name), model_type)
  stored = dict(hf_files.read_tensors(os.path.join(FIXTURES, name)))
  written = dict(hf_files.read_tensors(path))
  tied_copy = {'lm_head.weight'} if model.config.tie_embeddings else set()
  assert set(written) == set(stored) - tied_copy
  for tensor, value in written.items():
    np.testing.assert_allclose(value, stored[tensor], rtol=0, atol=1e-6, err_msg=tensor)
  back = hf.load(path)
  assert back.config == model.config
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-6), back.params,
               model.params)
  want = _expected(name)
  _check_logits(_logits(back.config, back.params, jnp.asarray(want['prompts'])), want,
                f'{name} saved and loaded again')


def test_save_picks_the_plainest_type_and_refuses_what_it_cannot_write(tmp_path, loaded):
  types = {name: hf.save_type(loaded[name].config) for name in SAVED}
  assert types == dict(llama_gqa='llama', llama_tied_mqa='llama', qwen2='qwen2', mistral='llama',
                       llama_rope_llama3='llama', mistral_rope_linear='llama', qwen3='qwen3',
                       gemma='gemma', mistral_window='mistral', gemma2='gemma2',
                       gemma3='gemma3_text', qwen2_yarn='qwen2', phi3='mistral',
                       phi3_longrope='phi3', gpt2='gpt2', gpt_neox='gpt_neox')
  with pytest.raises(hf.UnsupportedCheckpoint, match=r"position='learned' \(read back: 'rope'\)"):
    hf.save(loaded['gpt2'], str(tmp_path / 'gpt2'), 'gpt_neox')
  with pytest.raises(hf.UnsupportedCheckpoint, match='not .falcon.'):
    hf.save(loaded['gpt2'], str(tmp_path / 'gpt2'), 'falcon')
  with pytest.raises(hf.UnsupportedCheckpoint, match=r'global_layers=\(1,\) \(read back: \(\)\)'):
    hf.save(loaded['gemma2'], str(tmp_path / 'm'), 'mistral')  # Layer 1 is global.


def test_tokenizer_json_behind_the_binaries_interface():
  from spsjax.data.hf_tokenizer import HFTokenizer  # pylint: disable=g-import-not-at-top
  tok = HFTokenizer.load(os.path.join(FIXTURES, 'qwen2'))
  assert (tok.vocab_size, tok.eos_id, tok.pad_id) == (fixtures.VOCAB, 1, 1)
  text = 'def f(x):\n    return x + 1'
  ids = tok.encode(text)
  assert len(ids) == len(text) and tok.decode(ids) == text
  assert tok.decode(ids + [tok.eos_id]) == text  # Special tokens decode to nothing.
  assert tok.encode_batch([text, 'ab']) == [ids, tok.encode('ab')]
  assert tok.id_to_piece(ids[0]) == 'd'
  assert tok.to_bytes() == HFTokenizer.load(os.path.join(FIXTURES, 'llama_gqa')).to_bytes()
  with pytest.raises(FileNotFoundError, match='no tokenizer.json'):
    HFTokenizer.load(os.path.join(FIXTURES, 'export'))


def test_prompts_start_with_what_the_tokenizer_puts_before_a_text(tmp_path):
  """A post-processor's BOS (Llama's, Gemma's: transformers' tokenizer adds it by default) heads
  every prompt and survives a cut; the fixtures' tokenizer has none."""
  import tokenizers  # pylint: disable=g-import-not-at-top
  from spsjax.data import prompts  # pylint: disable=g-import-not-at-top
  from spsjax.data.hf_tokenizer import HFTokenizer  # pylint: disable=g-import-not-at-top
  assert HFTokenizer.load(os.path.join(FIXTURES, 'qwen2')).prompt_prefix == ()
  path = _copy_with(tmp_path, 'qwen2')
  raw = tokenizers.Tokenizer.from_file(os.path.join(path, 'tokenizer.json'))
  raw.post_processor = tokenizers.processors.TemplateProcessing(
      single='<unk> $A', special_tokens=[('<unk>', 2)])
  raw.save(os.path.join(path, 'tokenizer.json'))
  tok = HFTokenizer.load(path)
  assert tok.prompt_prefix == (2,)
  out, lengths = prompts.encode_prompts(tok, ['ab', 'abcdef'], max_len=4, bucket=4)
  assert lengths.tolist() == [3, 4]
  assert out[0, :3].tolist() == [2] + tok.encode('ab')
  assert out[1].tolist() == [2] + tok.encode('abcdef')[-3:]  # The prefix stays; the text's end.
  assert tok.decode(out[1]) == 'def'
  with pytest.raises(ValueError, match='no room after the prompt prefix'):
    prompts.encode_prompts(tok, ['ab'], max_len=1)


def test_tokenizer_eos_ids_are_what_generate_stops_at(tmp_path):
  """generation_config.json's eos ids (an instruct model's end of turn and end of text), else
  config.json's, else tokenizer_config.json's eos_token; the first is `eos_id`."""
  from spsjax.data.hf_tokenizer import HFTokenizer  # pylint: disable=g-import-not-at-top
  tok = HFTokenizer.load(_copy_with(tmp_path / 'config', 'qwen2', eos_token_id=[5, 7]))
  assert (tok.eos_ids, tok.eos_id, tok.pad_id) == ((5, 7), 5, 5)
  path = _copy_with(tmp_path / 'generation', 'qwen2', eos_token_id=[5, 7])
  with open(os.path.join(path, 'generation_config.json'), 'w', encoding='utf-8') as f:
    json.dump(dict(eos_token_id=[9, 5, 11]), f)
  tok = HFTokenizer.load(path)
  assert (tok.eos_ids, tok.eos_id) == ((9, 5, 11), 9)
  tok = HFTokenizer.load(os.path.join(FIXTURES, 'qwen2'))  # Neither names one: tokenizer_config.
  assert (tok.eos_ids, tok.eos_id) == ((1,), 1)
