"""Autoregressive sampling (ArS): prefill, then the whole decode as one `lax.while_loop`.

Invariant after every step: row b's cache holds exactly its prompt and its generated tokens but the
last one (which is fed on the next step), so `cache.lengths[b] == prompt_lengths[b] +
num_generated[b] - 1`. Rows that stopped (eos or max_new_tokens) idle: their lengths stop moving and
their outputs stay PAD_ID. No host round trip inside the program.
"""

import functools

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from spsjax import sharding
from spsjax.models import KVCache, Model, extend, kv_cache, prefill
from spsjax.sampling import common
from spsjax.sampling.processors import SamplingConfig, probabilities_and_sample

trace_count = 0  # Incremented each time the program is traced; tests assert it stays put.


@flax.struct.dataclass
class _State:
  tokens_BxW: jax.Array  # Generated tokens, PAD_ID beyond each row's end; W = max_new + 1.
  num_generated_B: jax.Array
  done_B: jax.Array
  cache: KVCache
  row_keys_B: jax.Array


def _emit(state: _State, logits_BxV, sampling, eos_id, max_new_tokens, native_kernel) -> _State:
  """Samples one token per active row and records it; stopped rows are left as they are."""
  keys_B = common.step_keys(state.row_keys_B, state.num_generated_B)
  _, new_B = probabilities_and_sample(keys_B, logits_BxV, sampling, native_kernel=native_kernel)
  tokens_BxW, num_generated_B, done_B, _ = common.commit(
      state.tokens_BxW, state.num_generated_B, state.done_B, new_B[:, None],
      jnp.ones_like(new_B), eos_id=eos_id, max_new_tokens=max_new_tokens)
  return state.replace(tokens_BxW=tokens_BxW, num_generated_B=num_generated_B, done_B=done_B)


def _last_tokens(state: _State) -> jax.Array:
  rows_B = jnp.arange(state.tokens_BxW.shape[0])
  return state.tokens_BxW[rows_B, jnp.maximum(state.num_generated_B - 1, 0)]


@functools.partial(jax.jit, static_argnames=('max_new_tokens', 'sampling', 'eos_id', 'mesh', 'rules'))
def _program(model: Model, prompts_BxP, prompt_lengths_B, rng, *, max_new_tokens, sampling, eos_id,
             mesh, rules):
  global trace_count
  trace_count += 1
  config, params = model.config, model.params
  B, P = prompts_BxP.shape
  prompts_BxP = common.clean_padding(prompts_BxP, prompt_lengths_B)
  last_logits_Bx1xV, cache = prefill(config, params, prompts_BxP, prompt_lengths_B,
                                     capacity=P + max_new_tokens, last_only=True)
  cache = kv_cache.constrain(cache, mesh, rules)
  last_logits_BxV = last_logits_Bx1xV[:, 0]
  state = _State(
      tokens_BxW=common.output_buffer(B, max_new_tokens, 1),
      num_generated_B=jnp.zeros((B,), jnp.int32),
      done_B=jnp.zeros((B,), bool),
      cache=cache,
      row_keys_B=common.row_keys(rng, B))
  native_kernel = mesh is None  # The native sampling kernel runs on one device.
  state = _emit(state, last_logits_BxV, sampling, eos_id, max_new_tokens, native_kernel)

  def cond(state):
    return ~jnp.all(state.done_B)

  def body(state):
    lengths_B = state.cache.lengths
    logits_Bx1xV, cache = extend(config, params, state.cache, _last_tokens(state)[:, None])
    cache = kv_cache.constrain(cache.with_lengths(jnp.where(state.done_B, lengths_B,
                                                            cache.lengths)), mesh, rules)
    return _emit(state.replace(cache=cache), logits_Bx1xV[:, 0], sampling, eos_id, max_new_tokens,
                 native_kernel)

  state = jax.lax.while_loop(cond, body, state)
  return common.SampleOutput(tokens=state.tokens_BxW[:, :max_new_tokens], num_generated=state.num_generated_B)


def autoregressive_sample(model: Model, prompts, prompt_lengths, rng: jax.Array, *,
                          max_new_tokens: int, sampling: SamplingConfig = SamplingConfig(),
                          eos_id: int | None = None, mesh: Mesh | None = None,
                          rules: sharding.Rules = sharding.DEFAULT_RULES) -> common.SampleOutput:
  """Samples up to `max_new_tokens` per row from `model`; one compiled program per shape bucket.

  A row stops after emitting `eos_id` or `max_new_tokens` tokens. Recompiles only when the padded
  prompt width P, the batch size, `max_new_tokens`, the sampling settings, eos or mesh change.
  """
  common.check_inputs(model, prompts, prompt_lengths, max_new_tokens=max_new_tokens,
                      eos_id=eos_id, mesh=mesh)
  model, prompts, prompt_lengths = common.place(model, prompts, prompt_lengths, mesh, rules)
  return _program(model, prompts, prompt_lengths, rng, max_new_tokens=max_new_tokens,
                  sampling=sampling, eos_id=eos_id, mesh=mesh, rules=rules)
