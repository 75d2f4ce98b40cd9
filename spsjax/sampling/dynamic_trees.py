"""Dynamic trees of drafts (EAGLE-2, Li et al. 2024): each row's tree grown where its draft is
confident, a fixed number of nodes scored.

Per loop and row, with `width` w and depth k: the root's draft law gives w candidate children;
a candidate's value is the sum of the draft's log-probabilities along its path (the product of
its confidences). At each depth d < k the w candidates of depth d of highest value are
expanded: the drafter reads them in one call (`read`, each node seeing its ancestors), and each
gets w candidate children of its own. The `nodes` N candidates of highest priority, over all
depths, are the tree the target scores (`models.RowTrees`), in creation order (parents first);
a child's priority is at most its parent's and ties keep the earlier candidate, so the chosen
set holds every chosen node's parent.

The children, and exactness (`children_for` picks by the loop's draft sampling):
- a greedy draft (`top_children`, EAGLE-2's): each node's w top tokens under the draft's softmax
  at temperature 1, proposed as point masses; priority = value. Every draft is a function of the
  committed tokens, so the tree's shape may depend on anything: a child is accepted with
  probability r(t), and on rejection r loses t (`rejection.accept_tree`).
- a sampled draft (`sampled_children`): each node's children drawn from the draft's law without
  replacement (`drafters.draw_children`), each with its law given its earlier siblings; a child's
  priority is its parent's value plus the log of the mass its earlier siblings left. That bounds
  the priority of every later sibling and every descendant, so whether a child is scored never
  depends on its own token nor on theirs: the recursive rejection at each node sees candidates
  drawn from the laws it is told, and the output law is the target's.
Each node's children are drawn (or ranked) from its draft law as the loop's draft sampling reads it
after the committed tokens and the node's path (`Context`): the n-gram ban, sequence biases and
bans by position shift its logits, a repetition penalty reads the tokens on the path, as the
target's accept step does along each row's paths.

Sizes: w candidates at depth 1 and w^2 at each deeper one, C = w + (k - 1) w^2 in all, N <= C;
the drafter's own tree of expanded nodes (`expansion_tree`) has 1 + (k - 1) w nodes, level d's
at 1 + (d - 1) w .. d w.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from spsjax.models import RowTrees, TokenTree
from spsjax.sampling import ngrams
from spsjax.sampling.drafters import Committed, Proposal, draw_children
from spsjax.sampling.processors import SamplingConfig, penalise, present_along


class Grown(NamedTuple):
  """A loop's dynamic trees (`grow`)."""
  tokens_BxN: jax.Array  # int32: node i's token at i - 1.
  valid_BxN: jax.Array  # bool: a value above -inf (a token the draft gives mass).
  trees: RowTrees
  expanded_BxNp1: jax.Array  # int32: each node's node in the drafter's own tree; 0 if not read.
  q_BxNxV: jax.Array | None = None  # Each node's law given its earlier siblings; None: points.


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


class Parents(NamedTuple):
  """The L nodes whose children a call of `children` draws, in the drafter's own tree: the root
  (`tree` None), or the w expanded nodes of a level from node `first` on (node n's token at
  tokens_BxE[:, n - 1]; `tree` the `expansion_tree` that holds them)."""
  tokens_BxE: jax.Array | None = None
  tree: RowTrees | None = None
  first: int = 0


class Context(NamedTuple):
  """What the loop's draft sampling reads beside a node's logits: the committed tokens' history
  (n-gram ban, sequence biases, bans by position: `ngrams.History`) and the tokens present
  (a repetition penalty), each along the node's path (`read`)."""
  sampling: SamplingConfig  # The loop's draft sampling.
  history: ngrams.History | None
  present_BxV: jax.Array | None

  @classmethod
  def of(cls, loop, committed: Committed) -> 'Context | None':
    """The context of a loop's committed tokens; None where the draft sampling reads none."""
    history = committed.history(loop.draft_sampling)
    if history is None and committed.present_BxV is None:
      return None
    return cls(loop.draft_sampling, history, committed.present_BxV)

  def read(self, logits_BxLxV, parents: Parents) -> tuple[jax.Array, jax.Array | None]:
    """(the parents' logits shifted by the history after each one's path, the tokens present
    after it [B, L, V] or None without a penalty)."""
    L = logits_BxLxV.shape[1]
    if parents.tree is None:  # The root: after the committed tokens.
      offsets_BxLxV = None if self.history is None else self.history.after()[:, None]
      present_BxLxV = None if self.present_BxV is None else self.present_BxV[:, None]
    else:
      nodes = slice(parents.first, parents.first + L)
      offsets_BxLxV = None if self.history is None else self.history.along_tree(
          parents.tokens_BxE, parents.tree)[:, nodes]
      present_BxLxV = None if self.present_BxV is None else present_along(
          self.present_BxV, parents.tokens_BxE, parents.tree.ancestors[:, nodes, 1:])
    return ngrams.shift(logits_BxLxV, offsets_BxLxV), present_BxLxV


class Children(NamedTuple):
  """w children of each of L nodes (`top_children`, `sampled_children`)."""
  tokens_BxLxW: jax.Array
  q_BxLxWxV: jax.Array | None  # Each child's law given its earlier siblings; None: point masses.
  log_q_BxLxW: jax.Array  # log q(t) of each child under its parent's law: its value's step.
  log_rest_BxLxW: jax.Array  # Its priority's step (`grow`).
  valid_BxLxW: jax.Array


def top_children(width: int, context: Context | None = None):
  """(d, logits [B, L, V], `Parents`) -> `Children`: each node's w top tokens under the draft's
  softmax at temperature 1 (its logits read in `context`, a repetition penalty included),
  point masses; a child's priority its value (EAGLE-2's rule)."""

  def children(d: int, logits_BxLxV, parents: Parents = Parents()) -> Children:
    del d
    if context is not None:
      logits_BxLxV, present_BxLxV = context.read(logits_BxLxV, parents)
      if present_BxLxV is not None:
        logits_BxLxV = penalise(logits_BxLxV, context.sampling.without_context(), present_BxLxV)
    log_q_BxLxV = jax.nn.log_softmax(logits_BxLxV.astype(jnp.float32), axis=-1)
    log_q_BxLxW, tokens_BxLxW = jax.lax.top_k(log_q_BxLxV, width)
    return Children(tokens_BxLxW, None, log_q_BxLxW, log_q_BxLxW, jnp.isfinite(log_q_BxLxW))

  return children


def sampled_children(loop, keys_BxK, width: int, context: Context | None = None):
  """(d, logits [B, L, V], `Parents`) -> `Children`: each node's first child drawn from the
  draft's law q (the loop's draft sampling, its logits read in `context`; depth d's key of the
  row, one stream per node), then w - 1 more without replacement (`drafters.draw_children`),
  each with its law. A child's value step is log q(t); its priority step
  log(1 - q(earlier siblings)), the parent's mass left before it: a child's
  priority is then at least any later sibling's and any descendant's, so whether it is scored
  depends on neither its own token nor theirs, which keeps the tree exact."""

  def children(d: int, logits_BxLxV, parents: Parents = Parents()) -> Children:
    present_RxV = None
    if context is not None:
      logits_BxLxV, present_BxLxV = context.read(logits_BxLxV, parents)
      if present_BxLxV is not None:
        present_RxV = present_BxLxV.reshape((-1,) + present_BxLxV.shape[2:])
    tokens_BxLxW, q_BxLxWxV, valid_BxLxW = draw_children(loop, keys_BxK[:, d - 1],
                                                         logits_BxLxV, width, present_RxV)
    q_BxLxV = q_BxLxWxV[:, :, 0]  # The first child's law: the parent's.
    mass_BxLxW = jnp.take_along_axis(q_BxLxV, tokens_BxLxW, axis=2)  # q(t) of each child.
    before_BxLxW = jnp.cumsum(mass_BxLxW, axis=2) - mass_BxLxW
    log = lambda x: jnp.log(jnp.maximum(x, 0.0))
    return Children(tokens_BxLxW, q_BxLxWxV, log(mass_BxLxW), log(1.0 - before_BxLxW),
                    valid_BxLxW)

  return children


def children_for(loop, keys_BxK, width: int, committed: Committed):
  """The children for the loop's draft sampling after the `committed` tokens: `top_children` for
  a greedy draft, else `sampled_children` (the module docstring), in their `Context`."""
  context = Context.of(loop, committed)
  if loop.draft_sampling.greedy:
    return top_children(width, context)
  return sampled_children(loop, keys_BxK, width, context)


def grow(nodes: int, width: int, k: int, root_logits_BxV, read, children=None) -> Grown:
  """The dynamic tree from the root's draft logits [B, V] (module docstring). `read(d,
  tokens [B, w], parents [B, w], tree)`: the drafter reads level d's expanded nodes (d = 1 ..
  k - 1; `parents` index the level before, `tree` the `expansion_tree` so far) and returns their
  draft logits [B, w, V]. `children(d, logits [B, L, V], Parents)`: the w children of each of L
  nodes of depth d - 1 (default `top_children`: point masses).

  A candidate's value is its parent's plus log q(t); its priority, which chooses the N scored,
  its parent's value plus `log_rest`: with point masses its value, with sampled children the log
  of the parent's mass its earlier siblings left (`sampled_children`)."""
  check_sizes(nodes, width, k)
  children = children or top_children(width)
  B = root_logits_BxV.shape[0]
  # Candidates of each depth, in creation order: tokens, laws, values, priorities, validity and
  # parents' candidate ids (-1: the root).
  first_level = children(1, root_logits_BxV[:, None], Parents())
  flat = lambda x: x.reshape((B, -1) + x.shape[3:])
  tokens, values = [flat(first_level.tokens_BxLxW)], [flat(first_level.log_q_BxLxW)]
  priorities, valid = [flat(first_level.log_rest_BxLxW)], [flat(first_level.valid_BxLxW)]
  laws = [None if first_level.q_BxLxWxV is None else flat(first_level.q_BxLxWxV)]
  parents = [jnp.full((B, width), -1, jnp.int32)]
  first = 0  # The candidate id of the newest depth's first.
  expanded_parents, expanded_ids, expanded_tokens = [], [], []
  for d in range(1, k):
    # Level d: the newest depth's w best candidates by value.
    best_values_BxW, best_BxW = jax.lax.top_k(values[-1], width)
    best_tokens_BxW = jnp.take_along_axis(tokens[-1], best_BxW, axis=1)
    best_priorities_BxW = jnp.take_along_axis(priorities[-1], best_BxW, axis=1)
    expanded_parents.append(best_BxW // width if d > 1 else jnp.zeros_like(best_BxW))
    expanded_ids.append(first + best_BxW)
    expanded_tokens.append(best_tokens_BxW)
    tree = expansion_tree(expanded_parents, k, width)
    logits_BxWxV = read(d, best_tokens_BxW, expanded_parents[-1], tree)
    tokens_BxE = jnp.pad(jnp.concatenate(expanded_tokens, axis=1),
                         ((0, 0), (0, (k - 1 - d) * width)))  # Levels not read yet: 0.
    level = children(d + 1, logits_BxWxV, Parents(tokens_BxE, tree, 1 + (d - 1) * width))
    tokens.append(flat(level.tokens_BxLxW))
    values.append(flat(best_values_BxW[:, :, None] + level.log_q_BxLxW))
    # Never above the parent's (float rounding aside it is not): the N chosen hold their parents.
    priorities.append(flat(jnp.minimum(best_priorities_BxW[:, :, None],
                                       best_values_BxW[:, :, None] + level.log_rest_BxLxW)))
    valid.append(flat(level.valid_BxLxW))
    laws.append(None if level.q_BxLxWxV is None else flat(level.q_BxLxWxV))
    parents.append(jnp.repeat(first + best_BxW, width, axis=1).astype(jnp.int32))
    first += tokens[-2].shape[1]
  cat = lambda xs: jnp.concatenate(xs, axis=1)
  tokens_BxC, parents_BxC = cat(tokens), cat(parents)
  # The N of highest priority, in creation order; top_k keeps the lower index among equals.
  _, chosen_BxN = jax.lax.top_k(cat(priorities), nodes)
  chosen_BxN = jnp.sort(chosen_BxN, axis=1)
  pick = lambda x_BxC: jnp.take_along_axis(
      x_BxC, chosen_BxN.reshape(chosen_BxN.shape + (1,) * (x_BxC.ndim - 2)), axis=1)
  C = tokens_BxC.shape[1]
  rows_BxN = jnp.broadcast_to(jnp.arange(B)[:, None], (B, nodes))
  node_of_BxC = jnp.zeros((B, C + 1), jnp.int32).at[rows_BxN, chosen_BxN + 1].set(
      jnp.arange(1, nodes + 1, dtype=jnp.int32)[None])  # Candidate id + 1 -> node; the root 0.
  tree_parents_BxN = jnp.take_along_axis(node_of_BxC, pick(parents_BxC) + 1, axis=1)
  expanded_of_BxC = jnp.zeros((B, C), jnp.int32)  # Candidate id -> node of the drafter's tree.
  rows_BxW = jnp.broadcast_to(jnp.arange(B)[:, None], (B, width))
  for d, ids_BxW in enumerate(expanded_ids, start=1):
    expanded_of_BxC = expanded_of_BxC.at[rows_BxW, ids_BxW].set(
        1 + (d - 1) * width + jnp.arange(width, dtype=jnp.int32)[None])
  return Grown(pick(tokens_BxC), pick(cat(valid)), RowTrees.of(tree_parents_BxN, k, width),
               jnp.pad(pick(expanded_of_BxC), ((0, 0), (1, 0))),
               None if laws[0] is None else pick(cat(laws)))


def proposal(grown: Grown, vocab_size: int, k: int) -> Proposal:
  """The loop's proposal of the grown trees (point masses where the children were)."""
  tokens_BxN = grown.tokens_BxN
  q_BxNxV = (jax.nn.one_hot(tokens_BxN, vocab_size, dtype=jnp.float32) if grown.q_BxNxV is None
             else grown.q_BxNxV)
  return Proposal(tokens_BxN, q_BxNxV, jnp.full(tokens_BxN.shape[:1], k, jnp.int32),
                  grown.valid_BxN, row_trees=grown.trees)
