"""The native CPU kernels against XLA's ops, in every instruction-set variant this CPU runs.

The library must be built (`pip install` builds it): a missing build fails here, not silently
falls back. Each variant (AVX-512, AVX2 + FMA, baseline) runs on the same inputs; shapes cover
partial panels, head dims that are not a multiple of the vector width and ragged row offsets.
"""

import dataclasses
import functools
import importlib.machinery

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spsjax import models, native, sampling, sharding
from spsjax.native import attention, threefry
from spsjax.sampling import drafters, processors, rejection

ISAS = native.isas()


def test_library_is_built_and_runs_the_baseline():
  assert native.available(), 'spsjax/native was not built: reinstall with pip install -e .'
  assert 'baseline' in ISAS


def test_variants_run_are_those_this_cpu_has_and_the_others_are_refused():
  """The instruction sets the tests run are those /proc/cpuinfo lists (a broken detection would
  silently drop the AVX-512 or AVX2 cases); a variant this CPU lacks is refused with an error."""
  with open('/proc/cpuinfo') as f:
    flags = set(next(line for line in f if line.startswith('flags')).split(':')[1].split())
  want = ['baseline'] + (['avx2'] if {'avx2', 'fma'} <= flags else [])
  want += ['avx512'] if {'avx512f', 'avx2', 'fma'} <= flags else []
  assert ISAS == want
  print(f'instruction-set variants tested on this CPU: {ISAS}')
  for isa in sorted(set(native.ISAS) - {'best'} - set(ISAS)):
    with pytest.raises(Exception, match='lacks the instruction set'):
      jax.block_until_ready(native.matmul(jnp.ones((2, 8)), native.pack(jnp.ones((8, 8))),
                                          isa=isa, use_kernel=True))


def test_loader_takes_the_library_built_for_this_interpreter(tmp_path, monkeypatch):
  from spsjax.native import library
  monkeypatch.delenv('SPSJAX_NATIVE_LIBRARY', raising=False)
  assert library.path_to_load(str(tmp_path)) is None
  for name in ('_kernels.cpython-39-x86_64-linux-gnu.so', '_kernels.cpython-313-darwin.so',
               '_kernels.abi3.so'):
    (tmp_path / name).write_bytes(b'')
  assert library.path_to_load(str(tmp_path)) == str(tmp_path / '_kernels.abi3.so')
  ours = tmp_path / f'_kernels{importlib.machinery.EXTENSION_SUFFIXES[0]}'
  ours.write_bytes(b'')
  assert library.path_to_load(str(tmp_path)) == str(ours)
  monkeypatch.setenv('SPSJAX_NATIVE_LIBRARY', '/elsewhere/k.so')
  assert library.path_to_load(str(tmp_path)) == '/elsewhere/k.so'


@pytest.mark.parametrize('isa', ISAS)
# Inner widths that are not whole vectors (37, 13: the tail loops), and 1000 x 70 on threads.
@pytest.mark.parametrize('d_in,d_out', [(96, 160), (40, 37), (1024, 48), (37, 20), (13, 5),
                                        (1000, 70)])
@pytest.mark.parametrize('rows', [1, 3, 5, 8, 9, 16, 17, 67, 300])
def test_packed_matmul_equals_dot(isa, d_in, d_out, rows):
  w_IxF = jax.random.normal(jax.random.key(0), (d_in, d_out))
  x_RxI = jax.random.normal(jax.random.key(rows), (rows, d_in))
  packed = native.pack(w_IxF)
  got = jax.jit(lambda x, p: native.matmul(x, p, isa=isa, use_kernel=True))(x_RxI, packed)
  want = jnp.dot(x_RxI, w_IxF, precision='highest')
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.sqrt(d_in))


@jax.jit  # One program per shape: op by op, these compiled a dozen small ones per shape.
def _prologue_wants(x_RxI, gate_in_Rx2xI, scale_I, residual_RxF, w_IxF):
  """The XLA ops' rms_norm(x) @ w, silu_gate @ w, x @ w + residual, silu_gate @ w + residual."""
  dot = lambda a, b: jnp.dot(a, b, precision='highest')
  gated_RxI = native.silu_gate(gate_in_Rx2xI[:, 0], gate_in_Rx2xI[:, 1])
  return (dot(native.rms_norm(x_RxI, scale_I, 1e-5), w_IxF), dot(gated_RxI, w_IxF),
          residual_RxF + dot(x_RxI, w_IxF), residual_RxF + dot(gated_RxI, w_IxF))


@pytest.mark.parametrize('isa', ISAS)
@pytest.mark.parametrize('d_in,d_out', [(96, 160), (40, 37), (128, 600)])
@pytest.mark.parametrize('rows', [1, 5, 9, 16, 24, 700])  # 700 x 128: the prologue on threads.
def test_packed_matmul_prologues_and_residual(isa, d_in, d_out, rows):
  """rms_norm(x) @ w, silu_gate(x) @ w, and + residual, against the same XLA ops."""
  keys = jax.random.split(jax.random.key(rows), 4)
  w_IxF = jax.random.normal(keys[0], (d_in, d_out))
  packed = native.pack(w_IxF)
  x_RxI = 3 * jax.random.normal(keys[1], (rows, d_in))
  scale_I = 1 + jax.random.normal(keys[2], (d_in,))
  residual_RxF = jax.random.normal(keys[3], (rows, d_out))
  # Gates far in both tails too: the kernel's sigmoid must not overflow.
  gate_in_Rx2xI = jnp.stack([x_RxI.at[:, 0].set(-100.0).at[:, 1].set(100.0), x_RxI[::-1]], axis=1)
  wants = _prologue_wants(x_RxI, gate_in_Rx2xI, scale_I, residual_RxF, w_IxF)
  options = (dict(norm=(scale_I, 1e-5)), dict(gated=True), dict(residual=residual_RxF),
             dict(gated=True, residual=residual_RxF))
  cases = zip((x_RxI, gate_in_Rx2xI, x_RxI, gate_in_Rx2xI), options, wants, strict=True)
  for x, options, want in cases:
    for use_kernel in (True, False):
      got = jax.jit(lambda x, p, o=options, k=use_kernel: native.matmul(
          x, p, isa=isa, use_kernel=k, **o))(x, packed)
      np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.sqrt(d_in),
                                 err_msg=f'{sorted(options)} kernel={use_kernel}')


@pytest.mark.parametrize('isa', ISAS)
@pytest.mark.parametrize('B,T,counts', [
    (3, 9, [9, 3, 0]),
    (3, 300, [300, 100, 0]),  # 3 x 300 x 128 inputs: the prologues on threads.
    # A batch scoring 2 positions with idle rows (count 0) and a short one: whole rows next to
    # each other are computed as one run of rows.
    (8, 2, [2, 2, 0, 2, 1, 2, 2, 0])])
def test_packed_matmul_skips_padding_rows(isa, B, T, counts):
  """With counts, rows t < counts[b] of x [B, T, I] are the product's and the others, padding,
  come out as their residual (or zeros), for every prologue."""
  d_in, d_out = 128, 100
  keys = jax.random.split(jax.random.key(T), 4)
  w_IxF = jax.random.normal(keys[0], (d_in, d_out))
  packed = native.pack(w_IxF)
  x_BxTxI = jax.random.normal(keys[1], (B, T, d_in))
  gate_in_BxTx2xI = jnp.stack([x_BxTxI, x_BxTxI[:, ::-1]], axis=2)
  scale_I = 1 + jax.random.normal(keys[2], (d_in,))
  residual_BxTxF = jax.random.normal(keys[3], (B, T, d_out))
  dot = lambda a: jnp.einsum('BTI,IF->BTF', a, w_IxF, precision='highest')
  cases = [
      (x_BxTxI, {}, dot(x_BxTxI)),
      (x_BxTxI, dict(norm=(scale_I, 1e-5), residual=residual_BxTxF),
       residual_BxTxF + dot(native.rms_norm(x_BxTxI, scale_I, 1e-5))),
      (gate_in_BxTx2xI, dict(gated=True, residual=residual_BxTxF),
       residual_BxTxF + dot(native.silu_gate(x_BxTxI, x_BxTxI[:, ::-1]))),
  ]
  for x, options, want in cases:
    got = jax.jit(lambda x, p, c, o=options: native.matmul(
        x, p, counts=c, isa=isa, use_kernel=True, **o))(x, packed, jnp.array(counts, jnp.int32))
    for b, count in enumerate(counts):
      np.testing.assert_allclose(got[b, :count], want[b, :count], rtol=1e-4,
                                 atol=1e-4 * np.sqrt(d_in), err_msg=f'{sorted(options)}')
      padding = residual_BxTxF[b, count:] if 'residual' in options else 0.0
      np.testing.assert_array_equal(got[b, count:], padding)
  with pytest.raises(ValueError, match='counts'):
    native.matmul(x_BxTxI, packed, counts=jnp.array([1, 2], jnp.int32))


def test_packed_matmul_leading_and_output_dims_and_xla_path():
  w = jax.random.normal(jax.random.key(0), (3, 8, 5, 6))  # in (3, 8), out (5, 6).
  x = jax.random.normal(jax.random.key(1), (2, 4, 24))
  packed = native.pack(w, in_dims=2)
  assert packed.panels_PxIxC.shape == (2, 24, native.PANEL)
  assert (packed.in_shape, packed.out_shape, packed.size) == ((3, 8), (5, 6), w.size)
  want = jnp.einsum('BTI,IF->BTF', x, w.reshape(24, 30), precision='highest').reshape(2, 4, 5, 6)
  for use_kernel in (True, False):
    np.testing.assert_allclose(native.matmul(x, packed, use_kernel=use_kernel), want, rtol=2e-5,
                               atol=1e-4)
  np.testing.assert_array_equal(native.unpack(packed), w)


def test_packed_matmul_of_no_rows():
  """An empty batch gives [0, F] on both paths and with every prologue (a reshape that infers a
  dimension from zero elements fails)."""
  packed = native.pack(jax.random.normal(jax.random.key(0), (6, 5)))
  cases = [(jnp.zeros((0, 6)), {}), (jnp.zeros((0, 6)), dict(norm=(jnp.ones(6), 1e-5))),
           (jnp.zeros((0, 2, 6)), dict(gated=True, residual=jnp.zeros((0, 5))))]
  for x, options in cases:
    for use_kernel in (True, False):
      got = jax.jit(lambda x, k=use_kernel, o=options: native.matmul(
          x, packed, use_kernel=k, **o))(x)
      assert got.shape == (0, 5), (options, use_kernel)


@jax.jit  # One program per shape, not one per op.
def _norm_dot_residual(x_RxI, scale_I, w_IxF, residual_RxF):
  """residual + rms_norm(x) @ w in XLA's ops."""
  return residual_RxF + jnp.dot(native.rms_norm(x_RxI, scale_I, 1e-6), w_IxF, precision='highest')


@pytest.mark.parametrize('isa', ISAS)
@pytest.mark.parametrize('rows', [1, 5, 9, 16, 24, 700])  # 700: the prologue on threads.
@pytest.mark.parametrize('d_in,d_out', [(40, 37), (1001, 70)])  # 1001 x 70: panels on threads.
def test_bfloat16_panels_multiply_in_float32(isa, rows, d_in, d_out):
  """bfloat16 panels: the kernel's product equals float32 arithmetic on the rounded weights, with
  the prologues and the residual too, and the XLA path gives the same."""
  w_IxF = jax.random.normal(jax.random.key(0), (d_in, d_out))
  x_RxI = jax.random.normal(jax.random.key(rows), (rows, d_in))
  packed = native.pack(w_IxF, dtype='bfloat16')
  assert packed.panels_PxIxC.dtype == jnp.bfloat16
  rounded_IxF = w_IxF.astype(jnp.bfloat16).astype(jnp.float32)
  np.testing.assert_array_equal(native.unpack(packed), rounded_IxF)
  assert not np.array_equal(rounded_IxF, w_IxF)  # The rounding is real: a test that can fail.
  scale = jnp.linspace(0.5, 1.5, d_in)
  residual = jax.random.normal(jax.random.key(9), (rows, d_out))
  want = _norm_dot_residual(x_RxI, scale, rounded_IxF, residual)
  for use_kernel in (True, False):
    got = jax.jit(lambda x, p, r, u=use_kernel: native.matmul(
        x, p, norm=(scale, 1e-6), residual=r, isa=isa, use_kernel=u))(x_RxI, packed, residual)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.sqrt(d_in))


@pytest.mark.parametrize('isa', ISAS)
@pytest.mark.parametrize('rows', [1, 5, 9, 16, 24, 700])  # 700: the prologue on threads.
@pytest.mark.parametrize('d_in,d_out', [(40, 37), (1001, 70)])  # 1001 x 70: panels on threads.
def test_int8_panels_multiply_in_float32(isa, rows, d_in, d_out):
  """int8 panels: each column quantized to 255 levels of its largest magnitude; the kernel's
  product equals float32 arithmetic on the quantized weights (prologues and residual too), on
  both paths."""
  w_IxF = jax.random.normal(jax.random.key(0), (d_in, d_out)).at[:, 5].set(0.0)
  x_RxI = jax.random.normal(jax.random.key(rows), (rows, d_in))
  packed = native.pack(w_IxF, dtype='int8')
  panels = -(-d_out // native.PANEL)
  assert packed.panels_PxIxC.dtype == jnp.int8 and packed.scales_PxC.shape == (panels,
                                                                               native.PANEL)
  quantized_IxF = native.unpack(packed)
  step_F = jnp.max(jnp.abs(w_IxF), axis=0) / 127
  assert np.all(np.abs(quantized_IxF - w_IxF) <= step_F[None, :] / 2 + 1e-6)  # Nearest level.
  np.testing.assert_array_equal(quantized_IxF[:, 5], 0.0)  # A zero column stays zero.
  assert not np.allclose(quantized_IxF, w_IxF, atol=1e-4)  # The quantization is real.
  np.testing.assert_array_equal(jnp.max(jnp.abs(packed.panels_PxIxC), axis=1).reshape(-1)[:5],
                                127)  # Each column's largest weight is the top level.
  scale = jnp.linspace(0.5, 1.5, d_in)
  residual = jax.random.normal(jax.random.key(9), (rows, d_out))
  want = _norm_dot_residual(x_RxI, scale, quantized_IxF, residual)
  for use_kernel in (True, False):
    got = jax.jit(lambda x, p, r, u=use_kernel: native.matmul(
        x, p, norm=(scale, 1e-6), residual=r, isa=isa, use_kernel=u))(x_RxI, packed, residual)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.sqrt(d_in))
  gated = jax.random.normal(jax.random.key(7), (rows, 2, d_in))
  want = jnp.dot(native.silu_gate(gated[:, 0], gated[:, 1]), quantized_IxF, precision='highest')
  got = native.matmul(gated, packed, gated=True, isa=isa, use_kernel=True)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.sqrt(d_in))


def test_pack_rejects_what_it_cannot_do():
  with pytest.raises(ValueError, match='stored as one of'):
    native.pack(jnp.zeros((4, 4)), dtype='float16')
  with pytest.raises(ValueError, match='Packed weights are one of'):
    models.pack(_model(), 'int4')
  with pytest.raises(ValueError, match='float32'):
    native.pack(jnp.zeros((4, 4), jnp.bfloat16))
  with pytest.raises(ValueError, match='in_dims'):
    native.pack(jnp.zeros((4, 4)), in_dims=2)
  with pytest.raises(ValueError, match='width'):
    native.matmul(jnp.zeros((2, 5)), native.pack(jnp.zeros((4, 4))))
  with pytest.raises(ValueError, match='width'):  # gated wants [..., 2, I].
    native.matmul(jnp.zeros((2, 3, 4)), native.pack(jnp.zeros((4, 4))), gated=True)
  with pytest.raises(ValueError, match='one prologue'):
    native.matmul(jnp.zeros((2, 2, 4)), native.pack(jnp.zeros((4, 4))), gated=True,
                  norm=(jnp.ones(4), 1e-6))
  with pytest.raises(ValueError, match='Norm scale'):
    native.matmul(jnp.zeros((2, 4)), native.pack(jnp.zeros((4, 4))), norm=(jnp.ones(3), 1e-6))
  with pytest.raises(ValueError, match='Residual'):
    native.matmul(jnp.zeros((2, 4)), native.pack(jnp.zeros((4, 3))), residual=jnp.zeros((2, 4)))
  with pytest.raises(ValueError, match='instruction set'):  # Caught before the library is called.
    native.matmul(jnp.zeros((2, 4)), native.pack(jnp.zeros((4, 4))), isa='sse9', use_kernel=True)


# One program per shape: op by op, the reference compiled ~1 s of small programs per shape.
_attention_reference = jax.jit(attention.reference, static_argnums=4)


@pytest.mark.parametrize('isa', ISAS)
@pytest.mark.parametrize('T,K,G,H,S', [(1, 2, 3, 64, 40), (5, 2, 3, 64, 40), (4, 1, 6, 24, 40),
                                       (3, 3, 1, 36, 40), (16, 2, 4, 8, 40), (20, 2, 3, 16, 40),
                                       (2, 2, 2, 10, 40),  # H = 10: not whole vectors.
                                       (5, 1, 4, 64, 3000),  # A long cache, filled to the end.
                                       (40, 2, 2, 16, 300)])  # A prefill: blocks of positions.
def test_cached_attention_equals_reference(isa, T, K, G, H, S):
  """Rotation, cache writes and attention: the kernel's outputs and both caches, every slot."""
  B = 3
  keys = jax.random.normal(jax.random.key(0), (B, S, K, H))
  values = jax.random.normal(jax.random.key(1), (B, S, K, H))
  qkv = 3 * jax.random.normal(jax.random.key(2), (B, T, K * G + 2 * K, H))  # Peaked softmaxes.
  starts = jnp.array([0, 17, S - T], jnp.int32)
  assert attention.use_kernel(qkv, keys)
  kernel = jax.jit(lambda *a: attention._kernel(*a, 500.0, isa))  # pylint: disable=protected-access
  got = kernel(qkv, keys, values, starts, jnp.zeros((0,), jnp.int32))
  want = _attention_reference(qkv, keys, values, starts, 500.0)
  for g, w in zip(got, want, strict=True):
    np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize('isa', ISAS)
def test_cached_attention_skips_padding_positions(isa):
  """With counts (a prefill of right-padded prompts) row b's first counts[b] positions are the
  reference's; the padding's outputs are zeros and its cache slots keep what they held."""
  B, S, T, K, G, H = 3, 40, 20, 2, 3, 16
  keys = jax.random.normal(jax.random.key(0), (B, S, K, H))
  values = jax.random.normal(jax.random.key(1), (B, S, K, H))
  qkv = 3 * jax.random.normal(jax.random.key(2), (B, T, K * G + 2 * K, H))
  starts, counts = jnp.array([0, 5, 20], jnp.int32), [T, 7, 0]
  got_out, got_k, got_v = jax.jit(lambda *a: attention.cached_attention(
      *a[:4], rope_base=500.0, counts_B=a[4], isa=isa))(qkv, keys, values, starts,
                                                       jnp.array(counts, jnp.int32))
  want_out, want_k, want_v = attention.reference(qkv, keys, values, starts, 500.0)
  for b, (start, count) in enumerate(zip(np.asarray(starts), counts)):
    np.testing.assert_allclose(got_out[b, :count], want_out[b, :count], rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(got_out[b, count:], 0.0)
    for got, want, before in ((got_k, want_k, keys), (got_v, want_v, values)):
      np.testing.assert_allclose(got[b, :start + count], want[b, :start + count], rtol=2e-5,
                                 atol=2e-5)
      np.testing.assert_array_equal(got[b, start + count:], before[b, start + count:])


def test_cached_attention_writes_in_place_or_copies():
  """Donated caches are written in place; kept ones are copied first and stay unchanged."""
  B, S, K, G, H = 2, 16, 2, 2, 8
  keys = jax.random.normal(jax.random.key(0), (B, S, K, H))
  values = jax.random.normal(jax.random.key(1), (B, S, K, H))
  qkv = jax.random.normal(jax.random.key(2), (B, 3, K * G + 2 * K, H))
  starts = jnp.array([2, 9], jnp.int32)
  want = attention.reference(qkv, keys, values, starts, 10_000.0)
  call = lambda *a: attention.cached_attention(*a, rope_base=10_000.0)
  kept = jax.jit(call)(qkv, keys, values, starts)
  keys_copy, values_copy = jnp.copy(keys), jnp.copy(values)
  donated = jax.jit(call, donate_argnums=(1, 2))(qkv, keys_copy, values_copy, starts)
  assert keys_copy.is_deleted()
  for a, b, w in zip(kept, donated, want, strict=True):
    np.testing.assert_allclose(a, w, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(a, b)
  assert not np.array_equal(kept[1], keys)  # The input itself is untouched...
  np.testing.assert_array_equal(keys, jax.random.normal(jax.random.key(0), (B, S, K, H)))


def test_cached_attention_falls_back_for_many_queries():
  qkv = jnp.zeros((1, attention.MAX_KERNEL_QUERIES + 1, 3, 8))
  assert not attention.use_kernel(qkv, jnp.zeros((1, 80, 1, 8)))
  assert not attention.use_kernel(qkv[:, :1], jnp.zeros((1, 80, 1, 8), jnp.bfloat16))
  with pytest.raises(ValueError, match='kv heads'):
    attention.cached_attention(jnp.zeros((1, 1, 5, 8)), jnp.zeros((1, 8, 2, 8)),
                               jnp.zeros((1, 8, 2, 8)), jnp.zeros((1,), jnp.int32), rope_base=1e4)


def _model(dtype='float32', **overrides):
  config = models.TransformerConfig(vocab_size=61, d_model=40, num_layers=2, num_heads=4,
                                    num_kv_heads=2, d_ff=72, max_seq_len=64, dtype=dtype,
                                    **overrides)
  return models.Model(config, models.init_params(config, jax.random.key(0)))


@pytest.mark.parametrize('overrides', [{}, dict(tie_embeddings=False), dict(mlp='gelu')])
def test_pack_unpack_model(overrides):
  model = _model(**overrides)
  packed = models.pack(model)
  assert models.is_packed(packed) and not models.is_packed(model)
  assert models.num_params(packed.params) == models.num_params(model.params)
  assert ('head' in packed.params) == ('head' in model.params) or model.config.tie_embeddings
  unpacked = models.unpack(packed)
  assert jax.tree.structure(unpacked.params) == jax.tree.structure(model.params)
  for got, want in zip(jax.tree.leaves(unpacked.params), jax.tree.leaves(model.params)):
    np.testing.assert_array_equal(got, want)


def test_for_decoding_packs_float32_on_one_cpu_device_only():
  model = _model()
  assert models.packable(model) is None
  assert models.is_packed(models.for_decoding(model))
  bf16 = _model('bfloat16')
  assert 'bfloat16' in models.packable(bf16)
  assert models.for_decoding(bf16) is bf16
  with pytest.raises(ValueError, match='float32'):
    models.pack(bf16)


@pytest.mark.parametrize('method', ['ars', 'sps', 'sps_dynamic', 'sps_lookup'])
def test_greedy_decoding_of_packed_model_equals_unpacked(method):
  """Same tokens from the packed and the unpacked pair (greedy: argmax of equal logits), with an
  eos that stops one row early: the packed kernels skip the idle rows' work (count 0) while the
  other rows go on, and those rows' tokens stay the same. Ragged drafters (dynamic k, prompt
  lookup) propose fewer than k drafts in some rows: the target then scores, and the draft model
  reads, only what each row proposed, and the tokens stay ArS's."""
  target = _model()
  draft_config = models.TransformerConfig(vocab_size=61, d_model=24, num_layers=1, num_heads=2,
                                          d_ff=48, max_seq_len=64)
  draft = models.Model(draft_config, models.init_params(draft_config, jax.random.key(1)))
  prompts = jax.random.randint(jax.random.key(2), (3, 6), 0, 61)
  lengths = jnp.array([6, 2, 4])
  greedy = sampling.SamplingConfig(temperature=0.0)
  free = np.asarray(sampling.autoregressive_sample(target, prompts, lengths, jax.random.key(3),
                                                   max_new_tokens=20, sampling=greedy).tokens)
  eos_id = next(int(free[0, j]) for j in range(3, 20) if free[0, j] not in free[0, :j])

  def run(t, d):
    if method == 'ars':
      return sampling.autoregressive_sample(t, prompts, lengths, jax.random.key(3),
                                            max_new_tokens=20, sampling=greedy, eos_id=eos_id)
    drafter = {'sps': drafters.ModelDrafter(), 'sps_dynamic': drafters.ModelDrafter(stop_below=0.1),
               'sps_lookup': drafters.PromptLookup(max_ngram=2)}[method]
    if method == 'sps_dynamic':  # The target drafts: every draft it proposes is accepted.
      d = t
    return sampling.speculative_sample(t, None if method == 'sps_lookup' else d, prompts, lengths,
                                       jax.random.key(3), k=3, max_new_tokens=20, sampling=greedy,
                                       eos_id=eos_id, drafter=drafter)

  want = run(target, draft)
  assert len(set(np.asarray(want.num_generated).tolist())) > 1  # Rows stop at different times.
  got = run(models.pack(target), models.pack(draft))
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_array_equal(got.num_generated, want.num_generated)
  if method != 'ars':  # Equal drafts too (greedy drafts of equal logits): same loops, accepted.
    np.testing.assert_array_equal(got.num_loops, want.num_loops)
    np.testing.assert_array_equal(got.accepted_histogram, want.accepted_histogram)
  if method == 'sps_dynamic':
    np.testing.assert_array_equal(got.num_accepted, got.num_drafted)
  ars = sampling.autoregressive_sample(target, prompts, lengths, jax.random.key(3),
                                      max_new_tokens=20, sampling=greedy, eos_id=eos_id)
  np.testing.assert_array_equal(got.tokens, ars.tokens)
  if method in ('sps_dynamic', 'sps_lookup'):  # Some loops proposed fewer than k, some more than 0.
    proposed = np.asarray(got.proposed_histogram)
    assert proposed[:3].sum() > 0 and proposed[1:].sum() > 0, proposed
  if method == 'sps':  # A draft in bfloat16 or int8 changes its proposals, never the tokens.
    for weights in ('bfloat16', 'int8'):
      draft_low = models.pack(draft, weights)
      assert models.packed_dtype(draft_low) == weights and models.packed_dtype(draft) is None
      np.testing.assert_array_equal(run(models.pack(target), draft_low).tokens, want.tokens)


def test_sharded_placement_unpacks():
  """On a mesh XLA's dots do the products: placing a packed model unpacks it."""
  model = models.pack(_model())
  placed = sampling.common.place_params(model, sharding.make_mesh(1, 2, jax.devices()[:2]))
  assert not models.is_packed(placed)
  assert all(len(x.devices()) == 2 for x in jax.tree.leaves(placed.params))
  assert 'not one CPU device' in models.packable(placed)


def assert_draws_agree_but_at_boundaries(got_R, want_R, uniforms_R, weights_RxV,
                                         most: int = 5, tolerance: float = 5e-6):
  """Draws from the same uniforms agree in all rows but at most `most`, and each row where they
  differ has its uniform within `tolerance` (float32 prefix sums' rounding) of the boundary between
  the two tokens in the float64 CDF of `weights`, with no mass beyond that between them. Both
  tokens have positive weight."""
  got_R, want_R = np.asarray(got_R), np.asarray(want_R)
  weights_RxV = np.asarray(weights_RxV, np.float64)
  rows = np.arange(len(got_R))
  assert np.all(weights_RxV[rows, got_R] > 0) and np.all(weights_RxV[rows, want_R] > 0)
  differ = np.flatnonzero(got_R != want_R)
  assert len(differ) <= most, f'{len(differ)} of {len(got_R)} draws differ (rows {differ[:20]})'
  for r in differ:
    cdf_V = np.cumsum(weights_RxV[r]) / weights_RxV[r].sum()
    lo, hi = sorted((got_R[r], want_R[r]))
    between = cdf_V[hi - 1] - cdf_V[lo]  # Mass strictly between the two tokens.
    assert abs(uniforms_R[r] - cdf_V[lo]) <= tolerance and between <= tolerance, (
        f'row {r}: tokens {got_R[r]} vs {want_R[r]} at u = {uniforms_R[r]:.9f}, boundary '
        f'{cdf_V[lo]:.9f}, mass between {between:.3g}')


def assert_same_support_but_at_top_p(probs_RxV, want_RxV, before_top_p_RxV, top_p: float,
                                     tolerance=1e-5):
  """The same tokens have positive probability, but where top-p's cut falls within rounding of a
  token's rank: the mass ranked before each token that differs, in the law top-p cuts
  (`before_top_p`: probabilities descending, ties by id), is within `tolerance` of top_p.
  Returns whether each row's support is the same."""
  probs_RxV, want_RxV = np.asarray(probs_RxV), np.asarray(want_RxV)
  same_R = np.all((probs_RxV > 0) == (want_RxV > 0), axis=1)
  for r in np.flatnonzero(~same_R):
    differ = np.flatnonzero((probs_RxV[r] > 0) != (want_RxV[r] > 0))
    law = np.asarray(before_top_p_RxV[r], np.float64)
    order = np.lexsort((np.arange(len(law)), -law))  # Descending, ties by id.
    before = (np.cumsum(law[order]) - law[order])[np.argsort(order)]
    assert top_p < 1 and np.all(np.abs(before[differ] - top_p) <= tolerance), (
        f'row {r}: support differs at tokens {differ[:10]} (mass before {before[differ[:10]]})')
  return same_R


# Jitted once for the module: a program per shape, setting and isa, whichever test calls it.
@functools.partial(jax.jit, static_argnums=(2, 3))
def _native_probabilities(logits, uniforms, config, isa):
  return native.probabilities_and_draw(logits, uniforms, temperature=config.temperature,
                                       top_k=config.top_k, top_p=config.top_p, isa=isa)


_draws = jax.jit(jax.vmap(processors.draw_with))


def _xla_probabilities(logits, uniforms, config):
  probs = jax.jit(processors.probabilities, static_argnums=1)(logits, config)
  return probs, _draws(uniforms, probs)


@functools.lru_cache(maxsize=1)  # The isas of a case run one after another: made once for all.
def _probabilities_case(settings_items, V):
  """(config, logits, uniforms, XLA's probabilities and draws, the law before top-p) of a case of
  `test_probabilities_kernel_equals_processors`."""
  config = sampling.SamplingConfig(**dict(settings_items))
  R = {37: 2000, 4100: 400, 50257: 48}[V]
  logits = 3 * jax.random.normal(jax.random.key(0), (R, V))
  logits = logits.at[:20, :10].set(4.0).at[20:40, 5:9].set(
      jnp.max(logits[20:40], axis=1)[:, None])
  logits = logits.at[R - 1].set(0.0)  # A flat row: the whole vocabulary ties.
  uniforms = jax.random.uniform(jax.random.key(1), (R,)).at[:2].set([0.0, 1 - 2.0 ** -24])
  want, want_tokens = _xla_probabilities(logits, uniforms, config)
  # Jitted: op by op, top-p's blockwise cumsum took ~2 s a case.
  before_top_p = jax.jit(processors.probabilities, static_argnums=1)(
      logits, dataclasses.replace(config, top_p=1.0))
  return (config, logits, uniforms,
          *(np.asarray(x) for x in (uniforms, want, want_tokens, before_top_p)))


@pytest.mark.parametrize('isa', ISAS)
@pytest.mark.parametrize('settings', [dict(temperature=1.0), dict(temperature=0.8, top_p=0.95),
                                      dict(temperature=0.7, top_k=50, top_p=0.8),
                                      dict(temperature=1.3, top_k=3), dict(temperature=0.0),
                                      dict(temperature=2.0, top_p=0.3)])
@pytest.mark.parametrize('V', [50257, 4100, 37])
def test_probabilities_kernel_equals_processors(isa, settings, V):
  """Same distribution (support exactly, values to float rounding) and the same draws from the
  same uniforms as `spsjax.sampling.processors`, ties included (ranked by id), but where a
  uniform falls within rounding of a CDF boundary. V = 4100: whole vectors and 64-token blocks
  plus a tail; 37: a tail only."""
  config, logits, uniforms, uniforms_np, want, want_tokens, before_top_p = _probabilities_case(
      tuple(sorted(settings.items())), V)
  R = logits.shape[0]
  probs, tokens = (np.asarray(x) for x in _native_probabilities(logits, uniforms, config, isa))
  rounding = 1e-5
  same = assert_same_support_but_at_top_p(probs, want, before_top_p, config.top_p, rounding)
  assert np.sum(~same) <= 1  # Only the flat row's ties can meet the cut.
  np.testing.assert_allclose(probs[same], want[same], rtol=rounding, atol=1e-6)
  assert_draws_agree_but_at_boundaries(tokens[same], want_tokens[same], uniforms_np[same],
                                       want[same], tolerance=rounding / 2)
  assert np.all(probs[np.arange(R), tokens] > 0)


def _odd_rows(V):
  """Logit rows at the edges of float32, and what their distribution must be (None: none)."""
  finite = np.linspace(-3.0, 2.0, V).astype(np.float32)
  rows = {
      'nan': finite.copy(), 'negative_nan': finite.copy(), 'plus_inf': finite.copy(),
      'all_minus_inf': np.full(V, -np.inf, np.float32),
      'masked': finite.copy(), 'one_left': np.full(V, -np.inf, np.float32),
      'huge_spread': finite.copy(), 'float32_extremes': finite.copy(),
      'all_equal_huge': np.full(V, 3e38, np.float32),
  }
  rows['nan'][V // 2] = np.nan
  rows['negative_nan'][0] = np.copysign(np.float32(np.nan), -1)  # x86's NaN (inf - inf).
  rows['plus_inf'][V // 3] = np.inf
  rows['masked'][1::2] = -np.inf  # Banned tokens, the last one included.
  rows['one_left'][V // 2] = 5.0
  rows['huge_spread'][::3] = -200.0  # exp underflows: probability exactly 0.
  rows['huge_spread'][1::3] = -1e30
  rows['float32_extremes'][:3] = [3.4e38, -3.4e38, 3.3e38][:V]
  return rows


@pytest.mark.parametrize('isa', ISAS + ['xla'])
@pytest.mark.parametrize('settings', [dict(temperature=1.0), dict(temperature=0.0),
                                      dict(temperature=0.7, top_k=5, top_p=0.9),
                                      dict(temperature=1.2e-38, top_p=0.9),
                                      dict(temperature=8.5e37, top_p=0.5),
                                      dict(temperature=1.0, top_k=2 ** 40, top_p=1e-30)])
@pytest.mark.parametrize('V', [1, 2, 17, 4100])
def test_odd_logits_have_one_defined_result(isa, settings, V):
  """Any float32 row and any accepted setting: a row with a NaN or +inf logit or no logit above
  -inf has no distribution (NaN everywhere, token 0) on every path; a -inf logit and one whose
  scaled value's exp underflows have probability exactly 0 and are never drawn, whatever the
  uniform (0 and the largest float below 1 included); every other row is a distribution."""
  config = sampling.SamplingConfig(**settings)
  names, rows = zip(*_odd_rows(V).items())
  logits = np.stack(rows)
  R = len(names)
  u_values = np.array([0.0, 0.5, 1 - 2.0 ** -24], np.float32)
  for u in u_values:
    uniforms = jnp.full((R,), u)
    if isa == 'xla':
      probs, tokens = _xla_probabilities(jnp.asarray(logits), uniforms, config)
    else:
      probs, tokens = _native_probabilities(jnp.asarray(logits), uniforms, config, isa)
    probs, tokens = np.asarray(probs), np.asarray(tokens)
    for r, name in enumerate(names):
      defined = not (np.isnan(logits[r]).any() or np.isposinf(logits[r]).any()
                     or np.isneginf(logits[r]).all())
      if not defined:
        assert np.isnan(probs[r]).all() and tokens[r] == 0, (name, probs[r][:4], tokens[r])
        continue
      assert not np.isnan(probs[r]).any(), name
      assert np.sum(probs[r]) == pytest.approx(1.0, abs=1e-5), name
      assert 0 <= tokens[r] < V and probs[r, tokens[r]] > 0, (name, tokens[r])
      np.testing.assert_array_equal(probs[r][np.isneginf(logits[r])], 0.0, err_msg=name)
      if name == 'huge_spread' and config.temperature == 1.0:
        np.testing.assert_array_equal(probs[r][logits[r] <= logits[r].max() - 200.0], 0.0)
  if isa != 'xla':  # Both paths agree row by row (values to rounding).
    want, _ = _xla_probabilities(jnp.asarray(logits), jnp.zeros((R,)), config)
    np.testing.assert_array_equal(np.isnan(probs), np.isnan(want))
    np.testing.assert_allclose(probs, want, rtol=1e-5, atol=1e-6)


def test_sampling_config_refuses_what_float32_cannot_do():
  for temperature in (1e-39, 1e-45, float('inf'), float('nan'), -1.0, 1e38, 3e38):
    with pytest.raises(ValueError, match='temperature'):
      sampling.SamplingConfig(temperature=temperature)
  sampling.SamplingConfig(temperature=float(np.finfo(np.float32).tiny))  # The smallest accepted.


def test_take_rows_equals_take():
  table = jax.random.normal(jax.random.key(0), (11, 24))
  ids = jnp.array([[0, 10, 3], [3, 7, 1]], jnp.int32)
  want = jnp.take(table, ids, axis=0)
  for use_kernel in (True, False):
    got = jax.jit(lambda t, i, u=use_kernel: native.take_rows(t, i, use_kernel=u))(table, ids)
    np.testing.assert_array_equal(got, want)
  # Out of range: clipped into the table, on both paths.
  out = jnp.array([[-4, 11]], jnp.int32)
  for use_kernel in (True, False):
    got = jax.jit(lambda t, i, u=use_kernel: native.take_rows(t, i, use_kernel=u))(table, out)
    np.testing.assert_array_equal(got, table[jnp.array([[0, 10]])])


def test_for_decoding_checks_the_weights_dtype_where_it_does_not_pack():
  bf16_model = _model(dtype='bfloat16')  # Not packable: returned as is, the value still checked.
  assert models.for_decoding(bf16_model, 'bfloat16') is bf16_model
  with pytest.raises(ValueError, match='Packed weights are one of'):
    models.for_decoding(bf16_model, 'int4')


def test_threefry_unrolled_on_cpu_draws_the_same_bits():
  # Importing spsjax.sampling registered the straight-line lowering; the rolled one (JAX's
  # default on the CPU) must give the same bits, and only it a loop.
  from jax._src.interpreters import mlir
  from jax._src.random import threefry2x32
  assert threefry.unroll_on_cpu()

  def draws(offset):  # A fresh function per lowering: nothing comes from jit's caches.
    return jax.jit(lambda key: (jax.random.uniform(jax.random.fold_in(key, 7 + offset), (5,)),
                                jax.random.key_data(jax.random.split(key, 3))))

  key = jax.random.key(3)
  unrolled = draws(0)
  mlir.register_lowering(threefry2x32.threefry2x32_p,
                         threefry2x32._threefry2x32_cpu_lowering_rule, platform='cpu')
  try:
    rolled = draws(0)
    rolled_text = rolled.lower(key).compile().as_text()
    rolled_out = rolled(key)
  finally:
    mlir.register_lowering(threefry2x32.threefry2x32_p,
                           threefry2x32._threefry2x32_lowering_rule, platform='cpu')
  assert ' while(' in rolled_text
  assert ' while(' not in unrolled.lower(key).compile().as_text()
  for a, b in zip(unrolled(key), rolled_out):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@functools.lru_cache(maxsize=1)  # The isas of a case run one after another: made once for all.
def _accept_case(lenience, V):
  """(K, p, q, drafts, num, row keys, `rejection.accept_and_resample`'s counts and tokens, the
  uniforms it drew from, those of the tokens) of a case of `test_accept_kernel_equals_rejection`."""
  B, K = 2048 if V == 37 else 256, 3
  keys = jax.random.split(jax.random.key(V), 6)
  p = jax.nn.softmax(2 * jax.random.normal(keys[0], (B, K + 1, V)), -1)
  q = jax.nn.softmax(jnp.log(p[:, :K]) + 0.7 * jax.random.normal(keys[1], (B, K, V)), -1)
  q = q.at[:8].set(p[:8, :K])  # Equal laws: every draft accepted, or a residual without mass.
  p = p.at[8:16].set(jax.nn.one_hot(jnp.argmax(p[8:16], -1), V))  # Greedy targets.
  drafts = jax.random.categorical(keys[2], jnp.log(q)).astype(jnp.int32)
  num = jnp.arange(B, dtype=jnp.int32) % (K + 1)
  row_keys = jax.random.split(keys[3], B)
  want_n, want_tokens = jax.vmap(functools.partial(rejection.accept_and_resample,
                                                   lenience=lenience))(row_keys, p, q, drafts, num)
  u, token_keys = jax.vmap(lambda key: rejection._split(key, K))(row_keys)  # pylint: disable=protected-access
  return K, p, q, drafts, num, row_keys, want_n, want_tokens, u, processors.uniforms(token_keys)


@pytest.mark.parametrize('isa', ISAS)
@pytest.mark.parametrize('lenience', [1.0, 0.6])
@pytest.mark.parametrize('V', [4100, 37])
def test_accept_kernel_equals_rejection(isa, lenience, V):
  """The accept step's kernel against `rejection.accept_and_resample` from the same uniforms: the
  same number of accepted drafts in every row, and the same tokens but at rounding boundaries,
  always of positive weight in the law they were drawn from. Rows cover every count of proposed
  drafts, p = q (no residual mass: p itself), one-hot p (greedy) and drafts q gave no mass to."""
  K, p, q, drafts, num, row_keys, want_n, want_tokens, u, u_tokens = _accept_case(lenience, V)
  n, tokens = jax.jit(lambda *a: native.accept(*a, lenience=lenience, isa=isa))(
      p, q, drafts, num, u, u_tokens)
  np.testing.assert_array_equal(n, want_n)
  assert len(set(np.asarray(n).tolist())) == K + 1  # Every count occurs.
  laws = jax.jit(jax.vmap(lambda p, q, n, num: jnp.where(
      (n < num) & (jnp.sum(jnp.maximum(p[n] - q[jnp.minimum(n, K - 1)], 0)) > 0),
      jnp.maximum(p[n] - q[jnp.minimum(n, K - 1)], 0), p[n])))(p, q, n, num)
  assert_draws_agree_but_at_boundaries(tokens, want_tokens, u_tokens, laws)
  # And through the batched entry point the loop calls.
  got = jax.jit(lambda *a: rejection.accept_and_resample_rows(
      *a, lenience=lenience, native_kernel=True))(row_keys, p, q, drafts, num)
  np.testing.assert_array_equal(got[0], want_n)


@pytest.mark.parametrize('isa', ISAS + ['xla'])
def test_accept_at_the_edge_uniforms(isa):
  """u = 0 and u = the largest float below 1, on every draft test and on the token's draw: u = 0
  accepts a draft iff p(d) > 0 and draws the first token of positive weight; u -> 1 accepts iff
  p(d) >= q(d) (but for rounding) and draws the last token of positive weight; a draft the target
  gives no mass is never accepted, and no token of zero weight ever comes out."""
  V, K = 40, 3
  keys = jax.random.split(jax.random.key(7), 3)
  p = jax.nn.softmax(2 * jax.random.normal(keys[0], (64, K + 1, V)), -1)
  p = jnp.where(jax.random.uniform(keys[1], p.shape) < 0.3, 0.0, p)  # Zero target mass...
  p = p / jnp.sum(p, -1, keepdims=True)
  q = jax.nn.softmax(2 * jax.random.normal(keys[2], (64, K, V)), -1)
  q = q.at[:32].set(p[:32, :K])  # q = p: accepted at any u < 1 where p(d) > 0.
  drafts = jax.random.randint(keys[2], (64, K), 0, V)  # Some where p, or q, is 0.
  num = jnp.full((64,), K, jnp.int32)
  p_np, q_np, drafts_np = (np.asarray(x) for x in (p, q, drafts))
  rows = np.arange(64)
  p_at = p_np[rows[:, None], np.arange(K)[None], drafts_np]
  q_at = q_np[rows[:, None], np.arange(K)[None], drafts_np]
  for u in (0.0, 1 - 2.0 ** -24):
    u_BxK, u_token_B = jnp.full((64, K), u, jnp.float32), jnp.full((64,), u, jnp.float32)
    if isa == 'xla':
      n, tokens = jax.jit(jax.vmap(rejection.accept_with))(u_BxK, u_token_B, p, q, drafts, num)
    else:
      n, tokens = jax.jit(lambda *a: native.accept(*a, lenience=1.0, isa=isa))(
          p, q, drafts, num, u_BxK, u_token_B)
    n, tokens = np.asarray(n), np.asarray(tokens)
    passes = p_at > 0 if u == 0 else p_at > np.float32(u) * q_at
    np.testing.assert_array_equal(n, np.argmin(np.c_[passes, np.zeros(64, bool)], axis=1))
    assert np.any(n < K) and np.any(n > 0)  # Both outcomes occur.
    residual = np.maximum(p_np[rows, n] - q_np[rows, np.minimum(n, K - 1)], 0)
    law = np.where((n < K)[:, None] & (residual.sum(-1, keepdims=True) > 0), residual,
                   p_np[rows, n])
    positive = law > 0
    want = (np.argmax(positive, -1) if u == 0
            else V - 1 - np.argmax(positive[:, ::-1], -1))
    np.testing.assert_array_equal(tokens, want)
