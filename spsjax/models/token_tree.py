"""A static tree of draft tokens, and a model's view of it: depths and ancestors.

Node 0 is the root (the last committed token); nodes 1 .. N are drafts, each after its parent
(`parents[i - 1]` is node i's parent, a node before it). A model call on a tree (`models.extend`'s
`tree`) writes node i's keys and values at cache slot `length + i` and rotates them at position
`length + depth(i)`; node i attends to the cached positions and to its ancestors and itself only.
A call may write a run of nodes only (`first_node`): a draft model extends a tree level by level
(`levels`, for a tree in breadth-first order), reading the levels it wrote before.
The children of a node are tried in node order (`children`): the first is the draft model's own
draw, the later ones its alternatives.

Invariant: parents come before children, so the depth of node i is at most i: a root-to-node
path moved to slots `length + depth` (`kv_cache.keep_path`) never reads a slot it has written.

`RowTrees` are trees of the same size whose structure is traced and each row's own (a dynamic
drafter's, `sampling.dynamic_trees`): the same views, per row ([B, ...]); a model call takes
either, and a `TreeMask`'s arrays carry a leading batch axis for them.
"""

import dataclasses
import functools
from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


class TreeMask(NamedTuple):
  """What a model call on the nodes first .. first + T - 1 of a tree of M = N + 1 nodes needs;
  the arrays lead with a batch axis for `RowTrees` (each row its own tree)."""
  ancestors_xTxM: jax.Array  # bool: [.., t, m] iff node m is node first + t or an ancestor.
  depths_xM: jax.Array  # int32: every node's depth.
  first: int


@dataclasses.dataclass(frozen=True)
class TokenTree:
  """`parents`: node i's parent for i = 1 .. N (0 is the root)."""
  parents: tuple[int, ...]

  def __post_init__(self):
    if not self.parents:
      raise ValueError('A token tree needs at least one draft node.')
    for i, parent in enumerate(self.parents, start=1):
      if not 0 <= parent < i:
        raise ValueError(f'Node {i} of a token tree has parent {parent}: parents must be earlier '
                         f'nodes (0 is the root), got parents {self.parents}.')

  @classmethod
  def chain_with_alternatives(cls, k: int, alternatives: int) -> 'TokenTree':
    """A chain of k drafts (nodes 1 .. k) and, after each of the chain's first k nodes (the root
    included), `alternatives` other tokens as leaves: nodes k + 1 + i * alternatives + j, the j-th
    alternative to chain node i + 1."""
    if k < 1 or alternatives < 0:
      raise ValueError(f'A chain with alternatives needs k >= 1 and alternatives >= 0, got k={k}, '
                       f'alternatives={alternatives}.')
    chain = tuple(range(k))
    leaves = tuple(i for i in range(k) for _ in range(alternatives))
    return cls(chain + leaves)

  @classmethod
  def full(cls, branching) -> 'TokenTree':
    """Every node at depth d - 1 with branching[d - 1] children (d = 1 .. len(branching)), in
    breadth-first order: sum over d of prod(branching[:d]) nodes."""
    branching = tuple(int(b) for b in branching)
    if not branching or min(branching) < 1:
      raise ValueError(f'A full tree needs branching factors >= 1, got {branching}.')
    parents, level = [], [0]
    for b in branching:
      first = len(parents) + 1
      parents += [node for node in level for _ in range(b)]
      level = list(range(first, len(parents) + 1))
    return cls(tuple(parents))

  @property
  def num_nodes(self) -> int:
    """N: the draft nodes (the root not counted)."""
    return len(self.parents)

  @functools.cached_property
  def depths(self) -> np.ndarray:
    """int32[N + 1]: each node's depth (the root's 0)."""
    depth = [0]
    for parent in self.parents:
      depth.append(depth[parent] + 1)
    return np.asarray(depth, np.int32)

  @property
  def depth(self) -> int:
    """The deepest node's depth: the most drafts one loop can accept."""
    return int(self.depths.max())

  @functools.cached_property
  def ancestors(self) -> np.ndarray:
    """bool[N + 1, N + 1]: [i, j] iff node j is node i or one of its ancestors."""
    n = self.num_nodes + 1
    out = np.eye(n, dtype=bool)
    for i, parent in enumerate(self.parents, start=1):
      out[i] |= out[parent]
    return out

  @functools.cached_property
  def children(self) -> np.ndarray:
    """int32[N + 1, M]: each node's children in node order, padded with -1 (M: the most any node
    has, at least 1)."""
    kids = [[] for _ in range(self.num_nodes + 1)]
    for i, parent in enumerate(self.parents, start=1):
      kids[parent].append(i)
    width = max(1, max(len(k) for k in kids))
    return np.asarray([k + [-1] * (width - len(k)) for k in kids], np.int32)

  @functools.cached_property
  def levels(self) -> tuple[tuple[int, int], ...]:
    """(first node, count) of each depth 0 .. depth, for a tree in breadth-first order (its
    depths never decrease along the nodes); ValueError otherwise."""
    depths = self.depths
    if np.any(np.diff(depths) < 0):
      raise ValueError(f'The tree {self.parents} is not in breadth-first order: a draft model '
                       'extends trees level by level.')
    return tuple((int(np.argmax(depths == d)), int(np.sum(depths == d)))
                 for d in range(self.depth + 1))

  def mask(self, first: int = 0, count: int | None = None) -> TreeMask:
    """The `TreeMask` of a call on nodes first .. first + count - 1 (default: to the last)."""
    count = _check_range(first, count, self.num_nodes + 1)
    return TreeMask(jnp.asarray(self.ancestors[first:first + count]), jnp.asarray(self.depths),
                    first)

  def for_rows(self, B: int, width: int | None = None) -> 'RowTrees':
    """This tree in every one of B rows, as `RowTrees` (children bound `width`, default the most
    any node has)."""
    width = self.children.shape[1] if width is None else width
    return RowTrees.of(jnp.broadcast_to(jnp.asarray(self.parents, jnp.int32),
                                        (B, self.num_nodes)), self.depth, width)


def _check_range(first: int, count: int | None, M: int) -> int:
  count = M - first if count is None else count
  if not (0 <= first and count >= 1 and first + count <= M):
    raise ValueError(f'Nodes {first} .. {first + count - 1} are not in a tree of {M} nodes (the '
                     'root included).')
  return count


@flax.struct.dataclass
class RowTrees:
  """Each row's own tree of N draft nodes (a pytree: the structure is traced, its sizes static).

  `parents_BxN[b, i - 1]`: node i's parent in row b, an earlier node (0 is the root). `depth`
  bounds every row's depth and `width` the children of any node: whoever builds the trees keeps
  both (nothing traced can be checked; `TokenTree.for_rows` and `sampling.dynamic_trees` do).
  The views are `TokenTree`'s with a leading batch axis; `of` computes them once.
  """
  parents_BxN: jax.Array
  ancestors: jax.Array  # bool[B, N + 1, N + 1]: [b, i, j] iff node j is node i or an ancestor.
  depths: jax.Array  # int32[B, N + 1].
  depth: int = flax.struct.field(pytree_node=False)
  width: int = flax.struct.field(pytree_node=False)

  @classmethod
  def of(cls, parents_BxN: jax.Array, depth: int, width: int) -> 'RowTrees':
    """The trees of these parents (depth and width bounds as the class docstring), their
    ancestors by repeated squaring of the parent relation (ceil(log2(depth)) + 1 products)."""
    parents_BxN = jnp.asarray(parents_BxN, jnp.int32)
    B, N = parents_BxN.shape
    parent_BxMxM = jax.nn.one_hot(jnp.pad(parents_BxN, ((0, 0), (1, 0)), constant_values=-1),
                                  N + 1, dtype=jnp.float32)  # [b, i, j]: j is i's parent.
    within_BxMxM = jnp.eye(N + 1, dtype=jnp.float32)[None] + parent_BxMxM  # Paths of <= 1 step.
    for _ in range(max(depth - 1, 0).bit_length()):  # Paths of <= 2, 4, ... >= depth steps.
      within_BxMxM = jnp.minimum(jnp.einsum('bij,bjk->bik', within_BxMxM, within_BxMxM), 1.0)
    ancestors_BxMxM = within_BxMxM > 0
    depths_BxM = jnp.sum(ancestors_BxMxM, axis=2, dtype=jnp.int32) - 1
    return cls(parents_BxN, ancestors_BxMxM, depths_BxM, depth, width)

  @property
  def num_nodes(self) -> int:
    return self.parents_BxN.shape[1]

  @property
  def children(self) -> jax.Array:
    """int32[B, N + 1, width]: each node's children in node order, padded with -1."""
    B, N = self.parents_BxN.shape
    child_BxMxN = self.parents_BxN[:, None, :] == jnp.arange(N + 1)[None, :, None]  # [b, m, i-1]
    rank_BxMxN = jnp.cumsum(child_BxMxN, axis=2) - 1
    slot_BxMxNxC = child_BxMxN[..., None] & (
        rank_BxMxN[..., None] == jnp.arange(self.width)[None, None, None])
    ids_N = jnp.arange(1, N + 1, dtype=jnp.int32)
    found_BxMxC = jnp.any(slot_BxMxNxC, axis=2)
    return jnp.where(found_BxMxC, jnp.einsum('bmnc,n->bmc', slot_BxMxNxC.astype(jnp.int32),
                                             ids_N), -1)

  def mask(self, first: int = 0, count: int | None = None) -> TreeMask:
    """The per-row `TreeMask` of a call on nodes first .. first + count - 1."""
    count = _check_range(first, count, self.num_nodes + 1)
    return TreeMask(self.ancestors[:, first:first + count], self.depths, first)
