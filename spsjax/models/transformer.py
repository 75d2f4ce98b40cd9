"""Decoder-only transformer in Flax, one forward for both the full causal pass and the cached pass.

Shapes use single-letter einsum names throughout: B batch, T new positions, S key positions (cache
slots, or T without a cache), D d_model, N query heads, K kv heads, G = N / K query heads per kv
head, H head dim, F MLP hidden, V vocabulary.

Parameters carry logical axis names (`spsjax.sharding`); the forward has no sharding code of its own:
with Megatron-sharded weights, XLA's partitioner splits heads and MLP units over `model` and inserts
one all-reduce after each attention and MLP block.

`config.kernels` chooses what computes the projections and the cached attention, in one place per
block: 'xla', XLA's ops on the parameters `init_params` makes; 'xla_fused', XLA's ops on a model
fused for decoding (`models.fuse`, in `spsjax.models.packing`): q, k and v one product (`wqkv`,
[D, K, G + 2, H]: each kv head's G query heads, its key and its value side by side, so that a
Megatron split of the kv heads keeps every group on one device) and a gated MLP's gate and input
one (`w_gate_in`, [D, 2, F]), fewer and larger products a step; 'native', the CPU kernels on a
model packed for decoding (`spsjax.models.packing`, which sets it), whose parameters hold
`native.PackedWeight`s in place of its projection weights, q, k and v as one (`wqkv`) and the gate
and input of a gated MLP as one (`w_gate_in`): each block then asks for its product from
`native.matmul`, and a cached call rotates, writes the cache and attends in one
`native.cached_attention`; everything else is the same code. A setting the parameters cannot
serve (packed weights with 'xla', plain ones with 'native', fused ones with anything but
'xla_fused') is an error (`_check_kernels`). On XLA's path every projection goes through
`project`, which gives a single row a zero second one where `config.single_row` says so.

GPT-2's and GPT-NeoX's options (`norm='layer'`, `position='learned'`, `dense_bias`, `rope_dims`,
`parallel_residual`) run on every path: on the packed one their LayerNorms and biases are XLA's
ops beside the kernels' products, and the attention kernel rotates the first `rotary_dims` of a
head (none with learned positions).

Invariant: a cached call at row offsets `lengths` computes exactly what the full causal forward
computes at those positions (up to float reassociation).
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from spsjax import native
from spsjax.models import kv_cache, rope
from spsjax.models.config import GATED_MLPS, TransformerConfig
from spsjax.models.token_tree import TreeMask


def _param(module, name, shape, names, fan_in, dtype, zeros=False):
  init = nn.initializers.zeros if zeros else nn.initializers.normal(stddev=fan_in**-0.5)
  return module.param(name, nn.with_logical_partitioning(init, names), shape, dtype)


def _pads_single_row(config: TransformerConfig) -> bool:
  return config.single_row in ('padded', 'stream') or (config.single_row == 'auto'
                                                       and jax.default_backend() == 'gpu')


def _streams_two_rows(config: TransformerConfig, tokens_BxT: jax.Array) -> bool:
  """Whether a call carries its single row (B = T = 1) as a stream of two (`single_row`
  'stream'; the packed CPU kernels take single rows as they are)."""
  return (config.single_row == 'stream' and config.kernels != 'native'
          and tokens_BxT.shape[0] * tokens_BxT.shape[1] == 1)


def _pad_rows(x_BxTx_: jax.Array, rows: int) -> jax.Array:
  """x with zero positions appended along T up to `rows` (x itself if it has them)."""
  if x_BxTx_.shape[1] == rows:
    return x_BxTx_
  return jnp.pad(x_BxTx_, [(0, 0), (0, rows - x_BxTx_.shape[1])] + [(0, 0)] * (x_BxTx_.ndim - 2))


def project(config: TransformerConfig, spec: str, x_BxTx_, w, **kwargs) -> jax.Array:
  """`jnp.einsum(spec, x, w)` for a product of the stream's positions (`spec` 'BT...,...->BT...').
  A single row (B = T = 1) is given a second, zero row where `config.single_row` says so, and its
  result sliced back: XLA:GPU turns a matrix-vector product of fewer than 10M weight elements into
  a multiply and a reduce (on an H200, llama1b's attention output, 8.4 MB: 16 us a layer; its MLP
  output, 34 MB through a GEMM: 10 us), while two rows make a GEMM that reads the weight once."""
  if x_BxTx_.shape[0] * x_BxTx_.shape[1] != 1 or not _pads_single_row(config):
    return jnp.einsum(spec, x_BxTx_, w, **kwargs)
  return jnp.einsum(spec, _pad_rows(x_BxTx_, 2), w, **kwargs)[:, :1]


def _kept_counts(keep_BxL: jax.Array, counts_B: jax.Array | None) -> jax.Array | None:
  """Real positions among the kept ones (`keep_BxL`, increasing along L) of rows whose first
  counts[b] positions are real: a count for the kept positions, for the products after them."""
  if counts_B is None:
    return None
  return jnp.sum(keep_BxL < counts_B[:, None], axis=1).astype(jnp.int32)


def _packed(module, name) -> native.PackedWeight:
  """The packed weight `name` of a model whose kernels are 'native'."""
  return module.get_variable('params', name)


def _layout(module) -> str:
  """The kernels the parameters are laid out for: a packed model always holds a packed output
  layer (`head`), a plain one never does; a fused one holds `wqkv` in its first layer."""
  head = module.get_variable('params', 'head') if module.has_variable('params', 'head') else None
  if isinstance(head, native.PackedWeight):
    return 'native'
  layer = module.get_variable('params', 'layer_0') if module.has_variable('params',
                                                                           'layer_0') else {}
  return 'xla_fused' if 'wqkv' in layer.get('attn', {}) else 'xla'


def _check_kernels(module, config: TransformerConfig) -> None:
  """Raises ValueError unless the parameters are laid out for `config.kernels` (XLA's layouts
  can be initialised: `param_shardings` of a fused model names the fused weights)."""
  if module.is_initializing() and config.kernels != 'native':
    return
  layout = _layout(module)
  if layout != config.kernels:
    raise ValueError(
        f'config.kernels is {config.kernels!r} but the parameters are laid out for {layout!r}: '
        f'the native kernels run on weights packed by `models.pack` (which sets '
        f'kernels=\'native\'; `models.unpack` sets \'xla\' back), XLA\'s fused products on '
        f'weights fused by `models.fuse` (\'xla_fused\'; `models.unfuse`), and `init_params` '
        f'and checkpoints give XLA\'s layout (\'xla\').')


class RMSNorm(nn.Module):
  """Pre-norm: x / rms(x) * scale, or with `norm='layer'` LayerNorm, (x - mean) / std * scale +
  bias. A packed product applies the RMS norm itself (`native.matmul(norm=)`)."""
  config: TransformerConfig

  def setup(self):
    c = self.config
    self.scale = self.param('scale', nn.with_logical_partitioning(nn.initializers.ones, ('embed',)),
                            (c.d_model,), c.jnp_dtype)
    if c.norm == 'layer':
      self.bias = self.param('bias', nn.with_logical_partitioning(nn.initializers.zeros,
                                                                  ('embed',)),
                             (c.d_model,), c.jnp_dtype)

  def __call__(self, x_BxTxD):
    c = self.config
    if c.norm == 'layer':
      x = x_BxTxD.astype(jnp.float32)
      x = x - jnp.mean(x, axis=-1, keepdims=True)
      x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + c.norm_eps)
      scale_1x1xD, bias_1x1xD = (p.astype(jnp.float32).reshape(1, 1, -1)
                                 for p in (self.scale, self.bias))
      return (x * scale_1x1xD + bias_1x1xD).astype(c.jnp_dtype)
    return native.rms_norm(x_BxTxD, self.scale, c.norm_eps).astype(c.jnp_dtype)

  @property
  def fused(self) -> tuple[jax.Array, float]:
    """What a packed product needs to apply this RMS norm to its input."""
    return self.scale, self.config.norm_eps

  def packed_input(self, x_BxTxD) -> tuple[jax.Array, tuple[jax.Array, float] | None]:
    """(the input of a packed product, its `norm=`): an RMS norm runs in the product's kernel,
    a LayerNorm by XLA's ops before it."""
    if self.config.norm == 'rms':
      return x_BxTxD, self.fused
    return self(x_BxTxD), None


def _tree_operands(tree: TreeMask, T: int) -> dict:
  """`native.cached_attention`'s tree operands for a call on T of a tree's nodes: its nodes up to
  the call's last (`native.tree_slots`)."""
  W = tree.first + T
  return dict(tree_depths=tree.depths_xM[..., :W], tree_allowed=tree.ancestors_xTxM[..., :W])


def _whole_tree(tree: TreeMask, B: int, T: int, where: str) -> jax.Array:
  """The mask [B, T, T] of a call on a whole tree (first node 0, all M nodes), which `where`
  needs."""
  if tree.first != 0 or tree.ancestors_xTxM.shape[-1] != T:
    raise ValueError(f'{where} takes a token tree in one call, root first (got nodes from '
                     f'{tree.first}, {T} of {tree.ancestors_xTxM.shape[-1]}).')
  return jnp.broadcast_to(tree.ancestors_xTxM, (B, T, T))


class Attention(nn.Module):
  """Multi-head attention with K kv heads shared by groups of G query heads (MHA, GQA, MQA).

  Takes the residual stream and its pre-norm, returns the stream with the attention added.
  With `qk_norm`, queries and keys are RMS-normed per head (scales `q_norm`, `k_norm`) before the
  rotation, by XLA's ops on every path. `keep_BxL` (indices into T): return the stream at those
  positions only, [B, L, D]; the keys and values of all T positions are still computed and
  returned (the model's last layer when only some positions' logits are wanted: the other
  positions' output projection and MLP are skipped).
  `counts_B` (a prefill of right-padded prompts, or 0 for a decoder's idle rows): positions
  t >= counts[b] are padding, whose outputs nothing reads; the packed kernels skip them (XLA's ops
  compute them). After `keep_BxL`, the kept positions that are real count (`_kept_counts`).
  A stream of more positions than `positions_BxT` has (`single_row` 'stream': a single row carried
  as two) gives the extra ones no keys, values or attention: they get zero attention output.
  Layer `layer`'s window and rotary frequencies are the config's for it; `post_norm` (Gemma 2's)
  norms the output before the residual add.
  `sees_BxT` (int32, each query's >= its position): query t sees the keys at positions up to
  sees[t] rather than its own (a semi-autoregressive head's block, `feature_head`), rotated at
  its own; by XLA's attention on every path.
  """
  config: TransformerConfig
  layer: int = 0

  @nn.compact
  def __call__(self, x_BxTxD, norm: RMSNorm, positions_BxT, layer_cache, keep_BxL=None,
               counts_B=None, post_norm: RMSNorm | None = None, tree: TreeMask | None = None,
               sees_BxT=None):
    c = self.config
    # The first R dims of each head rotate (`rotary_dims`; none with learned positions).
    freqs_R2 = (rope.frequencies(c, self.layer) if c.position == 'rope'
                else jnp.zeros((0,), jnp.float32))
    amplitude = rope.attention_factor(c, self.layer)  # YaRN's, LongRoPE's: on the rotated dims.
    options = dict(scale=c.query_scale, window=c.window(self.layer), softcap=c.attn_softcap)
    D, N, K, H, dt = c.d_model, c.num_heads, c.kv_heads, c.dims_per_head, c.jnp_dtype
    packed = c.kernels == 'native'
    B, rows = x_BxTxD.shape[:2]
    T = positions_BxT.shape[1]  # The stream's extra rows ('stream') are not attended.
    if c.qkv_bias:  # Biases stay unpacked: [N + 2K, H], added after the product.
      bias_MxH = jnp.concatenate([
          _param(self, 'bq', (N, H), ('heads', 'head_dim'), 1, dt, zeros=True),
          _param(self, 'bk', (K, H), ('kv_heads', 'head_dim'), 1, dt, zeros=True),
          _param(self, 'bv', (K, H), ('kv_heads', 'head_dim'), 1, dt, zeros=True)])
    if packed:  # One product for q, k and v, an RMS norm applied by the kernel.
      h_BxTxD, fused = norm.packed_input(x_BxTxD)
      qkv_BxTxMxH = native.matmul(h_BxTxD, _packed(self, 'wqkv'), norm=fused,
                                  counts=counts_B).astype(dt)
      if c.qkv_bias:
        qkv_BxTxMxH = qkv_BxTxMxH + bias_MxH[None, None]
      wo = _packed(self, 'wo')
    elif c.kernels == 'xla_fused':  # Per kv head: its G query heads, its key, its value.
      wqkv = _param(self, 'wqkv', (D, K, N // K + 2, H), ('embed', 'kv_heads', None, 'head_dim'),
                    D, dt)
      wo = _param(self, 'wo', (N, H, D), ('heads', 'head_dim', 'embed'), N * H, dt)
    else:
      wq = _param(self, 'wq', (D, N, H), ('embed', 'heads', 'head_dim'), D, dt)
      wk = _param(self, 'wk', (D, K, H), ('embed', 'kv_heads', 'head_dim'), D, dt)
      wv = _param(self, 'wv', (D, K, H), ('embed', 'kv_heads', 'head_dim'), D, dt)
      wo = _param(self, 'wo', (N, H, D), ('heads', 'head_dim', 'embed'), N * H, dt)
    if c.qk_norm:
      q_scale_H, k_scale_H = (
          self.param(name, nn.with_logical_partitioning(nn.initializers.ones, ('head_dim',)),
                     (H,), dt) for name in ('q_norm', 'k_norm'))
      norm_qk = lambda q, k: (native.rms_norm(q, q_scale_H, c.norm_eps).astype(dt),
                              native.rms_norm(k, k_scale_H, c.norm_eps).astype(dt))
    written = None
    # A packed model's cached call attends by the kernel, on a tree too, but for a windowed
    # layer's: that attends over a whole tree by XLA's ops, as a ring (after the packed product;
    # the cache has the same layout).
    if packed and layer_cache is not None and sees_BxT is None and (
        tree is None or options['window'] is None):
      # Rotation, cache writes and attention in one native call that reads only the slots in
      # use (a cached call's positions are starts + t, `api.extend`).
      if c.qk_norm:  # Normed by XLA's ops between the product and the attention kernel.
        q_BxTxNxH, k_BxTxKxH, v_BxTxKxH = jnp.split(qkv_BxTxMxH, [N, N + K], axis=2)
        qkv_BxTxMxH = jnp.concatenate([*norm_qk(q_BxTxNxH, k_BxTxKxH), v_BxTxKxH], axis=2)
      cache_k, cache_v, starts_B = layer_cache
      out_BxTxKxGxH, keys_BxSxKxH, values_BxSxKxH = native.cached_attention(
          qkv_BxTxMxH, cache_k, cache_v, starts_B, rope_freqs=freqs_R2, counts_B=counts_B,
          rope_scale=amplitude, **options, **({} if tree is None else _tree_operands(tree, T)))
      out_BxTxKxGxH = out_BxTxKxGxH.astype(dt)
    else:
      if packed:  # A full pass, a windowed layer's tree or queries that see ahead (`sees_BxT`):
        # XLA's attention after the product.
        q_BxTxNxH, k_BxTxKxH, v_BxTxKxH = jnp.split(qkv_BxTxMxH, [N, N + K], axis=2)
      elif c.kernels == 'xla_fused':
        G = N // K
        qkv_BxTxKxCxH = project(c, 'BTD,DKCH->BTKCH', norm(x_BxTxD), wqkv)[:, :T]
        q_BxTxNxH = qkv_BxTxKxCxH[:, :, :, :G].reshape(B, T, N, H)
        k_BxTxKxH, v_BxTxKxH = qkv_BxTxKxCxH[:, :, :, G], qkv_BxTxKxCxH[:, :, :, G + 1]
      else:
        h_BxTxD = norm(x_BxTxD)
        q_BxTxNxH, k_BxTxKxH, v_BxTxKxH = (
            project(c, spec, h_BxTxD, w)[:, :T]
            for spec, w in (('BTD,DNH->BTNH', wq), ('BTD,DKH->BTKH', wk), ('BTD,DKH->BTKH', wv)))
      if c.qkv_bias and not packed:
        q_BxTxNxH, k_BxTxKxH, v_BxTxKxH = (
            q_BxTxNxH + bias_MxH[None, None, :N], k_BxTxKxH + bias_MxH[None, None, N:N + K],
            v_BxTxKxH + bias_MxH[None, None, N + K:])
      if c.qk_norm:
        q_BxTxNxH, k_BxTxKxH = norm_qk(q_BxTxNxH, k_BxTxKxH)
      if c.position == 'rope':
        q_BxTxNxH = native.rope(q_BxTxNxH, positions_BxT, freqs_R2, amplitude)
        k_BxTxKxH = native.rope(k_BxTxKxH, positions_BxT, freqs_R2, amplitude)
      q_BxTxKxGxH = q_BxTxNxH.reshape(B, T, K, N // K, H)
      allowed_BxTxS = None  # A token tree's nodes see their ancestors only among the new keys.
      if layer_cache is None:  # Full causal pass: keys are the new positions themselves.
        keys_BxSxKxH, values_BxSxKxH, key_pos_BxS = k_BxTxKxH, v_BxTxKxH, positions_BxT
        if tree is not None:
          allowed_BxTxS = _whole_tree(tree, B, T, 'An uncached forward')
      elif options['window'] is not None:  # A ring (kv_cache): as it was, then the new keys.
        cache_k, cache_v, starts_B = layer_cache
        keys_BxSxKxH = jnp.concatenate([cache_k, k_BxTxKxH.astype(cache_k.dtype)], axis=1)
        values_BxSxKxH = jnp.concatenate([cache_v, v_BxTxKxH.astype(cache_v.dtype)], axis=1)
        key_pos_BxS = jnp.concatenate(
            [kv_cache.ring_positions(starts_B, cache_k.shape[1]), positions_BxT], axis=1)
        if tree is not None:  # Its ring holds no node a call wrote before.
          allowed_BxTxS = jnp.concatenate(
              [jnp.ones((B, T, cache_k.shape[1]), bool),
               _whole_tree(tree, B, T, 'A sliding-window layer')], axis=2)
        written = (kv_cache.ring_write(cache_k, k_BxTxKxH, starts_B, counts_B),
                   kv_cache.ring_write(cache_v, v_BxTxKxH, starts_B, counts_B))
      else:  # Write this call's positions first, then attend over the whole cache.
        cache_k, cache_v, starts_B = layer_cache
        keys_BxSxKxH = native.write_rows(cache_k, k_BxTxKxH, starts_B)
        values_BxSxKxH = native.write_rows(cache_v, v_BxTxKxH, starts_B)
        key_pos_BxS = jnp.broadcast_to(jnp.arange(keys_BxSxKxH.shape[1]),
                                       keys_BxSxKxH.shape[:2])
        if tree is not None:  # The call's first node is written at starts.
          key_pos_BxS, allowed_BxTxS = native.tree_slots(
              tree.depths_xM, tree.ancestors_xTxM, starts_B - tree.first, keys_BxSxKxH.shape[1])
      out_BxTxKxGxH = native.attend(
          q_BxTxKxGxH, keys_BxSxKxH, values_BxSxKxH,
          positions_BxT if sees_BxT is None else sees_BxT, key_pos_BxS,
          allowed_BxTxS=allowed_BxTxS, **options)
    # One contracting dim of N * H: wo is then only reshaped. With (N, H) contracted as two dims,
    # XLA's CPU layout assignment transposes wo instead of the small activation, a copy of the
    # weight on every call that it does not hoist out of the decode loop.
    out_BxTxF = _pad_rows(out_BxTxKxGxH.reshape(B, T, N * H), rows)
    if keep_BxL is not None:  # From here on the T axis holds the L kept positions.
      out_BxTxF, x_BxTxD = (jnp.take_along_axis(a, keep_BxL[:, :, None], axis=1)
                            for a in (out_BxTxF, x_BxTxD))
      counts_B = _kept_counts(keep_BxL, counts_B)
    bias_1x1xD = (_param(self, 'bo', (D,), ('embed',), 1, dt, zeros=True)[None, None]
                  if c.dense_bias else None)
    if written is None:  # The layer's cache: the keys and values attended to, or its ring's.
      written = (keys_BxSxKxH, values_BxSxKxH)
    if packed:
      return (_packed_output(x_BxTxD, out_BxTxF, wo, post_norm, counts_B, dt, bias_1x1xD),
              written)
    out_BxTxD = project(c, 'BTF,FD->BTD', out_BxTxF, wo.reshape(N * H, D))
    if bias_1x1xD is not None:
      out_BxTxD = out_BxTxD + bias_1x1xD
    return _residual(x_BxTxD, out_BxTxD, post_norm), written


class Mlp(nn.Module):
  """Gated SiLU, gated GELU or GELU (tanh or erf) MLP; like `Attention`, takes the stream and its
  norm (and `counts_B`, `post_norm`), returns the stream with the output added; `residual_BxTxD`
  is the stream it is added to instead (a parallel block's attention output)."""
  config: TransformerConfig

  @nn.compact
  def __call__(self, x_BxTxD, norm: RMSNorm, counts_B=None, post_norm: RMSNorm | None = None,
               residual_BxTxD=None):
    c = self.config
    D, F, dt = c.d_model, c.ff_dim, c.jnp_dtype
    packed = c.kernels == 'native'
    residual_BxTxD = x_BxTxD if residual_BxTxD is None else residual_BxTxD
    gelu = functools.partial(jax.nn.gelu, approximate=c.mlp != 'gelu_exact')
    bias = lambda name, n: (_param(self, name, (n,), (('mlp',) if n == F else ('embed',)), 1, dt,
                                   zeros=True)[None, None] if c.dense_bias else None)
    if packed:
      h_BxTxD, fused = norm.packed_input(x_BxTxD)
    if packed and c.mlp in GATED_MLPS:  # One product for the gate and the input.
      gate_in_BxTx2xF = native.matmul(h_BxTxD, _packed(self, 'w_gate_in'), norm=fused,
                                      counts=counts_B)
      if c.dense_bias:  # On the input, not the gate, as XLA's path adds it.
        gate_in_BxTx2xF = gate_in_BxTx2xF + jnp.stack(
            [jnp.zeros((1, 1, F), dt), bias('b_in', F)], axis=2)
      if c.mlp == 'gated_silu':  # The gating in the second product's kernel.
        return _packed_output(residual_BxTxD, gate_in_BxTx2xF, _packed(self, 'w_out'),
                              post_norm, counts_B, dt, bias('b_out', D), gated=True)
      gate_in_BxTx2xF = gate_in_BxTx2xF.astype(dt)  # The gating by XLA's ops between the two.
      h_BxTxF = jax.nn.gelu(gate_in_BxTx2xF[:, :, 0]) * gate_in_BxTx2xF[:, :, 1]
      return _packed_output(residual_BxTxD, h_BxTxF, _packed(self, 'w_out'), post_norm,
                            counts_B, dt, bias('b_out', D))
    if packed:  # GELU, its biases (GPT-2's, GPT-NeoX's) by XLA's ops.
      h_BxTxF = native.matmul(h_BxTxD, _packed(self, 'w_in'), norm=fused,
                              counts=counts_B).astype(dt)
      if c.dense_bias:
        h_BxTxF = h_BxTxF + bias('b_in', F)
      return _packed_output(residual_BxTxD, gelu(h_BxTxF), _packed(self, 'w_out'), post_norm,
                            counts_B, dt, bias('b_out', D))
    h_BxTxD = norm(x_BxTxD)
    if c.kernels == 'xla_fused' and c.mlp in GATED_MLPS:  # One product, gate then input.
      w_gate_in = _param(self, 'w_gate_in', (D, 2, F), ('embed', None, 'mlp'), D, dt)
      w_out = _param(self, 'w_out', (F, D), ('mlp', 'embed'), F, dt)
      gate_in_BxTx2xF = project(c, 'BTD,DCF->BTCF', h_BxTxD, w_gate_in)
      gate_BxTxF, h_BxTxF = gate_in_BxTx2xF[:, :, 0], gate_in_BxTx2xF[:, :, 1]
    else:
      w_in = _param(self, 'w_in', (D, F), ('embed', 'mlp'), D, dt)
      w_out = _param(self, 'w_out', (F, D), ('mlp', 'embed'), F, dt)
      gate_BxTxF, h_BxTxF = None, project(c, 'BTD,DF->BTF', h_BxTxD, w_in)
    if c.dense_bias:
      h_BxTxF = h_BxTxF + bias('b_in', F)
    if c.mlp in GATED_MLPS:
      if gate_BxTxF is None:
        w_gate = _param(self, 'w_gate', (D, F), ('embed', 'mlp'), D, dt)
        # Gate and input as two products, not one stacked tensor: stacking made training's
        # backward pass pad, add and transpose [B, T, 2, F] (a tenth of a reference step).
        gate_BxTxF = project(c, 'BTD,DF->BTF', h_BxTxD, w_gate)
      h_BxTxF = (native.silu_gate(gate_BxTxF, h_BxTxF) if c.mlp == 'gated_silu'
                 else jax.nn.gelu(gate_BxTxF) * h_BxTxF)
    else:
      h_BxTxF = gelu(h_BxTxF)
    out_BxTxD = project(c, 'BTF,FD->BTD', h_BxTxF, w_out)
    if c.dense_bias:
      out_BxTxD = out_BxTxD + bias('b_out', D)
    return _residual(residual_BxTxD, out_BxTxD, post_norm)


def _residual(x_BxTxD, out_BxTxD, post_norm: RMSNorm | None) -> jax.Array:
  """The stream plus a block's output, the output normed first where the model has post-norms."""
  return x_BxTxD + (out_BxTxD if post_norm is None else post_norm(out_BxTxD))


def _packed_output(x_BxTxD, h_BxTxF, w: native.PackedWeight, post_norm: RMSNorm | None,
                   counts_B, dtype, bias_1x1xD=None, **options) -> jax.Array:
  """A block's output product on the packed kernels and its residual add: in the kernel, or with
  a post-norm by XLA's ops after it; a bias (GPT-2's) added by XLA's ops (`options`:
  `native.matmul`'s, e.g. `gated`)."""
  if post_norm is None:
    out_BxTxD = native.matmul(h_BxTxF, w, residual=x_BxTxD, counts=counts_B,
                              **options).astype(dtype)
    return out_BxTxD if bias_1x1xD is None else out_BxTxD + bias_1x1xD
  out_BxTxD = native.matmul(h_BxTxF, w, counts=counts_B, **options).astype(dtype)
  if bias_1x1xD is not None:
    out_BxTxD = out_BxTxD + bias_1x1xD
  return _residual(x_BxTxD, out_BxTxD, post_norm)


class Block(nn.Module):
  """Layer `layer`: attention and MLP, each pre-normed (and post-normed: `post_norms`), in turn
or in parallel (`parallel_residual`)."""
  config: TransformerConfig
  layer: int = 0

  @nn.compact
  def __call__(self, x_BxTxD, positions_BxT, layer_cache, keep_BxL=None, counts_B=None,
               tree: TreeMask | None = None, sees_BxT=None):
    c = self.config
    post_norm = lambda name: RMSNorm(c, name=name) if c.post_norms else None
    block_in_BxTxD = x_BxTxD
    x_BxTxD, new_kv = Attention(c, self.layer, name='attn')(
        x_BxTxD, RMSNorm(c, name='attn_norm'), positions_BxT, layer_cache, keep_BxL, counts_B,
        post_norm('attn_post_norm'), tree, sees_BxT)
    mlp_counts_B = counts_B if keep_BxL is None else _kept_counts(keep_BxL, counts_B)
    if c.parallel_residual:  # The MLP reads the block's input (at the kept positions).
      if keep_BxL is not None:
        block_in_BxTxD = jnp.take_along_axis(block_in_BxTxD, keep_BxL[:, :, None], axis=1)
      x_BxTxD = Mlp(c, name='mlp')(block_in_BxTxD, RMSNorm(c, name='mlp_norm'), mlp_counts_B,
                                   post_norm('mlp_post_norm'), residual_BxTxD=x_BxTxD)
    else:
      x_BxTxD = Mlp(c, name='mlp')(x_BxTxD, RMSNorm(c, name='mlp_norm'), mlp_counts_B,
                                   post_norm('mlp_post_norm'))
    return x_BxTxD, new_kv


def feature_taps(config: TransformerConfig, features) -> tuple[int, ...]:
  """The taps `Transformer`'s `features` asks for: () for False or None, the last layer's
  output (num_layers,) for True, else the taps given (increasing, in [0, num_layers])."""
  if features is None or features is False:
    return ()
  if features is True:
    return (config.num_layers,)
  taps = tuple(int(t) for t in features)
  if not taps or list(taps) != sorted(set(taps)) or not 0 <= taps[0] <= taps[-1] <= (
      config.num_layers):
    raise ValueError(f'Feature taps must be increasing indices in [0, {config.num_layers}] of '
                     f'this {config.num_layers}-layer model\'s residual stream, got {features}.')
  return taps


class Transformer(nn.Module):
  """tokens [B, T] at `positions` [B, T] -> float32 logits [B, T, V] and each layer's (k, v).

  With `logits_at` (int32[B, L], indices into T) only those positions get logits: [B, L, V], and
  the last layer runs its output projection and MLP on those positions only (every position's keys
  and values are computed all the same): a prefill that wants the last token's logits skips most
  of its last layer, and a one-layer draft fed two tokens most of its work on the first.
  With `counts_B` (int32[B]: a prefill of right-padded prompts, or a decoding call whose idle
  rows, stopped at eos or at their length, have count 0) positions t >= counts[b] are padding:
  their logits are unspecified and the packed kernels skip them (`Attention`); `logits_at`
  positions must then be increasing along L.
  With `features` a third output: the last layer's output before the final norm (what the LM
  head reads) at every position, [B, T, D] in the model's dtype, also with `logits_at` (whose
  positions alone get logits; the last layer then runs on every position): the target's hidden
  states for a feature-level drafter, from the same forward (without it the program is as before).
  `features` may name taps of the residual stream instead (`TransformerConfig.feature_taps`: i <
  num_layers layer i's input, num_layers the last output): [B, T, len(taps) D], side by side in
  the taps' order.
  With `tree` (`token_tree.TreeMask`) the T tokens are a tree's nodes tree.first .. + T - 1,
  the first written at the cache's length: each attends to the cache before the tree's root and
  to its ancestors (a packed model's by the attention kernel but in windowed layers).
  """
  config: TransformerConfig

  @nn.compact
  def __call__(self, tokens_BxT, positions_BxT, cache=None, logits_at_BxL=None, counts_B=None,
               features=False, tree: TreeMask | None = None):
    c = self.config
    _check_kernels(self, c)
    packed = c.kernels == 'native'
    embedding_VxD = _param(self, 'embedding', (c.vocab_size, c.d_model), ('vocab', 'embed'),
                           c.d_model, c.jnp_dtype)
    x_BxTxD = embed(c, embedding_VxD, tokens_BxT)
    if c.position == 'learned':  # Positions past the table (never read back) are clipped.
      table_SxD = _param(self, 'position_embedding', (c.max_seq_len, c.d_model),
                         ('length', 'embed'), c.d_model, c.jnp_dtype)
      x_BxTxD = x_BxTxD + jnp.take(table_SxD, positions_BxT, axis=0, mode='clip')
    streams = _streams_two_rows(c, tokens_BxT)
    if streams:  # Every layer's norms and products on two rows; `Attention` on the real one.
      x_BxTxD = _pad_rows(x_BxTxD, 2)
      logits_at_BxL = jnp.zeros_like(tokens_BxT) if logits_at_BxL is None else logits_at_BxL
    taps = feature_taps(c, features)
    tapped = []  # The residual stream at each tap, [B, T, D].
    new_k, new_v = [], []
    for i in range(c.num_layers):
      if i in taps:
        tapped.append(x_BxTxD[:, :tokens_BxT.shape[1]])
      layer_cache = None if cache is None else (cache.k[i], cache.v[i], cache.lengths)
      # x is then [B, L, D]; features are wanted at every position.
      keep_BxL = logits_at_BxL if i == c.num_layers - 1 and not (taps or streams) else None
      x_BxTxD, (k, v) = Block(c, i, name=f'layer_{i}')(x_BxTxD, positions_BxT, layer_cache,
                                                      keep_BxL, counts_B, tree)
      new_k.append(k)
      new_v.append(v)
    kv = (tuple(new_k), tuple(new_v))
    if c.num_layers in taps:
      tapped.append(x_BxTxD[:, :tokens_BxT.shape[1]])
    extra = (jnp.concatenate(tapped, axis=-1),) if taps else ()
    if taps and logits_at_BxL is not None and not streams:
      x_BxTxD = jnp.take_along_axis(x_BxTxD, logits_at_BxL[:, :, None], axis=1)
    final_norm = RMSNorm(c, name='final_norm')
    if packed:  # An untied head, or a packed copy of a tied table.
      head = _packed(self, 'head')
      counts_B = counts_B if logits_at_BxL is None else _kept_counts(logits_at_BxL, counts_B)
    elif not c.tie_embeddings:
      head = _param(self, 'head', (c.d_model, c.vocab_size), ('embed', 'vocab'), c.d_model,
                    c.jnp_dtype)
    else:
      head = None
    logits_BxLxV = _output(c, final_norm, embedding_VxD, head, x_BxTxD, counts_B)
    if streams:  # The head ran on both rows too; the indices all pick the real one.
      logits_BxLxV = jnp.take_along_axis(logits_BxLxV, logits_at_BxL[:, :, None], axis=1)
    return (logits_BxLxV, kv) + extra


def embed(config: TransformerConfig, embedding_VxD: jax.Array, tokens_BxT: jax.Array) -> jax.Array:
  """The rows of the embedding table for `tokens` (a packed model copies them on the calling
  thread: `native.take_rows`), times sqrt(d_model) in the model's dtype with `embed_scale`."""
  if config.kernels == 'native':
    x_BxTxD = native.take_rows(embedding_VxD, tokens_BxT)
  else:
    x_BxTxD = jnp.take(embedding_VxD, tokens_BxT, axis=0)
  if config.embed_scale:
    x_BxTxD = x_BxTxD * jnp.asarray(config.d_model**0.5, config.jnp_dtype)
  return x_BxTxD


def _output(config: TransformerConfig, final_norm: RMSNorm, embedding_VxD, head, x_BxTxD,
            counts_B=None) -> jax.Array:
  """The output layer: float32 logits of the final norm of x through the head (`head`: packed,
  [D, V], or None for the tied table), soft-capped where the model caps them; a packed head
  skips rows past `counts_B`."""
  if config.kernels == 'native':
    h_BxTxD, fused = final_norm.packed_input(x_BxTxD)
    logits_BxTxV = native.matmul(h_BxTxD, head, norm=fused, counts=counts_B)
  elif head is None:
    logits_BxTxV = project(config, 'BTD,VD->BTV', final_norm(x_BxTxD), embedding_VxD,
                           preferred_element_type=jnp.float32)
  else:
    logits_BxTxV = project(config, 'BTD,DV->BTV', final_norm(x_BxTxD), head,
                           preferred_element_type=jnp.float32)
  if config.logit_softcap is not None:
    logits_BxTxV = config.logit_softcap * jnp.tanh(logits_BxTxV / config.logit_softcap)
  return logits_BxTxV


def output_logits(config: TransformerConfig, params, x_BxTxD: jax.Array,
                  counts_B: jax.Array | None = None, head=None) -> jax.Array:
  """The output layer of a model (`config`, `params`) on hidden states x [B, T, D] (its last
  layer's output, as `Transformer(features=True)` returns them): float32[B, T, V], the logits the
  model would give. A drafter predicting the target's features reads them through the target's
  own output layer, or (`head`, packed, with a packed model) through a copy of its weights in
  another precision after the model's own final norm (`models.pack`'s `target`)."""
  final_norm = RMSNorm(config).bind({'params': params['final_norm']})
  if head is not None and config.kernels != 'native':
    raise ValueError('A packed copy of the output layer needs a packed model.')
  if head is None:
    head = params['head'] if config.kernels == 'native' or not config.tie_embeddings else None
  return _output(config, final_norm, params['embedding'], head, x_BxTxD, counts_B)
