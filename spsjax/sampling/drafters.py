"""What proposes the draft tokens of the SpS loop: the drafter interface and the drafters.

A drafter proposes, per row, up to k tokens and the law q each one was drawn from (`Proposal`),
inside the jitted loop, with fixed shapes: `tokens_BxK`, `q_BxKxV` and the ragged count `num_B` in
[0, k]. Slots at and past `num_B[b]` hold valid ids the target scores but the accept step never
looks at (`rejection.accept_and_resample`). A deterministic proposal (prompt lookup) has a point
mass for q: its token is accepted with probability p(d), and the residual is p without d.

Exactness needs only that each proposal is a function of the committed tokens and of randomness
independent of the accept step's; the number proposed may depend on the drafts drawn so far
(dynamic k): the output law stays the target's for every drafter here.

Drafters are frozen dataclasses (static settings: one compiled program per drafter) with
- `init(loop, draft, prompts_BxP, lengths_B, capacity) -> state`, after the target's prefill;
- `propose(loop, draft, state, committed, keys_BxK) -> (Proposal, state)`;
- `rollback(loop, state, base_B, target_lengths_B) -> state`, after the accept step (base_B: the
  committed tokens before the loop, less one; target_lengths_B: the target cache's new lengths);
- `needs_model` and `ragged` (whether rows may propose fewer than k: the loop can then score only
  as many positions as the longest proposal needs, `speculative.Loop.trim_score`);
- `draft_steps(k, proposed_per_loop)`: the draft model steps a loop runs (for the theory's cost
  per loop, `bench.theory.Prediction`).
`draft` is the draft model (a jit argument) or None for drafters that need none; `loop` is the
`speculative.Loop` (k, draft sampling, mesh and rules, native kernel).

- `ModelDrafter`: a small transformer sampling one token after another (the paper's draft), with
  an optional confidence threshold that stops a row's drafting early (dynamic k, DSL/SpecDec++);
- `PromptLookup`: the tokens that followed the latest earlier occurrence of the row's last n
  committed tokens (n from `max_ngram` down to `min_ngram`; Saxena's prompt lookup decoding), no
  model call; the copy runs on into its own tokens, so a repeating row gets k drafts, not only
  the tokens left before its end;
- `Hybrid`: prompt lookup's tokens where it matches, the model's after them and where it does not
  (per row); the model reads every proposed token, so its cache stays as `ModelDrafter`'s.
"""

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from spsjax.models import KVCache, Model, extend, kv_cache, prefill
from spsjax.sampling import common
from spsjax.sampling.processors import probabilities_and_sample_with, uniforms


@flax.struct.dataclass
class Proposal:
  tokens_BxK: jax.Array  # int32; slots >= num_B hold valid ids, never accepted.
  q_BxKxV: jax.Array  # float32: the law each token was drawn from (a point mass if deterministic).
  num_B: jax.Array  # int32 in [0, k]: tokens proposed for each row.


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


def _point_masses(tokens_BxK, vocab_size):
  return jax.nn.one_hot(tokens_BxK, vocab_size, dtype=jnp.float32)


@dataclasses.dataclass(frozen=True)
class PromptLookup:
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
      J = S - n + 1  # Candidate match positions j: seq[j:j+n] against the last n tokens.
      match_BxJ = jnp.ones((B, J), bool)
      for t in range(n):
        last_B = jnp.take_along_axis(seq_BxS, jnp.maximum(c_B - n + t, 0)[:, None], axis=1)
        match_BxJ &= seq_BxS[:, t:t + J] == last_B
      # The match must end before the row's last token, so that at least one token follows it.
      j_J = jnp.arange(J)
      match_BxJ &= (j_J[None] + n <= c_B[:, None] - 1) & (c_B[:, None] > n)
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

  def init(self, loop, draft, prompts_BxP, prompt_lengths_B, capacity):
    del loop, draft, prompts_BxP, prompt_lengths_B, capacity
    return ()

  def propose(self, loop, draft, state, committed: Committed, keys_BxK):
    del draft, keys_BxK
    tokens_BxK, num_B = self.lookup(committed, loop.k)
    return Proposal(tokens_BxK, _point_masses(tokens_BxK, committed.vocab_size), num_B), state

  def rollback(self, loop, state, base_B, target_lengths_B):
    del loop, base_B, target_lengths_B
    return state


@dataclasses.dataclass(frozen=True)
class ModelDrafter:
  """A draft model sampling k tokens one after another (the paper's draft).

  `stop_below` > 0 makes k dynamic: a row stops proposing at the first draft whose law at
  temperature 1 (the draft's own softmax, before the sampling processors) has a largest
  probability below it; the first draft is always proposed, and drafting ends for the batch when
  every row has stopped.

  Cache invariant (with c_b committed tokens): the draft cache holds at least the first c_b - 2
  tokens. Each loop's first call feeds the last two committed tokens at position c_b - 2
  (rewriting one position where the draft already had it), which covers the case where every
  draft was accepted (the draft never consumed the last one; the next loop feeds it with the
  bonus token).
  """
  stop_below: float = 0.0

  needs_model = True

  @property
  def ragged(self) -> bool:
    """Whether rows may propose fewer than k (dynamic k)."""
    return self.stop_below > 0

  def __post_init__(self):
    if not 0.0 <= self.stop_below <= 1.0:
      raise ValueError(f'stop_below (dynamic k confidence threshold) must be in [0, 1], got '
                       f'{self.stop_below}.')

  def draft_steps(self, k: int, proposed_per_loop: float) -> float:
    """k; with dynamic k, the drafts proposed (exact at batch 1; a batch drafts on until its
    last row stops, so more there)."""
    return proposed_per_loop if self.ragged else float(k)

  def init(self, loop, draft: Model, prompts_BxP, prompt_lengths_B, capacity) -> KVCache:
    _, cache = prefill(draft.config, draft.params, prompts_BxP, prompt_lengths_B, capacity,
                       last_only=True)
    return kv_cache.constrain(cache, loop.mesh, loop.rules)

  def propose(self, loop, draft: Model, cache: KVCache, committed: Committed, keys_BxK):
    return self.draft(loop, draft, cache, committed, keys_BxK)

  def draft(self, loop, draft: Model, cache: KVCache, committed: Committed, keys_BxK,
            forced_BxK=None, num_forced_B=None):
    """k draft steps; slots i < num_forced_B[b] take forced_BxK[b, i] (a point mass) instead of
    the model's draw, and the model reads them as it would its own."""
    k, sampling, native = loop.k, loop.draft_sampling, loop.native_kernel
    B = keys_BxK.shape[0]
    V = draft.config.vocab_size
    uniforms_BxK = uniforms(keys_BxK)  # At once: per step, threefry is a handful of small ops.

    def choose(i, logits_BxV):
      """(q, draft, whether the row drafts on); the plain model draft (no forced tokens, fixed
      k) pays for nothing else per step."""
      q_BxV, d_B = probabilities_and_sample_with(uniforms_BxK[:, i], logits_BxV, sampling,
                                                 native_kernel=native)
      forced_B = jnp.zeros((B,), bool)
      if forced_BxK is not None:
        forced_B = i < num_forced_B
        q_BxV = jnp.where(forced_B[:, None], jax.nn.one_hot(forced_BxK[:, i], V), q_BxV)
        d_B = jnp.where(forced_B, forced_BxK[:, i], d_B)
      if not self.ragged:
        return q_BxV, d_B, jnp.ones((B,), bool)
      confidence_B = jnp.max(jax.nn.softmax(logits_BxV.astype(jnp.float32), -1), -1)
      return q_BxV, d_B, forced_B | (confidence_B >= self.stop_below)

    cache = cache.with_lengths(committed.lengths_B - 2)
    last2_Bx2 = jnp.stack([committed.last(2), committed.last(1)], axis=1)
    logits_Bx1xV, cache = extend(draft.config, draft.params, cache, last2_Bx2,
                                 logits_at_BxL=jnp.ones((B, 1), jnp.int32),  # The second's.
                                 counts_B=committed.counts(2))
    q_BxV, d_B, _ = choose(0, logits_Bx1xV[:, 0])  # The first draft is always proposed.
    drafts_BxK = jnp.zeros((B, k), jnp.int32).at[:, 0].set(d_B)
    q_BxKxV = jnp.zeros((B, k, V), jnp.float32).at[:, 0].set(q_BxV)
    num_B = jnp.ones((B,), jnp.int32)

    def step(i, carry):
      drafts_BxK, q_BxKxV, num_B, cache = carry
      # A row that stopped proposing (num_B < i) needs nothing more of this loop's drafting: its
      # cache keeps at most num_B + 1 of the positions written (`rollback`), all written by now.
      counts_B = committed.counts(1)
      if self.ragged:  # Fixed k: every active row drafts on (num_B == i).
        drafting_B = num_B == i
        if committed.active_B is not None:
          drafting_B &= committed.active_B
        counts_B = drafting_B.astype(jnp.int32)
      logits_Bx1xV, cache = extend(draft.config, draft.params, cache, drafts_BxK[:, i - 1, None],
                                   counts_B=counts_B)
      q_BxV, d_B, confident_B = choose(i, logits_Bx1xV[:, 0])
      num_B = jnp.where((num_B == i) & confident_B, i + 1, num_B)
      return drafts_BxK.at[:, i].set(d_B), q_BxKxV.at[:, i].set(q_BxV), num_B, cache

    carry = (drafts_BxK, q_BxKxV, num_B, cache)
    if self.stop_below == 0.0:
      carry = jax.lax.fori_loop(1, k, step, carry)
    else:  # Stops when no row drafts on (a row still drafting has num_B == i).
      carry = jax.lax.while_loop(
          lambda ic: (ic[0] < k) & jnp.any(ic[1][2] == ic[0]),
          lambda ic: (ic[0] + 1, step(ic[0], ic[1])), (jnp.int32(1), carry))[1]
    drafts_BxK, q_BxKxV, num_B, cache = carry
    return Proposal(drafts_BxK, q_BxKxV, num_B), cache

  def rollback(self, loop, cache: KVCache, base_B, target_lengths_B) -> KVCache:
    # The draft keeps at most what it wrote this loop (its cache length after drafting) and no
    # more than the target kept; idle rows keep theirs.
    del base_B
    lengths_B = jnp.minimum(target_lengths_B, cache.lengths)
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


Drafter = ModelDrafter | PromptLookup | Hybrid
KINDS = ('model', 'lookup', 'hybrid')


def build(kind: str = 'model', *, max_ngram: int = 3, min_ngram: int = 1,
          stop_below: float = 0.0) -> Drafter:
  """The drafter a config names: `model` (with `stop_below` > 0: dynamic k), `lookup` (n-grams
  from `max_ngram` down to `min_ngram`) or `hybrid` (both)."""
  if kind == 'model':
    return ModelDrafter(stop_below=stop_below)
  if kind == 'hybrid':
    return Hybrid(stop_below=stop_below, max_ngram=max_ngram, min_ngram=min_ngram)
  if kind == 'lookup':
    if stop_below:
      raise ValueError(f'stop_below={stop_below}: prompt lookup has no draft model whose '
                       f'confidence could stop it; use drafter hybrid or model.')
    return PromptLookup(max_ngram=max_ngram, min_ngram=min_ngram)
  raise ValueError(f'Unknown drafter {kind!r}; known: {list(KINDS)}.')
