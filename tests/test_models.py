"""The cached path equals the reference forward, for MHA, GQA and MQA, at ragged row offsets.

`layout` runs the cached path of the same model as it is ('xla'), fused for XLA's decoding
(`models.fuse`: q, k and v one product, gate and input one) or packed for the CPU kernels
(`models.pack`: native products and the native cached attention), against the plain reference
forward.
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spsjax import models, native
from spsjax.models import rope

VOCAB = 97

# Jitted: a whole forward dispatched op by op costs seconds per test.
_logits = jax.jit(models.logits, static_argnums=0)
_prefill = jax.jit(models.prefill, static_argnums=0,
                   static_argnames=('capacity', 'last_only', 'rollback'))
_extend = jax.jit(models.extend, static_argnums=0)


def _config(num_kv_heads, **kw):
  return models.TransformerConfig(vocab_size=VOCAB, d_model=48, num_layers=2, num_heads=6,
                                  num_kv_heads=num_kv_heads, d_ff=96, max_seq_len=64, **kw)


LAYOUTS = ['xla', 'fused', 'packed']


def _decoding(config, params, layout):
  """(config, params) of the model as the cached path runs it, in `layout`."""
  model = models.Model(config, params)
  model = {'xla': lambda m: m, 'fused': models.fuse, 'packed': models.pack}[layout](model)
  return model.config, model.params


# Gemma 2's options: sliding windows on layer 0 (layer 1 global), soft-capped scores and logits,
# another score scale, post-norms. Gemma 3's: its windows, query and key norms, a rotary base of
# its own on the sliding layers (the global ones scaled).
GEMMA2 = dict(mlp='gated_gelu', embed_scale=True, post_norms=True, sliding_window=3,
              global_layers=(1,), query_scale=0.2, attn_softcap=1.5, logit_softcap=4.0)
GEMMA3 = dict(mlp='gated_gelu', embed_scale=True, post_norms=True, qk_norm=True, sliding_window=4,
              global_layers=(1,), local_rope_base=100.0,
              rope_scaling=models.RopeScaling('linear', 2.0))


@pytest.mark.parametrize('overrides', [GEMMA2, GEMMA3, dict(sliding_window=5)],
                         ids=['gemma2', 'gemma3', 'window-all-layers'])
@pytest.mark.parametrize('chunk', [1, 5])
@pytest.mark.parametrize('layout', LAYOUTS)
def test_windows_and_caps_decode_the_reference(overrides, chunk, layout):
  """Sliding windows, soft-capping and post-norms: a cached decode far past the windows gives
  the full forward's logits; post-norm scales away from 1; the window changes the logits. On
  XLA's layouts the windowed layers hold rings of window - 1 slots (`rollback=0`), filled by a
  prefill and by chunks longer than the ring."""
  config = _config(2, **overrides)
  params = jax.tree_util.tree_map_with_path(
      lambda path, x: x * 1.7 if 'post_norm' in jax.tree_util.keystr(path) else x,
      models.init_params(config, jax.random.key(0)))
  tokens_BxL = jax.random.randint(jax.random.key(1), (2, 24), 0, VOCAB)
  reference_BxLxV = np.asarray(_logits(config, params, tokens_BxL))
  unwindowed = dataclasses.replace(config, sliding_window=None, global_layers=(),
                                   local_rope_base=None)
  assert not np.allclose(_logits(unwindowed, params, tokens_BxL)[:, 8:], reference_BxLxV[:, 8:],
                         atol=1e-3)
  config, params = _decoding(config, params, layout)
  lengths = np.array([2, 6])
  _, cache = _prefill(config, params, tokens_BxL[:, :6], jnp.asarray(lengths), capacity=24,
                      rollback=0)
  slots = [k.shape[1] for k in cache.k]
  assert slots == [24 if layout == 'packed' or config.window(i) is None else config.window(i) - 1
                   for i in range(2)]
  while lengths.max() + chunk <= 24:
    chunk_BxT = np.stack([np.asarray(tokens_BxL[b, l:l + chunk]) for b, l in enumerate(lengths)])
    out_BxTxV, cache = _extend(config, params, cache, jnp.asarray(chunk_BxT))
    for b, l in enumerate(lengths):
      np.testing.assert_allclose(out_BxTxV[b], reference_BxLxV[b, l:l + chunk], rtol=1e-5,
                                 atol=1e-5, err_msg=f'row {b} at {l}')
    lengths = lengths + chunk


@pytest.mark.parametrize('layout', ['xla', 'fused'])
def test_a_ring_rolled_back_decodes_the_reference(layout):
  """Rings of window + 2 slots (`rollback=3`), written 4 positions a call, of which the last 0-3
  are dropped (rolled back) and were other tokens than the ones written next: every kept
  position's logits are the full forward's, far past the windows (the dropped keys, whose slots
  now read as positions a window back, are never attended). With one slot fewer a dropped key
  is seen (so the check can fail)."""
  config = _config(2, **GEMMA2)
  config, params = _decoding(config, models.init_params(config, jax.random.key(0)), layout)
  tokens_BxL = jax.random.randint(jax.random.key(1), (2, 40), 0, VOCAB)
  noise_BxL = (tokens_BxL + 1 + jax.random.randint(jax.random.key(2), (2, 40), 0, VOCAB - 1)
               ) % VOCAB  # Never the token itself.
  reference_BxLxV = np.asarray(_logits(config, params, tokens_BxL))
  keeps = np.random.default_rng(0).integers(1, 5, size=(30, 2))

  def worst_error(rollback):
    lengths = np.array([3, 5])
    _, cache = _prefill(config, params, tokens_BxL[:, :5], jnp.asarray(lengths), capacity=44,
                        rollback=rollback)
    assert cache.k[0].shape[1] == GEMMA2['sliding_window'] - 1 + rollback
    error = 0.0
    for keep_B in keeps:
      if lengths.max() + 4 > 40:
        break
      kept_BxL = np.arange(4)[None, :] < keep_B[:, None]
      chunk_Bx4 = np.stack([np.where(kept_BxL[b], tokens_BxL[b, l:l + 4], noise_BxL[b, l:l + 4])
                            for b, l in enumerate(lengths)])
      out_Bx4xV, cache = _extend(config, params, cache, jnp.asarray(chunk_Bx4))
      for b, l in enumerate(lengths):
        n = keep_B[b]
        error = max(error, float(np.max(np.abs(out_Bx4xV[b, :n] - reference_BxLxV[b, l:l + n]))))
      lengths = lengths + keep_B
      cache = cache.with_lengths(jnp.asarray(lengths))
    return error

  assert worst_error(3) < 1e-5
  assert worst_error(2) > 1e-3


# GPT-NeoX's options: LayerNorm, biases, a part of each head rotated, a parallel block, GELU
# (erf); GPT-2's: learned positions, GELU (tanh).
NEOX = dict(norm='layer', qkv_bias=True, dense_bias=True, rope_dims=2, parallel_residual=True,
            mlp='gelu_exact')
GPT2 = dict(norm='layer', qkv_bias=True, dense_bias=True, position='learned', mlp='gelu')


@pytest.mark.parametrize('overrides', [NEOX, dict(NEOX, parallel_residual=False, rope_dims=6)])
@pytest.mark.parametrize('layout', LAYOUTS)
def test_neox_options_decode_the_reference(overrides, layout):
  """Cached calls of 1 and 3 positions, and logits at chosen positions, give the full forward's
  logits, packed for the CPU kernels too; the options change them (so the check can fail)."""
  config = _config(None, **overrides)
  params = models.init_params(config, jax.random.key(0))
  params = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.key(1), x.shape), params)
  tokens_BxL = jax.random.randint(jax.random.key(2), (2, 12), 0, VOCAB)
  reference_BxLxV = np.asarray(_logits(config, params, tokens_BxL))
  for plain in (dataclasses.replace(config, rope_dims=None),
                dataclasses.replace(config, parallel_residual=not config.parallel_residual),
                dataclasses.replace(config, mlp='gelu')):
    assert not np.allclose(_logits(plain, params, tokens_BxL), reference_BxLxV, atol=1e-4)
  decode_config, decode_params = _decoding(config, params, layout)
  _, cache = _prefill(decode_config, decode_params, tokens_BxL[:, :4], jnp.array([2, 4]),
                      capacity=12)
  out_Bx1xV, cache = _extend(decode_config, decode_params, cache, tokens_BxL[:, 2:3])
  np.testing.assert_allclose(out_Bx1xV[0, 0], reference_BxLxV[0, 2], rtol=1e-5, atol=1e-5)
  cache = cache.with_lengths(jnp.array([3, 4]))
  chunk_Bx3 = jnp.stack([tokens_BxL[0, 3:6], tokens_BxL[1, 4:7]])
  out_Bx2xV, _ = _extend(decode_config, decode_params, cache, chunk_Bx3,
                         jnp.array([[0, 2], [1, 2]], jnp.int32))
  np.testing.assert_allclose(out_Bx2xV[0], reference_BxLxV[0, [3, 5]], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(out_Bx2xV[1], reference_BxLxV[1, [5, 6]], rtol=1e-5, atol=1e-5)


# Every head layout one position at a time; scoring 5 positions with GQA and MQA. Fused: GQA one
# at a time, MQA five (its layout differs from the plain one's in the kv grouping only).
@pytest.mark.parametrize('num_kv_heads,chunk,layout', [
    (kv, chunk, layout) for layout in LAYOUTS
    for kv, chunk in [(None, 1), (2, 1), (1, 1), (2, 5), (1, 5)]
    if layout != 'fused' or (kv, chunk) in ((2, 1), (1, 5))])
def test_cached_extension_equals_reference(num_kv_heads, chunk, layout):
  config = _config(num_kv_heads)
  params = models.init_params(config, jax.random.key(0))
  total = 30
  tokens_BxL = jax.random.randint(jax.random.key(1), (3, total), 0, VOCAB)
  reference_BxLxV = np.asarray(_logits(config, params, tokens_BxL))
  config, params = _decoding(config, params, layout)
  prompt_lengths = np.array([4, 9, 1])
  width = int(prompt_lengths.max())

  prefill_BxPxV, cache = _prefill(config, params, tokens_BxL[:, :width],
                                        jnp.asarray(prompt_lengths), capacity=total + chunk)
  for b, length in enumerate(prompt_lengths):
    np.testing.assert_allclose(prefill_BxPxV[b, :length], reference_BxLxV[b, :length], rtol=1e-5,
                               atol=1e-5)
  lengths = prompt_lengths.copy()
  while lengths.max() + chunk <= total:
    chunk_BxT = np.stack([np.asarray(tokens_BxL[b, l:l + chunk]) for b, l in enumerate(lengths)])
    out_BxTxV, cache = _extend(config, params, cache, jnp.asarray(chunk_BxT))
    for b, l in enumerate(lengths):
      expected = reference_BxLxV[b, l:l + chunk]
      np.testing.assert_allclose(out_BxTxV[b], expected, rtol=1e-5,
                                 atol=1e-5 * np.abs(expected).max())
    lengths = lengths + chunk
    np.testing.assert_array_equal(cache.lengths, lengths)


@pytest.mark.parametrize('layout', LAYOUTS)
def test_rollback_is_moving_lengths(layout):
  """Extending, rolling a row back and re-extending with other tokens matches the reference."""
  config = _config(2)
  reference_params = models.init_params(config, jax.random.key(0))
  decode_config, params = _decoding(config, reference_params, layout)
  logits = jax.jit(functools.partial(models.logits, config, reference_params))
  tokens = jax.random.randint(jax.random.key(2), (2, 12), 0, VOCAB)
  other = jax.random.randint(jax.random.key(3), (2, 4), 0, VOCAB)
  _, cache = _prefill(decode_config, params, tokens[:, :8], jnp.array([8, 8]), capacity=16)
  _, cache = _extend(decode_config, params, cache, other)  # Both rows now at 12.
  cache = cache.with_lengths(jnp.array([8, 10]))  # Row 0 drops all 4, row 1 keeps 2.
  out_Bx4xV, cache = _extend(decode_config, params, cache, tokens[:, 8:12])
  seq0 = tokens[0]
  seq1 = jnp.concatenate([tokens[1, :8], other[1, :2], tokens[1, 8:12]])
  np.testing.assert_allclose(out_Bx4xV[0], logits(seq0[None])[0, 8:12], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(out_Bx4xV[1], logits(seq1[None])[0, 10:14], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('overrides', [
    {}, dict(tie_embeddings=False, mlp='gelu'),
    dict(qk_norm=True, rope_scaling=models.RopeScaling('llama3', 8.0, original_max_len=16)),
    dict(mlp='gated_gelu', embed_scale=True), GEMMA2, GEMMA3, GPT2, NEOX],
                         ids=['plain', 'gelu', 'qk_norm-llama3_rope', 'gemma', 'gemma2', 'gemma3',
                              'gpt2', 'neox'])
@pytest.mark.parametrize('layout', LAYOUTS)
def test_logits_at_selects_positions_per_row(overrides, layout):
  """prefill(last_only) and extend(logits_at) give the selected rows of the full logits, and the
  same cache."""
  config = _config(2, **overrides)
  params = models.init_params(config, jax.random.key(0))
  tokens_BxL = jax.random.randint(jax.random.key(4), (3, 10), 0, VOCAB)
  reference_BxLxV = np.asarray(_logits(config, params, tokens_BxL))
  config, params = _decoding(config, params, layout)
  lengths = np.array([3, 7, 1])
  last_Bx1xV, cache = _prefill(config, params, tokens_BxL[:, :7], jnp.asarray(lengths),
                               capacity=12, last_only=True)
  assert last_Bx1xV.shape == (3, 1, VOCAB)
  # The last layer skips the other positions' output projection and MLP, not their keys and values.
  _, full_cache = _prefill(config, params, tokens_BxL[:, :7], jnp.asarray(lengths), capacity=12)
  for got, want in zip(jax.tree.leaves(cache), jax.tree.leaves(full_cache), strict=True):
    np.testing.assert_array_equal(got, want)
  for b, length in enumerate(lengths):
    np.testing.assert_allclose(last_Bx1xV[b, 0], reference_BxLxV[b, length - 1], rtol=1e-5,
                               atol=1e-5)
  chunk_Bx3 = np.stack([np.asarray(tokens_BxL[b, l:l + 3]) for b, l in enumerate(lengths)])
  at_Bx2 = jnp.array([[2, 0], [1, 1], [0, 2]], jnp.int32)
  out_Bx2xV, _ = _extend(config, params, cache, jnp.asarray(chunk_Bx3), at_Bx2)
  for b, l in enumerate(lengths):
    np.testing.assert_allclose(out_Bx2xV[b], reference_BxLxV[b, l + np.asarray(at_Bx2[b])],
                               rtol=1e-5, atol=1e-5)


def test_config_validation():
  with pytest.raises(ValueError, match='num_kv_heads'):
    _config(4)  # 6 heads are not a multiple of 4 kv heads.
  with pytest.raises(ValueError, match='dtype'):
    _config(2, dtype='float16')
  with pytest.raises(ValueError, match='mlp'):
    _config(2, mlp='relu')
  with pytest.raises(ValueError, match='kernels'):
    _config(2, kernels='pallas')
  with pytest.raises(ValueError, match='native kernels'):
    _config(2, dtype='bfloat16', kernels='native')
  with pytest.raises(ValueError, match='qk_norm'):
    _config(2, qk_norm=True, norm='layer')
  with pytest.raises(ValueError, match='sliding_window must be'):
    _config(2, sliding_window=0)
  with pytest.raises(ValueError, match='global_layers'):
    _config(2, sliding_window=4, global_layers=(2,))  # 2 layers: 0 and 1.
  with pytest.raises(ValueError, match='global_layers'):
    _config(2, global_layers=(1,))  # No window.
  with pytest.raises(ValueError, match='local_rope_base'):
    _config(2, local_rope_base=10.0)
  with pytest.raises(ValueError, match='attn_softcap'):
    _config(2, attn_softcap=0.0)
  assert _config(2, sliding_window=4, global_layers=[1]).global_layers == (1,)  # From JSON.
  with pytest.raises(ValueError, match='must be even'):
    _config(2, rope_dims=3)
  with pytest.raises(ValueError, match='rope_dims must be'):
    _config(2, rope_dims=10)  # Heads of 8 dims.


def test_rope_scalings_rescale_the_frequencies():
  """Linear divides every frequency; Llama 3's keeps the short wavelengths, divides the long ones
  and joins them in between (transformers' own numbers: tests/test_hf.py's fixtures)."""
  config = _config(2)
  H = config.dims_per_head
  plain = np.asarray(rope.frequencies(config))
  np.testing.assert_array_equal(plain, native.rope_frequencies(H, config.rope_base))
  linear = dataclasses.replace(config, rope_scaling=models.RopeScaling('linear', 4.0))
  np.testing.assert_array_equal(rope.frequencies(linear), plain / np.float32(4.0))
  scaling = models.RopeScaling('llama3', 8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                               original_max_len=64)
  got = np.asarray(rope.frequencies(dataclasses.replace(config, rope_scaling=scaling)))
  wavelengths = 2 * np.pi / plain
  short, long = wavelengths < 64 / 4, wavelengths > 64 / 1
  assert short.any() and long.any() and (~short & ~long).any()  # All three bands.
  np.testing.assert_array_equal(got[short], plain[short])
  np.testing.assert_allclose(got[long], plain[long] / 8, rtol=1e-6)
  between = ~short & ~long
  assert np.all((got[between] < plain[between]) & (got[between] > plain[between] / 8))
  with pytest.raises(ValueError, match='RopeScaling.kind'):
    models.RopeScaling('dynamic', 4.0)
  with pytest.raises(ValueError, match='yarn rope scaling wants'):
    models.RopeScaling('yarn', 4.0, beta_slow=0.0)
  with pytest.raises(ValueError, match='low_freq_factor < high_freq_factor'):
    models.RopeScaling('llama3', 8.0, low_freq_factor=4.0, high_freq_factor=1.0)
  with pytest.raises(ValueError, match='rotary model'):
    dataclasses.replace(config, position='learned', rope_scaling=scaling)


def _two_row_products(stablehlo: str) -> int:
  """Products in lowered text whose left operand is [1, 2, ...] of rank 3 or 4 (a padded single
  row; the attention's products, rank 5, are not `project`'s)."""
  return len(re.findall(r'dot_general .*: \(tensor<1x2x(?:\d+x){1,2}[a-z]', stablehlo))


def test_project_pads_a_single_row_only_where_asked(monkeypatch):
  """`project` is the einsum; with single_row='padded' a single row (B = T = 1) goes through a
  product of two rows (the second zero) and is sliced back, other shapes never."""
  x_BxTxD = jax.random.normal(jax.random.key(0), (1, 1, 8))
  x_BxTx2xD = jax.random.normal(jax.random.key(1), (1, 1, 2, 8))
  w_DxF, w_2xDxE = (jax.random.normal(jax.random.key(2), s) for s in ((8, 5), (2, 8, 5)))
  for spec, x, w in (('BTD,DF->BTF', x_BxTxD, w_DxF), ('BTID,IDE->BTE', x_BxTx2xD, w_2xDxE)):
    expected = jnp.einsum(spec, x, w)
    for single_row in models.config.SINGLE_ROW:
      config = _config(2, single_row=single_row)
      project = functools.partial(models.transformer.project, config, spec)
      np.testing.assert_allclose(project(x, w), expected, rtol=1e-6, atol=1e-6)
      padded = single_row in ('padded', 'stream') or (single_row == 'auto'
                                                      and jax.default_backend() == 'gpu')
      assert _two_row_products(jax.jit(project).lower(x, w).as_text()) == padded
      wide = jnp.concatenate([x, x], axis=1)  # Two positions of their own: no padding.
      assert 'stablehlo.pad' not in jax.jit(project).lower(wide, w).as_text()
  with monkeypatch.context() as m:  # 'auto' pads on a GPU.
    m.setattr(jax, 'default_backend', lambda: 'gpu')
    project = functools.partial(models.transformer.project, _config(2), 'BTD,DF->BTF')
    assert _two_row_products(jax.jit(project).lower(x_BxTxD, w_DxF).as_text()) == 1
  with pytest.raises(ValueError, match='single_row'):
    _config(2, single_row='always')


@pytest.mark.parametrize('layout', ['xla', 'fused'])
def test_padded_single_rows_decode_the_same_logits(layout):
  """A batch-1 decode (one position a call) with single_row='padded' gives the plain logits, and
  'stream' (the stream carried at two rows, one pad at the embedding and one before each
  attention output projection instead of one before every product) the padded ones."""
  config = _config(2, qkv_bias=True)
  params = models.init_params(config, jax.random.key(0))
  tokens_BxL = jax.random.randint(jax.random.key(1), (1, 12), 0, VOCAB)
  outs = {}
  products = {'xla': 7, 'fused': 4}[layout]  # A layer's: q, k, v, out, gate, in, out.
  pads = {'plain': 0, 'padded': 2 * products + 1, 'stream': 1 + 2}
  for single_row in ('plain', 'padded', 'stream'):
    c, p = _decoding(dataclasses.replace(config, single_row=single_row), params, layout)
    _, cache = _prefill(c, p, tokens_BxL[:, :5], jnp.array([5]), capacity=16)
    outs[single_row] = []
    for t in range(5, 12):
      out_BxTxV, cache = _extend(c, p, cache, tokens_BxL[:, t:t + 1])
      assert out_BxTxV.shape == (1, 1, VOCAB)
      outs[single_row].append(np.asarray(out_BxTxV))
    lowered = _extend.lower(c, p, cache, tokens_BxL[:, :1]).as_text()
    assert _two_row_products(lowered) == (single_row != 'plain') * (2 * products + 1)
    assert lowered.count('call @_pad') == pads[single_row], single_row  # `jnp.pad`'s calls.
  np.testing.assert_allclose(outs['padded'], outs['plain'], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(outs['stream'], outs['padded'], rtol=1e-6, atol=1e-6)


def test_a_streamed_single_row_gives_the_padded_features_logits_and_cache():
  """single_row='stream' at B = T = 1: `extend_with_features` (logits at repeated indices, the
  features, the cache) and the uncached `features` give what 'padded' gives."""
  params = models.init_params(_config(2), jax.random.key(0))
  got = {}
  for single_row in ('padded', 'stream'):
    config = _config(2, single_row=single_row)
    _, cache = models.prefill(config, params, jnp.array([[3, 4, 5]]), jnp.array([3]), 16)
    logits_BxLxV, features_BxTxD, cache = models.extend_with_features(
        config, params, cache, jnp.array([[7]]), logits_at_BxL=jnp.array([[0, 0]]))
    got[single_row] = (logits_BxLxV, features_BxTxD, cache.k[1], cache.v[1], cache.lengths,
                       models.features(config, params, jnp.array([[9]])))
  assert got['stream'][0].shape == (1, 2, VOCAB) and got['stream'][1].shape[:2] == (1, 1)
  for streamed, padded in zip(got['stream'], got['padded']):
    np.testing.assert_allclose(streamed, padded, rtol=1e-6, atol=1e-6)


def test_kernels_are_the_config_setting_that_packing_sets():
  """`pack` sets kernels='native' and `unpack` 'xla'; a setting the parameters cannot serve is
  an error, not a silent switch of code path."""
  config = _config(2)
  model = models.Model(config, models.init_params(config, jax.random.key(0)))
  packed = models.pack(model)
  assert (config.kernels, packed.config.kernels) == ('xla', 'native')
  assert models.unpack(packed).config == config
  tokens_BxT = jnp.zeros((1, 4), jnp.int32)
  with pytest.raises(ValueError, match='packed'):
    models.logits(packed.config, model.params, tokens_BxT)
  with pytest.raises(ValueError, match='packed'):
    models.logits(config, packed.params, tokens_BxT)


@pytest.mark.parametrize('overrides', [{}, dict(num_kv_heads=1, qkv_bias=True, dense_bias=True),
                                       dict(mlp='gelu', norm='layer', position='learned',
                                            dense_bias=True), dict(qk_norm=True),
                                       dict(mlp='gated_gelu', embed_scale=True)],
                         ids=['gqa', 'mqa-biases', 'gpt2', 'qk_norm', 'gemma'])
def test_fusing_lays_out_the_same_parameters_for_fewer_products(overrides):
  """`fuse` sets kernels='xla_fused' and gives the same logits; `unfuse` gives back exactly the
  parameters; each kv head's query heads, key and value sit side by side in `wqkv`."""
  config = _config(overrides.pop('num_kv_heads', 2), **overrides)
  params = jax.tree_util.tree_map_with_path(  # Biases start at zero: make them count.
      lambda path, x: x + 0.1 if path[-1].key.startswith('b') else x,
      models.init_params(config, jax.random.key(0)))
  model = models.Model(config, params)
  fused = models.fuse(model)
  assert fused.config.kernels == 'xla_fused' and models.fuse(fused) is fused
  attn, mlp = fused.params['layer_1']['attn'], fused.params['layer_1']['mlp']
  K, G = config.kv_heads, config.num_heads // config.kv_heads
  assert 'wq' not in attn and attn['wqkv'].shape == (48, K, G + 2, 8)
  plain = model.params['layer_1']['attn']
  np.testing.assert_array_equal(attn['wqkv'][:, K - 1, :G], plain['wq'][:, (K - 1) * G:K * G])
  np.testing.assert_array_equal(attn['wqkv'][:, K - 1, G + 1], plain['wv'][:, K - 1])
  gated = config.mlp in ('gated_silu', 'gated_gelu')
  assert ('w_gate_in' in mlp) == gated and ('w_gate' in mlp) is False
  tokens_BxT = jax.random.randint(jax.random.key(1), (2, 7), 0, VOCAB)
  np.testing.assert_allclose(_logits(fused.config, fused.params, tokens_BxT),
                             _logits(config, model.params, tokens_BxT), rtol=1e-5, atol=1e-5)
  back = models.unfuse(fused)
  assert back.config == config
  assert jax.tree.structure(back.params) == jax.tree.structure(model.params)
  for got, want in zip(jax.tree.leaves(back.params), jax.tree.leaves(model.params)):
    np.testing.assert_array_equal(got, want)
  with pytest.raises(ValueError, match="laid out for 'xla_fused'"):
    models.logits(config, fused.params, tokens_BxT)
  with pytest.raises(ValueError, match="laid out for 'xla'"):
    models.logits(fused.config, model.params, tokens_BxT)
  packed = models.pack(fused)  # Packing a fused model packs its plain layout; not the reverse.
  assert packed.config.kernels == 'native'
  np.testing.assert_array_equal(models.unpack(packed).params['layer_0']['attn']['wk'],
                                model.params['layer_0']['attn']['wk'])
  with pytest.raises(ValueError, match='unpack'):
    models.fuse(packed)


@pytest.mark.parametrize('overrides', [dict(mlp='gelu'), dict(tie_embeddings=False),
                                       dict(dtype='bfloat16')])
def test_variants_run(overrides):
  config = _config(2, **overrides)
  params = models.init_params(config, jax.random.key(0))
  out = models.logits(config, params, jnp.zeros((2, 5), jnp.int32))
  assert out.shape == (2, 5, VOCAB) and out.dtype == jnp.float32
  assert np.isfinite(np.asarray(out)).all()
  leaves = jax.tree.leaves(params)
  assert all(x.dtype == config.jnp_dtype for x in leaves)


@pytest.mark.parametrize('size', ['tiny', 'demo', 'reference'])
def test_draft_shapes_have_about_the_same_size(size):
  """The draft-topology sweep's three shapes (1, 2 and 4 layers) at about equal parameters, all
  well below the target's."""
  from spsjax.models import presets  # pylint: disable=import-outside-toplevel
  count = lambda name: models.num_params(jax.eval_shape(
      lambda: models.init_params(models.TransformerConfig(**presets.get(f'{size}_{name}')),
                                 jax.random.key(0))))
  wide, mid, deep = count('draft'), count('draft_mid'), count('draft_deep')
  layers = [presets.get(f'{size}_{n}')['num_layers'] for n in ('draft', 'draft_mid', 'draft_deep')]
  assert layers[0] < layers[1] < layers[2]
  assert max(wide, mid, deep) / min(wide, mid, deep) < 1.25, (wide, mid, deep)
  assert max(wide, mid, deep) < count('target') / 3


def test_truncated_params_are_the_first_layers():
  """A truncated copy keeps the embedding, the first layers and the final norm, unchanged; a model
  that is not the same one with fewer layers is refused."""
  config = _config(2)
  params = models.init_params(config, jax.random.key(0))
  short = dataclasses.replace(config, num_layers=1)
  cut = models.truncated_params(config, params, short)
  assert sorted(cut) == ['embedding', 'final_norm', 'layer_0']
  for got, want in zip(jax.tree.leaves(cut), jax.tree.leaves(
      {k: params[k] for k in ('embedding', 'final_norm', 'layer_0')})):
    np.testing.assert_array_equal(got, want)
  out = models.logits(short, cut, jnp.zeros((1, 3), jnp.int32))
  assert out.shape == (1, 3, VOCAB)
  for bad in (dataclasses.replace(config, num_layers=3), dataclasses.replace(short, d_ff=48)):
    with pytest.raises(ValueError, match='truncated copy'):
      models.truncated_params(config, params, bad)


def test_init_params_compiles_once_per_config():
  """A second initialisation of the same config (another key) reuses the first's program: no
  tracing, no compile (a fresh program per call compiled every leaf's draw again); another config
  compiles its own; the draws follow the key."""
  from spsjax.bench import timing  # pylint: disable=import-outside-toplevel
  config = dataclasses.replace(_config(2), d_ff=88)  # A config no other test initialises.
  first = models.init_params(config, jax.random.key(0))
  with timing.CompileClock() as clock:
    again = models.init_params(config, jax.random.key(0))
    other_key = models.init_params(config, jax.random.key(1))
  assert clock.phases == dict.fromkeys(clock.phases, 0.0), clock.phases
  jax.tree.map(np.testing.assert_array_equal, first, again)
  assert not np.array_equal(first['layer_0']['mlp']['w_in'], other_key['layer_0']['mlp']['w_in'])
  with timing.CompileClock() as clock:
    models.init_params(dataclasses.replace(config, d_ff=80), jax.random.key(0))
  assert clock.programs['jit(random_params)'] == 1
