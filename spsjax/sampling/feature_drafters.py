"""Drafters that read the target's hidden states: an EAGLE head, a Falcon head, parallel
(Medusa/MTP) heads and an MLP speculator.

Both draft from `models.feature_head` heads, which share the target's embedding and output layer
(`Drafter.bind` hands them the target inside the program). The target's features reach them from
its own forwards, no second pass: the prompt's from the prefill (`Drafter.init`), and each loop's
scored positions from the scoring forward (`drafters.Verdict.features_BxKp1xD`).

Exactness holds as for any drafter: a proposal is a function of the committed tokens (the
target's features are a function of them) and of the loop's draft keys, and q is the law each
draft was drawn from after the draft's sampling processors. The context rules among them (the
n-gram ban, sequence biases, bans by position: `ngrams`) and a repetition penalty read the
committed tokens and the drafts before each slot (a tree node's path), as for a model drafter;
the parallel heads' one pass gives every slot's logits, and the slots are then drawn in order.

With `alternatives` = m > 0 either drafter proposes a tree (`models.TokenTree.
chain_with_alternatives`): beside each slot's draft, m other tokens from the same law without
replacement (`siblings.draw`), as leaves the target scores in the same call (Medusa's candidates
beside each head's first; EAGLE's head drafting the chain). The head runs the chain only; the
target's features then come from the accepted path's nodes.

With c_b committed tokens in row b, the target has features for positions 0 .. c_b - 2 (the last
committed token is scored next loop). Each drafter's state keeps the features of the newest m_b
of them that it has not yet read, m_b >= 1: the prompt's last at the start, the emitted block's
(accepted drafts' positions and the one before) after each loop; a Falcon drafter keeps at least
the newest m (its block), read or not.
"""

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from spsjax.models import KVCache, Model, TokenTree, feature_head, init_cache, kv_cache
from spsjax.sampling import dynamic_trees, ngrams, siblings, tree_drafters
from spsjax.sampling.drafters import (Committed, Drafter, Proposal, Verdict, alternatives_tree,
                                      chain_with_alternatives, check_alternatives,
                                      check_alternatives_fit, draw_draft)
from spsjax.sampling.processors import mark_present, uniforms


@flax.struct.dataclass
class HeadAndTarget:
  """What a feature drafter's methods receive as `draft` (`Drafter.bind`)."""
  head: Model
  target: Model


@flax.struct.dataclass
class Pending:
  """The target's features a drafter has not read yet: those of positions c_b - 1 - m_b ..
  c_b - 2 (module docstring), left-aligned, the rest unspecified."""
  features_BxMxD: jax.Array
  num_B: jax.Array  # int32 m_b in [1, M].

  @classmethod
  def of_prompts(cls, features_BxPxD, prompt_lengths_B, width: int, keep: int = 1
                 ) -> 'Pending':
    """The prompt's last position's (its last `keep`, as many as it has), in a buffer of
    `width` >= keep."""
    num_B = jnp.minimum(prompt_lengths_B, keep).astype(jnp.int32)
    at_BxM = jnp.clip((prompt_lengths_B - num_B)[:, None] + jnp.arange(width)[None], 0,
                      features_BxPxD.shape[1] - 1)
    return cls(jnp.take_along_axis(features_BxPxD, at_BxM[:, :, None], axis=1), num_B)

  def after(self, verdict: Verdict, keep: int = 1) -> 'Pending':
    """After a loop: the emitted block's features, base .. target_lengths - 1, with the newest
    ones before it where fewer than `keep` were emitted (as many as there are); rows that emitted
    nothing (idle) keep theirs."""
    emitted_B = verdict.target_lengths_B - verdict.base_B
    fresh_B = emitted_B > 0
    if keep == 1:
      return Pending(jnp.where(fresh_B[:, None, None], verdict.features_BxKp1xD,
                               self.features_BxMxD),
                     jnp.where(fresh_B, emitted_B, self.num_B).astype(jnp.int32))
    M, Kp1 = self.features_BxMxD.shape[1], verdict.features_BxKp1xD.shape[1]
    total_B = self.num_B + emitted_B
    num_B = jnp.minimum(jnp.maximum(emitted_B, keep), total_B)
    # Slot j holds the (total - num + j)-th of the kept ones followed by the emitted ones.
    v_BxM = (total_B - num_B)[:, None] + jnp.arange(M)[None]
    old_BxMxD = jnp.take_along_axis(self.features_BxMxD, jnp.clip(v_BxM, 0, M - 1)[:, :, None],
                                    axis=1)
    new_BxMxD = jnp.take_along_axis(verdict.features_BxKp1xD, jnp.clip(
        v_BxM - self.num_B[:, None], 0, Kp1 - 1)[:, :, None], axis=1)
    merged_BxMxD = jnp.where((v_BxM < self.num_B[:, None])[:, :, None], old_BxMxD, new_BxMxD)
    return Pending(jnp.where(fresh_B[:, None, None], merged_BxMxD, self.features_BxMxD),
                   jnp.where(fresh_B, num_B, self.num_B).astype(jnp.int32))

  def newest(self) -> jax.Array:
    """[B, D]: the features of position c_b - 2."""
    return jnp.take_along_axis(self.features_BxMxD, (self.num_B - 1)[:, None, None],
                               axis=1)[:, 0]


def _sampler(loop, keys_BxK, alternatives: int, committed: Committed):
  """(slot i, logits [B, V], the drafts so far [B, k]) -> (q [B, V], draft [B], the slot's
  `alternatives` siblings or None) with slot i's key, as a draft model: the logits shifted by
  the draft sampling's context rules after the committed tokens and drafts[:, :i] (`ngrams`), a
  repetition penalty on those tokens."""
  uniforms_BxK = uniforms(keys_BxK)
  sibling_keys_BxK = siblings.keys_apart(keys_BxK) if alternatives else None
  history = committed.history(loop.draft_sampling)

  def choose(i, logits_BxV, drafts_BxK):
    if history is not None:
      logits_BxV = ngrams.shift(logits_BxV, history.at(drafts_BxK, i))
    present_BxV = None
    if committed.present_BxV is not None:  # The committed tokens and the slots before i.
      present_BxV = mark_present(committed.present_BxV, drafts_BxK,
                                 jnp.full(drafts_BxK.shape[:1], i, jnp.int32))
    q_BxV, d_B = draw_draft(loop, uniforms_BxK[:, i], logits_BxV, present_BxV)
    if not alternatives:
      return q_BxV, d_B, None
    return q_BxV, d_B, siblings.draw(sibling_keys_BxK[:, i], logits_BxV, q_BxV, d_B,
                                     alternatives, greedy=loop.draft_sampling.greedy)

  return choose


def _proposal(tokens_BxK, q_BxKxV, alternatives: siblings.Siblings | None) -> Proposal:
  """Every slot proposed: the chain, or with per-slot alternatives the tree."""
  num_B = jnp.full(tokens_BxK.shape[:1], tokens_BxK.shape[1], jnp.int32)
  if alternatives is None:
    return Proposal(tokens_BxK, q_BxKxV, num_B)
  return chain_with_alternatives(tokens_BxK, q_BxKxV, num_B, alternatives)


@dataclasses.dataclass(frozen=True)
class _FeatureDrafterBase(Drafter):
  """What the feature drafters share: the target bound in, the head checked against it, the
  alternatives beside each draft (module docstring)."""
  alternatives: int = 0

  kind = ''  # The `feature_head` kind the drafter needs.
  needs_model = True
  ragged = False

  def __post_init__(self):
    check_alternatives(self.alternatives)

  def tree(self, k: int) -> TokenTree | None:
    return alternatives_tree(k, self.alternatives)

  @property
  def reads_features(self) -> bool:
    return True

  def check(self, target: Model, draft) -> None:
    if not isinstance(draft, Model):
      got = type(draft).__name__
    elif not feature_head.is_head(draft):
      got = 'a transformer'
    else:
      got = f'a {feature_head.kind(draft)!r} head'
    if got != f'a {self.kind!r} head':
      raise ValueError(f'{type(self).__name__} drafts with a {self.kind!r} head '
                       f'(`models.feature_head`); got {got}.')
    feature_head.check_pair(target, draft)
    check_alternatives_fit(self.alternatives, target)

  def bind(self, target: Model, draft: Model) -> HeadAndTarget:
    return HeadAndTarget(head=draft, target=target)


def _read_pending(draft: HeadAndTarget, state: '_HeadState', committed: Committed,
                  block: int = 1):
  """A head's first call of a loop: it reads the pending pairs of true features (over what it
  had fed itself there): (the first `block` drafts' logits [B, block, V], the features it
  predicts at the last `block` pairs [B, block, D], its cache through the pairs of positions ..
  c - 2). An EAGLE head's block is its last pair; a Falcon head's (`block` > 1) are the last
  `block`, each seeing up to the last (with fewer pending, the first repeated)."""
  pending = state.pending
  m_B, M = pending.num_B, pending.features_BxMxD.shape[1]
  # The committed tokens after the pending features' positions: c - m .. c - 1.
  tokens_BxM = jnp.stack([committed.last(jnp.maximum(m_B - j, 1)) for j in range(M)], axis=1)
  first_B = committed.lengths_B - 1 - m_B
  cache = state.cache.with_lengths(first_B)
  counts_B = m_B if committed.active_B is None else jnp.where(committed.active_B, m_B, 0)
  at_BxL = jnp.maximum((m_B - block)[:, None] + jnp.arange(block)[None], 0)
  sees_BxM = None
  if block > 1:  # The block sees up to its last pair's position, c - 2; the others their own.
    t_BxM = jnp.arange(M)[None]
    sees_BxM = jnp.where(t_BxM >= (m_B - block)[:, None], (committed.lengths_B - 2)[:, None],
                         first_B[:, None] + t_BxM)
  logits_BxLxV, predicted_BxMxD, cache = feature_head.extend_head(
      draft.head, draft.target, cache, pending.features_BxMxD, tokens_BxM,
      logits_at_BxL=at_BxL, counts_B=counts_B, sees_BxT=sees_BxM)
  features_BxLxD = jnp.take_along_axis(predicted_BxMxD, at_BxL[:, :, None], axis=1)
  return logits_BxLxV, features_BxLxD, cache.with_lengths(committed.lengths_B - 1)


@flax.struct.dataclass
class _HeadState:
  cache: KVCache  # The head's, valid through position c_b - 2 - m_b (pairs with true features).
  pending: Pending


def _head_state(loop, draft: HeadAndTarget, prompts_BxP, prompt_lengths_B, capacity,
                features_BxPxD, keep: int = 1) -> _HeadState:
  """A head's cache through the prompt's pairs 0 .. L - 2 (its features, each with the prompt
  token after it) and the pending features of its last `keep` positions (`Pending.of_prompts`)."""
  B, P = prompts_BxP.shape
  cache = init_cache(draft.head.config, B, capacity)
  if P > 1:
    _, _, cache = feature_head.extend_head(
        draft.head, draft.target, cache, features_BxPxD[:, :-1], prompts_BxP[:, 1:],
        logits_at_BxL=jnp.zeros((B, 1), jnp.int32), counts_B=prompt_lengths_B - 1)
  cache = kv_cache.constrain(cache.with_lengths(prompt_lengths_B - 1), loop.mesh, loop.rules)
  return _HeadState(cache, Pending.of_prompts(features_BxPxD, prompt_lengths_B,
                                              max(loop.k + 1, keep), keep))


@dataclasses.dataclass(frozen=True)
class FeatureDrafter(_FeatureDrafterBase):
  """EAGLE: a head that drafts on its own predicted features (`feature_head.FeatureHead`).

  Each loop's first head call reads the m_b pairs of true features the last loop's scoring gave
  (positions c_b - 1 - m_b .. c_b - 2, each with the committed token after it), over the pairs it
  had fed its own predictions at those positions, and draws the first draft from its prediction
  at the last; each of the k - 1 further calls reads one pair (its last prediction, the draft
  drawn from it). Head cache invariant: before drafting it holds the pairs of positions
  0 .. c_b - 2 - m_b, all with the target's features.
  """
  kind = 'feature'

  def draft_steps(self, k: int, proposed_per_loop: float) -> float:
    del proposed_per_loop
    return float(k)

  def init(self, loop, draft: HeadAndTarget, prompts_BxP, prompt_lengths_B, capacity,
           features_BxPxD=None) -> _HeadState:
    return _head_state(loop, draft, prompts_BxP, prompt_lengths_B, capacity, features_BxPxD)

  def propose(self, loop, draft: HeadAndTarget, state: _HeadState, committed: Committed,
              keys_BxK):
    k, B = loop.k, keys_BxK.shape[0]
    choose = _sampler(loop, keys_BxK, self.alternatives, committed)
    logits_Bx1xV, features_Bx1xD, cache = _read_pending(draft, state, committed)
    features_BxD = features_Bx1xD[:, 0]
    tokens_BxK = jnp.zeros((B, k), jnp.int32)
    q_BxV, d_B, alternatives = choose(0, logits_Bx1xV[:, 0], tokens_BxK)
    tokens_BxK = tokens_BxK.at[:, 0].set(d_B)
    q_BxKxV = jnp.zeros((B, k) + q_BxV.shape[1:], jnp.float32).at[:, 0].set(q_BxV)
    if alternatives is not None:
      alternatives = siblings.first_of_slots(alternatives, k)
    step_counts_B = committed.counts(1)

    def step(i, carry):
      tokens_BxK, q_BxKxV, alternatives, features_BxD, cache = carry
      logits_Bx1xV, predicted_Bx1xD, cache = feature_head.extend_head(
          draft.head, draft.target, cache, features_BxD[:, None], tokens_BxK[:, i - 1, None],
          counts_B=step_counts_B)
      q_BxV, d_B, more = choose(i, logits_Bx1xV[:, 0], tokens_BxK)
      if more is not None:
        alternatives = siblings.set_slot(alternatives, i, more)
      return (tokens_BxK.at[:, i].set(d_B), q_BxKxV.at[:, i].set(q_BxV), alternatives,
              predicted_Bx1xD[:, 0], cache)

    tokens_BxK, q_BxKxV, alternatives, _, cache = jax.lax.fori_loop(
        1, k, step, (tokens_BxK, q_BxKxV, alternatives, features_BxD, cache),
        unroll=loop.drafts_unrolled)
    cache = kv_cache.constrain(cache, loop.mesh, loop.rules)
    return _proposal(tokens_BxK, q_BxKxV, alternatives), state.replace(cache=cache)

  def rollback(self, loop, state: _HeadState, verdict: Verdict) -> _HeadState:
    del loop  # The next `propose` sets the cache's lengths from the committed tokens.
    return state.replace(pending=state.pending.after(verdict))


class _Branched:
  """What a feature drafter drafting a full tree adds (a mixin before the drafter it extends,
  whose dataclass declares `branching`): the tree (`models.TokenTree.full(branching)`, k its
  depth) and its checks."""

  def __post_init__(self):
    super().__post_init__()
    if self.alternatives:
      raise ValueError('A tree drafter takes branching factors, not alternatives.')
    object.__setattr__(self, 'branching', tuple(int(b) for b in self.branching))
    TokenTree.full(self.branching)  # Checks the factors.

  def tree(self, k: int) -> TokenTree:
    return tree_drafters.tree_of(self.branching, k)

  def check(self, target: Model, draft) -> None:
    super().check(target, draft)
    tree_drafters.check_children_fit(self.branching, target)


@dataclasses.dataclass(frozen=True)
class FeatureTreeDrafter(_Branched, FeatureDrafter):
  """EAGLE drafting a full tree (`models.TokenTree.full(branching)`, k its depth), level by
  level (`tree_drafters.draft_tree`): after the first call (`FeatureDrafter`'s), each level's
  nodes are read in one head call on the tree, node n's pair (its parent's predicted features,
  its token) at slot c - 2 + n and position c - 2 + depth(n) (the root's pair, the last true
  one, at c - 2), seeing its ancestors' pairs; its predicted features give its children's law.
  The head's cache invariant is `FeatureDrafter`'s: the next loop rewrites every pair from
  position c - 1 on (the tree's slots hold nothing it reads)."""
  branching: tuple[int, ...] = (2, 2, 1, 1)

  def draft_calls(self, k: int) -> tuple[int, ...]:
    return tree_drafters.level_calls(self.tree(k))

  def propose(self, loop, draft: HeadAndTarget, state: _HeadState, committed: Committed,
              keys_BxK):
    tree = self.tree(loop.k)
    logits_Bx1xV, features_Bx1xD, cache = _read_pending(draft, state, committed)
    features_BxD = features_Bx1xD[:, 0]
    root_B = committed.lengths_B - 2  # The root's pair: the last committed token's.
    carry = {'cache': cache, 'features_BxLxD': features_BxD[:, None]}

    def read(first_child, tokens_BxC):  # Each node after its parent's predicted features.
      b = tokens_BxC.shape[1] // carry['features_BxLxD'].shape[1]
      logits_BxCxV, predicted_BxCxD, carry['cache'] = feature_head.extend_head(
          draft.head, draft.target, carry['cache'].with_lengths(root_B),
          jnp.repeat(carry['features_BxLxD'], b, axis=1), tokens_BxC,
          counts_B=committed.counts(tokens_BxC.shape[1]), tree=tree, first_node=first_child)
      carry['features_BxLxD'] = predicted_BxCxD
      return logits_BxCxV

    proposal = tree_drafters.draft_tree(loop, self.branching, committed, keys_BxK, logits_Bx1xV,
                                        read)
    cache = kv_cache.constrain(carry['cache'].with_lengths(committed.lengths_B - 1), loop.mesh,
                               loop.rules)
    return proposal, state.replace(cache=cache)


@dataclasses.dataclass(frozen=True)
class FeatureDynamicDrafter(FeatureDrafter):
  """EAGLE-2: an EAGLE head growing each row's own tree (`dynamic_trees`: `nodes` N scored, k
  its depth bound, `width` w candidates per expanded node and expanded nodes per level). After
  the first call (`FeatureDrafter`'s), each level's w expanded nodes are read in one head call on
  the drafter's own tree (`dynamic_trees.expansion_tree`), node n's pair (its parent's predicted
  features, its token) at slot c - 2 + n and position c - 2 + depth(n), seeing its ancestors'
  pairs; the head's capacity has (k - 1) w more slots for them. Under a greedy draft the children
  are the head's top tokens as point masses, else drawn from its law
  (`dynamic_trees.children_for`). The head's cache invariant is `FeatureDrafter`'s."""
  nodes: int = 8
  width: int = 4

  def __post_init__(self):
    super().__post_init__()
    if self.alternatives:
      raise ValueError('A dynamic tree takes nodes and width, not alternatives.')
    dynamic_trees.check_sizes(self.nodes, self.width)

  def tree(self, k: int) -> TokenTree:
    dynamic_trees.check_sizes(self.nodes, self.width, k)
    return dynamic_trees.envelope(self.nodes, k)

  def check(self, target: Model, draft) -> None:
    super().check(target, draft)
    tree_drafters.check_children_fit((self.width,), target)

  def draft_calls(self, k: int) -> tuple[int, ...]:
    return (1,) + (self.width,) * (k - 1)

  def init(self, loop, draft: HeadAndTarget, prompts_BxP, prompt_lengths_B, capacity,
           features_BxPxD=None) -> _HeadState:
    return super().init(loop, draft, prompts_BxP, prompt_lengths_B,
                        capacity + (loop.k - 1) * self.width, features_BxPxD)

  def propose(self, loop, draft: HeadAndTarget, state: _HeadState, committed: Committed,
              keys_BxK):
    logits_Bx1xV, features_Bx1xD, cache = _read_pending(draft, state, committed)
    features_BxD = features_Bx1xD[:, 0]
    root_B = committed.lengths_B - 2  # The root's pair: the last committed token's.
    w = self.width
    carry = {'cache': cache, 'features_BxLxD': jnp.repeat(features_BxD[:, None], w, axis=1)}

    def read(d, tokens_BxW, parents_BxW, tree):  # Each node after its parent's features.
      parent_features_BxWxD = jnp.take_along_axis(carry['features_BxLxD'],
                                                  parents_BxW[:, :, None], axis=1)
      logits_BxWxV, carry['features_BxLxD'], carry['cache'] = feature_head.extend_head(
          draft.head, draft.target, carry['cache'].with_lengths(root_B), parent_features_BxWxD,
          tokens_BxW, counts_B=committed.counts(w), tree=tree, first_node=1 + (d - 1) * w)
      return logits_BxWxV

    grown = dynamic_trees.grow(self.nodes, w, loop.k, logits_Bx1xV[:, 0], read,
                               dynamic_trees.children_for(loop, keys_BxK, w, committed))
    proposal = dynamic_trees.proposal(grown, committed.vocab_size, loop.k)
    cache = kv_cache.constrain(carry['cache'].with_lengths(committed.lengths_B - 1), loop.mesh,
                               loop.rules)
    return proposal, state.replace(cache=cache)


@dataclasses.dataclass(frozen=True)
class FalconDrafter(_FeatureDrafterBase):
  """Falcon (Gao et al. 2024): a head drafting m = `per_pass` tokens a pass (a `feature_head`
  Falcon head of `drafts_per_pass` m), a chain of k in ceil(k / m) head calls.

  Each loop's first call reads the pending pairs of true features as EAGLE's does (at least the
  newest m: `Pending.after`'s `keep`), its last m pairs a block that sees up to position c - 2:
  their predictions give the first m drafts' laws. Each further call reads one block: the m
  features the call before predicted, each with the draft drawn from its law, at positions
  c - 1 + .., every pair seeing up to the block's last; its predictions give the next m laws.
  The m drafts of a pass are drawn in slot order (a context rule reads the drafts before each
  slot) from laws that do not read each other's draws: q is the law each was drawn from, and
  speculative sampling stays exact. The head's cache invariant is `FeatureDrafter`'s. A chain:
  no alternatives, no tree.
  """
  per_pass: int = 2

  kind = 'falcon'

  def __post_init__(self):
    super().__post_init__()
    if self.alternatives:
      raise ValueError('A Falcon drafter drafts a chain: it takes no alternatives.')
    if self.per_pass < 2:
      raise ValueError(f'A Falcon drafter drafts per_pass >= 2 tokens a pass (1 is EAGLE\'s '
                       f'drafter feature); got {self.per_pass}.')

  def passes(self, k: int) -> int:
    return -(-k // self.per_pass)

  def draft_steps(self, k: int, proposed_per_loop: float) -> float:
    del proposed_per_loop
    return float(self.passes(k))

  def draft_calls(self, k: int) -> tuple[int, ...]:
    return (self.per_pass,) * self.passes(k)

  def check(self, target: Model, draft) -> None:
    super().check(target, draft)
    if draft.config.drafts_per_pass != self.per_pass:
      raise ValueError(f'The Falcon head drafts {draft.config.drafts_per_pass} tokens a pass; '
                       f'the drafter was built for per_pass={self.per_pass}.')

  def init(self, loop, draft: HeadAndTarget, prompts_BxP, prompt_lengths_B, capacity,
           features_BxPxD=None) -> _HeadState:
    m = self.per_pass  # A first call of max(k + 1, m) pairs: m - k - 1 more slots where m > k + 1.
    return _head_state(loop, draft, prompts_BxP, prompt_lengths_B,
                       capacity + max(0, m - loop.k - 1), features_BxPxD, keep=m)

  def propose(self, loop, draft: HeadAndTarget, state: _HeadState, committed: Committed,
              keys_BxK):
    k, m, B = loop.k, self.per_pass, keys_BxK.shape[0]
    choose = _sampler(loop, keys_BxK, 0, committed)
    logits_BxMxV, features_BxMxD, cache = _read_pending(draft, state, committed, m)
    tokens_BxK = jnp.zeros((B, k), jnp.int32)
    qs = []
    for p in range(self.passes(k)):
      if p:  # Block p: the pairs at c - 1 + (p - 1) m .., each seeing up to the block's last.
        sees_BxM = jnp.broadcast_to((committed.lengths_B - 2 + p * m)[:, None], (B, m))
        logits_BxMxV, features_BxMxD, cache = feature_head.extend_head(
            draft.head, draft.target, cache, features_BxMxD, tokens_BxK[:, (p - 1) * m:p * m],
            counts_B=committed.counts(m), sees_BxT=sees_BxM)
      for j in range(min(m, k - p * m)):
        q_BxV, d_B, _ = choose(p * m + j, logits_BxMxV[:, j], tokens_BxK)
        tokens_BxK = tokens_BxK.at[:, p * m + j].set(d_B)
        qs.append(q_BxV)
    cache = kv_cache.constrain(cache.with_lengths(committed.lengths_B - 1), loop.mesh,
                               loop.rules)
    return _proposal(tokens_BxK, jnp.stack(qs, axis=1), None), state.replace(cache=cache)

  def rollback(self, loop, state: _HeadState, verdict: Verdict) -> _HeadState:
    del loop
    return state.replace(pending=state.pending.after(verdict, keep=self.per_pass))


@dataclasses.dataclass(frozen=True)
class HeadsDrafter(_FeatureDrafterBase):
  """Medusa / MTP: k parallel heads over the newest features and the last committed token
  (`feature_head.ParallelHeads`), all k drafts from one pass; draft i is drawn from head i's law
  with slot i's key. Needs a head model with at least k heads."""
  kind = 'heads'

  def draft_steps(self, k: int, proposed_per_loop: float) -> float:
    del k, proposed_per_loop
    return 1.0

  def init(self, loop, draft: HeadAndTarget, prompts_BxP, prompt_lengths_B, capacity,
           features_BxPxD=None) -> Pending:
    del prompts_BxP, capacity
    if loop.k > draft.head.config.num_layers:
      raise ValueError(f'k = {loop.k} drafts need k heads (an MLP speculator\'s stages); the '
                       f'head model has {draft.head.config.num_layers}.')
    return Pending.of_prompts(features_BxPxD, prompt_lengths_B, loop.k + 1)

  def propose(self, loop, draft: HeadAndTarget, pending: Pending, committed: Committed,
              keys_BxK):
    k = loop.k
    choose = _sampler(loop, keys_BxK, self.alternatives, committed)
    logits_BxKxV, _ = feature_head.parallel_heads(draft.head, draft.target, pending.newest(),
                                                  committed.last(1), num=k)
    tokens_BxK, drawn = jnp.zeros(logits_BxKxV.shape[:2], jnp.int32), []
    for i in range(k):  # In slot order: a context rule reads the drafts before each slot.
      drawn.append(choose(i, logits_BxKxV[:, i], tokens_BxK))
      tokens_BxK = tokens_BxK.at[:, i].set(drawn[-1][1])
    q_BxKxV = jnp.stack([q for q, _, _ in drawn], axis=1)
    alternatives = siblings.stack_slots([a for _, _, a in drawn]) if self.alternatives else None
    return _proposal(tokens_BxK, q_BxKxV, alternatives), pending

  def rollback(self, loop, pending: Pending, verdict: Verdict) -> Pending:
    del loop
    return pending.after(verdict)


@dataclasses.dataclass(frozen=True)
class MlpDrafter(HeadsDrafter):
  """IBM's MLP speculator (`feature_head.MlpSpeculator`): from the newest features and the last
  committed token, stage i draws slot i from its law after reading slot i - 1's draft, a chain
  in k small steps, no cache (the pending features as the parallel heads keep them). Needs at
  least k stages."""
  kind = 'mlp'

  def draft_steps(self, k: int, proposed_per_loop: float) -> float:
    del proposed_per_loop
    return float(k)  # A stage each.

  def propose(self, loop, draft: HeadAndTarget, pending: Pending, committed: Committed,
              keys_BxK):
    choose = _sampler(loop, keys_BxK, self.alternatives, committed)
    state_BxD = feature_head.speculator_state(draft.head, pending.newest())
    token_B = committed.last(1)
    tokens_BxK, drawn = jnp.zeros((token_B.shape[0], loop.k), jnp.int32), []
    for i in range(loop.k):
      logits_BxV, state_BxD = feature_head.speculator_stage(draft.head, draft.target, i,
                                                            state_BxD, token_B)
      drawn.append(choose(i, logits_BxV, tokens_BxK))
      token_B = drawn[-1][1]
      tokens_BxK = tokens_BxK.at[:, i].set(token_B)
    q_BxKxV = jnp.stack([q for q, _, _ in drawn], axis=1)
    alternatives = siblings.stack_slots([a for _, _, a in drawn]) if self.alternatives else None
    return _proposal(tokens_BxK, q_BxKxV, alternatives), pending


@dataclasses.dataclass(frozen=True)
class MlpTreeDrafter(_Branched, MlpDrafter):
  """IBM's MLP speculator drafting a full tree (`models.TokenTree.full(branching)`, k its depth,
  at most its stages; `tree_drafters.draft_tree`): the root's children from stage 0 after the
  last committed token, then each level's nodes through stage d at once, node n reading its
  parent's state and its own token, its next state its children's. Under a greedy draft each
  node's children are its top tokens. No cache: a level's call is a stage on its C nodes."""
  branching: tuple[int, ...] = (2, 2, 1, 1)

  def draft_calls(self, k: int) -> tuple[int, ...]:
    return tree_drafters.level_calls(self.tree(k))

  def propose(self, loop, draft: HeadAndTarget, pending: Pending, committed: Committed,
              keys_BxK):
    state_BxD = feature_head.speculator_state(draft.head, pending.newest())
    logits_BxV, state_BxD = feature_head.speculator_stage(draft.head, draft.target, 0, state_BxD,
                                                          committed.last(1))
    carry = {'stage': 0, 'states_BxLxD': state_BxD[:, None]}

    def read(first_child, tokens_BxC):  # Stage d on the level's nodes, after their parents'.
      del first_child
      carry['stage'] += 1
      B, C = tokens_BxC.shape
      parents_BxLxD = carry['states_BxLxD']
      D = parents_BxLxD.shape[2]
      states_BCxD = jnp.repeat(parents_BxLxD, C // parents_BxLxD.shape[1], axis=1).reshape(B * C, D)
      logits_BCxV, next_BCxD = feature_head.speculator_stage(
          draft.head, draft.target, carry['stage'], states_BCxD, tokens_BxC.reshape(B * C))
      carry['states_BxLxD'] = next_BCxD.reshape(B, C, D)
      return logits_BCxV.reshape(B, C, -1)

    return tree_drafters.draft_tree(loop, self.branching, committed, keys_BxK,
                                    logits_BxV[:, None], read), pending


@dataclasses.dataclass(frozen=True)
class HeadsTreeDrafter(_Branched, HeadsDrafter):
  """Medusa's tree: parallel heads drafting a full tree (`models.TokenTree.full(branching)`, k
  its depth) from their one pass, every node at depth d drawing its children from head d's law
  (`tree_drafters.draft_tree`); under a greedy draft each node's children are head d's top
  tokens, the Cartesian tree of the heads' candidates."""
  branching: tuple[int, ...] = (2, 2, 1, 1)

  def propose(self, loop, draft: HeadAndTarget, pending: Pending, committed: Committed,
              keys_BxK):
    logits_BxKxV, _ = feature_head.parallel_heads(draft.head, draft.target, pending.newest(),
                                                  committed.last(1), num=loop.k)
    depth = [0]

    def read(first_child, tokens_BxC):  # The new level's children: the next head's law.
      del first_child
      depth[0] += 1
      B, C = tokens_BxC.shape
      return jnp.broadcast_to(logits_BxKxV[:, depth[0], None], (B, C, logits_BxKxV.shape[2]))

    return tree_drafters.draft_tree(loop, self.branching, committed, keys_BxK,
                                    logits_BxKxV[:, :1], read), pending
