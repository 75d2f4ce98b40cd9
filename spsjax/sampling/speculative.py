"""Speculative sampling (SpS, Chen et al. 2023, Algorithm 2) as one jitted program.

Prefill of the target (and of the drafter's model, if it has one), then an outer `lax.while_loop`
that runs while any row generates (`Loop.cond`) and whose body (`Loop.body`) takes every row
through the same steps, whatever the drafter:
- draft: the drafter proposes up to k tokens per row with the laws q they were drawn from
  (`drafters.Drafter.propose`; its steps unrolled on accelerators: `Loop.drafts_unrolled`);
- score: the target on the last committed token and the drafts, k + 1 positions in one call
  (`Loop._score`; a drafter's tree of N nodes: N + 1 positions, `models.TokenTree`, or each
  row's own, `models.RowTrees`);
- accept: modified rejection sampling per row (`Loop._accept`, `spsjax.sampling.rejection`; for
  a tree, recursive rejection down the tree, `Loop._accept_tree`);
- commit and roll back: each row appends what it accepted and the token after it, and its caches
  roll back by moving that row's length, nothing recomputed or copied (after a tree the target
  first moves the accepted path's keys and values to their positions' slots)
  (`Loop._commit_and_roll_back`);
- statistics: the counts of `common.SampleOutput`, for the rows active in the loop
  (`Loop._statistics`).
Rows accept different numbers of drafts. Rows that stopped idle until every row has (a model
packed for CPU decoding skips their work: `_target_logits`).

Cache invariant, with c_b = the number of committed tokens of row b (prompt + generated): the
target cache holds exactly the first c_b - 1 tokens (all but the last, which is fed next), after
every loop for every number of accepted drafts; each drafter keeps its own state's invariant
(`drafters.ModelDrafter`). With a repetition penalty, `present_BxV` marks exactly the committed
tokens of each row (its prompt's and those generated).

Positions written reach c_b + k - 1 < prompt length + max_new_tokens + k - 1, so a row needs k - 1
positions of headroom past prompt + max_new_tokens within max_seq_len. A loop drops at most k of
the positions it wrote (the k + 1 scored keep at least one; a model drafter's k drafts): on XLA's
path the caches' sliding-window layers are rings of window - 1 + k slots
(`kv_cache.init_cache`). A tree of N nodes writes N slots past the length (positions up to the
tree's depth k): the target's capacity and rings have N of room instead of k. With
`trim_score`, a ragged drafter (fewer than k drafts in some rows) has the target score only as
many positions as the longest proposal of the loop needs (`_target_logits`); off by default: on
this CPU the branch costs more than the positions it saves (docs/sampling.md).
"""

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from spsjax import sharding
from spsjax.models import (KVCache, Model, RowTrees, TokenTree, extend, extend_with_features,
                           feature_head, kv_cache, prefill)
from spsjax.sampling import common, drafters, ngrams
from spsjax.sampling.processors import (SamplingConfig, mark_present, native_probabilities,
                                        present_along, present_through, probabilities,
                                        probabilities_and_sample)
from spsjax.sampling.drafters import Drafter
from spsjax.sampling.rejection import accept_and_resample_rows, accept_tree, check_lenience


@flax.struct.dataclass
class _State:
  """The outer loop's carry."""
  tokens_BxW: jax.Array  # Generated tokens, PAD_ID past each row's end; W = max_new + k + 1.
  num_generated_B: jax.Array
  done_B: jax.Array
  target_cache: KVCache
  draft_state: Any  # The drafter's (the draft model's cache for a model drafter).
  row_keys_B: jax.Array
  num_loops_B: jax.Array  # Also numbers each row's loops for its keys (`_loop_keys`).
  num_accepted_B: jax.Array
  num_drafted_B: jax.Array
  num_full_loops_B: jax.Array  # Loops that accepted every draft proposed.
  histogram_Kp1: jax.Array  # Loops that accepted exactly n drafts.
  proposed_Kp1: jax.Array  # Loops that proposed exactly n drafts.
  present_BxV: jax.Array | None  # The committed tokens per row (a repetition penalty's), or None.


def headroom(k: int) -> int:
  """Positions past prompt + max_new_tokens that the loop writes to (see the module docstring)."""
  return k - 1


def _target_logits(target: Model, cache: KVCache, tokens_BxKp1, active_B, num_B, longest,
                   features: bool | tuple[int, ...] = False,
                   tree: TokenTree | RowTrees | None = None):
  """The target's logits on the last committed token and the drafts: (float32[B, k + 1, V],
  cache, and with `features` their hidden states [B, k + 1, D] from the same forward (at its
  taps where they are given: [B, k + 1, n D]), else None).

  Row b's logits past its num_B[b] drafts, and every logit of an idle row (not `active_B`), are
  unspecified and never read (a row accepts at most what it proposed), and a model packed for CPU
  decoding skips their work (`models.extend`'s counts): at a batch of 8 the target's products are
  compute-bound, so a row that proposed fewer drafts (dynamic k, prompt lookup without a match) or
  finished first would otherwise pay for positions nobody reads.
  With `longest` (the most drafts any active row proposed, traced) only its first longest + 1
  positions are scored, by one of k + 1 compiled branches; the others' logits are zeros (uniform
  laws). With a `tree` the tokens are its root and N nodes, all scored ([B, N + 1, V], and the
  features [B, N + 1, D]).
  """
  Kp1 = tokens_BxKp1.shape[1]

  def forward(cache, tokens_BxN, counts_B):
    if features:
      logits_BxNxV, features_BxNxD, cache = extend_with_features(
          target.config, target.params, cache, tokens_BxN, counts_B=counts_B, tree=tree,
          taps=features)
      return logits_BxNxV, cache, features_BxNxD
    logits_BxNxV, cache = extend(target.config, target.params, cache, tokens_BxN,
                                 counts_B=counts_B, tree=tree)
    return logits_BxNxV, cache, None

  if tree is not None:  # Every node scored.
    return forward(cache, tokens_BxKp1, jnp.where(active_B, Kp1, 0).astype(jnp.int32))
  counts_B = jnp.where(active_B, num_B + 1, 0).astype(jnp.int32)
  if longest is None:
    return forward(cache, tokens_BxKp1, counts_B)

  def positions(n):
    def score(cache):
      logits_BxNxV, cache, features_BxNxD = forward(cache, tokens_BxKp1[:, :n],
                                                    jnp.minimum(counts_B, n))
      pad = lambda x: None if x is None else jnp.pad(x, ((0, 0), (0, Kp1 - n), (0, 0)))
      return pad(logits_BxNxV.astype(jnp.float32)), cache, pad(features_BxNxD)
    return score

  return jax.lax.switch(longest, [positions(n) for n in range(1, Kp1 + 1)], cache)


def _loop_keys(row_keys_B, num_loops_B, k):
  """Per row and loop: k draft keys and one accept key, all derived from that row's key."""
  keys_Bx2 = jax.vmap(lambda key, i: jax.random.split(jax.random.fold_in(key, i + 1)))(
      row_keys_B, num_loops_B)
  draft_keys_BxK = jax.vmap(lambda key: jax.random.split(key, k))(keys_Bx2[:, 0])
  return draft_keys_BxK, keys_Bx2[:, 1]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Loop(common.LoopSettings):
  """The SpS program for one set of static settings (with `common.LoopSettings`'s); `init`,
  `cond` and `body` are also callable one at a time from Python (tests step through loops to check
  the cache invariants)."""
  k: int
  draft_sampling: SamplingConfig
  drafter: Drafter = drafters.ModelDrafter()
  lenience: float = 1.0  # < 1: LOSSY (`rejection.lenient_law`); 1: exact.
  trim_score: bool = False  # Ragged drafters: score only the positions the longest proposal needs.
  unroll_drafts: bool | None = None  # None: `drafts_unrolled` chooses by platform.

  @property
  def tree(self) -> TokenTree | None:
    """The drafter's token tree for this k (`Drafter.tree`), or None for a chain."""
    return self.drafter.tree(self.k)

  @property
  def scored(self) -> int:
    """Positions the target writes past a row's length in a loop and may drop: k, or a tree's
    N nodes."""
    return self.k if self.tree is None else self.tree.num_nodes

  @property
  def drafts_unrolled(self) -> bool:
    """Whether a drafter's k - 1 steps after the first are straight-line code instead of a
    `fori_loop` (`unroll_drafts`; by default on accelerators, not on a CPU). On a GPU an inner
    loop splits the loop body's CUDA graphs: an H100 trace of the tiny pair
    (tests/data/h100_sps_generation.xplane.pb.gz) ran each SpS loop as three graphs (before, in
    and after the draft loop, the inner one launched once a step), the GPU idle 20-47 us a loop
    at the two inner boundaries; unrolled, the body is one graph, and XLA:GPU compiled llama1b's
    loop (k = 4) at bba396b to 643 ops instead of 695 (`experiments/compile_only.py`). On a CPU
    the loop costs next to nothing a step and unrolling only lengthens compiles. The same tokens
    either way."""
    return self.platform != 'cpu' if self.unroll_drafts is None else self.unroll_drafts

  def init(self, target: Model, draft: Model | None, prompts_BxP, prompt_lengths_B,
           rng) -> _State:
    """Prefills the target and the drafter; the first token comes from the target's prefill."""
    k, mesh, rules = self.k, self.mesh, self.rules
    B, P = prompts_BxP.shape
    capacity = P + self.max_new_tokens + self.scored
    row_keys_B = common.row_keys(rng, B)
    if self.drafter.reads_features:
      first_logits_Bx1xV, features_BxPxD, target_cache = prefill(
          target.config, target.params, prompts_BxP, prompt_lengths_B, capacity, last_only=True,
          with_features=self._features(draft), rollback=self.scored)
    else:
      features_BxPxD = None
      first_logits_Bx1xV, target_cache = prefill(target.config, target.params, prompts_BxP,
                                                 prompt_lengths_B, capacity, last_only=True,
                                                 rollback=self.scored)
    draft_state = self.drafter.init(self, self.drafter.bind(target, draft), prompts_BxP,
                                    prompt_lengths_B, capacity, features_BxPxD)
    first_logits_BxV = common.whole_vocabulary(first_logits_Bx1xV[:, 0], self.mesh, self.rules)
    present_BxV = common.initial_present(self.sampling, prompts_BxP, prompt_lengths_B,
                                         target.config.vocab_size)
    history = ngrams.History.of_prompts(self.sampling, prompts_BxP, prompt_lengths_B, 0,
                                        target.config.vocab_size)
    if history is not None:
      first_logits_BxV = ngrams.shift(first_logits_BxV, history.after())
    _, first_B = probabilities_and_sample(
        jax.vmap(jax.random.fold_in)(row_keys_B, jnp.zeros((B,), jnp.uint32)), first_logits_BxV,
        self.sampling.without_context(), native_kernel=self.native_kernel,
        present_BxV=present_BxV)
    zeros_B = jnp.zeros((B,), jnp.int32)
    tokens_BxW, num_generated_B, done_B, _ = common.commit(
        common.output_buffer(B, self.max_new_tokens, k + 1), zeros_B, jnp.zeros((B,), bool),
        first_B[:, None], jnp.ones_like(first_B), eos_id=self.eos_id,
        max_new_tokens=self.max_new_tokens)
    return _State(
        tokens_BxW=tokens_BxW, num_generated_B=num_generated_B, done_B=done_B,
        target_cache=kv_cache.constrain(target_cache, mesh, rules), draft_state=draft_state,
        row_keys_B=row_keys_B, num_loops_B=zeros_B, num_accepted_B=zeros_B,
        num_drafted_B=zeros_B, num_full_loops_B=zeros_B,
        histogram_Kp1=jnp.zeros((k + 1,), jnp.int32),
        proposed_Kp1=jnp.zeros((k + 1,), jnp.int32),
        present_BxV=None if present_BxV is None else mark_present(present_BxV, first_B[:, None]))

  def body(self, target: Model, draft: Model | None, prompts_BxP, prompt_lengths_B,
           state: _State) -> _State:
    """One loop for every row, step by step (the module docstring); stopped rows idle."""
    active_B = ~state.done_B
    features = self._features(draft)
    draft = self.drafter.bind(target, draft)
    committed = drafters.Committed(prompts_BxP, prompt_lengths_B, state.tokens_BxW,
                                   state.num_generated_B, target.config.vocab_size, active_B,
                                   state.present_BxV)
    draft_keys_BxK, accept_keys_B = _loop_keys(state.row_keys_B, state.num_loops_B, self.k)
    with jax.named_scope('draft'):
      proposal, draft_state = self.drafter.propose(self, draft, state.draft_state, committed,
                                                   draft_keys_BxK)
    with jax.named_scope('score'):
      logits_BxKp1xV, target_cache, features_BxKp1xD = self._score(
          target, state.target_cache, committed, proposal, features)
    with jax.named_scope('accept'):  # The profile's accept phase: everything after the scoring.
      if proposal.drafted_tree is None:
        path_BxD = None
        n_B, token_B = self._accept(accept_keys_B, logits_BxKp1xV, proposal, state.present_BxV,
                                    committed)
      else:
        path_BxD, n_B, token_B = self._accept_tree(accept_keys_B, logits_BxKp1xV, proposal,
                                                   state.present_BxV, committed)
      state = self._commit_and_roll_back(state, committed, proposal, n_B, token_B, target_cache,
                                         draft_state, features_BxKp1xD, path_BxD)
      return self._statistics(state, active_B, proposal.num_B, n_B)

  def _features(self, draft: Model | None) -> bool | tuple[int, ...]:
    """What the target's forwards return of its hidden states: nothing (False) unless the
    drafter reads them, then what its head reads (`feature_head.reads`)."""
    return self.drafter.reads_features and feature_head.reads(draft)

  def _score(self, target: Model, cache: KVCache, committed: drafters.Committed,
             proposal: drafters.Proposal, features: bool | tuple[int, ...] = False
             ) -> tuple[jax.Array, KVCache, jax.Array | None]:
    """The target on each row's last committed token and its drafts (its cache holds the
    committed tokens but the last): logits float32[B, k + 1, V], the cache, and the hidden
    states `features` asks for (`_target_logits`)."""
    tokens_BxKp1 = jnp.concatenate([committed.last(1)[:, None], proposal.tokens_BxK], axis=1)
    active_B = committed.active_B
    longest = (jnp.max(jnp.where(active_B, proposal.num_B, 0))
               if self.trim_score and self.drafter.ragged else None)
    return _target_logits(target, cache, tokens_BxKp1, active_B, proposal.num_B, longest,
                          features=features, tree=proposal.drafted_tree)

  def _accept(self, keys_B, logits_BxKp1xV, proposal: drafters.Proposal, present_BxV=None,
              committed: drafters.Committed | None = None):
    """Modified rejection sampling per row: (n_B, token_B), the drafts accepted and the token
    after them (drawn from the residual, or from p after the last draft when all were accepted;
    `rejection.accept_and_resample_rows`). With a repetition penalty, p at slot j reads the
    committed tokens and the drafts before j as present; an n-gram ban and sequence biases read
    `committed`'s tokens, then the drafts (`ngrams`)."""
    history = committed.history(self.sampling) if committed else None
    if history is not None:
      logits_BxKp1xV = ngrams.shift(logits_BxKp1xV, history.along_chain(
          proposal.tokens_BxK, logits_BxKp1xV.shape[1]))
    present_BxKp1xV = None
    if present_BxV is not None:
      drafted_BxKxV = present_through(proposal.tokens_BxK, present_BxV.shape[1])
      present_BxKp1xV = present_BxV[:, None] | jnp.pad(drafted_BxKxV, ((0, 0), (1, 0), (0, 0)))
    sampling = self.sampling.without_context()  # Shifted above.
    p_BxKp1xV = (native_probabilities(logits_BxKp1xV, sampling, present_BxKp1xV)
                 if self.native_kernel
                 else probabilities(logits_BxKp1xV, sampling, present_xV=present_BxKp1xV))
    return accept_and_resample_rows(keys_B, p_BxKp1xV, proposal.q_BxKxV, proposal.tokens_BxK,
                                    proposal.num_B, self.lenience,
                                    native_kernel=self.native_kernel)

  def _accept_tree(self, keys_B, logits_BxNp1xV, proposal: drafters.Proposal,
                   present_BxV=None, committed: drafters.Committed | None = None):
    """A tree's accept step per row (`rejection.accept_tree`): (path [B, depth + 1], n_B,
    token_B). With a repetition penalty, p after node n reads the committed tokens and the
    tokens of n and its ancestors as present; an n-gram ban and sequence biases read them in
    that order."""
    history = committed.history(self.sampling) if committed else None
    if history is not None:
      logits_BxNp1xV = ngrams.shift(logits_BxNp1xV, history.along_tree(
          proposal.tokens_BxK, proposal.drafted_tree))
    present_BxNp1xV = None
    if present_BxV is not None:  # Node n's path: its ancestors and itself, the root's committed.
      present_BxNp1xV = present_along(present_BxV, proposal.tokens_BxK,
                                      proposal.drafted_tree.ancestors[..., 1:])
    sampling = self.sampling.without_context()  # Shifted above.
    p_BxNp1xV = (native_probabilities(logits_BxNp1xV, sampling, present_BxNp1xV)
                 if self.native_kernel
                 else probabilities(logits_BxNp1xV, sampling, present_xV=present_BxNp1xV))
    tree = proposal.drafted_tree
    children_xNp1xC = jnp.asarray(tree.children)  # Shared, or each row's ([B, N + 1, C]).
    row = functools.partial(accept_tree, depth=tree.depth)
    return jax.vmap(row, in_axes=(0, 0, 0, 0, 0, 0 if children_xNp1xC.ndim == 3 else None))(
        keys_B, p_BxNp1xV, proposal.q_BxKxV, proposal.tokens_BxK, proposal.valid_BxK,
        children_xNp1xC)

  def _commit_and_roll_back(self, state: _State, committed: drafters.Committed,
                            proposal: drafters.Proposal, n_B, token_B, target_cache: KVCache,
                            draft_state, features_BxKp1xD=None, path_BxD=None) -> _State:
    """Appends each active row's n_B accepted drafts and the token after them to its output (up
    to an eos or max_new_tokens, `common.commit`), then rolls the caches back to the cache
    invariant by moving each row's lengths: the target keeps every committed token but the last,
    the drafter what it may (`Drafter.rollback`); idle rows keep theirs. After a tree
    (`path_BxD`: its node at each depth) the target first moves the path's keys and values to
    the slots of their positions (`kv_cache.keep_path`), and a drafter reading features gets the
    path's."""
    k = self.k
    base_B = committed.lengths_B - 1
    drafted_BxK = proposal.tokens_BxK
    if path_BxD is not None:  # The accepted nodes' tokens, as a chain.
      drafted_BxK = jnp.take_along_axis(proposal.tokens_BxK,
                                        jnp.maximum(path_BxD[:, 1:] - 1, 0), axis=1)
      target_cache = kv_cache.keep_path(target_cache, base_B, path_BxD)
      if features_BxKp1xD is not None:  # The path's, as a chain's (past its end unspecified).
        features_BxKp1xD = jnp.take_along_axis(
            features_BxKp1xD, jnp.maximum(path_BxD, 0)[:, :, None], axis=1)
    block_BxKp1 = jnp.where(jnp.arange(k + 1)[None, :] < n_B[:, None],
                            jnp.pad(drafted_BxK, ((0, 0), (0, 1))), token_B[:, None])
    tokens_BxW, num_generated_B, done_B, emitted_B = common.commit(
        state.tokens_BxW, state.num_generated_B, state.done_B, block_BxKp1, n_B + 1,
        eos_id=self.eos_id, max_new_tokens=self.max_new_tokens)
    target_lengths_B = jnp.where(committed.active_B, base_B + emitted_B, base_B)
    draft_state = self.drafter.rollback(
        self, draft_state, drafters.Verdict(base_B, target_lengths_B, features_BxKp1xD, path_BxD))
    target_cache = kv_cache.constrain(target_cache.with_lengths(target_lengths_B), self.mesh,
                                      self.rules)
    present_BxV = (None if state.present_BxV is None
                   else mark_present(state.present_BxV, block_BxKp1, emitted_B))
    return state.replace(tokens_BxW=tokens_BxW, num_generated_B=num_generated_B, done_B=done_B,
                         target_cache=target_cache, draft_state=draft_state,
                         present_BxV=present_BxV)

  def _statistics(self, state: _State, active_B, num_proposed_B, n_B) -> _State:
    """The loop's statistics (`common.SampleOutput`'s), counted for the rows active in it."""
    count = lambda x_B: jnp.where(active_B, x_B, 0)
    histogram = lambda x_B: jnp.sum(
        jax.nn.one_hot(x_B, self.k + 1, dtype=jnp.int32) * active_B[:, None], axis=0)
    return state.replace(
        num_loops_B=state.num_loops_B + active_B,
        num_accepted_B=state.num_accepted_B + count(n_B),
        num_drafted_B=state.num_drafted_B + count(num_proposed_B),
        num_full_loops_B=state.num_full_loops_B + count(n_B == num_proposed_B),
        histogram_Kp1=state.histogram_Kp1 + histogram(n_B),
        proposed_Kp1=state.proposed_Kp1 + histogram(num_proposed_B))

  @staticmethod
  def cond(state: _State) -> jax.Array:
    """Whether another loop runs: while any row generates. A row stops at an eos (kept) or at
    max_new_tokens (`common.commit` sets done_B), then idles in the loops the others still run:
    it proposes nothing that is read, scores nothing a packed model computes, and is counted in
    no statistic."""
    return ~jnp.all(state.done_B)

  @common.program
  def run(self, target: Model, draft: Model | None, prompts_BxP, prompt_lengths_B,
          rng) -> common.SampleOutput:
    """The whole generation as one program: prefill, then `body` in a `lax.while_loop`."""
    prompts_BxP = common.clean_padding(prompts_BxP, prompt_lengths_B)
    state = self.init(target, draft, prompts_BxP, prompt_lengths_B, rng)
    state = jax.lax.while_loop(
        self.cond, lambda state: self.body(target, draft, prompts_BxP, prompt_lengths_B, state),
        state)
    return common.SampleOutput(
        tokens=state.tokens_BxW[:, :self.max_new_tokens], num_generated=state.num_generated_B,
        num_loops=state.num_loops_B, num_accepted=state.num_accepted_B,
        accepted_histogram=state.histogram_Kp1, num_drafted=state.num_drafted_B,
        num_full_loops=state.num_full_loops_B, proposed_histogram=state.proposed_Kp1)


def check_pair(target: Model, draft: Model | None, k: int,
               drafter: Drafter = drafters.ModelDrafter()) -> None:
  if int(k) != k or k < 1:
    raise ValueError(f'k (draft tokens per loop) must be an integer >= 1, got {k}.')
  if drafter.needs_model and draft is None:
    raise ValueError(f'The drafter {drafter} needs a draft model; got draft=None.')
  if not drafter.needs_model and draft is not None:
    raise ValueError(f'The drafter {drafter} uses no draft model; pass draft=None.')
  if draft is not None and draft.config.vocab_size != target.config.vocab_size:
    raise ValueError(f'Draft vocab_size ({draft.config.vocab_size}) differs from the target\'s '
                     f'({target.config.vocab_size}); they must share a tokenizer.')
  drafter.check(target, draft)


def _check_tree(lenience: float) -> None:
  """What a tree of drafts does not run with: lenience."""
  if lenience != 1.0:
    raise ValueError(f'A tree of drafts is exact only: lenience must be 1, got {lenience}.')


def prepare(target: Model, draft: Model | None, prompts, prompt_lengths, *, k: int,
            max_new_tokens: int, sampling: SamplingConfig = SamplingConfig(),
            draft_sampling: SamplingConfig | None = None, eos_id: common.EosIds = None,
            mesh: Mesh | None = None, rules: sharding.Rules = sharding.DEFAULT_RULES,
            drafter: Drafter = drafters.ModelDrafter(), lenience: float = 1.0,
            trim_score: bool = False, compiler_options: Mapping[str, Any] | None = None):
  """Checks the inputs and places them: (loop, (target, draft, prompts, prompt_lengths)).

  `loop.run(*args, rng)` is the program `speculative_sample` runs (the profiler lowers it too).
  """
  check_pair(target, draft, k, drafter)
  check_lenience(lenience)
  if drafter.tree(k) is not None:
    _check_tree(lenience)
  for model in (target, draft) if draft is not None else (target,):
    common.check_inputs(model, prompts, prompt_lengths, max_new_tokens=max_new_tokens,
                        eos_id=eos_id, mesh=mesh, headroom=headroom(k))
  target, prompts, prompt_lengths = common.place(target, prompts, prompt_lengths, mesh, rules)
  if draft is not None:
    draft = common.place_params(draft, mesh, rules)
  loop = Loop(k=k, max_new_tokens=max_new_tokens, sampling=sampling,
              draft_sampling=draft_sampling or sampling, eos_id=common.eos_ids(eos_id), mesh=mesh,
              rules=rules,
              drafter=drafter, lenience=float(lenience), trim_score=bool(trim_score),
              compiler_options=common.compiler_options(compiler_options))
  return loop, (target, draft, prompts, prompt_lengths)


def speculative_sample(target: Model, draft: Model | None, prompts, prompt_lengths,
                       rng: jax.Array, *, k: int, max_new_tokens: int,
                       sampling: SamplingConfig = SamplingConfig(),
                       draft_sampling: SamplingConfig | None = None, eos_id: common.EosIds = None,
                       mesh: Mesh | None = None, rules: sharding.Rules = sharding.DEFAULT_RULES,
                       drafter: Drafter = drafters.ModelDrafter(), lenience: float = 1.0,
                       trim_score: bool = False,
                       compiler_options: Mapping[str, Any] | None = None) -> common.SampleOutput:
  """Samples from `target` with `drafter` proposing up to k tokens per loop (by default the
  `draft` model, k per loop); the output law is the target's. `rng` is one JAX key, typed
  (`jax.random.key`) or legacy (`jax.random.PRNGKey`): the same seed gives the same tokens. A row
  stops after an `eos_id` (an id, or any of a sequence of ids) or `max_new_tokens` tokens.

  `draft_sampling` (default: `sampling`) sets how a draft model samples (a repetition penalty
  too, but heads draft without one: `drafters.draw_draft`); acceptance always uses the
  distribution the draft really sampled from, so the output law does not depend on it. A
  drafter without a model (`drafters.PromptLookup`) takes draft=None. `lenience` < 1 (opt-in)
  accepts more drafts and is LOSSY: the output law is then no longer the target's
  (`rejection.lenient_law`). `trim_score` (ragged drafters only) scores only the positions the
  loop's longest proposal needs. `compiler_options` are XLA's options for the program (`jax.jit`'s),
  e.g. {'xla_backend_optimization_level': 3}.
  """
  common.check_rng(rng)
  loop, args = prepare(target, draft, prompts, prompt_lengths, k=k, max_new_tokens=max_new_tokens,
                       sampling=sampling, draft_sampling=draft_sampling, eos_id=eos_id, mesh=mesh,
                       rules=rules, drafter=drafter, lenience=lenience, trim_score=trim_score,
                       compiler_options=compiler_options)
  return loop.run(*args, rng)
