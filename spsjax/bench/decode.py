"""Decode timing at small batch: the cached step, end-to-end ArS, and the machine's copy bandwidth.

At batch 1 a decode step is memory bound: it reads every weight it multiplies by (all of them but
an untied input embedding table, of which it reads one row) and the whole KV cache up to its
capacity (attention masks empty slots but still reads them). So `bytes_per_token / step time` is
an effective bandwidth, to set against the copy bandwidth of the same machine.

Every time is the median of `repeats` calls, each blocked on, after warm-up calls that compile.
"""

import dataclasses
import functools
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from spsjax import models, sampling, sharding
from spsjax.bench import hlo, timing
from spsjax.models import feature_head, kv_cache
from spsjax.sampling import common


@dataclasses.dataclass(frozen=True)
class CopyBandwidth:
  """GB/s of bytes read + written (2 * nbytes per copy) by one copy of an nbytes float32 array."""
  nbytes: int
  jax_fresh: float  # jit(jnp.copy): XLA allocates (and first touches) a new output every call.
  jax_donated: float  # jit copy into a donated buffer of the same shape: no new memory.
  numpy: float  # np.copyto into a preallocated array (one thread).

  @property
  def best(self) -> float:
    """The fastest of the three: what the machine's memory can do here."""
    return max(self.jax_fresh, self.jax_donated, self.numpy)


def _jax_copy_seconds(n: int, repeats: int) -> tuple[float, float]:
  """Median seconds of a fresh and of a donated JAX copy of n float32s (their buffers are freed
  on return, before numpy's copy)."""
  src = jnp.arange(n, dtype=jnp.float32)
  fresh = jax.jit(jnp.copy)
  fresh_s = timing.median_seconds(lambda: fresh(src), repeats=repeats)
  into = jax.jit(lambda dst, src: dst.at[:].set(src), donate_argnums=0)
  state = {'dst': jnp.zeros_like(src)}

  def copy_into():
    state['dst'] = into(state['dst'], src)
    return state['dst']

  return fresh_s, timing.median_seconds(copy_into, repeats=repeats)


def copy_bandwidth(nbytes: int, *, repeats: int) -> CopyBandwidth:
  n = nbytes // 4
  moved = 2 * 4 * n
  jax_fresh, jax_donated = _jax_copy_seconds(n, repeats)
  src_np = np.arange(n, dtype=np.float32)
  dst_np = np.empty_like(src_np)
  numpy_s = timing.median_seconds(lambda: np.copyto(dst_np, src_np), repeats=repeats)
  return CopyBandwidth(nbytes=4 * n, jax_fresh=moved / jax_fresh / 1e9,
                       jax_donated=moved / jax_donated / 1e9, numpy=moved / numpy_s / 1e9)


def weight_bytes_per_token(config: models.TransformerConfig, params) -> int:
  """Parameter bytes a batch-1 decode step reads.

  All of them, but of the embedding table one row when the output layer is another array (an
  untied head, or the packed copy of a tied table, `models.pack`).
  """
  total = sum(x.nbytes for x in jax.tree.leaves(params))
  if 'head' not in params:
    return total
  embedding = params['embedding']
  return total - embedding.nbytes + embedding.nbytes // config.vocab_size


def _extend_steps(config, steps, params, cache, tokens_BxT, lengths_B, tree=None):
  """`steps` calls of `extend` in one program, each at the same row lengths (so in bounds); with
  `tree` (`models.TokenTree`) calls on that tree: a tree of drafts' scoring."""

  def one(_, carry):
    cache, checksum_B = carry
    logits_BxTxV, cache = models.extend(config, params, cache.with_lengths(lengths_B), tokens_BxT,
                                        tree=tree)
    return cache, checksum_B + logits_BxTxV[:, -1, 0]

  return jax.lax.fori_loop(0, steps, one, (cache, jnp.zeros(tokens_BxT.shape[:1], jnp.float32)))


# One jitted program per (config, steps, tree) and shapes, kept across calls: measuring the same
# model's costs again (each row of a table, each ceiling) compiles nothing new. Donates the cache.
extend_program = jax.jit(_extend_steps, static_argnums=(0, 1), static_argnames='tree',
                         donate_argnums=3)


def _positions(block: 'int | models.TokenTree') -> int:
  """Tokens per row of an `extend_seconds` block: T, or a tree's nodes and root."""
  return block.num_nodes + 1 if isinstance(block, models.TokenTree) else block


def _tree_kwargs(tree) -> dict:
  """`extend_program`'s tree argument, passed only for a tree: a call without it is the same
  compiled program as every other chain's (jit keys its cache on the arguments as passed)."""
  return {} if tree is None else {'tree': tree}


def _compile_extend(config, steps, params, cache, tokens_BxT, lengths_B, tree=None) -> None:
  extend_program.lower(config, steps, params, cache, tokens_BxT, lengths_B,
                       **_tree_kwargs(tree)).compile()


def _extend_args(model, blocks, capacity, batch, mesh, rules):
  """(config, params, cache, {T: tokens}, lengths) of `extend_seconds`' programs, placed."""
  sharding.check_batch(batch, mesh)
  model = common.place_params(model, mesh, rules)
  longest = max(_positions(T) for T in blocks)
  if longest > capacity:
    raise ValueError(f'A block of {longest} tokens does not fit in the cache capacity '
                     f'{capacity}.')
  lengths_B = jnp.full((batch,), capacity - longest, jnp.int32)
  cache = models.init_cache(model.config, batch, capacity)
  tokens = {T: jnp.ones((batch, _positions(T)), jnp.int32) for T in blocks}
  if mesh is not None:
    rows = lambda x: sharding.named(('batch',) + (None,) * (x.ndim - 1), x.shape, mesh, rules)
    cache = sharding.put(cache, kv_cache.shardings(cache, mesh, rules))
    lengths_B, tokens = sharding.put((lengths_B, tokens), jax.tree.map(rows, (lengths_B, tokens)))
  return model.config, model.params, cache, tokens, lengths_B


def extend_launches(model: models.Model, T: int, capacity: int, *, batch: int = 1,
                    steps: int = 8, mesh: Mesh | None = None,
                    rules: sharding.Rules = sharding.DEFAULT_RULES) -> int | None:
  """The operations one `extend` of T positions per row runs, in the program `extend_seconds`
  times (compiled by it already, else now): its loop body's instructions that run work
  (`hlo.launches`; on a GPU about one kernel each). None if XLA left no loop (unrolled it)."""
  config, params, cache, tokens, lengths_B = _extend_args(model, (T,), capacity, batch, mesh,
                                                          rules)
  return hlo.loop_launches(extend_program.lower(config, steps, params, cache, tokens[T],
                                                lengths_B).compile().as_text())


def extend_seconds(model: models.Model, blocks: Sequence[int], capacity: int, *, repeats: int,
                   batch: int = 1, steps: int = 8, mesh: Mesh | None = None,
                   rules: sharding.Rules = sharding.DEFAULT_RULES, compile_threads: int = 1
                   ) -> tuple[dict[int, float], int, bool]:
  """Median seconds of one `extend` appending T tokens per row, for each T in `blocks` (a
  `models.TokenTree` in `blocks`: a call on that tree, its nodes and root, keyed by the tree).

  Each timed call runs `steps` extends in one jitted loop and counts a `steps`-th of its time:
  the cost of a step inside a decoding program, without the per-call dispatch of a jitted call
  from Python (about 0.1-0.2 ms here, which would swamp the step of a small model).
  Returns ({T: seconds}, KV cache bytes, whether the donated cache came back in place). Every step
  writes at fixed lengths (capacity - max T), so it stays in bounds and attends over (almost) the
  whole cache. The blocks take turns within each repeat, so that a slow spell of the machine
  falls on all of them and their ratios stay comparable. On `mesh` the model is placed by its
  logical rules (before timing), the cache sharded like the weights, the rows on `data`. With
  `compile_threads` > 1 the blocks' programs compile first, that many at a time (`timing.warm`).
  """
  config, params, cache, tokens, lengths_B = _extend_args(model, blocks, capacity, batch, mesh,
                                                          rules)
  state = {'cache': cache}
  kv_bytes = sum(x.nbytes for x in state['cache'].k + state['cache'].v)
  first_buffer = lambda: state['cache'].k[0].addressable_shards[0].data.unsafe_buffer_pointer()
  buffer = first_buffer()

  tree_of = lambda T: T if isinstance(T, models.TokenTree) else None

  def call(T):
    state['cache'], checksum_B = extend_program(config, steps, params, state['cache'], tokens[T],
                                                lengths_B, **_tree_kwargs(tree_of(T)))
    return checksum_B

  if compile_threads > 1:  # Compiled, not run (the cache is donated); the first calls find them.
    timing.warm([functools.partial(_compile_extend, config, steps, params, state['cache'],
                                   tokens[T], lengths_B, tree_of(T)) for T in blocks],
                threads=compile_threads)

  seconds = timing.medians({T: functools.partial(call, T) for T in blocks}, repeats=repeats,
                           warmup=2)  # The first call of each compiles.
  times = {T: seconds[T] / steps for T in blocks}
  return times, kv_bytes, first_buffer() == buffer


@dataclasses.dataclass(frozen=True)
class DecodeResult:
  """One model, dtype and path at batch 1. Times in seconds; bytes per decoded token."""
  dtype: str
  path: str  # The model's kernels: 'native' (packed for the CPU kernels, `models.pack`) or 'xla'.
  num_params: int
  param_bytes: int  # All parameters.
  weight_bytes: int  # Parameter bytes a step reads (`weight_bytes_per_token`).
  kv_bytes: int  # Keys and values of every layer at full capacity, all read by a step.
  capacity: int  # Cache slots: prompt_len + max_new_tokens.
  step: float  # Median `extend` with T=1 inside a jitted loop (`extend_seconds`).
  block: int  # T of the multi-token `extend`.
  block_step: float  # Median `extend` with T=block on the same cache.
  cache_in_place: bool  # The donated cache came back in the same buffers.
  prefill: float  # Median `prefill` of the prompt.
  max_new_tokens: int
  ars_first_call: float  # First `autoregressive_sample` call: compile + run.
  ars: float  # Median `autoregressive_sample` run (prefill + max_new_tokens tokens).

  @property
  def bytes_per_token(self) -> int:
    return self.weight_bytes + self.kv_bytes

  @property
  def step_bandwidth(self) -> float:
    """GB/s read by the one-token step (weights and the whole cache)."""
    return self.bytes_per_token / self.step / 1e9

  @property
  def weight_bandwidth(self) -> float:
    """GB/s of weights read by the one-token step (the whole step's time charged to them)."""
    return self.weight_bytes / self.step / 1e9

  @property
  def ars_per_token(self) -> float:
    return self.ars / self.max_new_tokens

  @property
  def ars_per_decode_step(self) -> float:
    """ArS time without its prefill, per decode step (the first token comes from the prefill)."""
    return (self.ars - self.prefill) / max(1, self.max_new_tokens - 1)

  @property
  def ars_bandwidth(self) -> float:
    """GB/s read by one ArS decode step (the same bytes as the standalone step)."""
    return self.bytes_per_token / self.ars_per_decode_step / 1e9

  @property
  def block_ratio(self) -> float:
    return self.block_step / self.step


def measure_decode(model: models.Model, *, prompt_len: int, max_new_tokens: int, block: int = 5,
                   repeats: int = 10, ars_repeats: int = 3,
                   sampling_config: sampling.SamplingConfig = sampling.SamplingConfig(),
                   seed: int = 0, mesh: Mesh | None = None) -> DecodeResult:
  """Times the cached decode step (T=1 and T=block) and end-to-end ArS of `model` at batch 1
  (on `mesh`, if given, with the model placed by the logical rules before anything is timed)."""
  model = common.place_params(model, mesh)
  config, params = model.config, model.params
  capacity = prompt_len + max_new_tokens

  times, kv_bytes, cache_in_place = extend_seconds(model, (1, block), capacity, repeats=repeats,
                                                   mesh=mesh)
  one, many = times[1], times[block]

  # Any ids will do (no eos: every run decodes max_new_tokens); no RNG program to compile.
  prompts_BxP = (np.arange(prompt_len, dtype=np.int32)[None, :] * 7 + 1) % config.vocab_size
  prompt_lengths_B = np.full((1,), prompt_len, np.int32)
  _, prompts_BxP, prompt_lengths_B = common.place(model, prompts_BxP, prompt_lengths_B, mesh)
  fill = jax.jit(models.prefill, static_argnums=(0, 4))
  prefill = timing.median_seconds(
      lambda: fill(config, params, prompts_BxP, prompt_lengths_B, capacity), repeats=ars_repeats)

  calls = iter(range(1 + ars_repeats))
  ars = lambda: sampling.autoregressive_sample(
      model, prompts_BxP, prompt_lengths_B, jax.random.key(seed + next(calls)),
      max_new_tokens=max_new_tokens, sampling=sampling_config, mesh=mesh)
  start = time.perf_counter()
  jax.block_until_ready(ars())
  ars_first_call = time.perf_counter() - start
  ars_s = timing.median_seconds(ars, repeats=ars_repeats, warmup=0)

  return DecodeResult(
      dtype=config.dtype, path=model.config.kernels,
      num_params=models.num_params(params),
      param_bytes=sum(x.nbytes for x in jax.tree.leaves(params)),
      weight_bytes=weight_bytes_per_token(config, params), kv_bytes=kv_bytes, capacity=capacity,
      step=one, block=block, block_step=many, cache_in_place=cache_in_place, prefill=prefill,
      max_new_tokens=max_new_tokens, ars_first_call=ars_first_call, ars=ars_s)


def report(result: DecodeResult, copy: 'CopyBandwidth | None' = None) -> list[str]:
  """Lines for one result; with `copy`, the weights' bandwidth as a share of the copy's."""
  r, mb = result, 1e-6
  tag = f'[{r.dtype} {r.path}]'
  share = (f' = {r.weight_bandwidth / copy.best:.0%} of the copy bandwidth'
           if copy is not None else '')
  return [
      f'{tag} {r.num_params:,} parameters = {r.param_bytes * mb:.1f} MB; a step reads '
      f'{r.weight_bytes * mb:.1f} MB of weights + at most {r.kv_bytes * mb:.1f} MB of KV cache '
      f'(capacity {r.capacity})',
      f'{tag} extend T=1 (in a jitted loop, donated cache'
      f'{"" if r.cache_in_place else " NOT in place"}): '
      f'{r.step * 1e3:.2f} ms/token -> weights read at {r.weight_bandwidth:.2f} GB/s{share}',
      f'{tag} extend T={r.block}: {r.block_step * 1e3:.2f} ms = {r.block_ratio:.2f}x extend T=1 '
      f'(s)',
      f'{tag} autoregressive_sample, {r.max_new_tokens} new tokens: first call (compile + '
      f'run) {r.ars_first_call:.1f} s; run {r.ars:.3f} s = {r.ars_per_token * 1e3:.2f} ms/token '
      f'end to end; without its prefill ({r.prefill * 1e3:.1f} ms) '
      f'{r.ars_per_decode_step * 1e3:.2f} ms/step',
  ]


def batch_scoring_report(model: models.Model, batch: int, block: int, capacity: int, *,
                         repeats: int, mesh: Mesh | None = None) -> list[str]:
  """One line: `extend` at `batch` rows on 1 position, and s(T) = `extend` on T positions / on 1
  for T = 2 .. `block` (the cost of scoring T - 1 drafts per row; at batch 8 on a 2-core CPU the
  rows x positions make the products compute-bound, where batch 1's are bound by the reads)."""
  if batch < 1 or block < 2:
    raise ValueError(f'Need batch >= 1 and block >= 2, got batch={batch}, block={block}.')
  blocks = tuple(range(1, block + 1))
  times, _, _ = extend_seconds(model, blocks, capacity, repeats=repeats, batch=batch, mesh=mesh)
  ratios = ', '.join(f's({T}) {times[T] / times[1]:.2f}' for T in blocks[1:])
  return [f'[{model.config.dtype} {model.config.kernels}] batch {batch}: extend T=1 '
          f'{times[1] * 1e3:.2f} ms, {ratios} (blocks alternating in each repeat, capacity '
          f'{capacity})']


def copy_report(copy: CopyBandwidth) -> list[str]:
  return [
      f'copy of {copy.nbytes / 2**20:.0f} MiB float32, GB/s read + written: jit(jnp.copy) into a '
      f'fresh output {copy.jax_fresh:.2f}; jit copy into a donated buffer {copy.jax_donated:.2f}; '
      f'numpy copyto {copy.numpy:.2f}',
  ]


@dataclasses.dataclass(frozen=True)
class Costs:
  """Measured step costs at one batch and cache size (seconds, medians)."""
  target_step: float
  draft_step: float
  score_call: float  # Target `extend` on k + 1 positions, or on a drafter's tree (`scored`).
  draft_loop: float | None = None  # A loop's draft calls (`Drafter.draft_calls`; None: steps).
  scored: int | None = None  # Positions the score call reads; None: k + 1.

  @property
  def c(self) -> float:
    return self.draft_step / self.target_step

  @property
  def s(self) -> float:
    return self.score_call / self.target_step

  @property
  def draft_steps(self) -> float | None:
    """A loop's draft calls in one-position draft steps (None where not measured)."""
    if self.draft_loop is None:
      return None
    return self.draft_loop / self.draft_step if self.draft_step > 0 else 0.0


def measure_costs(target: models.Model, draft: models.Model | None, k: int, batch: int,
                  capacity: int, repeats: int = 20, mesh: Mesh | None = None,
                  tree: models.TokenTree | None = None,
                  draft_calls: tuple[int, ...] | None = None) -> Costs:
  """Step costs; a drafter without a model (draft None) costs nothing per step (c = 0). With a
  `tree` (`Drafter.tree`) the score call is the target's call on its nodes and root; with
  `draft_calls` (`Drafter.draft_calls`) a loop's draft calls are timed too, each as a call on
  as many positions (a level's call sees its ancestors only, which changes little but the
  mask)."""
  scored = k + 1 if tree is None else tree
  t, _, _ = extend_seconds(target, (1, scored), capacity, repeats=repeats, batch=batch,
                           mesh=mesh)
  widths = tuple(sorted(set(draft_calls or ()) | {1}))
  d = {w: 0.0 for w in widths}
  if draft is not None and feature_head.is_head(draft):
    d = {w: head_step_seconds(draft, target, k, capacity, repeats=repeats, batch=batch,
                              mesh=mesh, positions=w) for w in widths}
  elif draft is not None:
    d, _, _ = extend_seconds(draft, widths, capacity, repeats=repeats, batch=batch, mesh=mesh)
  return Costs(target_step=t[1], draft_step=d[1], score_call=t[scored],
               draft_loop=None if draft_calls is None else sum(d[w] for w in draft_calls),
               scored=None if tree is None else tree.num_nodes + 1)


def _head_steps(steps, k, head, target, cache, features_BxTxD, tokens_BxT, lengths_B):
  """`steps` draft steps of a head in one program: an EAGLE head reading T pairs (at the same
  row lengths), parallel heads' one pass of k drafts (from the first pair), or one stage of an
  MLP speculator on T nodes (its states reading the step before's output, so that no step is
  hoisted)."""

  def one(_, carry):
    cache, checksum_B = carry
    if feature_head.kind(head) == 'heads':
      logits_BxKxV, _ = feature_head.parallel_heads(head, target, features_BxTxD[:, 0],
                                                    tokens_BxT[:, 0], num=k)
    elif feature_head.kind(head) == 'mlp':  # A stage on T nodes (a tree's level: T > 1).
      B, T, D = features_BxTxD.shape
      states_BTxD = (features_BxTxD + 1e-30 * checksum_B[:, None, None]).reshape(B * T, D)
      logits_BTxV, _ = feature_head.speculator_stage(head, target, 0, states_BTxD,
                                                     tokens_BxT.reshape(B * T))
      logits_BxKxV = logits_BTxV.reshape(B, T, -1)
    else:  # A Falcon head's block sees up to its last pair (by XLA's attention: `Attention`).
      T = tokens_BxT.shape[1]
      sees_BxT = (jnp.broadcast_to((lengths_B + T - 1)[:, None], tokens_BxT.shape)
                  if head.config.drafts_per_pass > 1 else None)
      logits_BxKxV, _, cache = feature_head.extend_head(
          head, target, cache.with_lengths(lengths_B), features_BxTxD, tokens_BxT,
          sees_BxT=sees_BxT)
    return cache, checksum_B + logits_BxKxV[:, -1, 0]

  B = tokens_BxT.shape[0]
  return jax.lax.fori_loop(0, steps, one, (cache, jnp.zeros((B,), jnp.float32)))


_head_program = jax.jit(_head_steps, static_argnums=(0, 1), donate_argnums=4)  # As extend_program.


def head_step_seconds(head: models.Model, target: models.Model, k: int, capacity: int, *,
                      repeats: int, batch: int = 1, steps: int = 8,
                      mesh: Mesh | None = None, positions: int = 1) -> float:
  """Median seconds of one draft step of a head over `target`'s features (`draft_steps` of its
  drafter count them): `positions` pairs (one a step; a tree's level more) through an EAGLE
  head and the target's output layer at a nearly full cache, or parallel heads' pass of k
  drafts; timed as `extend_seconds` times."""
  head, target = (common.place_params(m, mesh) for m in (head, target))
  run = functools.partial(_head_program, steps, k)
  cache = models.init_cache(head.config, batch, capacity)
  lengths_B = jnp.full((batch,), capacity - positions, jnp.int32)
  features_BxTxD = jnp.ones((batch, positions, head.config.d_model), head.config.jnp_dtype)
  tokens_BxT = jnp.ones((batch, positions), jnp.int32)
  state = {'cache': cache}

  def call():
    state['cache'], checksum_B = run(head, target, state['cache'], features_BxTxD, tokens_BxT,
                                     lengths_B)
    return checksum_B

  return timing.medians({0: call}, repeats=repeats, warmup=2)[0] / steps
