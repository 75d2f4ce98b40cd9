"""The native kernels driven at odd shapes in a sanitizer build (`test_native_sanitized.py`).

  SPSJAX_NATIVE_LIBRARY=SANITIZED.so LD_PRELOAD=... python tests/native_sanitized_worker.py \
      SECTION[:ISA,...]...

Runs in a process whose native library is the AddressSanitizer + UndefinedBehaviorSanitizer build
the test makes (checked here: the library loaded is that file, and the sanitizer runtime is in
the process), so that a kernel reading or writing outside its buffers, or doing undefined
arithmetic, aborts the process with a report on stderr. Every FFI target is called through its
public wrapper, for every instruction set this CPU runs (or those a section names), and every
output is compared with a float64 numpy reference of what the kernel computes (not with XLA's
ops): a mismatch raises. Sections:

- matmul: `native.matmul` with float32, bfloat16, int8 and w8a8 panels, each prologue and a
  residual, at every number of rows 1..67 (one program, the rows computed set by `counts`),
  inner widths 1, 2, 13, 979 (over the kernels' threads) and 2053 (rows in blocks), partial last
  panels, and `counts` with padding, idle rows and out-of-range counts; matmul_rows: the cases
  whose paths depend on the number of rows only (for another threshold of the wide path);
- attention: `native.cached_attention` at head dims 2..66, T * G = 4096 queries (the kernel's
  limit), every row's positions ending at the cache's last slot, padding and idle rows, token
  trees (a whole tree, its last level alone, 29 nodes in query blocks), and a row past the
  cache's end or a tree's root before slot 0 (errors);
- sampling: `native.probabilities_and_draw` (temperature, top-k, top-p, min-p, typical-p, the
  epsilon and eta cutoffs) and `native.accept` at
  vocabularies 1..4100 and 50257, on one thread and over the kernels' threads, rows with NaN,
  +inf and -inf logits and logits far below the maximum, and a draft outside the vocabulary (an
  error);
- lookup: `native.take_rows` with ids outside the table;
- overflow_probe, ub_probe: the negative controls (`native_sanitizer_probe.cc`): they must abort.

Prints 'worker done' at the end.
"""

import argparse
import ctypes
import ctypes.util
import functools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position

from spsjax import native  # pylint: disable=wrong-import-position
from spsjax.native import library  # pylint: disable=wrong-import-position
from spsjax.sampling import processors as sampling_lib  # pylint: disable=wrong-import-position

# Rows of logits without a distribution (any NaN or +inf, every logit -inf) and rows with tokens
# of probability exactly 0 (-inf logits, logits far below the maximum), as
# `spsjax.sampling.processors` defines them; before that law, logits [[inf]] and [[-inf]] with
# top_p < 1 indexed TopP's masses at -8.
CHECK_NONFINITE_LOGITS = True


def check_library_is_sanitized() -> None:
  """The library loaded is SPSJAX_NATIVE_LIBRARY's, built with the sanitizers, and no other
  build of the kernels is in the process."""
  path = os.environ.get('SPSJAX_NATIVE_LIBRARY')
  assert path, 'SPSJAX_NATIVE_LIBRARY is not set'
  lib = library.load()
  assert lib is not None and lib._name == path, (lib, path)  # pylint: disable=protected-access
  with open('/proc/self/maps') as f:
    maps = f.read()
  assert os.path.realpath(path) in maps, 'the sanitized library is not mapped'
  assert 'libasan' in maps and 'libubsan' in maps, 'no sanitizer runtime in the process'
  assert '_kernels.' not in maps, 'a normal build of the kernels is loaded too'
  for symbol in ('__asan_report_store4', '__ubsan_handle_add_overflow_abort'):
    assert hasattr(ctypes.CDLL(path), symbol), f'{symbol}: the library is not instrumented'


def check_close(name, got, want, scale, rtol, atol=0.0):
  """|got - want| <= rtol * scale + atol everywhere (NaN fails), else AssertionError."""
  got = np.asarray(got, np.float64)
  err = np.abs(got - want)
  bad = ~(err <= rtol * scale + atol)
  if bad.any():
    i = np.unravel_index(np.argmax(np.where(bad, err, -1.0)), bad.shape)
    raise AssertionError(f'{name}: {bad.sum()} of {bad.size} values off; at {i} got {got[i]}, '
                         f'want {want[i]} (allowed {rtol * np.broadcast_to(scale, bad.shape)[i]}'
                         f' + {atol})')


def check_equal(name, got, want):
  got = np.asarray(got)
  want = np.broadcast_to(want, got.shape)
  if not np.array_equal(got, want):
    bad = got != want
    i = np.unravel_index(np.argmax(bad), bad.shape)
    raise AssertionError(f'{name}: {bad.sum()} of {bad.size} values differ; at {i} got '
                         f'{got[i]}, want {want[i]}')


def expect_error(name, message, call):
  """call() fails with the kernel's `message` (its arguments are checked, not used)."""
  try:
    jax.block_until_ready(call())
  except Exception as e:  # pylint: disable=broad-except
    assert message in str(e), (name, e)
    return
  raise AssertionError(f'{name}: no error')


def grid_normal(rng, shape, scale=3.0):
  """float32 normal numbers rounded to 0.01: distinct values are far apart, equal ones tie."""
  return np.round(scale * rng.standard_normal(shape), 2).astype(np.float32)


# --- The packed matmul -------------------------------------------------------------------------

EPS = 1e-5
MATMUL_VARIANTS = ('plain', 'norm', 'gated+residual', 'residual')
GATHER_COUNTS = [[8, 0, 3, 8, 8, 1, 0, 5], [0] * 8, [1, 0, 1, 0, 1, 0, 1, 0],
                 [-3, 99, 2, 7, 0, 8, 8, 4]]
RUN_COUNTS = [[30, 17, 0], [5, 30, 20], [0, 0, 30], [30, 30, 30]]
# (d_in, d_out, row counts without `counts`, [(B, T, count vectors)] with `counts`). The cases
# whose paths depend on the number of rows (and so on the wide path's threshold) come last.
MATMUL_ROW_CASES = [
    # Every number of rows 0..67 (and out-of-range counts) through one program.
    (13, 37, (0, 1, 2, 3, 5, 16, 17, 25, 67),
     [(1, 67, [[n] for n in range(-1, 69)]), (8, 8, GATHER_COUNTS), (3, 30, RUN_COUNTS),
      (9, 1, [[1, 0, 1, 1, 0, 0, 1, 1, 1]])]),
    # Rows in blocks: 67 rows of 2053 x 4 bytes > kRowBlockBytes (512 KiB), in 2 blocks (and the
    # wide path's tiles in 2 blocks).
    (2053, 17, (67,), []),
]
MATMUL_CASES = [
    (1, 1, (1, 67), [(1, 67, [[n] for n in (0, 1, 3, 16, 17, 29, 67)])]),
    (2, 17, (3, 17), [(8, 8, GATHER_COUNTS)]),
    # Over the kernels' threads: 5 panels x 979 x 16 weights >= kMinParallelWeights (1 << 16),
    # 67 x 979 inputs >= kMinParallelPrologue.
    (979, 67, (1, 17, 67),
     [(1, 67, [[n] for n in (0, 1, 17, 67)]), (8, 8, GATHER_COUNTS[:1]), (3, 30, RUN_COUNTS[:2])]),
    *MATMUL_ROW_CASES,
]


def _matmul_call(variant, x, x_gated, scale, residual, packed, counts, isa):
  options = dict(counts=counts, isa=isa, use_kernel=True)
  if variant.startswith('norm'):
    options['norm'] = (scale, EPS)
  if variant.startswith('gated'):
    x, options['gated'] = x_gated, True
  if variant.endswith('residual'):
    options['residual'] = residual
  return native.matmul(x, packed, **options)


@functools.partial(jax.jit, static_argnames='isas')
def _matmuls(x, x_gated, scale, residual, counts, packed_by_dtype, isas):
  return {f'{dtype}/{variant}/{isa}': _matmul_call(variant, x, x_gated, scale, residual, packed,
                                                    counts, isa)
          for dtype, packed in packed_by_dtype.items() for variant in MATMUL_VARIANTS
          for isa in isas}


def _prologue64(variant, x, x_gated, scale):
  if variant.startswith('norm'):
    x = x.astype(np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * scale
  if variant.startswith('gated'):
    gate, inputs = x_gated[..., 0, :].astype(np.float64), x_gated[..., 1, :]
    return gate / (1.0 + np.exp(-gate)) * inputs
  return x.astype(np.float64)


def _check_matmuls(name, outputs, x, x_gated, scale, residual, counts, w64_by_dtype, isas):
  """Each output against f(x) @ w (+ residual) in float64, within float32 rounding of the sum of
  |terms|; with counts, the rows past each group's count exactly the residual (or 0)."""
  used = None
  if counts is not None:
    T = x.shape[1]
    used = np.arange(T)[None, :] < np.clip(counts, 0, T)[:, None]  # [B, T]
  for variant in MATMUL_VARIANTS:
    f = _prologue64(variant, x, x_gated, scale)
    res = residual.astype(np.float64) if variant.endswith('residual') else 0.0
    for dtype, w64 in w64_by_dtype.items():
      want = f @ w64 + res
      terms = np.abs(f) @ np.abs(w64) + np.abs(res)
      assert want.size == 0 or np.any(want != 0)
      # w8a8 also quantizes each input row, by at most one of its steps (m / 127) an input: a
      # wrong integer sum is off by whole weights (its exact sums are test_native.py's).
      slack = 0.0
      if dtype == 'w8a8':
        slack = np.max(np.abs(f), axis=-1, keepdims=True) / 127 * np.sum(np.abs(w64), axis=0)
      for isa in isas:
        got = np.asarray(outputs[f'{dtype}/{variant}/{isa}'])
        label = f'{name} {dtype} {variant} {isa}'
        if used is None:
          check_close(label, got, want, terms, rtol=2e-5, atol=1e-30 + slack)
        else:
          slack_used = np.broadcast_to(slack, want.shape)[used]
          check_close(label, got[used], want[used], terms[used], rtol=2e-5,
                      atol=1e-30 + slack_used)
          check_equal(f'{label} padding', got[~used],
                      np.broadcast_to(res, want.shape)[~used].astype(np.float32))


# Jitted: op by op, packing compiled a dozen small programs per weight (in a process whose every
# allocation goes through AddressSanitizer). The panels and the float64 reference come from the
# same packed weights either way.
_pack = jax.jit(native.pack, static_argnames='dtype')
_unpack = jax.jit(native.unpack)


def matmul(isas, cases=MATMUL_CASES):
  for d_in, d_out, row_counts, count_layouts in cases:
    start = time.time()
    rng = np.random.default_rng(d_in * 1000 + d_out)
    w = rng.standard_normal((d_in, d_out)).astype(np.float32)
    if d_out > 1:
      w[:, d_out // 2] = 0.0  # A zero column (int8: any scale).
    packed_by_dtype = {dtype: _pack(jnp.asarray(w), dtype=dtype) for dtype in native.WEIGHT_DTYPES}
    w64_by_dtype = {dtype: np.asarray(_unpack(packed), np.float64)
                    for dtype, packed in packed_by_dtype.items()}
    scale = (1.0 + rng.standard_normal(d_in)).astype(np.float32)
    layouts = [((R,), None) for R in row_counts]
    layouts += [((B, T), np.array(c, np.int32)) for B, T, vectors in count_layouts
                for c in vectors]
    for lead, counts in layouts:
      x = grid_normal(rng, lead + (d_in,), 1.0)
      x_gated = grid_normal(rng, lead + (2, d_in), 2.0)
      if d_in >= 2:  # Gates far in both tails: the kernel's sigmoid must not overflow.
        x_gated[..., 0, 0], x_gated[..., 0, 1] = -100.0, 100.0
      residual = grid_normal(rng, lead + (d_out,), 1.0)
      outputs = _matmuls(x, x_gated, scale, residual, counts, packed_by_dtype, tuple(isas))
      name = f'matmul {d_in}x{d_out} x{lead}' + ('' if counts is None else f' counts {counts}')
      _check_matmuls(name, outputs, x, x_gated, scale, residual, counts, w64_by_dtype, isas)
    print(f'matmul {d_in}x{d_out}: {len(layouts)} layouts, {time.time() - start:.1f} s', flush=True)


def matmul_rows(isas):
  matmul(isas, MATMUL_ROW_CASES)


# --- Cached attention --------------------------------------------------------------------------

ROPE_BASE = 500.0
# name, B, S, K, G, H, T, starts, counts (None: every position).
ATTENTION_CASES = [
    ('decode at capacity', 3, 37, 2, 3, 66, 1, [0, 17, 36], None),
    ('head dim 2', 2, 50, 1, 1, 2, 5, [0, 45], None),
    ('padding and idle rows', 4, 67, 3, 2, 30, 7, [60, 0, 13, 33], [7, 0, 3, 99]),
    ('negative count', 2, 20, 1, 3, 10, 4, [16, 2], [-5, 2]),
    ('prefill in query blocks', 2, 40, 2, 1, 8, 37, [0, 3], [37, 20]),
    ('odd groups over threads', 3, 128, 2, 7, 34, 9, [0, 50, 119], [9, 4, 9]),
    ('one row, kv heads apart', 1, 100, 2, 3, 20, 3, [97], None),
    ('whole rows over threads', 2, 100, 2, 3, 20, 3, [97, 7], [3, 2]),
    *[(f'head dim {H}', 2, 33, 1, 2, H, 3, [0, 30], None)
      for H in (4, 6, 8, 12, 14, 16, 18, 24, 32, 34, 46, 48, 50, 62, 64, 66)],
    ('T x G = 4096 queries, long', 1, 600, 1, 8, 2, 512, [88], None),
    ('T x G = 4096 queries, 64 groups', 1, 70, 1, 64, 4, 64, [6], None),
    # Sliding windows (the kernel starts reading at the first query's window) and soft-capping.
    ('window of 1', 3, 37, 2, 3, 66, 1, [0, 17, 36], None, dict(window=1)),
    ('window, whole rows', 2, 100, 2, 3, 20, 3, [97, 7], [3, 2], dict(window=5, softcap=3.0)),
    ('window, prefill in query blocks', 2, 40, 2, 1, 8, 37, [0, 3], [37, 20],
     dict(window=9, softcap=0.5)),
    ('window past every position', 1, 33, 1, 2, 34, 3, [30], None, dict(window=1000)),
    # A part of each head rotated (GPT-NeoX), or none (GPT-2): `rotated` dims.
    ('a part rotated', 2, 40, 2, 3, 34, 5, [0, 35], None, dict(rotated=10)),
    ('none rotated', 2, 40, 1, 2, 18, 3, [7, 37], [3, 1], dict(rotated=0)),
    # Token trees (`tree`: node i's parent for i = 1 ..; the call on its last T nodes).
    ('tree, whole rows', 2, 40, 2, 3, 20, 7, [0, 33], None, dict(tree=(0, 0, 1, 1, 2, 2))),
    ('tree level, padding', 3, 30, 1, 2, 8, 4, [3, 10, 26], [4, 2, 0],
     dict(tree=(0, 0, 1, 1, 2, 2))),
    ('tree in query blocks', 1, 64, 2, 1, 16, 29, [35], None,
     dict(tree=(0,) * 4 + tuple(i for i in range(1, 5) for _ in range(2))
          + tuple(i for i in range(5, 13) for _ in range(2)))),
]

_libm = ctypes.CDLL(ctypes.util.find_library('m'))
_libm.powf.restype = ctypes.c_float
_libm.powf.argtypes = [ctypes.c_float, ctypes.c_float]


def _inverse_frequencies(half):
  """base^(-i / half) in float32 (libm's powf): the frequencies the kernel is given."""
  return np.array([_libm.powf(ROPE_BASE, float(np.float32(-i) / np.float32(half)))
                   for i in range(half)], np.float32)


def tree_arrays(parents, T):
  """(depths [W], allowed [T, W] as uint8) of a call on the last T of a tree's W = len(parents) +
  1 nodes: allowed[t, w] iff node w is node W - T + t or one of its ancestors."""
  parents = (-1, *parents)
  W = len(parents)
  depths, allowed = np.zeros(W, np.int32), np.zeros((T, W), np.uint8)
  for w in range(1, W):
    depths[w] = depths[parents[w]] + 1
  for t in range(T):
    node = W - T + t
    while node >= 0:
      allowed[t, node] = 1
      node = parents[node]
  return depths, allowed


def attention_reference(qkv, keys, values, starts, counts, window=None, softcap=None,
                        rotated=None, tree=None):
  """(outputs [B, T, K, G, H], keys, values) in float64 from float32 angles (position * the
  inverse frequency, as the model defines them); padding positions' outputs 0, their slots as
  they were; a query sees the last `window` slots up to its own, scores softcapped; the first
  `rotated` dims of each head rotated (None: all). With a `tree` (parents) the call's T
  positions are its last T nodes, rotated at the root's slot + their depth, each seeing the slots
  before the root and, of the tree's, its ancestors' and its own."""
  B, T, M, H = qkv.shape
  K = keys.shape[2]
  N, half = M - 2 * K, (H if rotated is None else rotated) // 2
  inv_freq = _inverse_frequencies(half)
  scale = float(np.float32(H**-0.5))
  out = np.zeros((B, T, K, N // K, H))
  k_cache, v_cache = keys.astype(np.float64), values.astype(np.float64)
  for b in range(B):
    used = T if counts is None else int(np.clip(counts[b], 0, T))
    positions = starts[b] + np.arange(used)
    seen = [np.arange(n) for n in positions + 1]  # Each position's slots.
    angle_positions = positions
    if tree is not None:
      depths, allowed = tree_arrays(tree, T)
      root = starts[b] - (len(depths) - T)
      angle_positions = root + depths[len(depths) - T:][:used]
      seen = [np.concatenate([np.arange(root), root + np.flatnonzero(allowed[t])])
              for t in range(used)]
    angles = (angle_positions.astype(np.float32)[:, None] * inv_freq[None, :]).astype(np.float64)
    cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]
    x = qkv[b, :used].astype(np.float64)

    def rotate(v):  # The first 2 half dims; the rest pass.
      v1, v2 = v[..., :half], v[..., half:2 * half]
      return np.concatenate([v1 * cos - v2 * sin, v2 * cos + v1 * sin, v[..., 2 * half:]],
                            axis=-1)

    q = (rotate(x[:, :N]) * scale).reshape(used, K, N // K, H)
    k_cache[b, positions] = rotate(x[:, N:N + K])
    v_cache[b, positions] = x[:, N + K:]
    for t in range(used):
      slots = seen[t][-window:] if window else seen[t]
      scores = np.einsum('kgh,skh->kgs', q[t], k_cache[b, slots])
      if softcap:
        scores = softcap * np.tanh(scores / softcap)
      p = np.exp(scores - scores.max(axis=-1, keepdims=True))
      p /= p.sum(axis=-1, keepdims=True)
      out[b, t] = np.einsum('kgs,skh->kgh', p, v_cache[b, slots])
  return out, k_cache, v_cache


@functools.partial(jax.jit, static_argnames=('isas', 'options'))
def _attentions(cases, isas, options):
  calls = []
  for (qkv, keys, values, starts, counts), option in zip(cases, options, strict=True):
    option = dict(option)
    freqs = _inverse_frequencies(option.pop('rotated', qkv.shape[-1]) // 2)
    if 'tree' in option:
      option['tree_depths'], option['tree_allowed'] = tree_arrays(option.pop('tree'),
                                                                   qkv.shape[1])
    calls.append({isa: native.cached_attention(qkv, keys, values, starts, rope_freqs=freqs,
                                               counts_B=counts, isa=isa, **option)
                  for isa in isas})
  return calls


def attention(isas):
  rng = np.random.default_rng(1)
  cases = []
  for _, B, S, K, G, H, T, starts, counts, *_ in ATTENTION_CASES:
    assert T * G <= native.attention.MAX_KERNEL_QUERIES
    cases.append((grid_normal(rng, (B, T, K * G + 2 * K, H), 1.0),
                  grid_normal(rng, (B, S, K, H), 1.0), grid_normal(rng, (B, S, K, H), 1.0),
                  np.array(starts, np.int32),
                  None if counts is None else np.array(counts, np.int32)))
  options = [case[9] if len(case) > 9 else {} for case in ATTENTION_CASES]
  results = _attentions(cases, tuple(isas), tuple(tuple(sorted(o.items())) for o in options))
  for case, (qkv, keys, values, starts, counts), by_isa in zip(ATTENTION_CASES, cases, results,
                                                              strict=True):
    name, B, S, _, _, _, T = case[:7]
    assert all(start + T <= S for start in starts)
    want_out, want_k, want_v = attention_reference(qkv, keys, values, starts, counts,
                                                   **(case[9] if len(case) > 9 else {}))
    for isa, (out, k_cache, v_cache) in by_isa.items():
      label = f'attention {name} {isa}'
      out, k_cache, v_cache = (np.asarray(a) for a in (out, k_cache, v_cache))
      for b in range(B):
        used = T if counts is None else int(np.clip(counts[b], 0, T))
        written = slice(starts[b], starts[b] + used)
        check_close(f'{label} row {b} outputs', out[b, :used], want_out[b, :used], 1.0,
                    rtol=2e-5)
        check_equal(f'{label} row {b} padding outputs', out[b, used:], 0.0)
        check_close(f'{label} row {b} keys written', k_cache[b, written], want_k[b, written],
                    np.abs(want_k[b, written]) + 1.0, rtol=1e-5)
        check_equal(f'{label} row {b} values written', v_cache[b, written], want_v[b, written])
        for got, before in ((k_cache, keys), (v_cache, values)):
          check_equal(f'{label} row {b} slots kept', np.delete(got[b], np.s_[written], axis=0),
                      np.delete(before[b], np.s_[written], axis=0))
  qkv, keys, values, _, _ = cases[0]  # A row whose positions would pass the cache's end.
  S, T = keys.shape[1], qkv.shape[1]
  expect_error('attention past the cache', 'exceed the cache', lambda: native.cached_attention(
      qkv, keys, values, np.array([0, 1, S - T + 1], np.int32),
      rope_freqs=_inverse_frequencies(qkv.shape[-1] // 2)))
  # A tree's last level (from node 3) at slot 2: its root would sit before slot 0.
  i = [case[0] for case in ATTENTION_CASES].index('tree level, padding')
  qkv, keys, values, starts, _ = cases[i]
  depths, allowed = tree_arrays(ATTENTION_CASES[i][9]['tree'], qkv.shape[1])
  expect_error('a tree before the cache', 'exceed the cache', lambda: native.cached_attention(
      qkv, keys, values, np.array([3, 2, 3], np.int32),
      rope_freqs=_inverse_frequencies(qkv.shape[-1] // 2), tree_depths=depths,
      tree_allowed=allowed))
  print(f'attention: {len(cases)} cases', flush=True)


# --- Sampling ----------------------------------------------------------------------------------

VOCABULARIES = (1, 2, 3, 15, 16, 17, 63, 64, 65, 4095, 4096, 4100, 50257)
# Uniform numbers of the rows' draws: 0 and the largest float32 below 1 among them.
UNIFORMS = np.array([0.3, 0.0, 1.0 - 2.0**-24, 0.5, 0.77, 0.12], np.float32)
DRAW_TOL = 1e-5  # Of the total mass: float32 prefix sums against float64 ones.
PROBABILITY_RTOL = 1e-5  # The kernel's sums are blocks of float32 added in double.
# How far from top_p the mass ranked before a token may be and its fate still go either way (the
# kernel's masses are float32 probabilities summed in double; the run of tokens tied with it adds
# float32 multiples of their probability).
TOP_P_TOL = 1e-5


def sampling_settings(V):
  """(temperature, top_k, top_p, min_p, typical_p, epsilon_cutoff, eta_cutoff) for a vocabulary
  of V: each of top-k (below, at and above V) and top-p on and off, greedy, a top-p that keeps a
  single token, min-p alone, after top-k and top-p, and at 1 (the ties at the maximum); typical-p,
  the epsilon and eta cutoffs each alone (at settings that keep one token, a few, and most), after
  top-k and min-p, and all three after top-p."""
  before = [(1.0, 0, 1.0, 0.0), (0.7, 0, 0.9, 0.0), (1.3, 3, 1.0, 0.0), (0.8, 50, 0.8, 0.0),
            (1.0, 1, 1.0, 0.0), (2.0, 0, 0.3, 0.0), (1.0, 0, 1e-6, 0.0), (0.0, 0, 1.0, 0.0),
            (1.1, max(V - 1, 1), 0.95, 0.0), (1.2, V, 1.0, 0.0), (0.9, V + 7, 0.5, 0.0),
            (1.0, 0, 1.0, 0.05), (0.8, 50, 0.9, 0.2), (1.0, 0, 1.0, 1.0), (0.0, 0, 1.0, 0.5)]
  later = [(1.0, 0, 1.0, 0.0, 0.5, 0.0, 0.0), (1.0, 0, 1.0, 0.0, 1e-6, 0.0, 0.0),
           (0.8, 7, 1.0, 0.1, 0.95, 0.0, 0.0), (1.0, 0, 1.0, 0.0, 1.0, 0.02, 0.0),
           (1.0, 0, 1.0, 0.0, 1.0, 0.9, 0.0), (1.2, 50, 1.0, 0.0, 1.0, 3e-4, 0.0),
           (1.0, 0, 1.0, 0.0, 1.0, 0.0, 0.004), (0.7, 0, 1.0, 0.0, 1.0, 0.0, 0.5),
           (0.9, 0, 0.95, 0.0, 0.9, 1e-3, 1e-3), (0.0, 0, 1.0, 0.0, 0.3, 0.5, 0.5)]
  return [s + (1.0, 0.0, 0.0) for s in before] + later


def logit_rows(V, rng):
  """Finite logits: two random rows, ties at the maximum, a flat row, one dominant token, two
  levels alternating (ties everywhere), and a near-flat row (most tokens in top-p's crossing
  bucket, which the kernel refines by finer buckets)."""
  rows = grid_normal(rng, (7, V))
  rows[2, :10] = rows[2].max() + 1.0
  rows[3] = 0.0
  rows[4, V // 2] = rows[4].max() + 15.0
  rows[5] = np.arange(V) % 2
  rows[6] = grid_normal(rng, (V,), scale=0.1)
  return rows


def nonfinite_logit_rows(V, rng):
  """(rows, which have no distribution): NaN, +inf, every logit -inf, some -inf, logits far
  below the maximum (probability exactly 0 after the temperature), and NaN with +inf."""
  rows = grid_normal(rng, (6, V))
  rows[0, V // 3] = np.nan
  rows[1, V - 1] = np.inf
  rows[2] = -np.inf
  rows[3, ::3] = -np.inf
  rows[3, min(1, V - 1)] = 5.0  # A finite maximum.
  rows[4, 1::2] -= 1000.0
  rows[5, 0] = np.nan
  rows[5, V - 1] = np.inf
  return rows, np.array([True, True, True, False, False, True])


def probabilities_reference(logits, temperature, top_k, top_p):
  """(p after temperature and top-k in float64; for top-p the mass ranked before each token by
  top-p's order, else None) of a row that has a distribution: the law of
  `spsjax.sampling.processors` before min-p (`min_p_kept`). Ranks and ties come from the float32
  (logit - max) / temperature, as the kernel's do; a scaled logit below log(float32 tiny) (and
  -inf) has probability 0."""
  x32 = scaled_logits(logits, temperature)
  x = x32.astype(np.float64)
  p = np.where(x >= np.log(np.finfo(np.float32).tiny), np.exp(x), 0.0)
  p /= p.sum()
  V = len(x)
  if 0 < top_k < V:
    kth = np.sort(x32)[::-1][top_k - 1]
    keep = x32 > kth
    tied = np.flatnonzero(x32 == kth)
    keep[tied[:top_k - keep.sum()]] = True
    p = np.where(keep, p, 0.0)
    p /= p.sum()
  if top_p >= 1.0:
    return p, None
  order = np.lexsort((np.arange(V), -p))  # p descending, then id.
  before = np.empty(V)
  before[order] = np.cumsum(p[order]) - p[order]
  return p, before


def scaled_logits(logits, temperature):
  return (logits - logits.max()) / np.float32(temperature)


def min_p_kept(logits, temperature, min_p):
  """The tokens min-p keeps: scaled logit >= log(min_p) rounded to float32 (all if off)."""
  cut = sampling_lib.SamplingConfig(temperature=temperature, min_p=min_p).min_logit
  return scaled_logits(logits, temperature) >= np.float32(cut)


def check_draw(label, weights, u, token, tol):
  """`token` is the inverse-CDF draw with u from `weights` (float64), up to `tol` of the mass."""
  cdf = np.cumsum(weights)
  threshold = u * cdf[-1]
  ok = (weights[token] > 0 and cdf[token] - weights[token] <= threshold + tol * cdf[-1] and
        cdf[token] >= threshold - tol * cdf[-1])
  assert ok, (f'{label}: drew {token} (weight {weights[token]}, mass {cdf[token]}) with u {u}; '
              f'inverse CDF: {np.argmax(cdf > threshold)}')


LATER_CUT_TOL = 1e-4  # Relative, on the float64 cuts (probabilities, distances, masses).


def later_cuts_bounds(x, p, typical_p, epsilon, eta):
  """(must keep, must drop) of one of typical-p, the epsilon and eta cutoffs (the others off) on
  the law p (float64, the kernel's scaled logits x): the tokens whose fate no rounding can
  change. Typical-p keeps token i iff the mass of the tokens strictly nearer the law's mean
  scaled logit than i is below typical_p; the cutoffs keep p >= cut and the most likely token."""
  kept = p > 0
  x = np.where(kept, x.astype(np.float64), 0.0)
  if typical_p < 1.0:
    d = np.where(kept, np.abs(x - np.sum(p * x)), np.inf)
    margin = LATER_CUT_TOL * (1.0 + np.abs(x))
    order = np.argsort(d, kind='stable')
    nearer = np.concatenate([[0.0], np.cumsum(p[order])])  # nearer[j]: the j nearest's mass.
    before_hi = nearer[np.searchsorted(d[order], d + margin)] - p  # Near ties count as nearer.
    before_lo = nearer[np.searchsorted(d[order], d - margin)]
    return (kept & (before_hi < typical_p - LATER_CUT_TOL),
            ~kept | (before_lo > typical_p + LATER_CUT_TOL))
  if epsilon > 0.0:
    cut = epsilon
  else:
    entropy = -np.sum(np.where(kept, p * np.log(np.where(kept, p, 1.0)), 0.0))
    cut = min(eta, np.sqrt(eta) * np.exp(-entropy))
  top = kept & (x == np.max(np.where(kept, x, -np.inf)))
  return (kept & (top | (p >= cut * (1 + LATER_CUT_TOL))),
          ~kept | (~top & (p < cut * (1 - LATER_CUT_TOL))))


def check_later_cuts(row, logits, temperature, top_k, top_p, min_p, typical_p, epsilon, eta,
                     probs, token, u):
  """A row under typical-p, the epsilon or the eta cutoff (one alone: its fate bounds checked;
  more: each kept token within the earlier cuts' support): the law before them (the kernel's
  own top-p support with top_p < 1), cut, renormalised, and a draw from it."""
  base, before = probabilities_reference(logits, temperature, top_k, top_p)
  base = np.where(min_p_kept(logits, temperature, min_p), base, 0.0)
  kept = probs > 0
  if before is not None:
    base = np.where(before < top_p + TOP_P_TOL, base, 0.0)
  assert not np.any(kept & (base == 0)), (row, 'kept outside the earlier cuts')
  if before is None and sum([typical_p < 1.0, epsilon > 0.0, eta > 0.0]) == 1:
    base /= base.sum()
    must_keep, must_drop = later_cuts_bounds(scaled_logits(logits, temperature), base,
                                             typical_p, epsilon, eta)
    assert not np.any(must_keep & ~kept), (row, 'dropped', np.flatnonzero(must_keep & ~kept))
    assert not np.any(must_drop & kept), (row, 'kept', np.flatnonzero(must_drop & kept))
  want = np.where(kept, base, 0.0)
  want /= want.sum()
  check_close(f'{row} probabilities', probs, want, want, rtol=PROBABILITY_RTOL, atol=1e-12)
  check_draw(row, probs.astype(np.float64), u, token, DRAW_TOL + 1e-9 * len(probs))


def check_probabilities(label, logits, temperature, top_k, top_p, min_p, typical_p, epsilon, eta,
                        probs, tokens, no_law):
  probs, tokens = np.asarray(probs), np.asarray(tokens)
  V = logits.shape[1]
  for r in range(logits.shape[0]):
    row = f'{label} row {r}'
    if no_law[r]:  # At every temperature.
      assert np.all(np.isnan(probs[r])) and tokens[r] == 0, (row, probs[r], tokens[r])
      continue
    if temperature == 0:
      best = int(np.argmax(logits[r]))
      check_equal(f'{row} greedy', probs[r], np.arange(V) == best)
      assert tokens[r] == best, (row, tokens[r], best)
      continue
    if typical_p < 1.0 or epsilon > 0.0 or eta > 0.0:
      check_later_cuts(row, logits[r], temperature, top_k, top_p, min_p, typical_p, epsilon, eta,
                       probs[r], tokens[r], UNIFORMS[r % len(UNIFORMS)])
      continue
    p, before = probabilities_reference(logits[r], temperature, top_k, top_p)
    min_kept = min_p_kept(logits[r], temperature, min_p)
    kept = probs[r] > 0
    if before is None:
      check_equal(f'{row} support', kept, (p > 0) & min_kept)
    else:
      must_keep = (p > 0) & (before < top_p - TOP_P_TOL) & min_kept
      must_drop = (p == 0) | (before > top_p + TOP_P_TOL) | ~min_kept
      assert not np.any(must_keep & ~kept), (row, 'top-p dropped',
                                             np.flatnonzero(must_keep & ~kept))
      assert not np.any(must_drop & kept), (row, 'top-p kept', np.flatnonzero(must_drop & kept))
    want = np.where(kept, p, 0.0)
    want /= want.sum()  # The law on the kernel's support (top-p's boundary may differ by rounding).
    check_close(f'{row} probabilities', probs[r], want, want, rtol=PROBABILITY_RTOL, atol=1e-12)
    check_draw(row, probs[r].astype(np.float64), UNIFORMS[r % len(UNIFORMS)], tokens[r],
               DRAW_TOL + 1e-9 * V)


def accept_inputs(V, rng, k=3, B=8):
  """p [B, k + 1, V], q [B, k, V], drafts, num, u, u_token: rows with q = p (every draft
  accepted), one-hot p (greedy), and numbers of proposed drafts 0..k, above k and negative."""
  p = np.exp(grid_normal(rng, (B, k + 1, V)))
  p = (p / p.sum(-1, keepdims=True)).astype(np.float32)
  q = np.exp(grid_normal(rng, (B, k, V)))
  q = (q / q.sum(-1, keepdims=True)).astype(np.float32)
  q[:2] = p[:2, :k]
  p[2:4] = np.arange(V) == np.argmax(p[2:4], -1)[..., None]
  drafts = rng.integers(0, V, (B, k)).astype(np.int32)
  drafts[2, 0] = np.argmax(p[2, 0])  # A draft the greedy target accepts.
  num = np.array([0, 3, 1, 2, 3, 2, 5, -1], np.int32)[:B]
  u = rng.random((B, k)).astype(np.float32)
  u_token = np.resize(UNIFORMS, B)
  return p, q, drafts, num, u, u_token


def check_accept(label, inputs, lenience, accepted, tokens):
  """The accept decisions exactly as float32 computes them, the draw from the residual (or p)
  in float64."""
  p, q, drafts, num, u, u_token = inputs
  k = q.shape[1]
  accepted, tokens = np.asarray(accepted), np.asarray(tokens)
  for b in range(p.shape[0]):
    limit, n = min(int(num[b]), k), 0
    while n < limit:
      d = drafts[b, n]
      if not u[b, n] * (np.float32(lenience) * q[b, n, d]) < p[b, n, d]:
        break
      n += 1
    assert accepted[b] == n, (label, b, accepted[b], n)
    weights = p[b, n].astype(np.float64)
    if n < limit:
      residual = np.maximum(p[b, n].astype(np.float64) - q[b, n], 0.0)
      if residual.sum() > 0:
        weights = residual
    check_draw(f'{label} row {b}', weights, u_token[b], tokens[b], DRAW_TOL + 1e-9 * p.shape[2])


@functools.partial(jax.jit, static_argnames=('settings', 'isas'))
def _sampling(logits, uniforms, accept_ops, settings, isas):
  probs = {(s, isa): native.probabilities_and_draw(
      logits, uniforms, temperature=s[0], top_k=s[1], top_p=s[2],
      min_logit=sampling_lib.SamplingConfig(temperature=s[0], min_p=s[3]).min_logit,
      typical_p=s[4], epsilon_cutoff=s[5], eta_cutoff=s[6], isa=isa)
           for s in settings for isa in isas}
  accepted = {(lenience, isa): native.accept(*accept_ops, lenience=lenience, isa=isa)
              for lenience in (1.0, 0.6) for isa in isas}
  return probs, accepted


def sampling(isas):
  for V in VOCABULARIES:
    start = time.time()
    rng = np.random.default_rng(V)
    logits = logit_rows(V, rng)
    no_law = np.zeros(len(logits), bool)
    if CHECK_NONFINITE_LOGITS:
      extra, extra_no_law = nonfinite_logit_rows(V, rng)
      logits, no_law = np.concatenate([logits, extra]), np.concatenate([no_law, extra_no_law])
    uniforms = np.resize(UNIFORMS, len(logits))
    inputs = accept_inputs(V, rng)
    settings = tuple(sampling_settings(V))
    probs, accepted = _sampling(logits, uniforms, inputs, settings, tuple(isas))
    for (s, isa), (p, tokens) in probs.items():
      check_probabilities(f'probabilities V={V} {s} {isa}', logits, *s, p, tokens, no_law)
    for (lenience, isa), (n, tokens) in accepted.items():
      check_accept(f'accept V={V} lenience {lenience} {isa}', inputs, lenience, n, tokens)
    print(f'sampling V={V}: {time.time() - start:.1f} s', flush=True)
  p, q, drafts, *rest = inputs
  drafts = drafts.copy()
  drafts[-1, -1] = p.shape[-1]
  expect_error('accept of a draft outside the vocabulary', 'outside the vocabulary',
               lambda: native.accept(p, q, drafts, *rest, lenience=1.0))


# --- Lookup ------------------------------------------------------------------------------------

LOOKUP_TABLES = ((1, 1), (3, 67), (7, 13), (50257, 3))  # (V, D)


def lookup(isas):
  del isas  # One variant.
  rng = np.random.default_rng(2)
  tables = [grid_normal(rng, shape) for shape in LOOKUP_TABLES]
  ids = [np.array([[-2**31, -1, 0], [1, V - 1, V], [V + 5, 2**31 - 1, V // 2]], np.int32)
         for V, _ in LOOKUP_TABLES]
  got = jax.jit(lambda ts, ids: [native.take_rows(t, i, use_kernel=True)
                                 for t, i in zip(ts, ids)])(tables, ids)
  for table, i, rows in zip(tables, ids, got, strict=True):
    check_equal(f'take_rows {table.shape}', rows, table[np.clip(i, 0, len(table) - 1)])
  print(f'lookup: {len(tables)} tables', flush=True)


# --- Negative controls -------------------------------------------------------------------------

def _probe(symbol, x, out):
  target = 'spsjax_probe_' + symbol.lower()
  jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library.load(), symbol)),
                              platform='cpu')
  y = jax.jit(lambda x: jax.ffi.ffi_call(target, out)(x))(x)
  jax.block_until_ready(y)
  print(f'{symbol} returned {np.asarray(y)[:4]}: the sanitizer missed it', flush=True)


def overflow_probe(isas):
  del isas
  _probe('SpsjaxProbeOverflow', jnp.arange(37, dtype=jnp.float32),
         jax.ShapeDtypeStruct((37,), jnp.float32))


def ub_probe(isas):
  del isas
  _probe('SpsjaxProbeSignedOverflow', jnp.array([2**31 - 1, 1], jnp.int32),
         jax.ShapeDtypeStruct((1,), jnp.int32))


SECTIONS = dict(matmul=matmul, matmul_rows=matmul_rows, attention=attention, sampling=sampling,
                lookup=lookup, overflow_probe=overflow_probe, ub_probe=ub_probe)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n', 1)[0])
  parser.add_argument('sections', nargs='+', metavar='SECTION[:ISA,...]',
                      help=f'one of {sorted(SECTIONS)}, driven in the instruction sets named '
                      '(default: every one this CPU runs)')
  args = parser.parse_args()
  check_library_is_sanitized()
  print(f'library {os.environ["SPSJAX_NATIVE_LIBRARY"]}, isas {native.isas()}, wide rows '
        f'{os.environ.get("SPSJAX_NATIVE_WIDE_ROWS", "default")}', flush=True)
  for spec in args.sections:
    section, _, only = spec.partition(':')
    isas = [isa for isa in native.isas() if not only or isa in only.split(',')]
    start = time.time()
    SECTIONS[section](isas)
    print(f'{spec} ({", ".join(isas)}): {time.time() - start:.1f} s', flush=True)
  # Every section has calls past its kernel's threshold for splitting work: the helpers ran.
  print(f'threads {library.threads()}, helpers started {library.helpers_started()}', flush=True)
  assert library.threads() == 1 or library.helpers_started() > 0, 'no call split its work'
  print('worker done', flush=True)


if __name__ == '__main__':
  main()
