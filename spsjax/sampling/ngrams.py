"""No repeated n-grams (transformers' `no_repeat_ngram_size`): the tokens banned after a context.

With size n, a token x is banned after a context c (the committed tokens, prompt first, then
what the position reads: a chain's earlier drafts, a tree node's ancestors) iff the n-gram
(c[-n + 1:], x) already occurs in c; n = 1 bans every token of c. A banned token's logit is -inf
before any other processing (`ban`), as transformers' NoRepeatNGramLogitsProcessor sets it, so
the law after it is the processed law of the other tokens, greedy decoding included; a row with
every token banned has no distribution (`processors.probabilities`: NaN, token 0).

Contexts are given as sequences with an end each (`banned_after`): the n-grams are found by
comparing every window of n - 1 tokens with the context's last n - 1, O(S n) per context for
sequences of S tokens, and the banned tokens scattered into a [V] mask. `History` holds what a
sampler has committed and gives the contexts of a chain's slots and of a tree's nodes.
"""

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from spsjax.models import TokenTree


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
  # The context's last m tokens (clamped reads where the context is shorter: no window then
  # ends before it, below).
  ends_BxRx1 = ends_BxR[..., None]
  tail_BxRxM = jnp.take_along_axis(
      sequences_BxRxS, jnp.clip(ends_BxRx1 - m + jnp.arange(m)[None, None], 0, S - 1), axis=-1)
  # Window i: tokens i .. i + m - 1, then the token it would ban, i + m (before the end).
  match_BxRxI = (jnp.arange(S - m)[None, None] + m < ends_BxRx1) & (ends_BxRx1 >= m)
  for j in range(m):
    match_BxRxI &= sequences_BxRxS[..., j:S - m + j] == tail_BxRxM[..., j:j + 1]
  next_BxRxI = sequences_BxRxS[..., m:]
  ids_BxRxI = jnp.where(match_BxRxI & (next_BxRxI >= 0) & (next_BxRxI < vocab_size), next_BxRxI,
                        vocab_size)
  rows_BxRxI = jnp.broadcast_to(jnp.arange(B)[:, None, None], ids_BxRxI.shape)
  slots_BxRxI = jnp.broadcast_to(jnp.arange(R)[None, :, None], ids_BxRxI.shape)
  return jnp.zeros((B, R, vocab_size), bool).at[rows_BxRxI, slots_BxRxI, ids_BxRxI].set(
      True, mode='drop')


def banned_through(tokens_BxT: jax.Array, n: int, vocab_size: int) -> jax.Array:
  """bool[B, T, V]: the tokens banned after each prefix tokens[:, :t + 1] of whole sequences
  (the law of the token after position t)."""
  B, T = tokens_BxT.shape
  ends_BxT = jnp.broadcast_to(jnp.arange(1, T + 1, dtype=jnp.int32), (B, T))
  return banned_after(tokens_BxT[:, None], ends_BxT, n, vocab_size)


def ban(logits_xV: jax.Array, banned_xV: jax.Array | None) -> jax.Array:
  """The logits with the banned tokens' at -inf (unchanged without a mask)."""
  if banned_xV is None:
    return logits_xV
  return jnp.where(banned_xV, -jnp.inf, logits_xV)


@flax.struct.dataclass
class History:
  """What each row has committed: tokens_BxS from position 0 (PAD_ID past lengths_B), and the
  n-gram size banned (static)."""
  tokens_BxS: jax.Array
  lengths_B: jax.Array
  n: int = flax.struct.field(pytree_node=False)
  vocab_size: int = flax.struct.field(pytree_node=False)

  @classmethod
  def of_prompts(cls, n: int, prompts_BxP: jax.Array, prompt_lengths_B: jax.Array, room: int,
                 vocab_size: int) -> 'History | None':
    """The prompts with `room` more slots for tokens to come (`append`); None for n = 0."""
    if not n:
      return None
    tokens_BxS = jnp.pad(prompts_BxP.astype(jnp.int32), ((0, 0), (0, room)), constant_values=-1)
    tokens_BxS = jnp.where(jnp.arange(tokens_BxS.shape[1])[None] < prompt_lengths_B[:, None],
                           tokens_BxS, -1)
    return cls(tokens_BxS, prompt_lengths_B.astype(jnp.int32), n, vocab_size)

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

  def banned(self) -> jax.Array:
    """bool[B, V]: the tokens banned after each row's committed tokens."""
    return banned_after(self.tokens_BxS[:, None], self.lengths_B[:, None], self.n,
                        self.vocab_size)[:, 0]

  def _with(self, tokens_BxN: jax.Array) -> jax.Array:
    """int32[B, S + N]: the committed tokens with `tokens` written after each row's."""
    N = tokens_BxN.shape[1]
    padded_BxS = jnp.pad(self.tokens_BxS, ((0, 0), (0, N)), constant_values=-1)
    write = lambda row_S, t_N, at: jax.lax.dynamic_update_slice(row_S, t_N, (at,))
    return jax.vmap(write)(padded_BxS, tokens_BxN.astype(padded_BxS.dtype), self.lengths_B)

  def banned_at(self, drafts_BxK: jax.Array, i) -> jax.Array:
    """bool[B, V]: the tokens banned at a chain's slot i (traced or not), after the committed
    tokens and drafts[:, :i]."""
    ends_Bx1 = (self.lengths_B + i)[:, None]
    return banned_after(self._with(drafts_BxK)[:, None], ends_Bx1, self.n, self.vocab_size)[:, 0]

  def banned_along_chain(self, drafts_BxK: jax.Array, slots: int) -> jax.Array:
    """bool[B, slots, V]: the tokens banned at each of a chain's first `slots` slots, slot j
    reading the committed tokens and drafts[:, :j]."""
    ends_BxR = self.lengths_B[:, None] + jnp.arange(slots, dtype=self.lengths_B.dtype)[None]
    return banned_after(self._with(drafts_BxK)[:, None], ends_BxR, self.n, self.vocab_size)

  def banned_along_tree(self, tokens_BxN: jax.Array, tree: TokenTree) -> jax.Array:
    """bool[B, N + 1, V]: the tokens banned after each node of a tree (the root: after the
    committed tokens; node i: after them and its path, its ancestors' tokens and its own, root
    excluded, in depth order). tokens_BxN are nodes 1 .. N's."""
    depths = tree.depths
    paths_RxD = np.zeros((len(depths), max(tree.depth, 1)), np.int32)  # Node ids by depth.
    for node, row in enumerate(tree.ancestors):
      on_path = [a for a in np.flatnonzero(row) if a > 0]
      paths_RxD[node, depths[on_path] - 1] = on_path
    path_tokens_BxRxD = jnp.take(tokens_BxN, jnp.asarray(np.maximum(paths_RxD - 1, 0)), axis=1)
    extended_BxRxS = jax.vmap(self._with, in_axes=1, out_axes=1)(path_tokens_BxRxD)
    ends_BxR = self.lengths_B[:, None] + jnp.asarray(depths)[None]
    return banned_after(extended_BxRxS, ends_BxR, self.n, self.vocab_size)
