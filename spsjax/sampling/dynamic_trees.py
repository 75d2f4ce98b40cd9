"""Dynamic trees of drafts (EAGLE-2, Li et al. 2024): each row's tree grown where its draft is
confident, a fixed number of nodes scored.

Per loop and row, with `width` w and depth k: the root's draft law gives w candidates, its top
tokens; a candidate's value is the sum of the draft's log-probabilities along its path (the
product of its confidences). At each depth d < k the w candidates of depth d of highest value
are expanded: the drafter reads them in one call (`read`, each node seeing its ancestors), and
each gets w candidates of its own, its top tokens. The `nodes` N candidates of highest value,
over all depths, are the tree the target scores (`models.RowTrees`), in creation order (parents
first). A child's value is at most its parent's and ties keep the earlier candidate, so the
chosen set holds every chosen node's parent.

Exactness: every draft is a function of the committed tokens (the draft's top tokens, no
randomness), so each is proposed as a point mass: a child is accepted with probability r(t),
and on rejection r loses t (`rejection.accept_tree`). The tree's shape being such a function
too, the output law is the target's whatever the tree. The values are the draft's softmax at
temperature 1 (its sampling settings, context rules included, are not applied): they choose
which tokens are tried, never the law.

Sizes: w candidates at depth 1 and w^2 at each deeper one, C = w + (k - 1) w^2 in all, N <= C;
the drafter's own tree of expanded nodes (`expansion_tree`) has 1 + (k - 1) w nodes, level d's
at 1 + (d - 1) w .. d w.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from spsjax.models import RowTrees, TokenTree
from spsjax.sampling.drafters import Proposal


class Grown(NamedTuple):
  """A loop's dynamic trees (`grow`)."""
  tokens_BxN: jax.Array  # int32: node i's token at i - 1.
  valid_BxN: jax.Array  # bool: a value above -inf (a token the draft gives mass).
  trees: RowTrees
  expanded_BxNp1: jax.Array  # int32: each node's node in the drafter's own tree; 0 if not read.


def num_candidates(k: int, width: int) -> int:
  """C = w + (k - 1) w^2: the candidates a loop values."""
  return width + (k - 1) * width * width


def check_sizes(nodes: int, width: int, k: int | None = None) -> None:
  """ValueError where a dynamic tree cannot have these sizes."""
  if nodes < 1 or width < 1:
    raise ValueError(f'A dynamic tree needs nodes >= 1 and width >= 1, got nodes={nodes}, '
                     f'width={width}.')
  if k is not None and nodes > num_candidates(k, width):
    raise ValueError(f'A dynamic tree of depth {k} and width {width} values '
                     f'{num_candidates(k, width)} candidates: nodes={nodes} is more.')


def envelope(nodes: int, k: int) -> TokenTree:
  """A static tree of the loop's sizes (N nodes, depth k: a chain of k and N - k leaves under the
  root, or a chain of N): what the loop's buffers and a cost model size by (a call's cost does
  not depend on the tree's shape); each loop's trees are the rows' own."""
  if nodes <= k:
    return TokenTree(tuple(range(nodes)))
  return TokenTree(tuple(range(k)) + (0,) * (nodes - k))


def expansion_tree(parents_BxL: list[jax.Array], k: int, width: int) -> RowTrees:
  """The drafter's own tree: the root, then level d's w expanded nodes for each level known
  (`parents_BxL[d - 1]`: each one's parent among the level before, 0 .. w - 1; level 1's are the
  root's children), the levels not yet known the root's (no call reads them)."""
  B = parents_BxL[0].shape[0]
  levels = [jnp.zeros((B, width), jnp.int32)]  # Level 1: the root's.
  for d, parents in enumerate(parents_BxL[1:], start=2):
    levels.append(1 + (d - 2) * width + parents.astype(jnp.int32))
  levels += [jnp.zeros((B, width), jnp.int32)] * (k - 1 - len(levels))
  return RowTrees.of(jnp.concatenate(levels, axis=1), max(k - 1, 1), width)


def grow(nodes: int, width: int, k: int, root_logits_BxV, read):
  """The dynamic tree from the root's draft logits [B, V] (module docstring). `read(d,
  tokens [B, w], parents [B, w], tree)`: the drafter reads level d's expanded nodes (d = 1 ..
  k - 1; `parents` index the level before, `tree` the `expansion_tree` so far) and returns their
  draft logits [B, w, V]."""
  check_sizes(nodes, width, k)
  B = root_logits_BxV.shape[0]
  log_q = lambda logits: jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  # Candidates of each depth, in creation order: tokens, values and parents' candidate ids (-1:
  # the root).
  top_values_Bx1xW, top_tokens_Bx1xW = jax.lax.top_k(log_q(root_logits_BxV)[:, None], width)
  tokens, values = [top_tokens_Bx1xW[:, 0]], [top_values_Bx1xW[:, 0]]
  parents = [jnp.full((B, width), -1, jnp.int32)]
  first = 0  # The candidate id of the newest depth's first.
  expanded_parents, expanded_ids = [], []
  for d in range(1, k):
    # Level d: the newest depth's w best candidates.
    best_values_BxW, best_BxW = jax.lax.top_k(values[-1], width)
    best_tokens_BxW = jnp.take_along_axis(tokens[-1], best_BxW, axis=1)
    expanded_parents.append(best_BxW // width if d > 1 else jnp.zeros_like(best_BxW))
    expanded_ids.append(first + best_BxW)
    logits_BxWxV = read(d, best_tokens_BxW, expanded_parents[-1],
                        expansion_tree(expanded_parents, k, width))
    child_values_BxWxW, child_tokens_BxWxW = jax.lax.top_k(log_q(logits_BxWxV), width)
    tokens.append(child_tokens_BxWxW.reshape(B, width * width))
    values.append((best_values_BxW[:, :, None] + child_values_BxWxW).reshape(B, width * width))
    parents.append(jnp.repeat(first + best_BxW, width, axis=1).astype(jnp.int32))
    first += tokens[-2].shape[1]
  tokens_BxC, values_BxC = jnp.concatenate(tokens, axis=1), jnp.concatenate(values, axis=1)
  parents_BxC = jnp.concatenate(parents, axis=1)
  # The N best, in creation order; top_k keeps the lower index among equal values.
  chosen_values_BxN, chosen_BxN = jax.lax.top_k(values_BxC, nodes)
  order_BxN = jnp.argsort(chosen_BxN, axis=1)
  chosen_BxN = jnp.take_along_axis(chosen_BxN, order_BxN, axis=1)
  chosen_values_BxN = jnp.take_along_axis(chosen_values_BxN, order_BxN, axis=1)
  C = tokens_BxC.shape[1]
  rows_BxN = jnp.broadcast_to(jnp.arange(B)[:, None], (B, nodes))
  node_of_BxC = jnp.zeros((B, C + 1), jnp.int32).at[rows_BxN, chosen_BxN + 1].set(
      jnp.arange(1, nodes + 1, dtype=jnp.int32)[None])  # Candidate id + 1 -> node; the root 0.
  tree_parents_BxN = jnp.take_along_axis(
      node_of_BxC, jnp.take_along_axis(parents_BxC, chosen_BxN, axis=1) + 1, axis=1)
  expanded_of_BxC = jnp.zeros((B, C), jnp.int32)  # Candidate id -> node of the drafter's tree.
  rows_BxW = jnp.broadcast_to(jnp.arange(B)[:, None], (B, width))
  for d, ids_BxW in enumerate(expanded_ids, start=1):
    expanded_of_BxC = expanded_of_BxC.at[rows_BxW, ids_BxW].set(
        1 + (d - 1) * width + jnp.arange(width, dtype=jnp.int32)[None])
  expanded_BxN = jnp.take_along_axis(expanded_of_BxC, chosen_BxN, axis=1)
  return Grown(jnp.take_along_axis(tokens_BxC, chosen_BxN, axis=1),
               jnp.isfinite(chosen_values_BxN), RowTrees.of(tree_parents_BxN, k, width),
               jnp.pad(expanded_BxN, ((0, 0), (1, 0))))


def proposal(grown: Grown, vocab_size: int, k: int) -> Proposal:
  """The loop's proposal of the grown trees: every node a point mass."""
  tokens_BxN = grown.tokens_BxN
  return Proposal(tokens_BxN, jax.nn.one_hot(tokens_BxN, vocab_size, dtype=jnp.float32),
                  jnp.full(tokens_BxN.shape[:1], k, jnp.int32), grown.valid_BxN,
                  row_trees=grown.trees)
