"""A draft model drafting a whole static tree: every node at depth d - 1 gets branching[d - 1]
children (`models.TokenTree.full`), level by level; or growing each row's own tree
(`DynamicTreeDrafter`, EAGLE-2's rule: `dynamic_trees`).

Per loop: the draft's first call feeds the last two committed tokens (as `drafters.ModelDrafter`),
giving the root's law; each level's children are drawn from their parent's law (the first by
the loop's draft key, the others without replacement, `drafters.draw_children`), and the draft
model then reads the new level in one call on the tree (`models.extend`'s `tree` and `first_node`: each node
sees the committed tokens and its ancestors), giving the next level's laws. The deepest level is
scored by the target but never read by the draft: a loop runs one draft call per level but the
last, k calls for a tree of depth k, on 1 + sum of the levels' sizes positions.

Exactness: each node's token is drawn from the law reported for it given its earlier siblings,
with randomness independent of the accept step's (`rejection.accept_tree`). A repetition penalty
reads the committed tokens and the parent's path (the parent and its ancestors).

Cache invariant (c_b committed tokens): the draft cache holds at least the first c_b - 2 tokens.
The tree's nodes are written at slots base + node (base = c_b - 1, the root's slot, as the
target's); after the accept step the accepted path moves to the slots of its positions
(`kv_cache.keep_path`) and the draft keeps the path's nodes it read (all but a last one at the
deepest level), which with the next loop's two-token call covers c_b' - 2.

The levels' calls attend by XLA's ops (a packed draft's products stay the kernels') over full
caches: a sliding-window draft layer is refused (its ring does not hold the levels written
before).
"""

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from spsjax.models import KVCache, Model, TokenTree, extend, kv_cache, prefill
from spsjax.sampling import dynamic_trees, ngrams
from spsjax.sampling.drafters import Committed, Drafter, Proposal, Verdict, draw_children
from spsjax.sampling.processors import present_along


def draft_tree(loop, branching: tuple[int, ...], committed: Committed, keys_BxK,
               root_logits_Bx1xV, read) -> Proposal:
  """A full tree (`TokenTree.full(branching)`) drafted level by level from the root's draft
  logits: each level's children drawn from their parent's law (the first with the loop's draft
  key of that depth, the others without replacement: `drafters.draw_children`; a repetition penalty
  reading the parent's path), then `read(first_child, tokens [B, C])` (every level but the
  deepest) gives the new level's C nodes' logits [B, C, V] (the drafter's model reading them on
  the tree)."""
  tree = TokenTree.full(branching)
  levels = tree.levels
  history = committed.history(loop.draft_sampling)
  B, V = keys_BxK.shape[0], committed.vocab_size
  M = tree.num_nodes + 1
  tokens_BxM = jnp.zeros((B, M), jnp.int32).at[:, 0].set(committed.last(1))
  q_BxMxV = jnp.zeros((B, M, V), jnp.float32)
  valid_BxM = jnp.zeros((B, M), bool)
  logits_BxLxV = root_logits_Bx1xV
  for d, b in enumerate(branching):
    parents, L = levels[d]
    children = levels[d + 1][0]  # Node parents + j's children: children + j * b .. + b.
    rows = lambda x: x.reshape((B * L,) + x.shape[2:])
    present_RxV = None
    if committed.present_BxV is not None:  # The committed tokens and each parent's path's.
      present_RxV = rows(present_along(committed.present_BxV, tokens_BxM[:, 1:],
                                       tree.ancestors[parents:parents + L, 1:]))
    if history is not None:  # The n-gram ban and biases after each parent's path.
      logits_BxLxV = ngrams.shift(logits_BxLxV, history.along_tree(
          tokens_BxM[:, 1:], tree)[:, parents:parents + L])
    tokens_BxLxC, q_BxLxCxV, valid_BxLxC = draw_children(loop, keys_BxK[:, d], logits_BxLxV,
                                                         b, present_RxV)
    level = slice(children, children + L * b)
    tokens_BxM = tokens_BxM.at[:, level].set(tokens_BxLxC.reshape(B, L * b))
    q_BxMxV = q_BxMxV.at[:, level].set(q_BxLxCxV.reshape(B, L * b, V))
    valid_BxM = valid_BxM.at[:, level].set(valid_BxLxC.reshape(B, L * b))
    if d + 1 < len(branching):
      logits_BxLxV = read(children, tokens_BxM[:, level])
  return Proposal(tokens_BxM[:, 1:], q_BxMxV[:, 1:], jnp.full((B,), len(branching), jnp.int32),
                  valid_BxM[:, 1:], tree=tree)


def tree_of(branching: tuple[int, ...], k: int) -> TokenTree:
  """The tree of `branching` for lookahead k, which must be its depth (ValueError otherwise)."""
  if k != len(branching):
    raise ValueError(f'The tree drafter with branching {branching} drafts trees of depth '
                     f'{len(branching)}: run it with k={len(branching)}, not {k}.')
  return TokenTree.full(branching)


def level_calls(tree: TokenTree) -> tuple[int, ...]:
  """The positions of a level-by-level drafter's calls in a loop on `tree`: the first reads what
  was committed (counted as one step), then one call per level but the deepest, on its nodes."""
  return (1,) + tuple(count for _, count in tree.levels[1:-1])


def check_children_fit(branching: tuple[int, ...], target: Model) -> None:
  """ValueError where a node would have more children than the vocabulary has tokens."""
  if max(branching) > target.config.vocab_size:
    raise ValueError(f'Branching {branching} asks for more children than the '
                     f'{target.config.vocab_size} tokens of the vocabulary.')


def check_full_caches(draft: Model) -> None:
  """ValueError for a draft with sliding-window layers: a level-by-level drafter's calls read
  the levels written before, which a ring does not hold."""
  if any(draft.config.window(i) is not None for i in range(draft.config.num_layers)):
    raise ValueError('The tree drafter needs a draft without sliding-window layers (their '
                     'rings do not hold the levels written before).')


def _root_logits(draft: Model, cache: KVCache, committed: Committed):
  """A loop's first draft call: the last two committed tokens at positions c - 2 and c - 1 (the
  first may be in the cache already), (the root's logits [B, 1, V], the cache)."""
  B = committed.lengths_B.shape[0]
  last2_Bx2 = jnp.stack([committed.last(2), committed.last(1)], axis=1)
  return extend(draft.config, draft.params, cache.with_lengths(committed.lengths_B - 2),
                last2_Bx2, logits_at_BxL=jnp.ones((B, 1), jnp.int32),
                counts_B=committed.counts(2))


def _prefill(loop, draft: Model, prompts_BxP, prompt_lengths_B, capacity) -> KVCache:
  _, cache = prefill(draft.config, draft.params, prompts_BxP, prompt_lengths_B, capacity,
                     last_only=True)
  return kv_cache.constrain(cache, loop.mesh, loop.rules)


@dataclasses.dataclass(frozen=True)
class TreeDrafter(Drafter):
  """`branching[d]`: children per node at depth d; its length is the loop's k (the tree's
  depth)."""
  branching: tuple[int, ...] = (2, 2, 1, 1)

  needs_model = True
  ragged = False

  def __post_init__(self):
    object.__setattr__(self, 'branching', tuple(int(b) for b in self.branching))
    TokenTree.full(self.branching)  # Checks the factors.

  def tree(self, k: int) -> TokenTree:
    return tree_of(self.branching, k)

  def check(self, target: Model, draft) -> None:
    check_full_caches(draft)
    check_children_fit(self.branching, target)

  def draft_steps(self, k: int, proposed_per_loop: float) -> float:
    del proposed_per_loop
    return float(k)

  def draft_calls(self, k: int) -> tuple[int, ...]:
    return level_calls(self.tree(k))

  def init(self, loop, draft: Model, prompts_BxP, prompt_lengths_B, capacity,
           features_BxPxD=None) -> KVCache:
    del features_BxPxD
    return _prefill(loop, draft, prompts_BxP, prompt_lengths_B, capacity)

  def propose(self, loop, draft: Model, cache: KVCache, committed: Committed, keys_BxK):
    tree = self.tree(loop.k)
    levels = tree.levels
    base_B = committed.lengths_B - 1
    logits_BxLxV, cache = _root_logits(draft, cache, committed)
    state = {'cache': cache}

    def read(first_child, tokens_BxC):  # The draft reads the new level on the tree.
      logits_BxCxV, state['cache'] = extend(
          draft.config, draft.params, state['cache'].with_lengths(base_B), tokens_BxC,
          counts_B=committed.counts(tokens_BxC.shape[1]), tree=tree, first_node=first_child)
      return logits_BxCxV

    proposal = draft_tree(loop, self.branching, committed, keys_BxK, logits_BxLxV, read)
    return proposal, state['cache'].with_lengths(base_B + levels[-1][0])

  def rollback(self, loop, cache: KVCache, verdict: Verdict) -> KVCache:
    # The path to the slots of its positions; the draft read its nodes but a deepest one.
    cache = kv_cache.keep_path(cache, verdict.base_B, verdict.path_BxD)
    accepted_B = jnp.sum(verdict.path_BxD[:, 1:] >= 0, axis=1)
    read_B = verdict.base_B + 1 + jnp.minimum(accepted_B, loop.k - 1)
    # An idle row's c_b - 2: its two-token call may have written nothing (a packed draft skips it).
    lengths_B = jnp.where(verdict.target_lengths_B > verdict.base_B,
                          jnp.minimum(verdict.target_lengths_B, read_B), verdict.base_B - 1)
    return kv_cache.constrain(cache.with_lengths(lengths_B), loop.mesh, loop.rules)


@flax.struct.dataclass
class _DynamicState:
  cache: KVCache
  # Each scored node's node in the draft's own tree (`dynamic_trees.Grown.expanded_BxNp1`).
  expanded_BxNp1: jax.Array


@dataclasses.dataclass(frozen=True)
class DynamicTreeDrafter(Drafter):
  """The draft model growing each row's own tree (`dynamic_trees`: `nodes` N scored, k its depth
  bound, `width` w candidates per expanded node and expanded nodes per level; under a greedy
  draft its top tokens as point masses, else drawn: `dynamic_trees.children_for`, each node's
  law read after its path). Per loop: the two-token call gives the root's law (as
  `TreeDrafter`), then each level's w expanded nodes are read in one call on the draft's own tree
  (`dynamic_trees.expansion_tree`), its node n at slot base + n (base = c_b - 1). Its capacity
  has (k - 1) w more slots for them. After the accept step the accepted path's nodes the draft
  read (all but the last, which may not have been) move to the slots of their positions: the
  cache holds the first c_b - 2 tokens, `TreeDrafter`'s invariant."""
  nodes: int = 8
  width: int = 4

  needs_model = True
  ragged = False

  def __post_init__(self):
    dynamic_trees.check_sizes(self.nodes, self.width)

  def tree(self, k: int) -> TokenTree:
    dynamic_trees.check_sizes(self.nodes, self.width, k)
    return dynamic_trees.envelope(self.nodes, k)

  def check(self, target: Model, draft) -> None:
    check_full_caches(draft)
    check_children_fit((self.width,), target)

  def draft_steps(self, k: int, proposed_per_loop: float) -> float:
    del proposed_per_loop
    return float(k)

  def draft_calls(self, k: int) -> tuple[int, ...]:
    return (1,) + (self.width,) * (k - 1)

  def init(self, loop, draft: Model, prompts_BxP, prompt_lengths_B, capacity,
           features_BxPxD=None) -> _DynamicState:
    del features_BxPxD
    cache = _prefill(loop, draft, prompts_BxP, prompt_lengths_B,
                     capacity + (loop.k - 1) * self.width)
    B = prompts_BxP.shape[0]
    return _DynamicState(cache, jnp.zeros((B, self.nodes + 1), jnp.int32))

  def propose(self, loop, draft: Model, state: _DynamicState, committed: Committed, keys_BxK):
    w = self.width
    base_B = committed.lengths_B - 1
    logits_Bx1xV, cache = _root_logits(draft, state.cache, committed)
    carry = {'cache': cache}

    def read(d, tokens_BxW, parents_BxW, tree):
      del parents_BxW  # The tree holds them.
      logits_BxWxV, carry['cache'] = extend(
          draft.config, draft.params, carry['cache'].with_lengths(base_B), tokens_BxW,
          counts_B=committed.counts(w), tree=tree, first_node=1 + (d - 1) * w)
      return logits_BxWxV

    grown = dynamic_trees.grow(self.nodes, w, loop.k, logits_Bx1xV[:, 0], read,
                               dynamic_trees.children_for(loop, keys_BxK, w, committed))
    cache = kv_cache.constrain(carry['cache'].with_lengths(base_B), loop.mesh, loop.rules)
    return (dynamic_trees.proposal(grown, committed.vocab_size, loop.k),
            _DynamicState(cache, grown.expanded_BxNp1))

  def rollback(self, loop, state: _DynamicState, verdict: Verdict) -> _DynamicState:
    # The accepted path but its last node, in the draft's own tree's node ids.
    path_BxD = verdict.path_BxD
    accepted_B = jnp.sum(path_BxD[:, 1:] >= 0, axis=1)
    depth_D = jnp.arange(path_BxD.shape[1], dtype=jnp.int32)
    read_BxD = jnp.take_along_axis(state.expanded_BxNp1, jnp.maximum(path_BxD, 0), axis=1)
    keep_BxD = jnp.where(depth_D[None] < accepted_B[:, None], read_BxD, depth_D[None])
    cache = kv_cache.keep_path(state.cache, verdict.base_B, keep_BxD)
    lengths_B = verdict.target_lengths_B - 1  # c_b' - 2 (an idle row: c_b - 2).
    return state.replace(cache=kv_cache.constrain(cache.with_lengths(lengths_B), loop.mesh,
                                                  loop.rules))
