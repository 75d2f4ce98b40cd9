"""No repeated n-grams: the tokens banned after a context are transformers' (fairseq's) set."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spsjax.models import TokenTree
from spsjax.sampling import ngrams


def reference_banned(context, n, vocab_size):
  """transformers' `_calc_banned_ngram_tokens` for one context, as a [V] mask: every n-gram of
  the context keyed by its first n - 1 tokens; the tokens after the context's last n - 1."""
  banned = np.zeros(vocab_size, bool)
  if len(context) + 1 < n:
    return banned
  following = {}
  for gram in zip(*[context[i:] for i in range(n)]):
    following.setdefault(tuple(gram[:-1]), []).append(gram[-1])
  banned[following.get(tuple(context[len(context) + 1 - n:]), [])] = True
  return banned


@pytest.mark.parametrize('n', [1, 2, 3, 4])
def test_banned_after_is_transformers_set(n):
  """Random sequences over 5 tokens (3 for n >= 3: many repeats), contexts of every length
  0..20, PAD_ID past some ends (never banned, never matched)."""
  rng = np.random.default_rng(n)
  V, B, R, S = 5 if n < 3 else 3, 6, 9, 20
  seqs = rng.integers(0, V, (B, S)).astype(np.int32)
  ends = rng.integers(0, S + 1, (B, R)).astype(np.int32)
  ends[:, 0], ends[:, 1] = 0, S
  seqs[0, 15:] = -1
  ends[0] = np.minimum(ends[0], 15)
  got = np.asarray(jax.jit(ngrams.banned_after, static_argnums=(2, 3))(
      jnp.asarray(seqs)[:, None], jnp.asarray(ends), n, V))
  banned_somewhere = 0
  for b in range(B):
    for r in range(R):
      want = reference_banned(list(seqs[b, :ends[b, r]]), n, V)
      np.testing.assert_array_equal(got[b, r], want, err_msg=f'row {b}, end {ends[b, r]}')
      banned_somewhere += want.any()
  assert banned_somewhere >= B * R // 5


def test_banned_through_each_prefix():
  tokens = np.array([[1, 2, 1, 2, 3, 1], [0, 0, 0, 4, 0, 0]], np.int32)
  got = np.asarray(ngrams.banned_through(jnp.asarray(tokens), 2, 5))
  for b in range(2):
    for t in range(6):
      np.testing.assert_array_equal(got[b, t], reference_banned(list(tokens[b, :t + 1]), 2, 5))
  assert got[0, 3, 1] and got[0, 0].sum() == 0  # After 1 2 1 2: 2 was followed by 1.


def _history(n):
  prompts = jnp.array([[1, 2, 3, 1, -1, -1], [4, 4, 1, 2, 4, 3]], jnp.int32)
  return ngrams.History.of_prompts(n, prompts, jnp.array([4, 6], jnp.int32), 8, 6)


def test_history_appends_and_bans_along_a_chain():
  """`append` commits counts[b] tokens per row; a chain's slot j reads the committed tokens and
  the drafts before it (`banned_along_chain`, `banned_at` with a traced slot)."""
  assert ngrams.History.of_prompts(0, jnp.zeros((1, 2), jnp.int32), jnp.ones(1), 3, 5) is None
  history = _history(2).append(jnp.array([[2, 5, 0], [1, 1, 1]]), jnp.array([2, 0]))
  np.testing.assert_array_equal(history.lengths_B, [6, 6])
  np.testing.assert_array_equal(history.tokens_BxS[:, :7], [[1, 2, 3, 1, 2, 5, -1],
                                                            [4, 4, 1, 2, 4, 3, -1]])
  committed = [[1, 2, 3, 1, 2, 5], [4, 4, 1, 2, 4, 3]]
  np.testing.assert_array_equal(history.banned(), [reference_banned(c, 2, 6) for c in committed])
  drafts = jnp.array([[3, 1, 2], [4, 1, 0]], jnp.int32)
  chain = np.asarray(history.banned_along_chain(drafts, 4))
  for j in range(4):
    want = [reference_banned(c + list(np.asarray(drafts[b, :j])), 2, 6)
            for b, c in enumerate(committed)]
    np.testing.assert_array_equal(chain[:, j], want, err_msg=f'slot {j}')
    np.testing.assert_array_equal(jax.jit(history.banned_at)(drafts, jnp.int32(j)), want)
  assert chain.any(axis=-1).sum() >= 5


def test_history_bans_along_a_tree():
  """Node i reads the committed tokens, then its ancestors' tokens and its own in depth order;
  the root the committed tokens alone."""
  tree = TokenTree((0, 0, 1, 1, 2, 3))  # Depths 1, 1, 2, 2, 2, 3.
  history = _history(3)
  tokens = jnp.array([[1, 4, 2, 3, 1, 1], [2, 4, 3, 2, 4, 1]], jnp.int32)  # Nodes 1 .. 6.
  got = np.asarray(history.banned_along_tree(tokens, tree))
  committed = [[1, 2, 3, 1], [4, 4, 1, 2, 4, 3]]
  for node in range(7):
    path = [a for a in np.flatnonzero(tree.ancestors[node]) if a > 0]
    for b in range(2):
      context = committed[b] + [int(tokens[b, a - 1]) for a in path]
      np.testing.assert_array_equal(got[b, node], reference_banned(context, 3, 6),
                                    err_msg=f'row {b}, node {node}, context {context}')
  assert got.any(axis=-1).sum() >= 2


def test_ban_sets_minus_infinity():
  logits = jnp.array([[0.5, 1.0, -2.0]])
  np.testing.assert_array_equal(ngrams.ban(logits, jnp.array([[False, True, False]])),
                                [[0.5, -np.inf, -2.0]])
  assert ngrams.ban(logits, None) is logits
