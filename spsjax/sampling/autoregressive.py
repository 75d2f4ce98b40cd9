"""Autoregressive sampling (ArS): prefill, then the whole decode as one `lax.while_loop`.

Invariant after every step: row b's cache holds exactly its prompt and its generated tokens but the
last one (which is fed on the next step), so `cache.lengths[b] == prompt_lengths[b] +
num_generated[b] - 1`; with a repetition penalty, `present_BxV` marks its prompt's and generated
tokens. Rows that stopped (eos or max_new_tokens) idle: their lengths stop moving and
their outputs stay PAD_ID. No host round trip inside the program.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from spsjax import sharding
from spsjax.models import KVCache, Model, extend, kv_cache, prefill
from spsjax.sampling import common, ngrams
from spsjax.sampling.processors import SamplingConfig, mark_present, probabilities_and_sample

@flax.struct.dataclass
class _State:
  tokens_BxW: jax.Array  # Generated tokens, PAD_ID beyond each row's end; W = max_new + 1.
  num_generated_B: jax.Array
  done_B: jax.Array
  cache: KVCache
  row_keys_B: jax.Array
  present_BxV: jax.Array | None  # The tokens present per row (a repetition penalty's), or None.
  history: ngrams.History | None  # The committed tokens (`ngrams`' settings), or None.


def _last_tokens(state: _State) -> jax.Array:
  rows_B = jnp.arange(state.tokens_BxW.shape[0])
  return state.tokens_BxW[rows_B, jnp.maximum(state.num_generated_B - 1, 0)]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Loop(common.LoopSettings):
  """The ArS program for one set of static settings (as `speculative.Loop`): `init` prefills and
  emits the first token, `body` one step for every row, `run` the whole generation as one jitted
  program; `init` and `body` are also callable one at a time from Python."""

  def _emit(self, state: _State, logits_BxV) -> _State:
    """Samples one token per active row and records it; stopped rows are left as they are."""
    keys_B = common.step_keys(state.row_keys_B, state.num_generated_B)
    if state.history is not None:
      logits_BxV = ngrams.shift(logits_BxV, state.history.after())
    _, new_B = probabilities_and_sample(
        keys_B, common.whole_vocabulary(logits_BxV, self.mesh, self.rules),
        self.sampling.without_context(), native_kernel=self.native_kernel,
        present_BxV=state.present_BxV)
    tokens_BxW, num_generated_B, done_B, emitted_B = common.commit(
        state.tokens_BxW, state.num_generated_B, state.done_B, new_B[:, None],
        jnp.ones_like(new_B), eos_id=self.eos_id, max_new_tokens=self.max_new_tokens)
    present_BxV = (None if state.present_BxV is None
                   else mark_present(state.present_BxV, new_B[:, None]))
    history = None if state.history is None else state.history.append(new_B[:, None], emitted_B)
    return state.replace(tokens_BxW=tokens_BxW, num_generated_B=num_generated_B, done_B=done_B,
                         present_BxV=present_BxV, history=history)

  def init(self, model: Model, prompts_BxP, prompt_lengths_B, rng) -> _State:
    B, P = prompts_BxP.shape
    last_logits_Bx1xV, cache = prefill(model.config, model.params, prompts_BxP, prompt_lengths_B,
                                       capacity=P + self.max_new_tokens, last_only=True,
                                       rollback=0)
    state = _State(
        tokens_BxW=common.output_buffer(B, self.max_new_tokens, 1),
        num_generated_B=jnp.zeros((B,), jnp.int32),
        done_B=jnp.zeros((B,), bool),
        cache=kv_cache.constrain(cache, self.mesh, self.rules),
        row_keys_B=common.row_keys(rng, B),
        present_BxV=common.initial_present(self.sampling, prompts_BxP, prompt_lengths_B,
                                           model.config.vocab_size),
        history=ngrams.History.of_prompts(self.sampling, prompts_BxP,
                                          prompt_lengths_B, self.max_new_tokens,
                                          model.config.vocab_size))
    return self._emit(state, last_logits_Bx1xV[:, 0])

  def body(self, model: Model, state: _State) -> _State:
    """One token for every active row; stopped rows idle (their cache lengths stay put, and a
    model packed for CPU decoding skips their work)."""
    lengths_B = state.cache.lengths
    logits_Bx1xV, cache = extend(model.config, model.params, state.cache,
                                 _last_tokens(state)[:, None],
                                 counts_B=common.active_counts(~state.done_B, 1))
    cache = kv_cache.constrain(
        cache.with_lengths(jnp.where(state.done_B, lengths_B, cache.lengths)), self.mesh,
        self.rules)
    return self._emit(state.replace(cache=cache), logits_Bx1xV[:, 0])

  @common.program
  def run(self, model: Model, prompts_BxP, prompt_lengths_B, rng) -> common.SampleOutput:
    """The whole generation as one program: `init`, then `body` in a `lax.while_loop`."""
    prompts_BxP = common.clean_padding(prompts_BxP, prompt_lengths_B)
    state = self.init(model, prompts_BxP, prompt_lengths_B, rng)
    state = jax.lax.while_loop(lambda state: ~jnp.all(state.done_B),
                               lambda state: self.body(model, state), state)
    return common.SampleOutput(tokens=state.tokens_BxW[:, :self.max_new_tokens],
                               num_generated=state.num_generated_B)


def prepare(model: Model, prompts, prompt_lengths, *, max_new_tokens: int,
            sampling: SamplingConfig = SamplingConfig(), eos_id: common.EosIds = None,
            mesh: Mesh | None = None, rules: sharding.Rules = sharding.DEFAULT_RULES,
            compiler_options: Mapping[str, Any] | None = None):
  """Checks the inputs and places them: (loop, (model, prompts, prompt_lengths)); the program is
  `loop.run(*args, rng)` (the profiler and tests lower it too)."""
  common.check_inputs(model, prompts, prompt_lengths, max_new_tokens=max_new_tokens,
                      eos_id=eos_id, mesh=mesh)
  args = common.place(model, prompts, prompt_lengths, mesh, rules)
  return Loop(max_new_tokens=max_new_tokens, sampling=sampling, eos_id=common.eos_ids(eos_id),
              mesh=mesh,
              rules=rules, compiler_options=common.compiler_options(compiler_options)), args


def autoregressive_sample(model: Model, prompts, prompt_lengths, rng: jax.Array, *,
                          max_new_tokens: int, sampling: SamplingConfig = SamplingConfig(),
                          eos_id: common.EosIds = None, mesh: Mesh | None = None,
                          rules: sharding.Rules = sharding.DEFAULT_RULES,
                          compiler_options: Mapping[str, Any] | None = None
                          ) -> common.SampleOutput:
  """Samples up to `max_new_tokens` per row from `model`; one compiled program per shape bucket.

  `rng` is one JAX key, typed (`jax.random.key`) or legacy (`jax.random.PRNGKey`): the same seed
  gives the same tokens. A row stops after emitting `eos_id` (an id, or any of a sequence of
  ids: an instruct model's end of turn and end of text) or `max_new_tokens` tokens. Recompiles
  only when the padded prompt width P, the batch size, `max_new_tokens`, the sampling
  settings, eos, mesh or `compiler_options` (XLA's options for the program, `jax.jit`'s) change.
  """
  common.check_rng(rng)
  loop, args = prepare(model, prompts, prompt_lengths, max_new_tokens=max_new_tokens,
                       sampling=sampling, eos_id=eos_id, mesh=mesh, rules=rules,
                       compiler_options=compiler_options)
  return loop.run(*args, rng)
