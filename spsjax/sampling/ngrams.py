"""What the tokens before a position do to its logits: banned repeated n-grams, sequence biases and
bans by position.

Transformers' logit processors that read the context c of a position (the committed tokens,
prompt first, then what the position reads: a chain's earlier drafts, a tree node's ancestors):
- `no_repeat_ngram_size` n (NoRepeatNGramLogitsProcessor): token x is banned (logit -inf) iff
  the n-gram (c[-n + 1:], x) already occurs in c; n = 1 bans every token of c;
- `sequence_bias` (SequenceBiasLogitsProcessor; banned words and suppressed tokens are biases of
  -inf, `generation_config`): a sequence (s_1 .. s_L) with bias b adds b to the logit of s_L iff
  c ends with s_1 .. s_{L-1} and holds at least L tokens (always for L = 1);
- `ban_before_new` (MinNewTokensLengthLogitsProcessor, SuppressTokensAtBeginLogitsProcessor):
  ids banned while c holds fewer than n tokens after the row's prompt, and `ban_before_length`
  (MinLengthLogitsProcessor): while c holds fewer than n tokens (one row's prompt, unpadded:
  transformers counts a left-padded batch's pads too).
All act on the raw logits before any other processing (`shift`): the repetition penalty then
reads the biased logits, as in transformers, and the law after a ban is the processed law of the
other tokens, greedy decoding included; a row with every token banned has no distribution
(`processors.probabilities`: NaN, token 0).

Contexts are given as sequences with an end each (`offsets_after`): n-grams are found by
comparing every window of n - 1 tokens with the context's last n - 1, O(S n) per context for
sequences of S tokens, and the banned tokens scattered into a [V] mask; a bias compares the
context's last L - 1 tokens with its prefix. `History` holds what a sampler has committed and gives
the contexts of a chain's slots and of a tree's nodes.
"""

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from spsjax.models import RowTrees, TokenTree
from spsjax.sampling.processors import SamplingConfig


def banned_after(sequences_BxRxS: jax.Array, ends_BxR: jax.Array, n: int,
                 vocab_size: int) -> jax.Array:
  """bool[B, R, V]: the tokens banned after each of R contexts, context r of row b being
  sequences[b, r, :ends[b, r]] (`sequences` may broadcast over R: [B, 1, S]). Ids outside the
  vocabulary (PAD_ID) are never banned; a context shorter than n - 1 bans nothing."""
  B, R = ends_BxR.shape
  sequences_BxRxS = jnp.broadcast_to(sequences_BxRxS, (B, R, sequences_BxRxS.shape[-1]))
  S, m = sequences_BxRxS.shape[-1], n - 1
  if S <= m:
    return jnp.zeros((B, R, vocab_size), bool)
  # Window i is followed by token i + m, the one it bans (the last window has none).
  match_BxRxI = tail_matches(sequences_BxRxS, ends_BxR, m)[..., :S - m]
  next_BxRxI = sequences_BxRxS[..., m:]
  ids_BxRxI = jnp.where(match_BxRxI & (next_BxRxI >= 0) & (next_BxRxI < vocab_size), next_BxRxI,
                        vocab_size)
  rows_BxRxI = jnp.broadcast_to(jnp.arange(B)[:, None, None], ids_BxRxI.shape)
  slots_BxRxI = jnp.broadcast_to(jnp.arange(R)[None, :, None], ids_BxRxI.shape)
  return jnp.zeros((B, R, vocab_size), bool).at[rows_BxRxI, slots_BxRxI, ids_BxRxI].set(
      True, mode='drop')


def tail_matches(sequences_BxRxS: jax.Array, ends_BxR: jax.Array, m: int) -> jax.Array:
  """bool[B, R, S - m + 1]: [b, r, i] iff window i (tokens i .. i + m - 1) of the sequence equals
  context r's last m tokens and is followed by a token of the context (i + m < ends[b, r]): the
  earlier occurrences of the context's tail (m = 0: every position before the end). The n-gram
  ban's and prompt lookup's (`drafters.PromptLookup`) search."""
  S = sequences_BxRxS.shape[-1]
  tail_BxRxM = _tails(sequences_BxRxS, ends_BxR, m)
  match_BxRxI = jnp.arange(S - m + 1)[None, None] + m < ends_BxR[..., None]
  for j in range(m):
    match_BxRxI &= sequences_BxRxS[..., j:S - m + 1 + j] == tail_BxRxM[..., j:j + 1]
  return match_BxRxI


def _tails(sequences_BxRxS, ends_BxR, m: int):
  """int32[B, R, m]: each context's last m tokens (clamped reads where it holds fewer)."""
  S = sequences_BxRxS.shape[-1]
  at_BxRxM = jnp.clip(ends_BxR[..., None] - m + jnp.arange(m)[None, None], 0, S - 1)
  return jnp.take_along_axis(sequences_BxRxS, at_BxRxM, axis=-1)


def biases_after(sequences_BxRxS: jax.Array, ends_BxR: jax.Array, sequence_bias,
                 vocab_size: int) -> jax.Array:
  """float32[B, R, V]: the sum of the biases of `sequence_bias` ((tokens, bias) pairs, ids in the
  vocabulary) that apply after each context (module docstring)."""
  B, R = ends_BxR.shape
  sequences_BxRxS = jnp.broadcast_to(sequences_BxRxS, (B, R, sequences_BxRxS.shape[-1]))
  static_V = np.zeros(vocab_size, np.float32)
  total_BxRxV = jnp.zeros((B, R, vocab_size), jnp.float32)
  for tokens, bias in sequence_bias:
    if len(tokens) == 1:
      static_V[tokens[0]] += bias
      continue
    prefix = jnp.asarray(tokens[:-1], sequences_BxRxS.dtype)
    match_BxR = (jnp.all(_tails(sequences_BxRxS, ends_BxR, len(prefix)) == prefix[None, None],
                         axis=-1) & (ends_BxR >= len(tokens)))
    total_BxRxV = total_BxRxV.at[:, :, tokens[-1]].add(jnp.where(match_BxR, bias, 0.0))
  return total_BxRxV + jnp.asarray(static_V)[None, None]


def banned_by_position(ends_BxR: jax.Array, prompt_lengths_B: jax.Array | None,
                       sampling: SamplingConfig, vocab_size: int) -> jax.Array:
  """bool[B, R, V]: the tokens `sampling`'s `ban_before_new` and `ban_before_length` ban after
  contexts of ends[b, r] tokens, row b's prompt holding prompt_lengths[b] of them (needed only
  with `ban_before_new`)."""
  B, R = ends_BxR.shape
  banned_BxRxV = jnp.zeros((B, R, vocab_size), bool)
  if sampling.ban_before_new and prompt_lengths_B is None:
    raise ValueError('ban_before_new counts new tokens: pass the prompts\' lengths.')
  rules = [(ids, n, ends_BxR - prompt_lengths_B[:, None]) for ids, n in sampling.ban_before_new]
  rules += [(ids, n, ends_BxR) for ids, n in sampling.ban_before_length]
  for ids, n, held_BxR in rules:
    ids_V = np.zeros(vocab_size, bool)
    ids_V[list(ids)] = True
    banned_BxRxV |= (held_BxR < n)[..., None] & jnp.asarray(ids_V)[None, None]
  return banned_BxRxV


def offsets_after(sequences_BxRxS: jax.Array, ends_BxR: jax.Array, sampling: SamplingConfig,
                  vocab_size: int, prompt_lengths_B: jax.Array | None = None) -> jax.Array:
  """float32[B, R, V]: what `sampling`'s n-gram ban (-inf), sequence biases and bans by position
  (-inf; `banned_by_position`) add to the logits after each context."""
  B, R = ends_BxR.shape
  offsets_BxRxV = jnp.zeros((B, R, vocab_size), jnp.float32)
  if sampling.sequence_bias:
    offsets_BxRxV = biases_after(sequences_BxRxS, ends_BxR, sampling.sequence_bias, vocab_size)
  if sampling.no_repeat_ngram_size:
    offsets_BxRxV = jnp.where(banned_after(sequences_BxRxS, ends_BxR,
                                           sampling.no_repeat_ngram_size, vocab_size),
                              -jnp.inf, offsets_BxRxV)
  if sampling.ban_before_new or sampling.ban_before_length:
    offsets_BxRxV = jnp.where(banned_by_position(ends_BxR, prompt_lengths_B, sampling,
                                                 vocab_size), -jnp.inf, offsets_BxRxV)
  return offsets_BxRxV


def offsets_through(tokens_BxT: jax.Array, sampling: SamplingConfig, vocab_size: int,
                    prompt_lengths_B: jax.Array | None = None) -> jax.Array:
  """float32[B, T, V]: `offsets_after` each prefix tokens[:, :t + 1] of whole sequences (for
  the law of the token after position t), each starting with its prompt of prompt_lengths[b]
  tokens (needed with `ban_before_new` only)."""
  B, T = tokens_BxT.shape
  ends_BxT = jnp.broadcast_to(jnp.arange(1, T + 1, dtype=jnp.int32)[None], (B, T))
  return offsets_after(tokens_BxT[:, None], ends_BxT, sampling, vocab_size, prompt_lengths_B)


def shift(logits_xV: jax.Array, offsets_xV: jax.Array | None) -> jax.Array:
  """The logits plus the offsets, in float32 (-inf bans; unchanged without offsets)."""
  if offsets_xV is None:
    return logits_xV
  return logits_xV.astype(jnp.float32) + offsets_xV


def check_vocabulary(sampling: SamplingConfig, vocab_size: int) -> None:
  """ValueError where a sequence bias or a ban names a token outside the vocabulary."""
  for name in ('sequence_bias', 'ban_before_new', 'ban_before_length'):
    for tokens, _ in getattr(sampling, name):
      if max(tokens) >= vocab_size:
        raise ValueError(f'{name} names {tokens}: a token outside the vocabulary of '
                         f'{vocab_size}.')


@flax.struct.dataclass
class History:
  """What each row has committed: tokens_BxS from position 0 (PAD_ID past lengths_B), the first
  prompt_lengths_B of them its prompt, and the sampling settings that read it (static)."""
  tokens_BxS: jax.Array
  lengths_B: jax.Array
  prompt_lengths_B: jax.Array
  sampling: SamplingConfig = flax.struct.field(pytree_node=False)
  vocab_size: int = flax.struct.field(pytree_node=False)

  @classmethod
  def of(cls, sampling: SamplingConfig, tokens_BxS: jax.Array, lengths_B: jax.Array,
         prompt_lengths_B: jax.Array, vocab_size: int) -> 'History | None':
    """The history of committed tokens for `sampling`; None where it reads no context."""
    if not sampling.reads_context:
      return None
    check_vocabulary(sampling, vocab_size)
    return cls(tokens_BxS, lengths_B, prompt_lengths_B.astype(lengths_B.dtype), sampling,
               vocab_size)

  @classmethod
  def of_prompts(cls, sampling: SamplingConfig, prompts_BxP: jax.Array,
                 prompt_lengths_B: jax.Array, room: int, vocab_size: int) -> 'History | None':
    """The prompts with `room` more slots for tokens to come (`append`)."""
    tokens_BxS = jnp.pad(prompts_BxP.astype(jnp.int32), ((0, 0), (0, room)), constant_values=-1)
    tokens_BxS = jnp.where(jnp.arange(tokens_BxS.shape[1])[None] < prompt_lengths_B[:, None],
                           tokens_BxS, -1)
    lengths_B = prompt_lengths_B.astype(jnp.int32)
    return cls.of(sampling, tokens_BxS, lengths_B, lengths_B, vocab_size)

  def append(self, tokens_BxT: jax.Array, counts_B: jax.Array) -> 'History':
    """Each row's first counts_B[b] of `tokens` committed after its tokens (no room left: the
    ones past the end dropped)."""
    T, S = tokens_BxT.shape[1], self.tokens_BxS.shape[1]
    at_BxT = self.lengths_B[:, None] + jnp.arange(T)[None]
    at_BxT = jnp.where(jnp.arange(T)[None] < counts_B[:, None], at_BxT, S)
    rows_BxT = jnp.broadcast_to(jnp.arange(tokens_BxT.shape[0])[:, None], at_BxT.shape)
    return self.replace(
        tokens_BxS=self.tokens_BxS.at[rows_BxT, at_BxT].set(tokens_BxT.astype(jnp.int32),
                                                            mode='drop'),
        lengths_B=self.lengths_B + counts_B.astype(self.lengths_B.dtype))

  def _offsets(self, sequences_BxRxS, ends_BxR):
    return offsets_after(sequences_BxRxS, ends_BxR, self.sampling, self.vocab_size,
                         self.prompt_lengths_B)

  def after(self) -> jax.Array:
    """float32[B, V]: the offsets after each row's committed tokens."""
    return self._offsets(self.tokens_BxS[:, None], self.lengths_B[:, None])[:, 0]

  def _with(self, tokens_BxN: jax.Array) -> jax.Array:
    """int32[B, S + N]: the committed tokens with `tokens` written after each row's."""
    N = tokens_BxN.shape[1]
    padded_BxS = jnp.pad(self.tokens_BxS, ((0, 0), (0, N)), constant_values=-1)
    write = lambda row_S, t_N, at: jax.lax.dynamic_update_slice(row_S, t_N, (at,))
    return jax.vmap(write)(padded_BxS, tokens_BxN.astype(padded_BxS.dtype), self.lengths_B)

  def at(self, drafts_BxK: jax.Array, i) -> jax.Array:
    """float32[B, V]: the offsets at a chain's slot i (traced or not), after the committed
    tokens and drafts[:, :i]."""
    ends_Bx1 = (self.lengths_B + i)[:, None]
    return self._offsets(self._with(drafts_BxK)[:, None], ends_Bx1)[:, 0]

  def along_chain(self, drafts_BxK: jax.Array, slots: int) -> jax.Array:
    """float32[B, slots, V]: the offsets at each of a chain's first `slots` slots, slot j
    reading the committed tokens and drafts[:, :j]."""
    ends_BxR = self.lengths_B[:, None] + jnp.arange(slots, dtype=self.lengths_B.dtype)[None]
    return self._offsets(self._with(drafts_BxK)[:, None], ends_BxR)

  def along_tree(self, tokens_BxN: jax.Array, tree: TokenTree | RowTrees) -> jax.Array:
    """float32[B, N + 1, V]: the offsets after each node of a tree (the root: after the
    committed tokens; node i: after them and its path, its ancestors' tokens and its own, root
    excluded, in depth order). tokens_BxN are nodes 1 .. N's; `tree` shared or each row's."""
    B, N = tokens_BxN.shape
    D = max(tree.depth, 1)
    if isinstance(tree, RowTrees):
      depths_BxM, ancestors_BxMxM = tree.depths, tree.ancestors
      at_depth_BxMxD = depths_BxM[:, :, None] == jnp.arange(1, D + 1)[None, None]
      node_M = jnp.arange(N + 1, dtype=jnp.int32)
      paths_BxRxD = jnp.einsum('brm,bmd,m->brd', ancestors_BxMxM.astype(jnp.int32),
                               at_depth_BxMxD.astype(jnp.int32), node_M)  # 0: no node there.
      path_tokens_BxRxD = jnp.take_along_axis(
          tokens_BxN[:, None, :], jnp.maximum(paths_BxRxD - 1, 0), axis=2)
      ends_BxR = self.lengths_B[:, None] + depths_BxM.astype(self.lengths_B.dtype)
    else:
      depths = tree.depths
      paths_RxD = np.zeros((len(depths), D), np.int32)  # Node ids by depth.
      for node, row in enumerate(tree.ancestors):
        on_path = [a for a in np.flatnonzero(row) if a > 0]
        paths_RxD[node, depths[on_path] - 1] = on_path
      path_tokens_BxRxD = jnp.take(tokens_BxN, jnp.asarray(np.maximum(paths_RxD - 1, 0)), axis=1)
      ends_BxR = self.lengths_B[:, None] + jnp.asarray(depths)[None]
    extended_BxRxS = jax.vmap(self._with, in_axes=1, out_axes=1)(path_tokens_BxRxD)
    return self._offsets(extended_BxRxS, ends_BxR)
