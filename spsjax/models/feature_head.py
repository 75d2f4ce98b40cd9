"""Draft heads that read the target's hidden states (EAGLE; Medusa and multi-token prediction).

A head predicts the target's next features from its current ones: the features of position t are
the target's last layer output there, before the final norm (`Transformer(features=True)`); the
target's output layer turns features at t into the law of token t + 1. A head embeds tokens and
turns its predicted features into logits through the target's own embedding table and output
layer (`transformer.embed`, `transformer.output_logits` on the target's parameters, passed in
at each call): its parameters hold neither, so it costs the target's vocabulary nothing to store
(a head packed in bfloat16, int8 or w8a8 for the CPU kernels may hold `output`, a copy of the
target's output layer in its own precision, made when it is packed: `models.pack`). A head with
a draft vocabulary (`draft_vocab_size` > 0, EAGLE-3's d2t) has its own output layer instead, over
that many of the target's tokens (`DraftVocab`, `draft_vocab`): a fraction of the vocabulary's
product per draft step; the other tokens have logits -inf, never drafted (speculative sampling
stays exact: the target's law decides what is kept and drawn).

The EAGLE head and the parallel heads read a pair (f_t, x_{t+1}) (the features at t and the
token after t, which the target's law at t drew): each RMS-normed, side by side, projected back
to D (`fuse`).
- `FeatureHead` (EAGLE-1, Li et al. 2024): then `num_layers` decoder blocks with their own KV cache
  over the pairs (pair t at position t); its output at t is f^_{t+1}, whose logits are the law of
  x_{t+2}. Drafting feeds it its own prediction with the token drawn from it, (f^_{t+1}, x_{t+2}).
  With `feature_taps` (EAGLE-3's multi-layer features, Li et al. 2025) the target's side of a
  pair is its residual stream at several depths (`Transformer`'s taps), each RMS-normed and
  projected together to D (`taps`) before the fuse; its own predictions enter as they are, so
  it is trained on them too (`train.head_losses`' own steps, EAGLE-3's training-time test).
- A Falcon head (Gao et al. 2024; kind 'falcon', `drafts_per_pass` m > 1) is a `FeatureHead`
  whose pairs enter through two gated cells (`_Cells`, Falcon's LSTM) and whose queries see
  ahead (`sees`): pair t of a block of m pairs sees up to the block's last, and its output is
  f^_{t+m}, whose logits are the law of x_{t+m+1}. One pass over a block gives m drafts'
  laws; drafting then reads the block of its m predictions with the tokens drawn from them.
  Training reads aligned blocks (`block_ends`); with one layer a pair's keys do not depend on
  its block, so the cache drafting keeps is the one training implies.
- `MlpSpeculator` (IBM's MLP speculator, Wertheimer et al. 2024): no fuse; the features RMS-normed
  are a state, and stage i mixes it with a token's embedding into the next state (a product, a
  norm, a GELU) whose product O_i is the predicted features: stage i reads the draft of stage
  i - 1, so the k drafts are a chain of k small steps, with no cache.
- `ParallelHeads` (Medusa, Cai et al. 2024; the MTP heads of Gloeckle et al. 2024): from one fused
  pair, head i (a residual gated MLP block) predicts the features f^_{t+1+i}: `num_layers` drafts
  x_{t+2}, .., x_{t+1+num_layers} in one pass, no cache and no draft fed back.

A head's parameters are a `Model` whose config is a `TransformerConfig` at the target's width,
heads and vocabulary (`head_config`), `num_layers` counting its blocks (FeatureHead) or heads
(ParallelHeads) or stages (MlpSpeculator); its kind is which of the three trees its parameters
hold (`kind`).
"""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from spsjax import native, sharding

from spsjax.models import kv_cache
from spsjax.models.api import Model, call_positions, features, logits
from spsjax.models.config import TransformerConfig
from spsjax.models.token_tree import TokenTree
from spsjax.models.transformer import (Block, Mlp, RMSNorm, _kept_counts, _output, _param,
                                        embed, output_logits, project)

KINDS = ('feature', 'heads', 'mlp', 'falcon')


def head_config(target: TransformerConfig, num_layers: int = 1,
                taps: tuple[int, ...] = (), draft_vocab_size: int = 0,
                drafts_per_pass: int = 1) -> TransformerConfig:
  """A head's config for `target`: its width, heads, MLP and vocabulary, `num_layers` blocks
  (or heads), XLA's kernels, attention over every earlier position (no sliding window), reading
  the target's residual stream at `taps` (`TransformerConfig.feature_taps`; () its last layer's
  output), drafting from its own output layer over `draft_vocab_size` tokens (0: through the
  target's, every token), `drafts_per_pass` a pass (> 1: a Falcon head)."""
  if taps and not all(0 <= t <= target.num_layers for t in taps):
    raise ValueError(f'Feature taps index the target\'s residual stream, 0 .. {target.num_layers}'
                     f' (its last output); got {taps}.')
  return dataclasses.replace(target, num_layers=num_layers, kernels='xla', sliding_window=None,
                             global_layers=(), local_rope_base=None, feature_taps=tuple(taps),
                             draft_vocab_size=draft_vocab_size, drafts_per_pass=drafts_per_pass)


def reads(head: Model) -> bool | tuple[int, ...]:
  """What a head reads of its target (`Transformer`'s and `models.extend_with_features`'
  `features`): True for the last layer's output, else its taps."""
  return head.config.feature_taps or True


def _normed_product(module: nn.Module, c: TransformerConfig, xs_BxTxD, norms: list[str],
                    name: str, counts_B, out: int | None = None):
  """Each of n inputs [B, T, D] RMS-normed (scales `norms`), then one product over their n D
  entries (weight `name`, [n, D, E], E = `out` or D; packed: one kernel call) -> [B, T, E]."""
  x_BxTxNxD = jnp.stack([RMSNorm(c, name=norm)(x.astype(c.jnp_dtype))
                         for norm, x in zip(norms, xs_BxTxD)], axis=2)
  B, T, N, D = x_BxTxNxD.shape
  if c.kernels == 'native':  # Packed (`models.pack`): one product over the n D entries.
    return native.matmul(x_BxTxNxD.reshape(B, T, N * D), module.get_variable('params', name),
                         counts=counts_B).astype(c.jnp_dtype)
  E = out or D
  w_NxDxE = _param(module, name, (N, D, E), ('fuse', 'embed', 'embed' if E == D else None),
                   N * D, c.jnp_dtype)
  return project(c, 'BTID,IDE->BTE', x_BxTxNxD, w_NxDxE)


class _Fuse(nn.Module):
  """The pair (features, token embedding) -> one stream [B, T, D]: both RMS-normed, then one
  product over their 2D entries."""
  config: TransformerConfig

  @nn.compact
  def __call__(self, features_BxTxD, embedded_BxTxD, counts_B=None):
    return _normed_product(self, self.config, [features_BxTxD, embedded_BxTxD],
                           ['feature_norm', 'token_norm'], 'fuse', counts_B)


def _gated_cell(gates_BxTx3D):
  """An LSTM cell's output from a zero state: gates (in, candidate, out) -> sigmoid(out)
  tanh(sigmoid(in) tanh(candidate)) (the forget gate multiplies the zero state: absent)."""
  in_, candidate, out = jnp.split(gates_BxTx3D.astype(jnp.float32), 3, axis=-1)
  return jax.nn.sigmoid(out) * jnp.tanh(jax.nn.sigmoid(in_) * jnp.tanh(candidate))


class _Cells(nn.Module):
  """Falcon's input: the pair (features, token embedding), both RMS-normed, through two gated
  cells -> one stream [B, T, D]. Cell 0's gates are one product over the pair's 2D entries, cell
  1's over cell 0's output, each plus a bias: an LSTM layer's step from a zero state, which is
  what Falcon's two-layer `nn.LSTM` computes in its published code (no `batch_first`: a [1, T, 2D]
  input is T sequences of one step). Each pair's stream is its own: no recurrent state to roll
  back beside the cache."""
  config: TransformerConfig

  @nn.compact
  def __call__(self, features_BxTxD, embedded_BxTxD, counts_B=None):
    c = self.config
    D, dt = c.d_model, c.jnp_dtype
    bias = lambda i: _param(self, f'bias_{i}', (3 * D,), (None,), 1, dt,
                            zeros=True)[None, None]
    gates_BxTx3D = _normed_product(self, c, [features_BxTxD, embedded_BxTxD],
                                   ['feature_norm', 'token_norm'], 'cell_0', counts_B, 3 * D)
    h_BxTxD = _gated_cell(gates_BxTx3D + bias(0)).astype(dt)
    gates_BxTx3D = _dense(self, c, h_BxTxD, 'cell_1', counts_B, 3 * D)
    return _gated_cell(gates_BxTx3D + bias(1)).astype(dt)


class _Taps(nn.Module):
  """The target's residual stream at n taps, [B, T, n D] side by side -> [B, T, D]: each
  RMS-normed (its depth's scale), then one product over the n D entries (EAGLE-3's fc)."""
  config: TransformerConfig

  @nn.compact
  def __call__(self, taps_BxTxF, counts_B=None):
    n, D = len(self.config.feature_taps), self.config.d_model
    each = [taps_BxTxF[..., j * D:(j + 1) * D] for j in range(n)]
    return _normed_product(self, self.config, each, [f'tap_norm_{j}' for j in range(n)], 'taps',
                           counts_B)


def _is_stream(c: TransformerConfig, features_BxTxF) -> bool:
  """Whether a head's input features are a stream already, [.., D] (its own predictions, or
  the target's last output), rather than the target's taps [.., n D] (ValueError for neither)."""
  if features_BxTxF.shape[-1] == c.d_model:
    return True
  n = len(c.feature_taps)
  if n < 2 or features_BxTxF.shape[-1] != n * c.d_model:
    raise ValueError(f'A head of taps {c.feature_taps} reads [.., {c.d_model}] (its own '
                     f'predictions) or [.., {n} x {c.d_model}] (the target\'s taps), got '
                     f'{features_BxTxF.shape}.')
  return False


def _stream(c: TransformerConfig, features_BxTxF, counts_B):
  """A head's input stream [B, T, D] (in its compact call): its own predictions as they are,
  the target's taps projected (`_Taps`)."""
  if _is_stream(c, features_BxTxF):
    return features_BxTxF
  return _Taps(c, name='taps')(features_BxTxF, counts_B)


class DraftVocab(nn.Module):
  """A head's own output layer over its draft vocabulary (EAGLE-3; `draft_vocab_size` > 0):
  predicted features [B, T, D], RMS-normed (`norm`), through a [D, Vd] product (`output`) ->
  float32 logits [B, T, Vd] of the target's tokens `tokens` (int32[Vd], increasing; not trained:
  the most frequent tokens of the head's training data, set before its first step)."""
  config: TransformerConfig

  @nn.compact
  def __call__(self, x_BxTxD, counts_B=None):
    c = self.config
    self.param('tokens', lambda _, n: jnp.arange(n, dtype=jnp.int32), c.draft_vocab_size)
    if c.kernels == 'native':
      w_DxVd = self.get_variable('params', 'output')
    else:
      w_DxVd = _param(self, 'output', (c.d_model, c.draft_vocab_size), ('embed', 'vocab'),
                      c.d_model, c.jnp_dtype)
    return _output(c, RMSNorm(c, name='norm'), None, w_DxVd, x_BxTxD, counts_B)


class FeatureHead(nn.Module):
  """EAGLE's head (module docstring): pairs at `positions` -> predicted features [B, T, D] and
  its blocks' (k, v), cached like the transformer's (`cache`: (k, v, lengths) per block). The
  pairs' features are the target's (its taps where the config names several: [B, T, n D]) or
  the head's own predictions [B, T, D]. A Falcon head (`drafts_per_pass` > 1) reads its pairs
  through gated cells (`_Cells`) and its queries see the keys up to `sees` (`Attention`)."""
  config: TransformerConfig

  @nn.compact
  def __call__(self, features_BxTxF, embedded_BxTxD, positions_BxT, cache=None, counts_B=None,
               tree=None, sees_BxT=None):
    c = self.config
    features_BxTxD = _stream(c, features_BxTxF, counts_B)
    if c.drafts_per_pass > 1:
      x_BxTxD = _Cells(c, name='cells')(features_BxTxD, embedded_BxTxD, counts_B)
    else:
      x_BxTxD = _Fuse(c, name='fuse')(features_BxTxD, embedded_BxTxD, counts_B)
    new_k, new_v = [], []
    for i in range(c.num_layers):
      layer_cache = None if cache is None else (cache.k[i], cache.v[i], cache.lengths)
      x_BxTxD, (k, v) = Block(c, name=f'layer_{i}')(x_BxTxD, positions_BxT, layer_cache, None,
                                                   counts_B, tree=tree, sees_BxT=sees_BxT)
      new_k.append(k)
      new_v.append(v)
    return x_BxTxD, (tuple(new_k), tuple(new_v))


class ParallelHeads(nn.Module):
  """Medusa / MTP heads (module docstring): one pair per row -> [B, num_layers, D], head i's
  predicted features (the law of the token i + 1 after the pair's)."""
  config: TransformerConfig

  @nn.compact
  def __call__(self, features_BxD, embedded_BxD):
    c = self.config
    u_Bx1xD = _Fuse(c, name='fuse')(features_BxD[:, None], embedded_BxD[:, None])
    return jnp.concatenate(
        [Mlp(c, name=f'head_{i}')(u_Bx1xD, RMSNorm(c, name=f'head_{i}_norm'))
         for i in range(c.num_layers)], axis=1)


def _dense(module: nn.Module, c: TransformerConfig, x_BxTxD, name: str, counts_B=None,
           out: int | None = None):
  """x [B, T, D] through the module's [D, E] product `name`, E = `out` or D (packed: one kernel
  call)."""
  if c.kernels == 'native':
    return native.matmul(x_BxTxD, module.get_variable('params', name),
                         counts=counts_B).astype(c.jnp_dtype)
  E = out or c.d_model
  w_DxE = _param(module, name, (c.d_model, E), ('embed', 'embed' if E == c.d_model else None),
                 c.d_model, c.jnp_dtype)
  return project(c, 'BTD,DE->BTE', x_BxTxD, w_DxE)


class _Stage(nn.Module):
  """Stage i of the MLP speculator: (state s [B, T, D], embedded token [B, T, D]) ->
  (predicted features [B, T, D], next state). s' = GELU(norm(a s P + b token_norm(e))) with
  IBM's fixed weights a = 0.5^(0.5 / n), b = sqrt(1 - a^2) (n stages: the state's share shrinks
  stage by stage less than the token's grows), and features s' O, which the target's output
  layer reads (a linear map of the GELU state, which alone would give the frozen output layer
  only the near-positive orthant)."""
  config: TransformerConfig
  stages: int

  @nn.compact
  def __call__(self, state_BxTxD, embedded_BxTxD, counts_B=None):
    c = self.config
    a = 0.5**(0.5 / self.stages)
    mixed_BxTxD = (a * _dense(self, c, state_BxTxD, 'proj', counts_B)
                   + (1.0 - a * a)**0.5 * RMSNorm(c, name='token_norm')(embedded_BxTxD))
    next_BxTxD = jax.nn.gelu(RMSNorm(c, name='norm')(mixed_BxTxD))
    return _dense(self, c, next_BxTxD, 'out', counts_B), next_BxTxD


class MlpSpeculator(nn.Module):
  """IBM's MLP speculator (Wertheimer et al. 2024; fms-extras), over the target's own embedding
  and output layer: the features f_t RMS-normed are the state s_0; stage i reads s_i and token
  x_{t+1+i} (the pair's token, then the drafts) and predicts the features whose law is that of
  x_{t+2+i}. Sequential like a chain (each stage reads the draft before it), stateless like
  Medusa's heads (no cache: each loop starts from the newest features). Called with the tokens
  of its first n stages given (training: [B, T, D] features, [B, T, n, D] embedded tokens) ->
  [B, T, n, D]; drafting runs the stages one at a time (`speculator_stage`). Every stage's
  weights a and b depend on the number of stages, `num_layers`."""
  config: TransformerConfig

  @nn.compact
  def __call__(self, features_BxTxD, embedded_BxTxNxD):
    c = self.config
    state_BxTxD = RMSNorm(c, name='input_norm')(features_BxTxD)
    predicted = []
    for i in range(embedded_BxTxNxD.shape[2]):
      f_BxTxD, state_BxTxD = _Stage(c, c.num_layers, name=f'stage_{i}')(
          state_BxTxD, embedded_BxTxNxD[:, :, i])
      predicted.append(f_BxTxD)
    return jnp.stack(predicted, axis=2)


def is_head(model: Model) -> bool:
  """Whether `model` is a head of this module (rather than a transformer)."""
  return any(name in model.params for name in ('fuse', 'cells', 'stage_0'))


def kind(head: Model) -> str:
  """'feature' (an EAGLE head: decoder blocks), 'falcon' (a Falcon head: gated cells, then
  blocks), 'heads' (parallel heads) or 'mlp' (an MLP speculator)."""
  if not is_head(head):
    raise ValueError('Not a feature head (`models.feature_head`): a transformer\'s parameters.')
  if 'stage_0' in head.params:
    return 'mlp'
  if 'cells' in head.params:
    return 'falcon'
  return 'heads' if 'head_0' in head.params else 'feature'


def _module(kind_: str, config: TransformerConfig) -> nn.Module:
  if kind_ not in KINDS:
    raise ValueError(f'Unknown head kind {kind_!r}; known: {list(KINDS)}.')
  if kind_ != 'feature' and config.feature_taps:
    raise ValueError(f'Parallel heads, MLP speculators and Falcon heads read the target\'s last '
                     f'output; feature_taps {config.feature_taps} are for an EAGLE head (kind '
                     f'feature).')
  if (kind_ == 'falcon') != (config.drafts_per_pass > 1):
    raise ValueError(f'A Falcon head (kind falcon) drafts more than one token a pass and other '
                     f'heads one; got kind {kind_!r} with drafts_per_pass '
                     f'{config.drafts_per_pass}.')
  return {'feature': FeatureHead, 'falcon': FeatureHead, 'heads': ParallelHeads,
          'mlp': MlpSpeculator}[kind_](config)


def _boxed_init(kind_: str, config: TransformerConfig, rng: jax.Array):
  D = config.d_model
  if kind_ in ('feature', 'falcon'):  # The target's features, all its taps (the taps' product's).
    F = D * max(len(config.feature_taps), 1)
    args = (jnp.zeros((1, 1, F)), jnp.zeros((1, 1, D)), jnp.zeros((1, 1), jnp.int32))
  elif kind_ == 'mlp':
    args = (jnp.zeros((1, 1, D)), jnp.zeros((1, 1, config.num_layers, D)))
  else:
    args = (jnp.zeros((1, D)), jnp.zeros((1, D)))
  params = _module(kind_, config).init(rng, *args)['params']
  if config.draft_vocab_size:  # Its own output layer (`DraftVocab`).
    params = dict(params, draft_vocab=DraftVocab(config).init(
        jax.random.fold_in(rng, 1), jnp.zeros((1, 1, D)))['params'])
  return params


@functools.lru_cache(maxsize=16)
def _random_head_program(kind_: str, config: TransformerConfig):
  """`init_head`'s jitted program, one per kind and config (not traced again per call)."""
  return jax.jit(lambda key: nn.unbox(_boxed_init(kind_, config, key)))


def init_head(kind_: str, config: TransformerConfig, rng: jax.Array) -> dict:
  """Random parameters of a head of `kind_` ('feature' or 'heads')."""
  _module(kind_, config)  # An unknown kind is a ValueError before anything is cached.
  return _random_head_program(kind_, config)(rng)


def param_shapes(kind_: str, config: TransformerConfig) -> dict:
  """The parameter tree of `init_head` as jax.ShapeDtypeStructs (nothing is computed)."""
  return jax.eval_shape(functools.partial(init_head, kind_, config), jax.random.key(0))


@functools.lru_cache(maxsize=16)
def param_shardings(kind_: str, config: TransformerConfig, mesh: Mesh,
                    rules: sharding.Rules = sharding.DEFAULT_RULES):
  """NamedShardings for a head's parameters, from their logical axis names."""
  abstract = jax.eval_shape(functools.partial(_boxed_init, kind_, config), jax.random.key(0))
  return sharding.tree_shardings(abstract, mesh, rules)


def check_pair(target: Model, head: Model) -> None:
  """Raises ValueError unless `head` reads `target`'s features: the same width and vocabulary."""
  t, h = target.config, head.config
  if (t.d_model, t.vocab_size) != (h.d_model, h.vocab_size):
    raise ValueError(f'The head (d_model {h.d_model}, vocab {h.vocab_size}) does not fit the '
                     f'target (d_model {t.d_model}, vocab {t.vocab_size}): a head reads the '
                     f'target\'s features and shares its embedding and output layer.')
  if h.feature_taps and h.feature_taps[-1] > t.num_layers:
    raise ValueError(f'The head reads taps {h.feature_taps} of a residual stream; the target '
                     f'has {t.num_layers} layers (taps 0 .. {t.num_layers}).')


def stream(head: Model, features_BxTxF: jax.Array, counts_B: jax.Array | None = None
           ) -> jax.Array:
  """An EAGLE head's input stream [B, T, D] of the target's features: its taps projected (a
  head of several taps), else the features as they are."""
  if _is_stream(head.config, features_BxTxF):
    return features_BxTxF
  return _Taps(head.config).apply({'params': head.params['taps']}, features_BxTxF, counts_B)


def draft_vocab(head: Model) -> jax.Array | None:
  """The target's tokens a head drafts from its own output layer, int32[Vd] increasing
  (`DraftVocab`), or None: it drafts every token through the target's."""
  return head.params['draft_vocab']['tokens'] if head.config.draft_vocab_size else None


def with_draft_vocab(head: Model, tokens) -> Model:
  """`head` drafting the target's `tokens` (distinct ids, sorted here) from its own output
  layer; ValueError unless they are as many as its `draft_vocab_size`, within the vocabulary."""
  tokens = np.unique(np.asarray(tokens))
  c = head.config
  if tokens.size != c.draft_vocab_size or tokens.size and not 0 <= tokens[0] <= tokens[-1] < (
      c.vocab_size):
    raise ValueError(f'A head of draft_vocab_size {c.draft_vocab_size} drafts as many distinct '
                     f'tokens in [0, {c.vocab_size}); got {tokens.size} in '
                     f'[{tokens.min(initial=0)}, {tokens.max(initial=0)}].')
  vocab = head.params['draft_vocab']
  tokens = jnp.asarray(tokens, jnp.int32)
  if isinstance(vocab['tokens'], jax.Array):  # Where the placeholder lives (a mesh's devices).
    tokens = jax.device_put(tokens, vocab['tokens'].sharding)
  return head.replace(params=dict(head.params, draft_vocab=dict(vocab, tokens=tokens)))


def _logits_at(head: Model, target: Model, features_BxTxD, logits_at_BxL, counts_B,
               in_draft_vocab: bool = False):
  """The target's output layer on predicted features (the head's copy of it where it holds
  one: `models.pack`'s `target`); a head with a draft vocabulary, its own (`DraftVocab`), its
  logits [.., Vd] (`in_draft_vocab`) or placed among the target's tokens, -inf at the others."""
  if logits_at_BxL is not None:
    features_BxTxD = jnp.take_along_axis(features_BxTxD, logits_at_BxL[:, :, None], axis=1)
    counts_B = _kept_counts(logits_at_BxL, counts_B)
  if head.config.draft_vocab_size:
    own_BxTxVd = DraftVocab(head.config).apply({'params': head.params['draft_vocab']},
                                               features_BxTxD, counts_B)
    if in_draft_vocab:
      return own_BxTxVd
    everywhere = jnp.full(own_BxTxVd.shape[:-1] + (head.config.vocab_size,), -jnp.inf,
                          own_BxTxVd.dtype)
    return everywhere.at[..., draft_vocab(head)].set(own_BxTxVd, unique_indices=True)
  if in_draft_vocab:
    raise ValueError('This head drafts through the target\'s output layer: it has no draft '
                     'vocabulary of its own (draft_vocab_size 0).')
  return output_logits(target.config, target.params,
                       features_BxTxD.astype(target.config.jnp_dtype), counts_B,
                       head=head.params.get('output'))


def extend_head(head: Model, target: Model, cache: kv_cache.KVCache, features_BxTxD: jax.Array,
                tokens_BxT: jax.Array, *, logits_at_BxL: jax.Array | None = None,
                counts_B: jax.Array | None = None, tree=None, first_node: int = 0,
                sees_BxT: jax.Array | None = None
                ) -> tuple[jax.Array, jax.Array, kv_cache.KVCache]:
  """An EAGLE head on T pairs (features, token) per row at the row's offset `cache.lengths`:
  (float32 logits [B, T, V] (or [B, L, V] at `logits_at`), predicted features [B, T, D], cache
  with lengths + T). As `models.extend`: row b's pairs past counts[b] are padding, their
  outputs unspecified; with a `tree` (`models.TokenTree` or `RowTrees`) the pairs are its nodes
  first_node .., its root's pair at slot `cache.lengths`, each seeing its ancestors' pairs. A
  Falcon head's pair t sees the pairs up to position `sees[:, t]` (default its own)."""
  T = tokens_BxT.shape[1]
  cache, positions_BxT, mask = call_positions(cache, T, tree, first_node)
  embedded_BxTxD = embed(target.config, target.params['embedding'], tokens_BxT)
  predicted_BxTxD, (k, v) = FeatureHead(head.config).apply(
      {'params': head.params}, features_BxTxD, embedded_BxTxD, positions_BxT, cache, counts_B,
      mask, sees_BxT)
  logits = _logits_at(head, target, predicted_BxTxD, logits_at_BxL, counts_B)
  return logits, predicted_BxTxD, kv_cache.KVCache(k=k, v=v, lengths=cache.lengths + T)


def block_ends(T: int, m: int, ahead: bool = False) -> jax.Array:
  """int32[T]: what each of T pairs of a Falcon head of `m` drafts a pass sees up to in a
  whole-sequence call: its block's last pair, blocks of m aligned at 0 (training's); with
  `ahead` the pair m - 1 after it, every pair a block's first (its first draft's law). Both
  clipped at T - 1."""
  t_T = jnp.arange(T, dtype=jnp.int32)
  ends_T = t_T + m - 1 if ahead else (t_T // m + 1) * m - 1
  return jnp.minimum(ends_T, T - 1)


def feature_head_forward(head: Model, target: Model, features_BxTxD: jax.Array,
                         tokens_BxT: jax.Array, tree: TokenTree | None = None,
                         in_draft_vocab: bool = False, sees_T: jax.Array | None = None
                         ) -> tuple[jax.Array, jax.Array]:
  """An EAGLE head over whole sequences, no cache (training, and the reference of
  `extend_head`): pair t = (features[:, t], tokens[:, t]) -> (float32 logits [B, T, V] (a head
  with a draft vocabulary: [B, T, Vd] where `in_draft_vocab`), predicted features [B, T, D]).
  With a `tree` (root and nodes: the T pairs) each pair sits at its depth and sees its
  ancestors' pairs only (`models.tree_logits`' mask). A Falcon head's pair t sees the pairs up
  to `sees_T[t]` (default `block_ends(T, m)`: training's blocks)."""
  T = tokens_BxT.shape[1]
  positions_BxT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), tokens_BxT.shape)
  mask = None
  if tree is not None:
    mask = tree.mask(0, T)
    positions_BxT = jnp.broadcast_to(mask.depths_xM, tokens_BxT.shape)
  sees_BxT = None
  if head.config.drafts_per_pass > 1:
    if tree is not None:
      raise ValueError('A Falcon head reads a sequence, not a tree.')
    if sees_T is None:
      sees_T = block_ends(T, head.config.drafts_per_pass)
    sees_BxT = jnp.broadcast_to(sees_T, tokens_BxT.shape)
  embedded_BxTxD = embed(target.config, target.params['embedding'], tokens_BxT)
  predicted_BxTxD, _ = FeatureHead(head.config).apply(
      {'params': head.params}, features_BxTxD, embedded_BxTxD, positions_BxT, tree=mask,
      sees_BxT=sees_BxT)
  return (_logits_at(head, target, predicted_BxTxD, None, None, in_draft_vocab),
          predicted_BxTxD)


def parallel_heads(head: Model, target: Model, features_BxD: jax.Array, tokens_B: jax.Array,
                   num: int | None = None, in_draft_vocab: bool = False
                   ) -> tuple[jax.Array, jax.Array]:
  """Parallel heads on one pair per row: (float32 logits [B, n, V] ([B, n, Vd] as
  `feature_head_forward`'s), predicted features [B, n, D]) of the first `num` heads (default
  all), head i's for the token i + 1 after `tokens_B`."""
  n = head.config.num_layers if num is None else num
  if not 1 <= n <= head.config.num_layers:
    raise ValueError(f'{n} drafts need {n} heads; this model has {head.config.num_layers}.')
  params = dict(head.params)
  for i in range(n, head.config.num_layers):  # Heads past n are neither run nor passed.
    params.pop(f'head_{i}')
    params.pop(f'head_{i}_norm')
  embedded_BxD = embed(target.config, target.params['embedding'], tokens_B)
  predicted_BxNxD = ParallelHeads(dataclasses.replace(head.config, num_layers=n)).apply(
      {'params': params}, features_BxD, embedded_BxD)
  return (_logits_at(head, target, predicted_BxNxD, None, None, in_draft_vocab),
          predicted_BxNxD)


def mlp_speculator(head: Model, target: Model, features_BxD: jax.Array, tokens_BxN: jax.Array,
                   in_draft_vocab: bool = False) -> tuple[jax.Array, jax.Array]:
  """An MLP speculator's first N stages on one pair per row, stage i reading token i of
  `tokens_BxN` (the pair's token, then the tokens after it): (float32 logits [B, N, V] ([B, N,
  Vd] as `feature_head_forward`'s), predicted features [B, N, D]); stage i's law is that of the
  token after tokens_BxN[:, i]."""
  n = tokens_BxN.shape[1]
  if not 1 <= n <= head.config.num_layers:
    raise ValueError(f'{n} stages wanted; this speculator has {head.config.num_layers}.')
  embedded_Bx1xNxD = embed(target.config, target.params['embedding'], tokens_BxN)[:, None]
  predicted_BxNxD = MlpSpeculator(head.config).apply(  # Stages 0 .. N - 1 (of num_layers).
      {'params': head.params}, features_BxD[:, None], embedded_Bx1xNxD)[:, 0]
  return (_logits_at(head, target, predicted_BxNxD, None, None, in_draft_vocab),
          predicted_BxNxD)


def speculator_state(head: Model, features_BxD: jax.Array) -> jax.Array:
  """An MLP speculator's state s_0 [B, D] from the target's features."""
  return RMSNorm(head.config).apply({'params': head.params['input_norm']},
                                    features_BxD.astype(head.config.jnp_dtype))


def speculator_stage(head: Model, target: Model, stage: int, state_BxD: jax.Array,
                     tokens_B: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Stage `stage` of an MLP speculator on (state [B, D], token [B]): (float32 logits [B, V]
  of the token after it, the next state [B, D])."""
  c = head.config
  embedded_Bx1xD = embed(target.config, target.params['embedding'], tokens_B[:, None])
  predicted_Bx1xD, next_Bx1xD = _Stage(c, c.num_layers).apply(
      {'params': head.params[f'stage_{stage}']}, state_BxD[:, None], embedded_Bx1xD)
  return _logits_at(head, target, predicted_Bx1xD, None, None)[:, 0], next_Bx1xD[:, 0]


def next_token_logits(draft: Model, target: Model, tokens_BxL: jax.Array) -> jax.Array:
  """float32[B, L, V]: at each position t the law of token t + 1 a drafter proposes from the
  tokens up to t, as `models.logits` gives a transformer's: for a head, its first draft's law
  from the target's true features (pair t - 1 = (f_{t-1}, x_t)); position 0, with no pair
  before it, uniform (zeros). For a transformer `draft`, its logits (`target` unused)."""
  if not is_head(draft):
    return logits(draft.config, draft.params, tokens_BxL)
  f_BxLxD = features(target.config, target.params, tokens_BxL, reads(draft))
  B, L = tokens_BxL.shape
  if kind(draft) == 'falcon':  # Pair t - m, a block's first, seeing pair t - 1: token t + 1.
    m = draft.config.drafts_per_pass
    q_BxTxV, _ = feature_head_forward(draft, target, f_BxLxD[:, :-1], tokens_BxL[:, 1:],
                                      sees_T=block_ends(L - 1, m, ahead=True))
    return jnp.pad(q_BxTxV[:, :max(L - m, 0)], ((0, 0), (min(m, L), 0), (0, 0)))
  if kind(draft) == 'feature':
    q_BxTxV, _ = feature_head_forward(draft, target, f_BxLxD[:, :-1], tokens_BxL[:, 1:])
  else:
    rows_BTxD = f_BxLxD[:, :-1].reshape(B * (L - 1), -1)
    tokens_BT = tokens_BxL[:, 1:].reshape(B * (L - 1))
    if kind(draft) == 'heads':
      q_BTx1xV, _ = parallel_heads(draft, target, rows_BTxD, tokens_BT, num=1)
    else:
      q_BTx1xV, _ = mlp_speculator(draft, target, rows_BTxD, tokens_BT[:, None])
    q_BxTxV = q_BTx1xV.reshape(B, L - 1, -1)
  return jnp.pad(q_BxTxV, ((0, 0), (1, 0), (0, 0)))
