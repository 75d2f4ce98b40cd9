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


# Packing jitted: op by op it compiled half a dozen small programs per shape.
_pack = jax.jit(native.pack, static_argnames=('in_dims', 'tied_to', 'dtype'))


def _normal(seed, shape, scale=1.0):
  """float32 normals from numpy: inputs and references made without compiling anything."""
  return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


def _matmuls(packed, cases, isa, use_kernel=True):
  """`native.matmul(x, packed, **options)` for each (x, options) of `cases`, all in one jitted
  program: one compile for a test's row counts and prologues instead of one per product."""
  arrays = [(x, o['norm'][0] if 'norm' in o else None, o.get('residual'), o.get('counts'))
            for x, o in cases]
  statics = [(o.get('gated', False), o['norm'][1] if 'norm' in o else None) for _, o in cases]

  @jax.jit
  def run(packed, arrays):
    return [native.matmul(x, packed, norm=None if eps is None else (scale, eps), gated=gated,
                          residual=residual, counts=counts, isa=isa, use_kernel=use_kernel)
            for (x, scale, residual, counts), (gated, eps) in zip(arrays, statics, strict=True)]
  return [np.asarray(got) for got in run(packed, arrays)]


def _np_rms_norm(x, scale, eps):
  x = x.astype(np.float64)
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _np_silu_gate(gate, x):
  gate = gate.astype(np.float64)
  return gate / (1 + np.exp(-gate)) * x


@pytest.mark.parametrize('isa', ISAS)
# Inner widths that are not whole vectors (37, 13: the tail loops), and 1000 x 70 on threads.
@pytest.mark.parametrize('d_in,d_out', [(96, 160), (40, 37), (1024, 48), (37, 20), (13, 5),
                                        (1000, 70)])
def test_packed_matmul_equals_dot(isa, d_in, d_out):
  """1 to 300 rows (one program for all), against a float64 product. From 9 rows AVX-512's tiles
  read their rows transposed, 16 depths at a time in registers (12, 15: partial stores)."""
  w_IxF = _normal(0, (d_in, d_out))
  xs = [_normal(rows, (rows, d_in)) for rows in (1, 3, 5, 8, 9, 12, 15, 16, 17, 67, 300)]
  gots = _matmuls(_pack(w_IxF), [(x, {}) for x in xs], isa)
  for x_RxI, got in zip(xs, gots, strict=True):
    np.testing.assert_allclose(got, x_RxI.astype(np.float64) @ w_IxF, rtol=2e-5,
                               atol=2e-5 * np.sqrt(d_in), err_msg=f'{len(x_RxI)} rows')


@pytest.mark.parametrize('isa', ISAS)
@pytest.mark.parametrize('d_in,d_out', [(96, 160), (40, 37), (128, 600)])
def test_packed_matmul_prologues_and_residual(isa, d_in, d_out):
  """rms_norm(x) @ w, silu_gate(x) @ w, and + residual, against float64 arithmetic, for 1 to 700
  rows (700 x 128: the prologue on threads); the XLA path (the same for every isa) with the
  baseline's."""
  w_IxF = _normal(0, (d_in, d_out))
  scale_I = 1 + _normal(1, (d_in,))
  cases, wants = [], []
  for rows in (1, 5, 9, 16, 24, 700):
    x_RxI = _normal(rows, (rows, d_in), scale=3.0)
    residual_RxF = _normal(rows + 1, (rows, d_out))
    gate_RxI = x_RxI.copy()  # Gates far in both tails too: the sigmoid must not overflow.
    gate_RxI[:, 0], gate_RxI[:, 1] = -100.0, 100.0
    gate_in_Rx2xI = np.stack([gate_RxI, x_RxI[::-1]], axis=1)
    gated_RxF = _np_silu_gate(gate_RxI, x_RxI[::-1]) @ w_IxF
    cases += [(x_RxI, dict(norm=(scale_I, 1e-5))), (gate_in_Rx2xI, dict(gated=True)),
              (x_RxI, dict(residual=residual_RxF)),
              (gate_in_Rx2xI, dict(gated=True, residual=residual_RxF))]
    wants += [_np_rms_norm(x_RxI, scale_I, 1e-5) @ w_IxF, gated_RxF,
              residual_RxF + x_RxI.astype(np.float64) @ w_IxF, residual_RxF + gated_RxF]
  for use_kernel in (True, False) if isa == 'baseline' else (True,):
    gots = _matmuls(_pack(w_IxF), cases, isa, use_kernel)
    for got, (x, options), want in zip(gots, cases, wants, strict=True):
      np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.sqrt(d_in),
                                 err_msg=f'{len(x)} rows, {sorted(options)}, kernel={use_kernel}')


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
  w_IxF = _normal(0, (d_in, d_out))
  x_BxTxI = _normal(T, (B, T, d_in))
  scale_I = 1 + _normal(1, (d_in,))
  residual_BxTxF = _normal(2, (B, T, d_out))
  counts_B = np.array(counts, np.int32)
  cases = [(x_BxTxI, dict(counts=counts_B)),
           (x_BxTxI, dict(norm=(scale_I, 1e-5), residual=residual_BxTxF, counts=counts_B)),
           (np.stack([x_BxTxI, x_BxTxI[:, ::-1]], axis=2),
            dict(gated=True, residual=residual_BxTxF, counts=counts_B))]
  wants = [x_BxTxI.astype(np.float64) @ w_IxF,
           residual_BxTxF + _np_rms_norm(x_BxTxI, scale_I, 1e-5) @ w_IxF,
           residual_BxTxF + _np_silu_gate(x_BxTxI, x_BxTxI[:, ::-1]) @ w_IxF]
  for got, (_, options), want in zip(_matmuls(_pack(w_IxF), cases, isa), cases, wants,
                                     strict=True):
    for b, count in enumerate(counts):
      np.testing.assert_allclose(got[b, :count], want[b, :count], rtol=1e-4,
                                 atol=1e-4 * np.sqrt(d_in), err_msg=f'{sorted(options)}')
      padding = residual_BxTxF[b, count:] if 'residual' in options else 0.0
      np.testing.assert_array_equal(got[b, count:], padding)
  with pytest.raises(ValueError, match='counts'):
    native.matmul(x_BxTxI, _pack(w_IxF), counts=jnp.array([1, 2], jnp.int32))


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


_unpack = jax.jit(native.unpack)
LOW_PRECISION_ROWS = (1, 5, 9, 16, 24, 700)  # 700: the prologue on threads.


def _check_low_precision_products(packed, dense_IxF, isa):
  """residual + rms_norm(x) @ w on both paths (XLA's with the baseline's isa), and silu_gate(x) @ w
  on the kernel's, equal float64 arithmetic on `dense_IxF` (the packed weights as float32), for
  LOW_PRECISION_ROWS."""
  d_in, d_out = dense_IxF.shape
  scale_I = np.linspace(0.5, 1.5, d_in, dtype=np.float32)
  cases, wants = [], []
  for rows in LOW_PRECISION_ROWS:
    x_RxI, residual_RxF = _normal(rows, (rows, d_in)), _normal(9, (rows, d_out))
    cases.append((x_RxI, dict(norm=(scale_I, 1e-6), residual=residual_RxF)))
    wants.append(residual_RxF + _np_rms_norm(x_RxI, scale_I, 1e-6) @ dense_IxF)
  for use_kernel in (True, False) if isa == 'baseline' else (True,):  # XLA's: the same for all.
    for got, (x, _), want in zip(_matmuls(packed, cases, isa, use_kernel), cases, wants):
      np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.sqrt(d_in),
                                 err_msg=f'{len(x)} rows, kernel={use_kernel}')
  gated = [_normal(7 + rows, (rows, 2, d_in)) for rows in LOW_PRECISION_ROWS]
  gots = _matmuls(packed, [(g, dict(gated=True)) for g in gated], isa)
  for got, g in zip(gots, gated):
    np.testing.assert_allclose(got, _np_silu_gate(g[:, 0], g[:, 1]) @ dense_IxF, rtol=2e-5,
                               atol=2e-5 * np.sqrt(d_in), err_msg=f'{len(g)} rows, gated')


@pytest.mark.parametrize('isa', ISAS)
@pytest.mark.parametrize('d_in,d_out', [(40, 37), (1001, 70)])  # 1001 x 70: panels on threads.
def test_bfloat16_panels_multiply_in_float32(isa, d_in, d_out):
  """bfloat16 panels: the kernel's product equals float32 arithmetic on the rounded weights, with
  the prologues and the residual too, and the XLA path gives the same."""
  w_IxF = _normal(0, (d_in, d_out))
  packed = _pack(w_IxF, dtype='bfloat16')
  assert packed.panels_PxIxC.dtype == jnp.bfloat16
  rounded_IxF = np.asarray(jnp.asarray(w_IxF).astype(jnp.bfloat16).astype(jnp.float32))
  np.testing.assert_array_equal(_unpack(packed), rounded_IxF)
  assert not np.array_equal(rounded_IxF, w_IxF)  # The rounding is real: a test that can fail.
  _check_low_precision_products(packed, rounded_IxF, isa)


@pytest.mark.parametrize('isa', ISAS)
@pytest.mark.parametrize('d_in,d_out', [(40, 37), (1001, 70)])  # 1001 x 70: panels on threads.
def test_int8_panels_multiply_in_float32(isa, d_in, d_out):
  """int8 panels: each column quantized to 255 levels of its largest magnitude; the kernel's
  product equals float32 arithmetic on the quantized weights (prologues and residual too), on
  both paths."""
  w_IxF = _normal(0, (d_in, d_out))
  w_IxF[:, 5] = 0.0
  packed = _pack(w_IxF, dtype='int8')
  panels = -(-d_out // native.PANEL)
  assert packed.panels_PxIxC.dtype == jnp.int8 and packed.scales_PxC.shape == (panels,
                                                                               native.PANEL)
  quantized_IxF = np.asarray(_unpack(packed))
  step_F = np.max(np.abs(w_IxF), axis=0) / 127
  assert np.all(np.abs(quantized_IxF - w_IxF) <= step_F[None, :] / 2 + 1e-6)  # Nearest level.
  np.testing.assert_array_equal(quantized_IxF[:, 5], 0.0)  # A zero column stays zero.
  assert not np.allclose(quantized_IxF, w_IxF, atol=1e-4)  # The quantization is real.
  top = np.max(np.abs(np.asarray(packed.panels_PxIxC, np.int32)), axis=1).reshape(-1)
  np.testing.assert_array_equal(top[:5], 127)  # Each column's largest weight is the top level.
  _check_low_precision_products(packed, quantized_IxF, isa)


def _np_w8a8(x_RxI, packed):
  """What a w8a8 product computes, in numpy: each row quantized as `native.quantize_rows`
  documents, integer sums, then float32 scaling: float(sum) * (x_scale * w_scale)."""
  x_RxI = np.asarray(x_RxI, np.float32)
  m_R = np.max(np.abs(x_RxI), axis=1)
  inv_R = np.float32(127) / np.where(m_R > 0, m_R, np.float32(1))
  xq_RxI = np.round(np.clip(x_RxI * inv_R[:, None], -127, 127)).astype(np.int64)
  sums_RxF = xq_RxI @ _w8a8_integers(packed)
  scale_F = np.asarray(packed.scales_PxC).reshape(-1)[:packed.out_dim]
  return sums_RxF.astype(np.float32) * ((m_R * np.float32(1 / 127))[:, None] * scale_F[None])


def _w8a8_integers(packed):
  """The int8 weights of w8a8 panels, int64[I, F], read from the stored bytes (q + 128)."""
  P, G, C, J = packed.panels_PxIxC.shape
  q_PxGxCxJ = np.asarray(packed.panels_PxIxC, np.int64) - 128
  q_IxF = np.transpose(q_PxGxCxJ, (1, 3, 0, 2)).reshape(G * J, P * C)
  return q_IxF[:packed.in_dim, :packed.out_dim]


@pytest.mark.parametrize('isa', ISAS)
@pytest.mark.parametrize('d_in,d_out', [(40, 37), (1001, 70)])  # 1001 x 70: panels on threads.
def test_w8a8_panels_sum_quantized_inputs_exactly(isa, d_in, d_out):
  """w8a8: int8's weights, stored q + 128 in groups of 4 depths; each input row quantized to
  int8 of its largest magnitude, the sums exact: the kernel (every variant; VNNI on AVX-512
  where the CPU has it) and the XLA path equal numpy's integer arithmetic bit for bit; with a
  norm and a residual, to a rounding; and the result is the float product up to the inputs'
  quantization."""
  w_IxF = _normal(0, (d_in, d_out))
  w_IxF[:, 5] = 0.0
  packed = _pack(w_IxF, dtype='w8a8')
  P, G = -(-d_out // native.PANEL), -(-d_in // 4)
  assert packed.dtype == 'w8a8' and packed.panels_PxIxC.shape == (P, G, native.PANEL, 4)
  np.testing.assert_array_equal(_unpack(packed), _unpack(_pack(w_IxF, dtype='int8')))
  np.testing.assert_array_equal(_w8a8_integers(packed), np.asarray(
      _pack(w_IxF, dtype='int8').panels_PxIxC, np.int64).transpose(1, 0, 2).reshape(d_in, -1)[
          :, :d_out])
  xs = [_normal(rows, (rows, d_in)) for rows in LOW_PRECISION_ROWS]
  xs[1][2, :4] = [0.5, -1.5, 2.5, 127.0]  # m = 127: x * 127 / m on .5, rounded to even.
  for use_kernel in (True, False) if isa == 'baseline' else (True,):
    gots = _matmuls(packed, [(x, {}) for x in xs], isa, use_kernel)
    for got, x in zip(gots, xs):
      np.testing.assert_array_equal(got, _np_w8a8(x, packed), err_msg=f'{len(x)} rows')
      quantized = np.asarray(_unpack(packed), np.float64)
      step_R = np.max(np.abs(x), axis=1, keepdims=True) / 127
      slack = step_R / 2 * np.sum(np.abs(quantized), axis=0)[None, :]
      assert np.all(np.abs(got - x.astype(np.float64) @ quantized) <= slack * 1.001 + 1e-4)
    assert not np.allclose(gots[0], xs[0] @ np.asarray(_unpack(packed)), atol=1e-4)
  scale_I = np.linspace(0.5, 1.5, d_in, dtype=np.float32)
  cases = [(x, dict(norm=(scale_I, 1e-6), residual=_normal(9, (len(x), d_out)))) for x in xs[:4]]
  for got, (x, o) in zip(_matmuls(packed, cases, isa), cases):
    want = o['residual'] + _np_w8a8(_np_rms_norm(x, scale_I, 1e-6).astype(np.float32), packed)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('isa', ISAS)
def test_w8a8_zero_and_non_finite_rows(isa):
  """A zero input row gives zeros (plus the residual); a row holding an infinity or a NaN gives
  NaNs, and the other rows are unaffected, on both paths."""
  w_IxF = _normal(1, (37, 20))
  packed = _pack(w_IxF, dtype='w8a8')
  x = _normal(2, (5, 37))
  x[1] = 0.0
  x[2, 7] = np.inf
  x[3, 0] = np.nan
  residual = _normal(3, (5, 20))
  for use_kernel in (True, False):
    got, got_res = _matmuls(packed, [(x, {}), (x, dict(residual=residual))], isa, use_kernel)
    fine = [0, 4]
    np.testing.assert_array_equal(got[fine], _np_w8a8(x[fine], packed))
    np.testing.assert_array_equal(got[1], 0.0)
    np.testing.assert_array_equal(got_res[1], residual[1])
    assert np.all(np.isnan(got[2:4])) and np.all(np.isnan(got_res[2:4]))


def test_pack_rejects_what_it_cannot_do():
  with pytest.raises(ValueError, match='stored as one of'):
    native.pack(jnp.zeros((4, 4)), dtype='float16')
  with pytest.raises(ValueError, match='w8a8 weights take at most 65536 input depths'):
    native.pack(jnp.zeros((65537, 1)), dtype='w8a8')  # Beyond it int32 sums could overflow.
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


ATTENTION_SHAPES = [  # (T, K, G, H, S): queries, kv heads, queries per kv head, head dim, cache.
    (1, 2, 3, 64, 40), (5, 2, 3, 64, 40), (4, 1, 6, 24, 40), (3, 3, 1, 36, 40), (16, 2, 4, 8, 40),
    (20, 2, 3, 16, 40),
    (2, 2, 2, 10, 40),  # H = 10: not whole vectors.
    (5, 1, 4, 64, 3000),  # A long cache, filled to the end.
    (40, 2, 2, 16, 300)]  # A prefill: blocks of positions.


# One program per shape: op by op, the reference compiled ~1 s of small programs per shape.
_attention_reference = jax.jit(attention.reference)


@functools.cache
def test_write_rows_writes_each_rows_slots_a_batch_of_one_too():
  """A batch of one takes one dynamic-update-slice, more rows a vmapped one: both write row b's
  T entries at starts[b], clamped (as XLA clamps) where starts[b] + T passes the end."""
  S, T, N, H = 9, 3, 2, 4
  for starts in ([0, 4, 8], [8], [2]):
    B = len(starts)
    cache, new = _normal(0, (B, S, N, H)), _normal(1, (B, T, N, H))
    want = np.array(cache)
    for b, start in enumerate(starts):
      at = min(start, S - T)
      want[b, at:at + T] = new[b]
    got = jax.jit(attention.write_rows)(cache, new, jnp.array(starts, jnp.int32))
    np.testing.assert_array_equal(got, want)


def _freqs(qkv):
  """Rotary frequencies for the heads of `qkv`: base 500's, rescaled unevenly (as a model's
  rope scaling would), so that a kernel computing its own would differ."""
  half = qkv.shape[-1] // 2
  return attention.rope_frequencies(2 * half, 500.0) / jnp.linspace(1.0, 8.0, half)


def _attention_case():
  """Inputs (qkv, keys, values, starts) of every ATTENTION_SHAPES case, batch 4, and the XLA
  reference's outputs and caches for them (one program for all)."""
  B, cases = 4, []
  for i, (T, K, G, H, S) in enumerate(ATTENTION_SHAPES):
    keys, values = _normal(3 * i, (B, S, K, H)), _normal(3 * i + 1, (B, S, K, H))
    qkv = _normal(3 * i + 2, (B, T, K * G + 2 * K, H), scale=3.0)  # Peaked softmaxes.
    cases.append((qkv, keys, values, np.array([0, 17, S - T, 5], np.int32)))
  wants = jax.jit(lambda cases: [attention.reference(*c, _freqs(c[0])) for c in cases])(cases)
  return cases, jax.tree.map(np.asarray, wants)


@pytest.mark.parametrize('isa', ISAS)
def test_cached_attention_equals_reference(isa):
  """Rotation, cache writes and attention: the kernel's outputs and both caches, every slot, for
  every shape of ATTENTION_SHAPES (one program for all). Four rows take a few positions a row
  at a time (all kv heads in one pass over its cache, on up to 4 threads) and the second row
  alone a kv head at a time (on 2 threads or more)."""
  cases, wants = _attention_case()
  for qkv, keys, _, _ in cases:
    assert attention.use_kernel(qkv, keys)
  no_counts = np.zeros((0,), np.int32)
  row = lambda tree: jax.tree.map(lambda x: x[1:2], tree)
  gots = jax.jit(lambda cases: [
      (attention._kernel(*c, no_counts, _freqs(c[0]), isa),  # pylint: disable=protected-access
       attention._kernel(*row(c), no_counts, _freqs(c[0]), isa))  # pylint: disable=protected-access
      for c in cases])(cases)
  for shape, (got, got_row), want in zip(ATTENTION_SHAPES, gots, wants, strict=True):
    for name, g, g_row, w in zip(('outputs', 'keys', 'values'), got, got_row, want, strict=True):
      np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5,
                                 err_msg=f'{name}, (T, K, G, H, S) = {shape}')
      np.testing.assert_allclose(g_row, w[1:2], rtol=2e-5, atol=2e-5,
                                 err_msg=f'{name}, one row, (T, K, G, H, S) = {shape}')


@pytest.mark.parametrize('isa', ISAS)
@pytest.mark.parametrize('T', [20, 6])
def test_cached_attention_skips_padding_positions(isa, T):
  """With counts (a prefill of right-padded prompts) row b's first counts[b] positions are the
  reference's; the padding's outputs are zeros and its cache slots keep what they held. 20
  positions go a kv head at a time, 6 a row at a time."""
  B, S, K, G, H = 4, 40, 2, 3, 16
  keys, values = _normal(0, (B, S, K, H)), _normal(1, (B, S, K, H))
  qkv = _normal(2, (B, T, K * G + 2 * K, H), scale=3.0)
  starts, counts = np.array([0, 5, 20, 9], np.int32), [T, T // 3, 0, 1]
  got_out, got_k, got_v = jax.tree.map(np.asarray, jax.jit(lambda *a: attention.cached_attention(
      *a[:4], rope_freqs=_freqs(qkv), counts_B=a[4], isa=isa))(qkv, keys, values, starts,
                                                       np.array(counts, np.int32)))
  want_out, want_k, want_v = jax.tree.map(
      np.asarray, _attention_reference(qkv, keys, values, starts, _freqs(qkv)))
  for b, (start, count) in enumerate(zip(np.asarray(starts), counts)):
    np.testing.assert_allclose(got_out[b, :count], want_out[b, :count], rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(got_out[b, count:], 0.0)
    for got, want, before in ((got_k, want_k, keys), (got_v, want_v, values)):
      np.testing.assert_allclose(got[b, :start + count], want[b, :start + count], rtol=2e-5,
                                 atol=2e-5)
      np.testing.assert_array_equal(got[b, start + count:], before[b, start + count:])


def _windowed_attention(qkv, keys, values, starts, freqs, scale, window, softcap):
  """numpy: the attention outputs of `attention.reference`'s rotated queries and written caches,
  query by query over the slots its window keeps, scores capped: the options' meaning written
  out, independent of `attend`'s masks."""
  B, T, _, H = qkv.shape
  K = keys.shape[2]
  _, keys, values = jax.tree.map(np.asarray, attention.reference(qkv, keys, values, starts, freqs))
  positions = np.asarray(starts)[:, None] + np.arange(T)[None]
  q = np.asarray(attention.rope(jnp.asarray(qkv[:, :, :-2 * K]), jnp.asarray(positions), freqs))
  G = q.shape[2] // K
  out = np.zeros((B, T, K, G, H), np.float32)
  for b, t, n in np.ndindex(B, T, K * G):
    p = positions[b, t]
    seen = np.arange(max(0, p - window + 1) if window else 0, p + 1)
    scores = keys[b, seen, n // G].astype(np.float64) @ q[b, t, n] * scale
    if softcap:
      scores = softcap * np.tanh(scores / softcap)
    probs = np.exp(scores - scores.max())
    out[b, t, n // G, n % G] = probs / probs.sum() @ values[b, seen, n // G]
  return out


@pytest.mark.parametrize('isa', ISAS)
@pytest.mark.parametrize('T', [1, 5, 20])
def test_cached_attention_window_softcap_and_scale(isa, T):
  """A sliding window (1, shorter than the cache in use, longer than every position), Gemma 2's
  soft-capped scores and a scale other than 1 / sqrt(H): XLA's ops and the kernel against the
  options written out (`_windowed_attention`). One position goes a row at a time, 20 a kv head
  at a time in blocks of 16."""
  B, S, K, G, H = 4, 48, 2, 3, 16
  keys, values = _normal(0, (B, S, K, H)), _normal(1, (B, S, K, H))
  qkv = _normal(2, (B, T, K * G + 2 * K, H), scale=3.0)
  starts = np.array([0, 7, S - T, 19], np.int32)
  for window, softcap, scale in ((1, None, None), (6, 2.0, 0.3), (9, None, 0.5),
                                 (200, 5.0, None)):
    options = dict(scale=scale, window=window, softcap=softcap)
    want = _windowed_attention(qkv, keys, values, starts, _freqs(qkv), scale or H**-0.5, window,
                               softcap)
    for path in ('xla', 'kernel'):
      kernel = attention._kernel  # pylint: disable=protected-access
      call = attention.reference if path == 'xla' else functools.partial(
          kernel, isa=isa, counts_B=np.zeros((0,), np.int32))
      got, _, _ = jax.jit(lambda *a, call=call: call(*a[:4], freqs_H2=_freqs(qkv), **options))(
          qkv, keys, values, starts)
      np.testing.assert_allclose(got, want, rtol=5e-5, atol=5e-5,
                                 err_msg=f'{path}, window {window}, softcap {softcap}')
  with pytest.raises(ValueError, match='window must be'):
    attention.cached_attention(qkv, keys, values, starts, rope_freqs=_freqs(qkv), window=0)


def _tree_attention(qkv, keys, values, starts, freqs, parents, first):
  """numpy: a call on nodes first .. first + T - 1 of the tree `parents` (node i's parent for i = 1
  ..), the root at slot starts - first: each node rotated at the root's slot + its depth, written
  at its slot, its query seeing the slots before the root, its ancestors' and its own."""
  B, T, _, H = qkv.shape
  K = keys.shape[2]
  parents = (-1, *parents)
  depth = [0] * len(parents)
  for i in range(1, len(parents)):
    depth[i] = depth[parents[i]] + 1
  roots = np.asarray(starts) - first
  positions = roots[:, None] + np.array(depth[first:first + T])[None]
  rotate = lambda x: np.asarray(attention.rope(jnp.asarray(x), jnp.asarray(positions), freqs))
  keys, values = np.array(keys, np.float64), np.array(values, np.float64)
  for b, t in np.ndindex(B, T):
    keys[b, starts[b] + t] = rotate(qkv[:, :, -2 * K:-K])[b, t]
    values[b, starts[b] + t] = qkv[b, t, -K:]
  q = rotate(qkv[:, :, :-2 * K])
  G = q.shape[2] // K
  out = np.zeros((B, T, K, G, H), np.float32)
  for b, t, n in np.ndindex(B, T, K * G):
    node, seen = first + t, list(range(roots[b]))
    path = []
    while node >= 0:
      path.append(roots[b] + node)
      node = parents[node]
    seen = np.array(seen + path[::-1])
    scores = keys[b, seen, n // G] @ q[b, t, n] * H**-0.5
    probs = np.exp(scores - scores.max())
    out[b, t, n // G, n % G] = probs / probs.sum() @ values[b, seen, n // G]
  return out, keys, values


@pytest.mark.parametrize('isa', ISAS)
def test_cached_attention_on_a_tree(isa):
  """A call on a token tree's nodes (a whole tree of 7, its last level of 4 alone, and a tree of
  29 taken in blocks of 16 a kv head at a time; each row its own tree of 7, whole and its last 3):
  the kernel and XLA's ops against the tree written out (`_tree_attention`): every output and
  cache slot. A window is refused with a tree."""
  B, S, K, G, H = 3, 48, 2, 3, 16
  keys, values = _normal(0, (B, S, K, H)), _normal(1, (B, S, K, H))

  def check(qkv, starts, operands, want, label):  # Both paths, every output and cache slot.
    for path in ('xla', 'kernel'):
      call = attention.reference if path == 'xla' else functools.partial(
          attention._kernel, isa=isa,  # pylint: disable=protected-access
          counts_B=np.zeros((0,), np.int32))
      got = jax.jit(lambda *a, call=call: call(*a[:4], freqs_H2=_freqs(qkv), **operands))(
          qkv, keys, values, starts)
      for name, g, w in zip(('outputs', 'keys', 'values'), got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=3e-5, atol=3e-5, err_msg=f'{path}, {name}, {label}')

  small = models.TokenTree.full((2, 2))
  large = models.TokenTree.full((4, 2, 2))
  for tree, first in ((small, 0), (small, 3), (large, 0)):
    T = tree.num_nodes + 1 - first
    qkv = _normal(T, (B, T, K * G + 2 * K, H), scale=3.0)
    starts = np.array([first, 11, S - T], np.int32)
    mask = tree.mask(first)
    operands = dict(tree_depths=mask.depths_xM[:first + T],
                    tree_allowed=mask.ancestors_xTxM[:, :first + T])
    check(qkv, starts, operands,
          _tree_attention(qkv, keys, values, starts, _freqs(qkv), tree.parents, first),
          f'{T} nodes from {first}')
  # Each row its own tree of 6 nodes (`models.RowTrees`), the whole tree and its last 3 nodes.
  parents = ((0, 0, 1, 1, 2, 2), (0, 1, 2, 0, 1, 2), (0, 1, 1, 3, 0, 5))
  rows = models.RowTrees.of(jnp.asarray(parents, jnp.int32), 3, 2)
  for first in (0, 4):
    T = 7 - first
    qkv = _normal(10 + T, (B, T, K * G + 2 * K, H), scale=3.0)
    starts = np.array([first, 11, S - T], np.int32)
    mask = rows.mask(first)
    operands = dict(tree_depths=mask.depths_xM, tree_allowed=mask.ancestors_xTxM)
    each = [_tree_attention(qkv[b:b + 1], keys[b:b + 1], values[b:b + 1], starts[b:b + 1],
                            _freqs(qkv), parents[b], first) for b in range(B)]
    check(qkv, starts, operands, [np.concatenate(w) for w in zip(*each)],
          f'per row from {first}')
  with pytest.raises(ValueError, match='no window'):
    attention.cached_attention(qkv, keys, values, starts, rope_freqs=_freqs(qkv), window=4,
                               **operands)
  with pytest.raises(ValueError, match='allowed'):
    attention.cached_attention(qkv, keys, values, starts, rope_freqs=_freqs(qkv),
                               tree_depths=operands['tree_depths'],
                               tree_allowed=operands['tree_allowed'][1:])


@pytest.mark.parametrize('isa', ISAS)
@pytest.mark.parametrize('rotated', [0, 4, 10])
def test_cached_attention_rotates_a_part_or_none(isa, rotated):
  """GPT-NeoX rotates the first dims of a head, GPT-2 none: XLA's rotation against numpy's, and
  the kernel (queries and keys rotated, the rest passing; with an amplitude on the rotated dims,
  YaRN's and LongRoPE's) against XLA's ops."""
  B, S, K, G, H, T = 3, 24, 2, 2, 16, 3
  keys, values = _normal(0, (B, S, K, H)), _normal(1, (B, S, K, H))
  qkv = _normal(2, (B, T, K * G + 2 * K, H), scale=3.0)
  starts = np.array([0, 9, S - T], np.int32)
  freqs = np.asarray(attention.rope_frequencies(max(rotated, 2), 500.0))[:rotated // 2]
  positions = starts[:, None] + np.arange(T)[None]
  half = rotated // 2
  angles = positions[..., None, None] * freqs  # [B, T, 1, R / 2]
  x = qkv.astype(np.float64)
  want = x.copy()
  want[..., :half] = x[..., :half] * np.cos(angles) - x[..., half:rotated] * np.sin(angles)
  want[..., half:rotated] = x[..., half:rotated] * np.cos(angles) + x[..., :half] * np.sin(angles)
  np.testing.assert_allclose(attention.rope(qkv, jnp.asarray(positions), freqs), want,
                             rtol=1e-5, atol=1e-5)
  want[..., :rotated] *= 1.3  # YaRN's and LongRoPE's amplitude: the rotated dims only.
  np.testing.assert_allclose(attention.rope(qkv, jnp.asarray(positions), freqs, 1.3), want,
                             rtol=1e-5, atol=1e-5)
  kernel = attention._kernel  # pylint: disable=protected-access
  for amplitude in (1.0, 1.3):
    got, want = jax.jit(lambda *a, r=amplitude: (
        kernel(*a, np.zeros((0,), np.int32), freqs, isa, rope_scale=r),
        attention.reference(*a, freqs, rope_scale=r)))(qkv, keys, values, starts)
    for name, g, w in zip(('outputs', 'keys', 'values'), got, want, strict=True):
      np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5, err_msg=f'{name}, {amplitude}')


def test_cached_attention_writes_in_place_or_copies():
  """Donated caches are written in place; kept ones are copied first and stay unchanged."""
  B, S, K, G, H = 2, 16, 2, 2, 8
  keys = jax.random.normal(jax.random.key(0), (B, S, K, H))
  values = jax.random.normal(jax.random.key(1), (B, S, K, H))
  qkv = jax.random.normal(jax.random.key(2), (B, 3, K * G + 2 * K, H))
  starts = jnp.array([2, 9], jnp.int32)
  freqs = attention.rope_frequencies(H, 10_000.0)
  want = _attention_reference(qkv, keys, values, starts, freqs)
  call = lambda *a: attention.cached_attention(*a, rope_freqs=freqs)
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
                               jnp.zeros((1, 8, 2, 8)), jnp.zeros((1,), jnp.int32),
                               rope_freqs=jnp.ones(4))
  with pytest.raises(ValueError, match='rope_freqs of shape'):
    attention.cached_attention(jnp.zeros((1, 1, 6, 8)), jnp.zeros((1, 8, 2, 8)),
                               jnp.zeros((1, 8, 2, 8)), jnp.zeros((1,), jnp.int32),
                               rope_freqs=jnp.ones(8))


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
  if method == 'sps':  # A draft in bfloat16, int8 or w8a8 changes its proposals, never the tokens.
    for weights in ('bfloat16', 'int8', 'w8a8'):
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


@functools.partial(jax.jit, static_argnums=(2, 3))
def _native_probabilities(logits, uniforms, configs, isa):
  """The kernel's (probabilities, draws) under each of `configs`: one program for all."""
  return [native.probabilities_and_draw(logits, uniforms, temperature=c.temperature,
                                        top_k=c.top_k, top_p=c.top_p, min_logit=c.min_logit,
                                        typical_p=c.typical_p, epsilon_cutoff=c.epsilon_cutoff,
                                        eta_cutoff=c.eta_cutoff, isa=isa) for c in configs]


# LLVM's full optimisation: XLA's sorts of 50,257 logits run 3x faster for 2 s more compiling.
@functools.partial(jax.jit, static_argnums=2,
                   compiler_options={'xla_backend_optimization_level': 3})
def _xla_probabilities(logits, uniforms, configs):
  """`processors`' (probabilities, draws) under each of `configs`: one program for all."""
  laws = [processors.probabilities(logits, c) for c in configs]
  return [(probs, jax.vmap(processors.draw_with)(uniforms, probs)) for probs in laws]


def _probabilities(logits, uniforms, configs, isa):
  """(probabilities, draws) as numpy, by the kernel of `isa` or by XLA ('xla')."""
  if isa == 'xla':
    out = _xla_probabilities(logits, uniforms, configs)
  else:
    out = _native_probabilities(logits, uniforms, configs, isa)
  return jax.tree.map(np.asarray, out)


PROBABILITY_CONFIGS = tuple(sampling.SamplingConfig(**s) for s in [
    dict(temperature=1.0), dict(temperature=0.8, top_p=0.95),
    dict(temperature=0.7, top_k=50, top_p=0.8), dict(temperature=1.3, top_k=3),
    dict(temperature=0.0), dict(temperature=2.0, top_p=0.3), dict(temperature=1.0, min_p=0.05),
    dict(temperature=0.7, top_k=50, top_p=0.8, min_p=0.1), dict(temperature=1.0, typical_p=0.6),
    dict(temperature=0.9, top_p=0.95, typical_p=0.9, epsilon_cutoff=3e-4),
    dict(temperature=1.0, epsilon_cutoff=0.02), dict(temperature=1.1, top_k=50, eta_cutoff=0.004)])


@functools.lru_cache(maxsize=1)  # The isas of a case run one after another: made once for all.
def _probabilities_case(V):
  """(logits, uniforms, XLA's (probabilities, draws) for each of PROBABILITY_CONFIGS, the law
  before top-p of each) of a case of `test_probabilities_kernel_equals_processors`."""
  R = {37: 2000, 4100: 400, 50257: 48}[V]
  logits = 3 * _normal(0, (R, V))
  logits[:20, :10] = 4.0
  logits[20:40, 5:9] = np.max(logits[20:40], axis=1)[:, None]
  # Near-flat rows: most of the vocabulary in the kernel's crossing bucket with distinct values
  # (refined by finer buckets before a sort), some at a common value (ties among them). Not over
  # 50,257 tokens: there a token holds ~2e-5 and near-ties rank by each path's rounding, so the
  # two cuts may differ by a token beyond the test's 1e-5.
  if V < 50_000:
    logits[40:60] *= 0.002
    logits[50:60, ::7] = 0.0
  logits[R - 1] = 0.0  # A flat row: the whole vocabulary ties.
  uniforms = np.random.default_rng(1).uniform(size=R).astype(np.float32)
  uniforms[:2] = [0.0, 1 - 2.0 ** -24]
  wants = _probabilities(logits, uniforms, PROBABILITY_CONFIGS, 'xla')
  cut = [c for c in PROBABILITY_CONFIGS if c.top_p < 1]
  uncut = iter(_probabilities(logits, uniforms,
                              tuple(dataclasses.replace(c, top_p=1.0) for c in cut), 'xla'))
  before_top_p = [next(uncut)[0] if c in cut else want
                  for c, (want, _) in zip(PROBABILITY_CONFIGS, wants)]
  return logits, uniforms, wants, before_top_p


@pytest.mark.parametrize('isa', ISAS)
@pytest.mark.parametrize('V', [50257, 4100, 37])
def test_probabilities_kernel_equals_processors(isa, V):
  """Same distribution (support exactly, values to float rounding) and the same draws from the
  same uniforms as `spsjax.sampling.processors`, ties included (ranked by id), but where a
  uniform falls within rounding of a CDF boundary, for every setting of PROBABILITY_CONFIGS.
  V = 4100: whole vectors and 64-token blocks plus a tail; 37: a tail only."""
  logits, uniforms, wants, before_top_p = _probabilities_case(V)
  R = logits.shape[0]
  gots = _probabilities(logits, uniforms, PROBABILITY_CONFIGS, isa)
  rounding = 1e-5
  for config, (probs, tokens), (want, want_tokens), before in zip(
      PROBABILITY_CONFIGS, gots, wants, before_top_p, strict=True):
    try:
      same = assert_same_support_but_at_top_p(probs, want, before, config.top_p, rounding)
      assert np.sum(~same) <= 1  # Only the flat row's ties can meet the cut.
      np.testing.assert_allclose(probs[same], want[same], rtol=rounding, atol=1e-6)
      assert_draws_agree_but_at_boundaries(tokens[same], want_tokens[same], uniforms[same],
                                           want[same], tolerance=rounding / 2)
      assert np.all(probs[np.arange(R), tokens] > 0)
    except AssertionError as e:
      e.add_note(f'with {config}')
      raise


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


ODD_CONFIGS = tuple(sampling.SamplingConfig(**s) for s in [
    dict(temperature=1.0), dict(temperature=0.0), dict(temperature=0.7, top_k=5, top_p=0.9),
    dict(temperature=1.2e-38, top_p=0.9), dict(temperature=8.5e37, top_p=0.5),
    dict(temperature=1.0, top_k=2 ** 40, top_p=1e-30),
    dict(temperature=0.5, typical_p=1e-30, epsilon_cutoff=0.9, eta_cutoff=0.999)])


@pytest.mark.parametrize('isa', ISAS + ['xla'])
@pytest.mark.parametrize('V', [1, 2, 17, 4100])
def test_odd_logits_have_one_defined_result(isa, V):
  """Any float32 row and any accepted setting (ODD_CONFIGS): a row with a NaN or +inf logit or
  no logit above -inf has no distribution (NaN everywhere, token 0) on every path; a -inf logit
  and one whose scaled value's exp underflows have probability exactly 0 and are never drawn,
  whatever the uniform (0 and the largest float below 1 included); every other row is a
  distribution."""
  names, rows = zip(*_odd_rows(V).items())
  logits = np.stack(rows)
  R = len(names)
  for u in (0.0, 0.5, 1 - 2.0 ** -24):
    gots = _probabilities(logits, np.full((R,), u, np.float32), ODD_CONFIGS, isa)
    for config, (probs, tokens) in zip(ODD_CONFIGS, gots, strict=True):
      for r, name in enumerate(names):
        where = (name, config, u)
        defined = not (np.isnan(logits[r]).any() or np.isposinf(logits[r]).any()
                       or np.isneginf(logits[r]).all())
        if not defined:
          assert np.isnan(probs[r]).all() and tokens[r] == 0, (where, probs[r][:4], tokens[r])
          continue
        assert not np.isnan(probs[r]).any(), where
        assert np.sum(probs[r]) == pytest.approx(1.0, abs=1e-5), where
        assert 0 <= tokens[r] < V and probs[r, tokens[r]] > 0, (where, tokens[r])
        np.testing.assert_array_equal(probs[r][np.isneginf(logits[r])], 0.0, err_msg=str(where))
        if name == 'huge_spread' and config.temperature == 1.0:
          np.testing.assert_array_equal(probs[r][logits[r] <= logits[r].max() - 200.0], 0.0)
  if isa != 'xla':  # Both paths agree row by row (values to rounding).
    wants = _probabilities(logits, np.zeros((R,), np.float32), ODD_CONFIGS, 'xla')
    for config, (probs, _), (want, _) in zip(ODD_CONFIGS, gots, wants, strict=True):
      np.testing.assert_array_equal(np.isnan(probs), np.isnan(want), err_msg=str(config))
      np.testing.assert_allclose(probs, want, rtol=1e-5, atol=1e-6, err_msg=str(config))


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


def _threefry_draws(offset):  # A fresh function per lowering: nothing comes from jit's caches.
  return jax.jit(lambda key: (jax.random.uniform(jax.random.fold_in(key, 7 + offset), (5,)),
                              jax.random.key_data(jax.random.split(key, 3))))


def test_threefry_unrolled_on_cpu_draws_the_same_bits():
  # Importing spsjax.sampling registered the straight-line lowering (up to jaxlib 0.10); the
  # rolled one (JAX's default on the CPU) must give the same bits, and only it a loop.
  from jax._src.interpreters import mlir
  from jax._src.lib import version as jaxlib_version
  from jax._src.random import threefry2x32
  key = jax.random.key(3)
  if tuple(jaxlib_version[:2]) > threefry.LAST_JAXLIB:  # Its XLA takes minutes to compile it.
    assert not threefry.unroll_on_cpu()
    assert ' while(' in _threefry_draws(0).lower(key).compile().as_text()
    return
  assert threefry.unroll_on_cpu()
  unrolled = _threefry_draws(0)
  mlir.register_lowering(threefry2x32.threefry2x32_p,
                         threefry2x32._threefry2x32_cpu_lowering_rule, platform='cpu')
  try:
    rolled = _threefry_draws(0)
    rolled_text = rolled.lower(key).compile().as_text()
    rolled_out = rolled(key)
  finally:
    mlir.register_lowering(threefry2x32.threefry2x32_p,
                           threefry2x32._threefry2x32_lowering_rule, platform='cpu')
  assert ' while(' in rolled_text
  assert ' while(' not in unrolled.lower(key).compile().as_text()
  for a, b in zip(unrolled(key), rolled_out):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


ACCEPT_K = 3


@functools.lru_cache(maxsize=1)  # The isas of a case run one after another: made once for all.
@functools.partial(jax.jit, static_argnums=(0, 1))  # One program: op by op, ~40 small ones.
def _accept_case(lenience, V):
  """(p, q, drafts, num, row keys, `rejection.accept_and_resample`'s counts and tokens, the
  uniforms it drew from, those of the tokens) of a case of `test_accept_kernel_equals_rejection`."""
  B, K = 2048 if V == 37 else 256, ACCEPT_K
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
  return p, q, drafts, num, row_keys, want_n, want_tokens, u, processors.uniforms(token_keys)



@jax.jit
@jax.vmap
def _token_laws(p, q, n, num):
  """The law a row's token is drawn from after n accepted drafts: the residual max(p - q, 0)
  where a draft was rejected and it has mass, else p."""
  residual = jnp.maximum(p[n] - q[jnp.minimum(n, ACCEPT_K - 1)], 0)
  return jnp.where((n < num) & (jnp.sum(residual) > 0), residual, p[n])


@functools.partial(jax.jit, static_argnums=(6, 7))
def _native_accept(p, q, drafts, num, u, u_tokens, lenience, isa):
  return native.accept(p, q, drafts, num, u, u_tokens, lenience=lenience, isa=isa)


@pytest.mark.parametrize('isa', ISAS)
@pytest.mark.parametrize('lenience', [1.0, 0.6])
@pytest.mark.parametrize('V', [4100, 37])
def test_accept_kernel_equals_rejection(isa, lenience, V):
  """The accept step's kernel against `rejection.accept_and_resample` from the same uniforms: the
  same number of accepted drafts in every row, and the same tokens but at rounding boundaries,
  always of positive weight in the law they were drawn from. Rows cover every count of proposed
  drafts, p = q (no residual mass: p itself), one-hot p (greedy) and drafts q gave no mass to."""
  p, q, drafts, num, row_keys, want_n, want_tokens, u, u_tokens = _accept_case(lenience, V)
  n, tokens = _native_accept(p, q, drafts, num, u, u_tokens, lenience, isa)
  np.testing.assert_array_equal(n, want_n)
  assert len(set(np.asarray(n).tolist())) == ACCEPT_K + 1  # Every count occurs.
  assert_draws_agree_but_at_boundaries(tokens, want_tokens, u_tokens, _token_laws(p, q, n, num))
  if isa == 'baseline':  # And through the batched entry point the loop calls (the best isa).
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
