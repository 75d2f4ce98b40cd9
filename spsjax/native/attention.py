"""Cached attention of a few new positions through the native kernel, or XLA's ops.

`cached_attention(qkv, keys, values, starts)` is the whole cached half of an attention block
after the q/k/v product: for every row b, the T new positions starts[b] + t get the rotary
embedding (`rope`) on their queries and keys, their keys and values are written into the cache
at those slots (`write_rows`), and every query attends over the slots [0, starts[b] + t] (the
causal mask of a cached call; a sliding window and Gemma 2's soft-capping of the scores are
options): softmax(q k^T / sqrt(H)) v. The kernel (`decode_attention.cc`)
does it in one call that reads only the slots in use and writes the cache in place, where XLA's
ops are a rotation, two cache writes and dots that read (and on XLA:CPU transpose) the whole
cache, five dispatches per layer. Its numbers are the reference's (`reference`, the model's own
ops) up to float reassociation, sin and cos rounding and an exp accurate to ~2e-7. A prefill of
right-padded prompts passes `counts_B` (each row's prompt length): the kernel then skips the
padding positions, whose outputs and cache slots nothing reads. A call on a token tree's nodes
(`tree_depths`, `tree_allowed`: `tree_slots`) rotates each node at its depth's position and lets
it see, of the tree's slots, its ancestors' only; the tree is shared by the rows or each row's own
(the operands lead with the batch axis).

`rope`, `write_rows` and `attend` are the model's own ops (`spsjax.models.transformer` uses them
on every path but this kernel's).
"""

import jax
import jax.numpy as jnp
import numpy as np

from spsjax.native import library

# Query rows per (row, kv head), T * G, up to which the kernel runs; its scores for one (row, kv
# head) take min(T, 16) * G * S floats (it takes positions 16 at a time). Prefills run it too: for
# `reference_target` a 128-token prefill took 23 ms with it and 35 ms with XLA's dots (which
# transpose the cache), 512 tokens 109 ms and 165 ms.
MAX_KERNEL_QUERIES = 4096


def rope_frequencies(head_dim: int, base: float) -> jax.Array:
  """The plain rotary frequencies, float32[head_dim / 2]: base^(-i / half) for i < half (a model
  with rope scaling rescales them: `spsjax.models.rope`)."""
  half = head_dim // 2
  return base ** (-jnp.arange(half, dtype=jnp.float32) / half)


def rope(x_BxTxNxH, positions_BxT, freqs_R2, amplitude: float = 1.0):
  """Rotary position embedding (half-split convention) of the first R = 2 len(freqs) dims of
  each head, at angles position * freqs_R2[i] (float32[R / 2]), times `amplitude` (YaRN's and
  LongRoPE's attention factor, on the rotated dims only, as transformers' cos and sin carry it),
  computed in float32; the other dims pass as they are (GPT-NeoX rotates a part of each head;
  R = 0: none)."""
  freqs_R2 = jnp.asarray(freqs_R2, jnp.float32)
  half = freqs_R2.shape[0]
  if half == 0:
    return x_BxTxNxH
  angles_BxTxR2 = positions_BxT[..., None].astype(jnp.float32) * freqs_R2[None, None, :]
  sin, cos = (f(angles_BxTxR2)[:, :, None] for f in (jnp.sin, jnp.cos))
  if amplitude != 1.0:
    sin, cos = sin * amplitude, cos * amplitude
  x = x_BxTxNxH.astype(jnp.float32)
  x1, x2 = x[..., :half], x[..., half:2 * half]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., 2 * half:]], axis=-1)
  return out.astype(x_BxTxNxH.dtype)


def write_rows(cache_BxSxNxH: jax.Array, new_BxTxNxH: jax.Array, starts_B: jax.Array) -> jax.Array:
  """Writes each row's T new entries at that row's own offset."""
  if cache_BxSxNxH.shape[0] == 1:
    # A batch of one: one dynamic-update-slice. The vmapped form's scatter over a batch of one
    # made XLA:GPU (JAX 0.10) carry the value cache in the key cache's layout through a decoding
    # loop and transpose it there and back every step (5 ops a layer, not 1).
    return jax.lax.dynamic_update_slice(cache_BxSxNxH, new_BxTxNxH.astype(cache_BxSxNxH.dtype),
                                        (0, starts_B[0], 0, 0))

  def one_row(row_SxNxH, new_TxNxH, start):
    return jax.lax.dynamic_update_slice(row_SxNxH, new_TxNxH.astype(row_SxNxH.dtype),
                                        (start, 0, 0))

  return jax.vmap(one_row)(cache_BxSxNxH, new_BxTxNxH, starts_B)


def attend(q_BxTxKxGxH, keys_BxSxKxH, values_BxSxKxH, positions_BxT, key_positions_BxS, *,
           scale=None, window=None, softcap=None, allowed_BxTxS=None):
  """XLA ops: each query at `positions` sees the keys at `key_positions` up to its own, and with
  a `window` only those after its position - window (a sliding window: its own position and the
  window - 1 before it); scores in float32, q.k times `scale` (None: 1 / sqrt(H)), with a
  `softcap` then softcap tanh(score / softcap) (Gemma 2). The model's attention on every path but
  the kernel's. `allowed_BxTxS` (bool) masks more keys (a token tree's: only a node's ancestors).

  The scores keep the products' natural order, S last ([B, K, T, G, S]: query dims before key
  dims, so jnp.einsum keeps q as the left operand): XLA:GPU then makes the softmax over S one
  kernel (max, sum and normalise across a minor dim) where S in the middle took three; on XLA:CPU
  the attention of a causal pass (T = S = 128 to 512) runs 1.3-2.4x faster.
  """
  H = keys_BxSxKxH.shape[3]
  mask_BxTxS = key_positions_BxS[:, None, :] <= positions_BxT[:, :, None]
  if window is not None:
    mask_BxTxS &= key_positions_BxS[:, None, :] > positions_BxT[:, :, None] - window
  if allowed_BxTxS is not None:
    mask_BxTxS &= allowed_BxTxS
  scores_BxKxTxGxS = jnp.einsum('BTKGH,BSKH->BKTGS', q_BxTxKxGxH, keys_BxSxKxH,
                                preferred_element_type=jnp.float32) * (
                                    H**-0.5 if scale is None else scale)
  if softcap is not None:
    scores_BxKxTxGxS = softcap * jnp.tanh(scores_BxKxTxGxS / softcap)
  scores_BxKxTxGxS = jnp.where(mask_BxTxS[:, None, :, None], scores_BxKxTxGxS,
                               jnp.finfo(jnp.float32).min)
  probs_BxKxTxGxS = jax.nn.softmax(scores_BxKxTxGxS, axis=-1).astype(values_BxSxKxH.dtype)
  out_BxKxTxGxH = jnp.einsum('BKTGS,BSKH->BKTGH', probs_BxKxTxGxS, values_BxSxKxH)
  return out_BxKxTxGxH.transpose(0, 2, 1, 3, 4)


def tree_rows(B: int, depths_xW, allowed_xTxW):
  """A tree's operands per row ([B, W], [B, T, W]), from shared ones ([W], [T, W]) or per-row."""
  depths_xW, allowed_xTxW = jnp.asarray(depths_xW), jnp.asarray(allowed_xTxW)
  return (jnp.broadcast_to(depths_xW, (B,) + depths_xW.shape[-1:]),
          jnp.broadcast_to(allowed_xTxW, (B,) + allowed_xTxW.shape[-2:]))


def tree_slots(depths_xW, allowed_xTxW, roots_B, num_slots: int):
  """(key positions [B, S], allowed [B, T, S]) of a full cache for a call on the last T of a token
  tree's first W nodes, its root at slot roots[b]: slot roots + w holds node w at position roots +
  depths[w] (the call's T nodes at its last T such slots); node W - T + t sees the slots before the
  root and the tree's slots w where allowed[t, w] (itself and its ancestors). Slots past the W
  nodes keep their own index as position, after every node's: causally masked. The tree's
  operands are shared ([W], [T, W]) or each row's ([B, W], [B, T, W])."""
  B = roots_B.shape[0]
  depths_BxW, allowed_BxTxW = tree_rows(B, depths_xW, allowed_xTxW)
  W = depths_BxW.shape[1]
  slot_BxS = jnp.broadcast_to(jnp.arange(num_slots, dtype=jnp.int32), (B, num_slots))
  node_BxS = slot_BxS - roots_B[:, None]
  in_tree_BxS = (node_BxS >= 0) & (node_BxS < W)
  node_BxS = jnp.clip(node_BxS, 0, W - 1)
  key_pos_BxS = jnp.where(in_tree_BxS, roots_B[:, None] + jnp.take_along_axis(
      depths_BxW, node_BxS, axis=1), slot_BxS)
  allowed_BxTxS = ~in_tree_BxS[:, None, :] | jnp.take_along_axis(
      allowed_BxTxW, node_BxS[:, None, :], axis=2)
  return key_pos_BxS, allowed_BxTxS


def _tree_positions(starts_B, T, tree_depths_xW):
  """Positions [B, T] of a call's T positions from starts: starts + t, or on a tree (the call's
  nodes the last T of W) root + depth."""
  if tree_depths_xW is None:
    return starts_B[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
  W = tree_depths_xW.shape[-1]
  depths_BxT = jnp.broadcast_to(jnp.asarray(tree_depths_xW)[..., W - T:], (starts_B.shape[0], T))
  return starts_B[:, None] - (W - T) + depths_BxT


def _split(qkv_BxTxMxH, K):
  N = qkv_BxTxMxH.shape[2] - 2 * K
  return jnp.split(qkv_BxTxMxH, [N, N + K], axis=2)


def reference(qkv_BxTxMxH, keys_BxSxKxH, values_BxSxKxH, starts_B, freqs_H2, rope_scale=1.0,
              tree_depths=None, tree_allowed=None, **options):
  """XLA ops: what `cached_attention` computes, as the model's own rotation (its amplitude
  `rope_scale`), writes and attention (`options`: `attend`'s scale, window and softcap), on a
  tree with `tree_slots`' mask."""
  B, T, _, H = qkv_BxTxMxH.shape
  K = keys_BxSxKxH.shape[2]
  q_BxTxNxH, k_BxTxKxH, v_BxTxKxH = _split(qkv_BxTxMxH, K)
  positions_BxT = _tree_positions(starts_B, T, tree_depths)
  keys_BxSxKxH = write_rows(keys_BxSxKxH, rope(k_BxTxKxH, positions_BxT, freqs_H2, rope_scale),
                            starts_B)
  values_BxSxKxH = write_rows(values_BxSxKxH, v_BxTxKxH, starts_B)
  q_BxTxKxGxH = rope(q_BxTxNxH, positions_BxT, freqs_H2, rope_scale).reshape(B, T, K, -1, H)
  slots_BxS = jnp.broadcast_to(jnp.arange(keys_BxSxKxH.shape[1]), keys_BxSxKxH.shape[:2])
  allowed_BxTxS = None
  if tree_depths is not None:
    slots_BxS, allowed_BxTxS = tree_slots(tree_depths, tree_allowed,
                                          starts_B - (tree_depths.shape[-1] - T),
                                          keys_BxSxKxH.shape[1])
  out = attend(q_BxTxKxGxH, keys_BxSxKxH, values_BxSxKxH, positions_BxT, slots_BxS,
               allowed_BxTxS=allowed_BxTxS, **options)
  return out, keys_BxSxKxH, values_BxSxKxH


def _kernel(qkv_BxTxMxH, keys_BxSxKxH, values_BxSxKxH, starts_B, counts_B, freqs_H2, isa, *,
            scale=None, rope_scale=1.0, window=None, softcap=None, tree_depths=None,
            tree_allowed=None):
  B, T, M, H = qkv_BxTxMxH.shape
  K = keys_BxSxKxH.shape[2]
  out = jax.ShapeDtypeStruct((B, T, K, (M - 2 * K) // K, H), jnp.float32)
  cache = jax.ShapeDtypeStruct(keys_BxSxKxH.shape, jnp.float32)
  if tree_depths is None:  # Empty operands: no tree.
    tree_depths, tree_allowed = jnp.zeros((0, 0), jnp.int32), jnp.zeros((0, 0, 0), jnp.uint8)
  else:  # The kernel takes each row's.
    tree_depths, tree_allowed = tree_rows(B, tree_depths, tree_allowed)
  return jax.ffi.ffi_call('spsjax_cached_attention', (out, cache, cache),
                          vmap_method='sequential', input_output_aliases={1: 1, 2: 2})(
      qkv_BxTxMxH.astype(jnp.float32), keys_BxSxKxH, values_BxSxKxH, starts_B.astype(jnp.int32),
      counts_B, freqs_H2, tree_depths.astype(jnp.int32), tree_allowed.astype(jnp.uint8),
      scale=np.float32(H**-0.5 if scale is None else scale),
      rope_scale=np.float32(rope_scale),
      window=np.int64(window or 0), softcap=np.float32(softcap or 0.0),
      isa=np.int32(library.isa_code(isa)))


def use_kernel(qkv_BxTxMxH, keys_BxSxKxH) -> bool:
  """Whether `cached_attention` would run the kernel for these operands (on a CPU)."""
  _, T, M, H = qkv_BxTxMxH.shape
  K = keys_BxSxKxH.shape[2]
  G = (M - 2 * K) // K
  return (library.available() and keys_BxSxKxH.dtype == jnp.float32
          and qkv_BxTxMxH.dtype == jnp.float32 and H % 2 == 0 and T * G <= MAX_KERNEL_QUERIES)


def cached_attention(qkv_BxTxMxH: jax.Array, keys_BxSxKxH: jax.Array, values_BxSxKxH: jax.Array,
                     starts_B: jax.Array, *, rope_freqs: jax.Array,
                     counts_B: jax.Array | None = None, scale: float | None = None,
                     rope_scale: float = 1.0, window: int | None = None,
                     softcap: float | None = None, tree_depths: jax.Array | None = None,
                     tree_allowed: jax.Array | None = None,
                     isa: str = 'best') -> tuple[jax.Array, jax.Array, jax.Array]:
  """(attention outputs [B, T, K, G, H], keys, values with this call's slots written); module
  docstring. qkv holds N = K G query heads, then K key and K value heads, before the rotation by
  `rope_freqs` (float32[R / 2], `rope_frequencies` or a model's rescaled ones, for the first R
  dims of each head: all H of them, a part (GPT-NeoX) or none (GPT-2)); the caller keeps
  starts + T <= S. `rope_scale`: the rotation's amplitude (`rope`'s); `scale`, `window` and
  `softcap` as in `attend` (the kernel reads no slot before a window).

  `counts_B` (a prefill of right-padded prompts): row b's positions t >= counts[b] are padding;
  their outputs and cache slots (at or past the row's length) are left unspecified. The kernel
  skips them (zeros, slots not written); XLA's ops compute them.

  `tree_depths` (int32[W]) and `tree_allowed` (bool[T, W], W >= T): the T positions are the last T
  of a token tree's first W nodes, the tree's root at slot starts - (W - T); node w sits at slot
  root + w and rotates at position root + depths[w]; the call's node t sees the slots before the
  root and the tree's slots w where allowed[t, w] (itself and its ancestors: `tree_slots`). Each
  row's own tree: [B, W] and [B, T, W]. No window with a tree."""
  K = keys_BxSxKxH.shape[2]
  M = qkv_BxTxMxH.shape[2]
  if M <= 2 * K or (M - 2 * K) % K:
    raise ValueError(f'qkv with {M} heads for {K} kv heads: want N + 2K heads, N a multiple of K.')
  B = qkv_BxTxMxH.shape[0]
  if counts_B is None:
    counts_B = jnp.zeros((0,), jnp.int32)
  elif counts_B.shape != (B,):
    raise ValueError(f'counts of shape {counts_B.shape} for {B} rows.')
  H = qkv_BxTxMxH.shape[3]
  rope_freqs = jnp.asarray(rope_freqs, jnp.float32)
  if rope_freqs.ndim != 1 or 2 * rope_freqs.shape[0] > H:
    raise ValueError(f'rope_freqs of shape {rope_freqs.shape} for heads of {H} dims: want '
                     f'(R / 2,), R <= {H} the rotated dims.')
  if window is not None and window < 1 or softcap is not None and not softcap > 0:
    raise ValueError(f'window must be >= 1 and softcap > 0 (or None), got {window}, {softcap}.')
  T = qkv_BxTxMxH.shape[1]
  if (tree_depths is None) != (tree_allowed is None):
    raise ValueError('A tree needs both tree_depths and tree_allowed.')
  if tree_depths is not None:
    W = tree_depths.shape[-1]
    rows = tree_depths.shape[:-1]
    if (tree_depths.ndim not in (1, 2) or rows not in ((), (B,))
        or tree_allowed.shape != rows + (T, W) or W < T):
      raise ValueError(f'A tree wants depths [W] and allowed [T, W] (or [B, W] and [B, T, W], '
                       f'B = {B}) with W >= T = {T}, got {tree_depths.shape} and '
                       f'{tree_allowed.shape}.')
    if window is not None:
      raise ValueError('A tree takes no window (a windowed layer attends over a tree by its '
                       'ring, `spsjax.models.transformer`).')
    tree_depths, tree_allowed = jnp.asarray(tree_depths, jnp.int32), jnp.asarray(tree_allowed)
  options = dict(scale=scale, window=window, softcap=softcap, rope_scale=rope_scale,
                 tree_depths=tree_depths, tree_allowed=tree_allowed)
  operands = (qkv_BxTxMxH, keys_BxSxKxH, values_BxSxKxH, starts_B, counts_B.astype(jnp.int32),
              rope_freqs)
  xla = lambda ops: reference(*ops[:4], ops[5], **options)
  if not use_kernel(qkv_BxTxMxH, keys_BxSxKxH):
    return xla(operands)
  return library.on_cpu(operands, lambda ops: _kernel(*ops, isa, **options), xla)
