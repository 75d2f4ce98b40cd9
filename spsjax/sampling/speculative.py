"""Speculative sampling (SpS, Chen et al. 2023, Algorithm 2) as one jitted program.

Prefill of both models, then an outer `lax.while_loop` whose body is: `draft` (k draft tokens, one
after another, from q), `score` (the target on k + 1 positions in one call), `accept` (modified
rejection sampling per row, `spsjax.sampling.rejection`). Rows accept different numbers of drafts;
each row's caches roll back by moving that row's length (nothing is recomputed or copied). Rows that
stopped idle until every row has.

Cache invariants, with c_b = the number of committed tokens of row b (prompt + generated):
- the target cache holds exactly the first c_b - 1 tokens (all but the last, which is fed next);
- the draft cache holds at least the first c_b - 2 tokens. Each loop's first draft call feeds the
  last two committed tokens at position c_b - 2 (rewriting one position where the draft already had
  it). This covers the case where all k drafts were accepted: the draft then never consumed d_k,
  and the next loop feeds it d_k and the bonus token.
Both hold after every loop for every number of accepted drafts n = 0..k.

Positions written reach c_b + k - 1 < prompt length + max_new_tokens + k - 1, so a row needs k - 1
positions of headroom past prompt + max_new_tokens within max_seq_len.
"""

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from spsjax import sharding
from spsjax.models import KVCache, Model, extend, kv_cache, prefill
from spsjax.sampling import common
from spsjax.sampling.processors import (SamplingConfig, native_probabilities, probabilities,
                                        probabilities_and_sample, probabilities_and_sample_with,
                                        uniforms)
from spsjax.sampling.rejection import accept_and_resample_rows

@flax.struct.dataclass
class _State:
  tokens_BxW: jax.Array  # Generated tokens, PAD_ID past each row's end; W = max_new + k + 1.
  num_generated_B: jax.Array
  done_B: jax.Array
  target_cache: KVCache
  draft_cache: KVCache
  row_keys_B: jax.Array
  num_loops_B: jax.Array
  num_accepted_B: jax.Array
  histogram_Kp1: jax.Array


def headroom(k: int) -> int:
  """Positions past prompt + max_new_tokens that the loop writes to (see the module docstring)."""
  return k - 1


def _draft(draft: Model, cache: KVCache, committed_B, last2_Bx2, keys_BxK, k, sampling,
           native_kernel):
  """k draft tokens per row: (drafts int32[B, k], q float32[B, k, V], draft cache)."""
  cache = cache.with_lengths(committed_B - 2)
  B = last2_Bx2.shape[0]
  uniforms_BxK = uniforms(keys_BxK)  # At once: per step, threefry is a handful of small ops.
  logits_Bx1xV, cache = extend(draft.config, draft.params, cache, last2_Bx2,
                               logits_at_BxL=jnp.ones((B, 1), jnp.int32))  # The second token's.
  q_BxV, d_B = probabilities_and_sample_with(uniforms_BxK[:, 0], logits_Bx1xV[:, 0], sampling,
                                             native_kernel=native_kernel)
  V = q_BxV.shape[-1]
  drafts_BxK = jnp.zeros((B, k), jnp.int32).at[:, 0].set(d_B)
  q_BxKxV = jnp.zeros((B, k, V), jnp.float32).at[:, 0].set(q_BxV)

  def step(i, carry):
    drafts_BxK, q_BxKxV, cache = carry
    logits_Bx1xV, cache = extend(draft.config, draft.params, cache, drafts_BxK[:, i - 1, None])
    q_BxV, d_B = probabilities_and_sample_with(uniforms_BxK[:, i], logits_Bx1xV[:, 0], sampling,
                                               native_kernel=native_kernel)
    return drafts_BxK.at[:, i].set(d_B), q_BxKxV.at[:, i].set(q_BxV), cache

  return jax.lax.fori_loop(1, k, step, (drafts_BxK, q_BxKxV, cache))


def _loop_keys(row_keys_B, num_loops_B, k):
  """Per row and loop: k draft keys and one accept key, all derived from that row's key."""
  keys_Bx2 = jax.vmap(lambda key, i: jax.random.split(jax.random.fold_in(key, i + 1)))(
      row_keys_B, num_loops_B)
  draft_keys_BxK = jax.vmap(lambda key: jax.random.split(key, k))(keys_Bx2[:, 0])
  return draft_keys_BxK, keys_Bx2[:, 1]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Loop(common.LoopSettings):
  """The SpS program for one set of static settings (with `common.LoopSettings`'s); `init` and
  `body` are also callable one at a time from Python (tests step through loops to check the cache
  invariants)."""
  k: int
  draft_sampling: SamplingConfig

  def init(self, target: Model, draft: Model, prompts_BxP, prompt_lengths_B, rng) -> _State:
    """Prefills both models; the first token comes from the target's prefill logits."""
    k, mesh, rules = self.k, self.mesh, self.rules
    B, P = prompts_BxP.shape
    capacity = P + self.max_new_tokens + k
    row_keys_B = common.row_keys(rng, B)
    first_logits_Bx1xV, target_cache = prefill(target.config, target.params, prompts_BxP,
                                               prompt_lengths_B, capacity, last_only=True)
    _, draft_cache = prefill(draft.config, draft.params, prompts_BxP, prompt_lengths_B, capacity,
                             last_only=True)
    first_logits_BxV = first_logits_Bx1xV[:, 0]
    _, first_B = probabilities_and_sample(
        jax.vmap(jax.random.fold_in)(row_keys_B, jnp.zeros((B,), jnp.uint32)), first_logits_BxV,
        self.sampling, native_kernel=self.native_kernel)
    zeros_B = jnp.zeros((B,), jnp.int32)
    tokens_BxW, num_generated_B, done_B, _ = common.commit(
        common.output_buffer(B, self.max_new_tokens, k + 1), zeros_B, jnp.zeros((B,), bool),
        first_B[:, None], jnp.ones_like(first_B), eos_id=self.eos_id,
        max_new_tokens=self.max_new_tokens)
    return _State(
        tokens_BxW=tokens_BxW, num_generated_B=num_generated_B, done_B=done_B,
        target_cache=kv_cache.constrain(target_cache, mesh, rules),
        draft_cache=kv_cache.constrain(draft_cache, mesh, rules),
        row_keys_B=row_keys_B, num_loops_B=zeros_B, num_accepted_B=zeros_B,
        histogram_Kp1=jnp.zeros((k + 1,), jnp.int32))

  def body(self, target: Model, draft: Model, prompts_BxP, prompt_lengths_B,
           state: _State) -> _State:
    """One draft/score/accept loop for every row; stopped rows idle."""
    k, mesh, rules = self.k, self.mesh, self.rules
    active_B = ~state.done_B
    committed_B = prompt_lengths_B + state.num_generated_B
    last_of = functools.partial(common.last_token, prompts_BxP, prompt_lengths_B,
                                state.tokens_BxW, state.num_generated_B)
    last_B, second_last_B = last_of(back=1), last_of(back=2)
    draft_keys_BxK, accept_keys_B = _loop_keys(state.row_keys_B, state.num_loops_B, k)

    with jax.named_scope('draft'):
      drafts_BxK, q_BxKxV, draft_cache = _draft(
          draft, state.draft_cache, committed_B, jnp.stack([second_last_B, last_B], axis=1),
          draft_keys_BxK, k, self.draft_sampling, self.native_kernel)

    with jax.named_scope('score'):  # The target cache holds committed - 1 tokens.
      logits_BxKp1xV, target_cache = extend(
          target.config, target.params, state.target_cache,
          jnp.concatenate([last_B[:, None], drafts_BxK], axis=1))

    with jax.named_scope('accept'):
      p_BxKp1xV = (native_probabilities(logits_BxKp1xV, self.sampling) if self.native_kernel
                   else probabilities(logits_BxKp1xV, self.sampling))
      n_B, token_B = accept_and_resample_rows(accept_keys_B, p_BxKp1xV, q_BxKxV, drafts_BxK)
      block_BxKp1 = jnp.where(jnp.arange(k + 1)[None, :] < n_B[:, None],
                              jnp.pad(drafts_BxK, ((0, 0), (0, 1))), token_B[:, None])
      tokens_BxW, num_generated_B, done_B, emitted_B = common.commit(
          state.tokens_BxW, state.num_generated_B, state.done_B, block_BxKp1, n_B + 1,
          eos_id=self.eos_id, max_new_tokens=self.max_new_tokens)
      # Roll back: the target keeps all committed tokens but the last; the draft at most what it
      # wrote (committed - 2 + k positions). Idle rows keep their lengths.
      base_B = committed_B - 1
      target_lengths_B = jnp.where(active_B, base_B + emitted_B, base_B)
      draft_lengths_B = jnp.minimum(target_lengths_B, base_B + k)
      return state.replace(
          tokens_BxW=tokens_BxW, num_generated_B=num_generated_B, done_B=done_B,
          target_cache=kv_cache.constrain(target_cache.with_lengths(target_lengths_B), mesh, rules),
          draft_cache=kv_cache.constrain(draft_cache.with_lengths(draft_lengths_B), mesh, rules),
          num_loops_B=state.num_loops_B + active_B,
          num_accepted_B=state.num_accepted_B + jnp.where(active_B, n_B, 0),
          histogram_Kp1=state.histogram_Kp1 + jnp.sum(
              jax.nn.one_hot(n_B, k + 1, dtype=jnp.int32) * active_B[:, None], axis=0))

  @functools.partial(jax.jit, static_argnames=('self',))
  def run(self, target: Model, draft: Model, prompts_BxP, prompt_lengths_B,
          rng) -> common.SampleOutput:
    """The whole generation as one program: prefill, then `body` in a `lax.while_loop`."""
    prompts_BxP = common.clean_padding(prompts_BxP, prompt_lengths_B)
    state = self.init(target, draft, prompts_BxP, prompt_lengths_B, rng)
    state = jax.lax.while_loop(
        lambda state: ~jnp.all(state.done_B),
        lambda state: self.body(target, draft, prompts_BxP, prompt_lengths_B, state), state)
    return common.SampleOutput(
        tokens=state.tokens_BxW[:, :self.max_new_tokens], num_generated=state.num_generated_B,
        num_loops=state.num_loops_B, num_accepted=state.num_accepted_B,
        accepted_histogram=state.histogram_Kp1)


def check_pair(target: Model, draft: Model, k: int) -> None:
  if int(k) != k or k < 1:
    raise ValueError(f'k (draft tokens per loop) must be an integer >= 1, got {k}.')
  if draft.config.vocab_size != target.config.vocab_size:
    raise ValueError(f'Draft vocab_size ({draft.config.vocab_size}) differs from the target\'s '
                     f'({target.config.vocab_size}); they must share a tokenizer.')


def prepare(target: Model, draft: Model, prompts, prompt_lengths, *, k: int, max_new_tokens: int,
            sampling: SamplingConfig = SamplingConfig(),
            draft_sampling: SamplingConfig | None = None, eos_id: int | None = None,
            mesh: Mesh | None = None, rules: sharding.Rules = sharding.DEFAULT_RULES):
  """Checks the inputs and places them: (loop, (target, draft, prompts, prompt_lengths)).

  `loop.run(*args, rng)` is the program `speculative_sample` runs (the profiler lowers it too).
  """
  check_pair(target, draft, k)
  for model in (target, draft):
    common.check_inputs(model, prompts, prompt_lengths, max_new_tokens=max_new_tokens,
                        eos_id=eos_id, mesh=mesh, headroom=headroom(k))
  target, prompts, prompt_lengths = common.place(target, prompts, prompt_lengths, mesh, rules)
  draft = common.place_params(draft, mesh, rules)
  loop = Loop(k=k, max_new_tokens=max_new_tokens, sampling=sampling,
              draft_sampling=draft_sampling or sampling, eos_id=eos_id, mesh=mesh, rules=rules)
  return loop, (target, draft, prompts, prompt_lengths)


def speculative_sample(target: Model, draft: Model, prompts, prompt_lengths, rng: jax.Array, *,
                       k: int, max_new_tokens: int, sampling: SamplingConfig = SamplingConfig(),
                       draft_sampling: SamplingConfig | None = None, eos_id: int | None = None,
                       mesh: Mesh | None = None,
                       rules: sharding.Rules = sharding.DEFAULT_RULES) -> common.SampleOutput:
  """Samples from `target` with `draft` proposing k tokens per loop; the output law is the target's.

  `draft_sampling` (default: `sampling`) sets how the draft samples; acceptance always uses the
  distribution the draft really sampled from, so the output law does not depend on it.
  """
  loop, args = prepare(target, draft, prompts, prompt_lengths, k=k, max_new_tokens=max_new_tokens,
                       sampling=sampling, draft_sampling=draft_sampling, eos_id=eos_id, mesh=mesh,
                       rules=rules)
  return loop.run(*args, rng)
