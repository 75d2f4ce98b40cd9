"""What proposes the draft tokens of the SpS loop: the interface (`Drafter`) and the drafters.

A drafter proposes, per row, up to k tokens and the law q each one was drawn from (`Proposal`),
inside the jitted loop, with fixed shapes: `tokens_BxK`, `q_BxKxV` and the ragged count `num_B` in
[0, k]. Slots at and past `num_B[b]` hold valid ids the target scores but the accept step never
looks at (`rejection.accept_and_resample`). A deterministic proposal (prompt lookup) has a point
mass for q: its token is accepted with probability p(d), and the residual is p without d.

Exactness needs only that each proposal is a function of the committed tokens and of randomness
independent of the accept step's; the number proposed may depend on the drafts drawn so far
(dynamic k): the output law stays the target's for every drafter here.

- `ModelDrafter`: a small transformer sampling one token after another (the paper's draft), with
  an optional confidence threshold that stops a row's drafting early (dynamic k, DSL/SpecDec++);
- `PromptLookup`: the tokens that followed the latest earlier occurrence of the row's last n
  committed tokens (n from `max_ngram` down to `min_ngram`; Saxena's prompt lookup decoding), no
  model call; the copy runs on into its own tokens, so a repeating row gets k drafts, not only
  the tokens left before its end;
- `Hybrid`: prompt lookup's tokens where it matches, the model's after them and where it does not
  (per row); the model reads every proposed token, so its cache stays as `ModelDrafter`'s.
"""

import abc
import dataclasses
import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from spsjax.models import KVCache, Model, RowTrees, TokenTree, extend, kv_cache, prefill
from spsjax.sampling import common, ngrams, siblings
from spsjax.sampling.processors import (SamplingConfig, mark_present, probabilities_and_sample_with,
                                        typed_keys, uniforms)


@flax.struct.dataclass
class Proposal:
  """A drafter's proposal for one loop (module docstring): per row a chain, slot i following slot
  i - 1 and slot 0 the last committed token; or, with `tree`, the tree's N nodes (slot i is node
  i + 1, after its parent: `models.TokenTree`), `valid_BxK` saying which were proposed and
  q_BxKxV each node's law given its earlier siblings (`rejection.accept_tree`); with `row_trees`
  instead, each row's own tree (`models.RowTrees`, a dynamic drafter's)."""
  tokens_BxK: jax.Array  # int32; slots >= num_B hold valid ids, never accepted.
  q_BxKxV: jax.Array  # float32: the law each token was drawn from (a point mass if deterministic).
  num_B: jax.Array  # int32 in [0, k]: tokens proposed for each row (a tree's: along its chain).
  valid_BxK: jax.Array | None = None  # bool, with a tree: the nodes proposed.
  tree: TokenTree | None = flax.struct.field(pytree_node=False, default=None)
  row_trees: RowTrees | None = None

  @property
  def drafted_tree(self) -> TokenTree | RowTrees | None:
    """The tree the drafts form, shared by the rows or each row's; None for a chain."""
    return self.tree if self.row_trees is None else self.row_trees


@flax.struct.dataclass
class Verdict:
  """What a loop's accept step tells the drafter (`Drafter.rollback`)."""
  base_B: jax.Array  # int32: each row's committed tokens before the loop, less one.
  # int32: the target cache's new lengths: base_B plus the tokens the row emitted (accepted
  # drafts and the token after them, up to an eos or max_new_tokens); base_B for an idle row.
  target_lengths_B: jax.Array
  # For a drafter that `reads_features` (else None): the target's hidden states at the scored
  # positions base_B .. base_B + k (the last committed token, then the drafts), from the scoring
  # forward (`models.extend_with_features`); valid up to target_lengths_B (the accepted ones).
  features_BxKp1xD: jax.Array | None = None
  # With a tree of drafts: the node accepted at each depth (the root first, -1 past the last;
  # `rejection.accept_tree`), for idle rows the root alone. None for a chain.
  path_BxD: jax.Array | None = None


@flax.struct.dataclass
class Committed:
  """The committed tokens of every row (prompt, then generated), as the loop holds them, the
  size of the target's vocabulary (the size of a proposal's laws) and which rows still generate
  (`active_B`, None: all): an idle row's proposal is never read, and a draft model skips its work
  (`models.extend`'s counts)."""
  prompts_BxP: jax.Array
  prompt_lengths_B: jax.Array
  tokens_BxW: jax.Array
  num_generated_B: jax.Array
  vocab_size: int = flax.struct.field(pytree_node=False)
  active_B: jax.Array | None = None
  # bool[B, V]: the committed tokens, with a repetition penalty (None without one).
  present_BxV: jax.Array | None = None

  def counts(self, positions: int) -> jax.Array | None:
    """`models.extend`'s counts for a call of `positions` tokens per row: 0 for idle rows."""
    return None if self.active_B is None else common.active_counts(self.active_B, positions)

  @property
  def lengths_B(self) -> jax.Array:
    return self.prompt_lengths_B + self.num_generated_B

  def last(self, back: int = 1) -> jax.Array:
    """The `back`-th last committed token of each row."""
    return common.last_token(self.prompts_BxP, self.prompt_lengths_B, self.tokens_BxW,
                             self.num_generated_B, back)

  def history(self, sampling: SamplingConfig) -> ngrams.History | None:
    """The committed tokens for `sampling`'s n-gram ban, sequence biases and bans by position
    (None without)."""
    return ngrams.History.of(sampling, self.sequence(), self.lengths_B, self.prompt_lengths_B,
                             self.vocab_size)

  def sequence(self) -> jax.Array:
    """int32[B, P + W]: each row's committed tokens from position 0, then PAD_ID."""
    P, W = self.prompts_BxP.shape[1], self.tokens_BxW.shape[1]
    pos_S = jnp.arange(P + W)
    L_Bx1 = self.prompt_lengths_B[:, None]
    from_prompt = jnp.pad(self.prompts_BxP, ((0, 0), (0, W)))
    from_output = jnp.take_along_axis(self.tokens_BxW, jnp.clip(pos_S[None] - L_Bx1, 0, W - 1),
                                      axis=1)
    seq_BxS = jnp.where(pos_S[None] < L_Bx1, from_prompt, from_output)
    return jnp.where(pos_S[None] < self.lengths_B[:, None], seq_BxS, common.PAD_ID)


class Drafter(abc.ABC):
  """What the SpS loop (`speculative.Loop`) asks of a drafter, and all it knows of one.

  A drafter is a frozen dataclass of static settings: part of the loop's compiled program, so
  equal settings share one. What it carries from loop to loop (the draft model's cache, or
  nothing) is its state, a pytree in the loop state. In every method `loop` is the running
  `speculative.Loop` (k, draft_sampling, native_kernel, mesh and rules), and `draft` the
  drafter's parameters, a jit argument: the draft model, or None for a drafter without one
  (`needs_model` False). Each loop calls `propose`, then, after the accept step, `rollback`.

  What the loop hands over travels in named dataclasses (`Committed`, `Proposal`, `Verdict`), so
  that a drafter needing more (a tree of drafts) adds fields there rather than arguments to every
  drafter; one that `reads_features` gets the target's hidden states at `init` and in `Verdict`,
  and the target itself through `bind`.
  """

  @property
  @abc.abstractmethod
  def needs_model(self) -> bool:
    """Whether it drafts with a draft model."""

  @property
  def reads_features(self) -> bool:
    """Whether `init` and `rollback` read the target's hidden states (of the prompt, and
    `Verdict.features_BxKp1xD`); the prefill and the scoring forward then return them too.
    False: the loop's program is as without them."""
    return False

  @property
  @abc.abstractmethod
  def ragged(self) -> bool:
    """Whether rows may propose fewer than k: the loop can then score only as many positions as
    the longest proposal needs (`speculative.Loop.trim_score`)."""

  def check(self, target: Model, draft) -> None:
    """Raises ValueError if `draft` cannot draft for `target` with this drafter (beyond the
    checks every drafter gets: `speculative.check_pair`)."""
    del target, draft

  def bind(self, target: Model, draft) -> Any:
    """What the other methods receive as `draft`, inside the program: the draft model as given,
    or for a drafter that reads the target's own weights (a feature head shares its embedding
    and output layer) the two together, the target's arrays not copied."""
    del target
    return draft

  def tree(self, k: int) -> TokenTree | None:
    """The token tree it proposes for lookahead k, or None for a chain of up to k drafts."""
    del k
    return None

  @abc.abstractmethod
  def init(self, loop, draft, prompts_BxP, prompt_lengths_B, capacity: int,
           features_BxPxD=None) -> Any:
    """The state for the prompts, after the target's prefill (`capacity`: the caches' size;
    `features_BxPxD`: the target's hidden states at every prompt position if `reads_features`,
    else None)."""

  @abc.abstractmethod
  def propose(self, loop, draft, state, committed: Committed, keys_BxK) -> tuple[Proposal, Any]:
    """Up to k tokens per row with the laws they were drawn from, and the state after drafting
    them: a function of the committed tokens and of `keys_BxK` (a key per slot, independent of
    the accept step's) only, which keeps the output law the target's. An idle row's proposal
    (`committed.active_B`) is never read."""

  @abc.abstractmethod
  def rollback(self, loop, state, verdict: Verdict) -> Any:
    """The state after the accept step, ready for the next `propose` (whatever was drafted past
    what the row kept is forgotten)."""

  @abc.abstractmethod
  def draft_steps(self, k: int, proposed_per_loop: float) -> float:
    """The draft model steps a loop runs, for the theory's cost per loop
    (`bench.theory.Prediction`), given the drafts proposed per loop measured."""

  def draft_calls(self, k: int) -> tuple[int, ...] | None:
    """The positions each draft call of a loop reads, where a call reads more than one (a tree
    drafter's levels), for the theory's cost and operations per loop; None: `draft_steps`
    one-position steps."""
    del k
    return None


def _point_masses(tokens_BxK, vocab_size):
  return jax.nn.one_hot(tokens_BxK, vocab_size, dtype=jnp.float32)


@dataclasses.dataclass(frozen=True)
class PromptLookup(Drafter):
  """Drafts copied from earlier in the row (see the module docstring); c ~ 0, no draft model."""
  max_ngram: int = 3
  min_ngram: int = 1

  def __post_init__(self):
    if not 1 <= self.min_ngram <= self.max_ngram:
      raise ValueError(f'Prompt lookup needs 1 <= min_ngram <= max_ngram, got min_ngram='
                       f'{self.min_ngram}, max_ngram={self.max_ngram}.')

  needs_model = False
  ragged = True  # Rows without a match propose nothing.

  def lookup(self, committed: Committed, k: int) -> tuple[jax.Array, jax.Array]:
    """(tokens int32[B, k], count int32[B]): the k tokens that followed the latest earlier match
    of the longest n-gram that matches, copied on past the row's end (count 0 where none does)."""
    seq_BxS = committed.sequence()
    c_B = committed.lengths_B
    B, S = seq_BxS.shape
    start_B = jnp.zeros((B,), jnp.int32)  # Where the copied tokens start (0: no match yet).
    found_B = jnp.zeros((B,), bool)
    for n in range(self.max_ngram, self.min_ngram - 1, -1):
      # Candidate match positions j: seq[j:j+n] against the last n tokens, ending before the
      # row's last token, so that at least one token follows it.
      match_BxJ = ngrams.tail_matches(seq_BxS[:, None], c_B[:, None], n)[:, 0]
      j_J = jnp.arange(match_BxJ.shape[1])
      latest_B = jnp.max(jnp.where(match_BxJ, j_J[None], -1), axis=1)
      take_B = ~found_B & (latest_B >= 0)
      start_B = jnp.where(take_B, latest_B + n, start_B)
      found_B |= take_B
    # An overlapping copy (as LZ77's): past the row's end the copy reads its own tokens, so a
    # match ending p tokens back proposes the last p tokens repeated, k of them.
    period_B = jnp.maximum(c_B - start_B, 1)
    idx_BxK = start_B[:, None] + jnp.arange(k)[None] % period_B[:, None]
    tokens_BxK = jnp.maximum(jnp.take_along_axis(seq_BxS, jnp.minimum(idx_BxK, S - 1), axis=1), 0)
    count_B = jnp.where(found_B, k, 0)
    return tokens_BxK.astype(jnp.int32), count_B.astype(jnp.int32)

  def draft_steps(self, k: int, proposed_per_loop: float) -> float:
    del k, proposed_per_loop
    return 0.0

  def init(self, loop, draft, prompts_BxP, prompt_lengths_B, capacity, features_BxPxD=None):
    del loop, draft, prompts_BxP, prompt_lengths_B, capacity, features_BxPxD
    return ()

  def propose(self, loop, draft, state, committed: Committed, keys_BxK):
    del draft, keys_BxK
    tokens_BxK, num_B = self.lookup(committed, loop.k)
    return Proposal(tokens_BxK, _point_masses(tokens_BxK, committed.vocab_size), num_B), state

  def rollback(self, loop, state, verdict: Verdict):
    del loop, verdict
    return state


@flax.struct.dataclass
class _Drafts:
  """The carry of a draft model's loop over slots: the drafts of slots < i, their laws, and the
  draft cache after them."""
  i: jax.Array  # int32: the slot the next step fills.
  tokens_BxK: jax.Array
  q_BxKxV: jax.Array
  num_B: jax.Array  # int32: drafts proposed; a row still drafting has num_B == i.
  cache: KVCache
  alternatives: 'siblings.Siblings | None' = None  # Per slot, [B, K, A, ...]; None without.

  @classmethod
  def first(cls, k: int, d_B, q_BxV, cache: KVCache, alternatives=None) -> '_Drafts':
    """After slot 0, which every row proposes."""
    B, V = q_BxV.shape
    slots = lambda x: jnp.zeros((B, k) + x.shape[1:], x.dtype).at[:, 0].set(x)
    return cls(i=jnp.int32(1), tokens_BxK=slots(d_B.astype(jnp.int32)), q_BxKxV=slots(q_BxV),
               num_B=jnp.ones((B,), jnp.int32), cache=cache,
               alternatives=None if alternatives is None else siblings.first_of_slots(
                   alternatives, k))


def draw_draft(loop, uniforms_B: jax.Array, logits_BxV: jax.Array,
               present_BxV: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """(q [B, V], a draft [B]) of one draft slot: `probabilities_and_sample_with` under the loop's
  draft sampling, on a mesh over rows whole on every device (`common.whole_vocabulary`; q too,
  or the partitioner splits the draw's work again to match where q is kept). A repetition
  penalty reads `present_BxV` (the committed tokens and the slot's earlier drafts); a drafter
  that passes none drafts without the penalty (q is still the law drawn from: SpS stays exact)."""
  whole = lambda x_BxV: common.whole_vocabulary(x_BxV, loop.mesh, loop.rules)
  # The n-gram ban and sequence biases shift the logits before (a drafter that reads them).
  sampling = loop.draft_sampling.without_context()
  sampling = sampling if present_BxV is not None else sampling.without_penalty()
  q_BxV, d_B = probabilities_and_sample_with(uniforms_B, whole(logits_BxV), sampling,
                                             native_kernel=loop.native_kernel,
                                             present_BxV=present_BxV)
  return whole(q_BxV), d_B


def draw_children(loop, keys_B: jax.Array, logits_BxLxV: jax.Array, count: int,
                  present_RxV: jax.Array | None = None
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`count` C children of each of L tree nodes per row, (tokens [B, L, C], each one's law
  given the earlier ones [B, L, C, V], whether each was proposed [B, L, C]): the first drawn from
  the node's draft law (`draw_draft`; `present_RxV`, [B L, V], as there), the others without
  replacement (`siblings.draw`), each with its law given the earlier ones. Node l draws with its
  own stream of the row's key `keys_B`."""
  B, L = logits_BxLxV.shape[:2]
  keys_BxL = jax.vmap(lambda key: jax.vmap(lambda j: jax.random.fold_in(key, j))(
      jnp.arange(L)))(typed_keys(keys_B))
  rows = lambda x: x.reshape((B * L,) + x.shape[2:])
  logits_RxV = rows(logits_BxLxV)
  q_RxV, first_R = draw_draft(loop, rows(uniforms(keys_BxL)), logits_RxV, present_RxV)
  drawn = siblings.Siblings(first_R[:, None], q_RxV[:, None], jnp.ones((B * L, 1), bool))
  if count > 1:
    more = siblings.draw(rows(siblings.keys_apart(keys_BxL)), logits_RxV, q_RxV, first_R,
                         count - 1, greedy=loop.draft_sampling.greedy)
    drawn = jax.tree.map(lambda a, b: jnp.concatenate([a, b], axis=1), drawn, more)
  back = lambda x: x.reshape((B, L) + x.shape[1:])
  return back(drawn.tokens_RxA), back(drawn.q_RxAxV), back(drawn.valid_RxA)


def check_alternatives(alternatives: int, ragged: bool = False) -> None:
  """ValueError unless `alternatives` (other tokens beside each draft) is an integer >= 0, and
  0 for a ragged drafter (dynamic k: a tree drafts every slot)."""
  if int(alternatives) != alternatives or alternatives < 0:
    raise ValueError(f'alternatives must be an integer >= 0, got {alternatives}.')
  if alternatives and ragged:
    raise ValueError('A draft with alternatives drafts every slot: it takes no stop_below '
                     '(dynamic k).')


def check_alternatives_fit(alternatives: int, target: Model) -> None:
  """ValueError where the vocabulary has too few tokens for a draft and its alternatives."""
  if alternatives >= target.config.vocab_size:
    raise ValueError(f'{alternatives} alternatives need a vocabulary of more than that many '
                     f'tokens, got {target.config.vocab_size}.')


def alternatives_tree(k: int, alternatives: int) -> TokenTree | None:
  """The tree a chain of k drafts with `alternatives` beside each proposes; None without."""
  return TokenTree.chain_with_alternatives(k, alternatives) if alternatives else None


def chain_with_alternatives(tokens_BxK, q_BxKxV, num_B, alternatives: 'siblings.Siblings'
                            ) -> Proposal:
  """The proposal of a chain's k drafts (nodes 1 .. k) and each slot's alternatives (per slot,
  [B, k, A, ...]), in `TokenTree.chain_with_alternatives`'s order."""
  B, k, A = alternatives.tokens_RxA.shape
  nodes = lambda chain, alts: jnp.concatenate(
      [chain, alts.reshape((B, k * A) + alts.shape[3:])], axis=1)
  return Proposal(
      nodes(tokens_BxK, alternatives.tokens_RxA), nodes(q_BxKxV, alternatives.q_RxAxV), num_B,
      nodes(jnp.ones((B, k), bool), alternatives.valid_RxA), tree=alternatives_tree(k, A))


@dataclasses.dataclass(frozen=True)
class ModelDrafter(Drafter):
  """A draft model sampling k tokens one after another (the paper's draft).

  `stop_below` > 0 makes k dynamic: a row stops proposing at the first draft whose law at
  temperature 1 (the draft's own softmax, before the sampling processors) has a largest
  probability below it; the first draft is always proposed, and drafting ends for the batch when
  every row has stopped.

  `alternatives` > 0 proposes a tree (`models.TokenTree.chain_with_alternatives`): besides each
  slot's draft, that many other tokens from the same draft law, without replacement
  (`siblings.draw`), as leaves the target scores in the same call; where the chain's draft is
  rejected they are tried in turn (`rejection.accept_tree`), and an accepted one is followed by
  the target's token after it. The draft model runs the chain only.

  Cache invariant (with c_b committed tokens): the draft cache holds at least the first c_b - 2
  tokens. Each loop's first call feeds the last two committed tokens at position c_b - 2
  (rewriting one position where the draft already had it), which covers the case where every
  draft was accepted (the draft never consumed the last one; the next loop feeds it with the
  bonus token) and the case where an alternative was accepted (the draft read the chain's).
  """
  stop_below: float = 0.0
  alternatives: int = 0

  needs_model = True

  @property
  def ragged(self) -> bool:
    """Whether rows may propose fewer than k (dynamic k)."""
    return self.stop_below > 0

  def __post_init__(self):
    if not 0.0 <= self.stop_below <= 1.0:
      raise ValueError(f'stop_below (dynamic k confidence threshold) must be in [0, 1], got '
                       f'{self.stop_below}.')
    check_alternatives(self.alternatives, self.ragged)

  def tree(self, k: int) -> TokenTree | None:
    return alternatives_tree(k, self.alternatives)

  def check(self, target: Model, draft) -> None:
    check_alternatives_fit(self.alternatives, target)

  def draft_steps(self, k: int, proposed_per_loop: float) -> float:
    """k; with dynamic k, the drafts proposed (exact at batch 1; a batch drafts on until its
    last row stops, so more there)."""
    return proposed_per_loop if self.ragged else float(k)

  def init(self, loop, draft: Model, prompts_BxP, prompt_lengths_B, capacity,
           features_BxPxD=None) -> KVCache:
    del features_BxPxD
    _, cache = prefill(draft.config, draft.params, prompts_BxP, prompt_lengths_B, capacity,
                       last_only=True, rollback=loop.k)
    return kv_cache.constrain(cache, loop.mesh, loop.rules)

  def propose(self, loop, draft: Model, cache: KVCache, committed: Committed, keys_BxK):
    return self.draft(loop, draft, cache, committed, keys_BxK)

  def draft(self, loop, draft: Model, cache: KVCache, committed: Committed, keys_BxK,
            forced_BxK=None, num_forced_B=None) -> tuple[Proposal, KVCache]:
    """k draft steps; slots i < num_forced_B[b] take forced_BxK[b, i] (a point mass) instead of
    the model's draw, and the model reads them as it would its own."""
    k, B = loop.k, keys_BxK.shape[0]
    # Uniforms at once: per step, threefry is a handful of small ops.
    alternative_keys_BxK = None
    if self.alternatives:  # Their own streams, apart from the drafts' uniforms.
      alternative_keys_BxK = siblings.keys_apart(keys_BxK)
    choose = functools.partial(self._choose, loop, uniforms(keys_BxK), forced_BxK, num_forced_B,
                               alternative_keys_BxK=alternative_keys_BxK)
    # Slot 0, always proposed, from the last two committed tokens (the cache invariant).
    cache = cache.with_lengths(committed.lengths_B - 2)
    last2_Bx2 = jnp.stack([committed.last(2), committed.last(1)], axis=1)
    logits_Bx1xV, cache = extend(draft.config, draft.params, cache, last2_Bx2,
                                 logits_at_BxL=jnp.ones((B, 1), jnp.int32),  # The second's.
                                 counts_B=committed.counts(2))
    history = committed.history(loop.draft_sampling)
    q_BxV, d_B, _, alternatives = choose(0, logits_Bx1xV[:, 0], committed.present_BxV,
                                         None if history is None else history.after())
    drafts = _Drafts.first(k, d_B, q_BxV, cache, alternatives)
    step = functools.partial(self._step, draft, committed, choose, history)
    if self.ragged:  # Stops when no row drafts on.
      drafts = jax.lax.while_loop(lambda d: (d.i < k) & jnp.any(d.num_B == d.i), step, drafts)
    else:
      drafts = jax.lax.fori_loop(1, k, lambda _, d: step(d), drafts, unroll=loop.drafts_unrolled)
    if drafts.alternatives is None:
      return Proposal(drafts.tokens_BxK, drafts.q_BxKxV, drafts.num_B), drafts.cache
    return (chain_with_alternatives(drafts.tokens_BxK, drafts.q_BxKxV, drafts.num_B,
                                    drafts.alternatives), drafts.cache)

  def _choose(self, loop, uniforms_BxK, forced_BxK, num_forced_B, i, logits_BxV,
              present_BxV=None, offsets_BxV=None, alternative_keys_BxK=None):
    """Slot i of every row: (q, draft, whether the row drafts on, the slot's alternatives
    (`siblings.Siblings`) or None), the tokens `present_BxV` before it with a repetition
    penalty, the logits shifted by `offsets_BxV` (`ngrams`). The plain model draft (no forced
    tokens, fixed k) pays for nothing else per step."""
    B, V = logits_BxV.shape
    logits_BxV = ngrams.shift(logits_BxV, offsets_BxV)
    # Whole rows on a mesh: the confidence's reductions need no collectives either.
    logits_BxV = common.whole_vocabulary(logits_BxV, loop.mesh, loop.rules)
    q_BxV, d_B = draw_draft(loop, uniforms_BxK[:, i], logits_BxV, present_BxV)
    model_q_BxV = q_BxV
    forced_B = jnp.zeros((B,), bool)
    if forced_BxK is not None:
      forced_B = i < num_forced_B
      q_BxV = jnp.where(forced_B[:, None], jax.nn.one_hot(forced_BxK[:, i], V), q_BxV)
      d_B = jnp.where(forced_B, forced_BxK[:, i], d_B)
    alternatives = None
    if self.alternatives:  # From the model's law without the slot's token, forced or drawn.
      alternatives = siblings.draw(alternative_keys_BxK[:, i], logits_BxV, model_q_BxV, d_B,
                                   self.alternatives, greedy=loop.draft_sampling.greedy)
    if not self.ragged:
      return q_BxV, d_B, jnp.ones((B,), bool), alternatives
    confidence_B = jnp.max(jax.nn.softmax(logits_BxV.astype(jnp.float32), -1), -1)
    return q_BxV, d_B, forced_B | (confidence_B >= self.stop_below), alternatives

  def _step(self, draft: Model, committed: Committed, choose, history: ngrams.History | None,
            d: '_Drafts') -> '_Drafts':
    """Slot d.i: the model reads slot d.i - 1's draft and draws the next."""
    # A row that stopped proposing (num_B < i) needs nothing more of this loop's drafting: its
    # cache keeps at most num_B + 1 of the positions written (`rollback`), all written by now.
    counts_B = committed.counts(1)  # Fixed k: every active row drafts on (num_B == i).
    if self.ragged:
      drafting_B = d.num_B == d.i
      if committed.active_B is not None:
        drafting_B &= committed.active_B
      counts_B = drafting_B.astype(jnp.int32)
    logits_Bx1xV, cache = extend(draft.config, draft.params, d.cache,
                                 d.tokens_BxK[:, d.i - 1, None], counts_B=counts_B)
    present_BxV = None
    if committed.present_BxV is not None:  # The committed tokens and the slots before d.i.
      present_BxV = mark_present(committed.present_BxV, d.tokens_BxK,
                                 jnp.full(d.num_B.shape, d.i, jnp.int32))
    offsets_BxV = None if history is None else history.at(d.tokens_BxK, d.i)
    q_BxV, d_B, confident_B, alternatives = choose(d.i, logits_Bx1xV[:, 0], present_BxV,
                                                   offsets_BxV)
    if alternatives is not None:
      alternatives = siblings.set_slot(d.alternatives, d.i, alternatives)
    return _Drafts(i=d.i + 1, tokens_BxK=d.tokens_BxK.at[:, d.i].set(d_B),
                   q_BxKxV=d.q_BxKxV.at[:, d.i].set(q_BxV),
                   num_B=jnp.where((d.num_B == d.i) & confident_B, d.i + 1, d.num_B),
                   cache=cache, alternatives=alternatives)

  def rollback(self, loop, cache: KVCache, verdict: Verdict) -> KVCache:
    # The draft keeps at most what it wrote this loop (its cache length after drafting) and no
    # more than the target kept; idle rows keep theirs. After a tree, only the chain's drafts
    # the path accepted (an accepted alternative is not what the draft read).
    lengths_B = jnp.minimum(verdict.target_lengths_B, cache.lengths)
    if verdict.path_BxD is not None:
      depth_D = jnp.arange(1, verdict.path_BxD.shape[1], dtype=jnp.int32)
      on_chain_B = jnp.sum(jnp.cumprod((verdict.path_BxD[:, 1:] == depth_D[None]).astype(
          jnp.int32), axis=1), axis=1)
      lengths_B = jnp.minimum(lengths_B, verdict.base_B + 1 + on_chain_B)
    return kv_cache.constrain(cache.with_lengths(lengths_B), loop.mesh, loop.rules)


@dataclasses.dataclass(frozen=True)
class Hybrid(ModelDrafter):
  """Prompt lookup where it matches, the draft model after its tokens and where it does not."""
  max_ngram: int = 3
  min_ngram: int = 1

  def __post_init__(self):
    super().__post_init__()
    PromptLookup(self.max_ngram, self.min_ngram)  # Checks the n-gram range.

  def propose(self, loop, draft: Model, cache: KVCache, committed: Committed, keys_BxK):
    forced_BxK, num_forced_B = PromptLookup(self.max_ngram, self.min_ngram).lookup(committed,
                                                                                   loop.k)
    return self.draft(loop, draft, cache, committed, keys_BxK, forced_BxK, num_forced_B)
