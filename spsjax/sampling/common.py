"""What every sampler shares: the output type, the pad id, input checks and per-row randomness.

Conventions: prompts are `int32[B, P]`, right-padded, with `prompt_lengths: int32[B]` in [1, P]; the
output holds generated tokens only, `PAD_ID` after each row's end.
"""

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from spsjax import sharding
from spsjax.models import Model, feature_head, param_shardings, unpack
from spsjax.sampling.processors import SamplingConfig, mark_present, typed_keys

PAD_ID = -1  # Fills `SampleOutput.tokens` after each row's last generated token.


@flax.struct.dataclass
class SampleOutput:
  tokens: jax.Array  # int32[B, max_new_tokens]; PAD_ID after a row's end.
  num_generated: jax.Array  # int32[B]; includes the eos token when a row stopped at eos.
  # Speculative sampling only (None for ArS):
  num_loops: jax.Array | None = None  # int32[B]: draft/score/accept loops the row took part in.
  num_accepted: jax.Array | None = None  # int32[B]: draft tokens accepted.
  accepted_histogram: jax.Array | None = None  # int32[k + 1]: loops that accepted exactly n drafts.
  num_drafted: jax.Array | None = None  # int32[B]: draft tokens proposed (k per loop, or fewer).
  num_full_loops: jax.Array | None = None  # int32[B]: loops that accepted every proposed draft.
  proposed_histogram: jax.Array | None = None  # int32[k + 1]: loops that proposed exactly n drafts.


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoopSettings:
  """What a sampler's program fixes when it is traced (ArS's and SpS's `Loop` extend it); frozen
  and hashable, so equal settings reuse one compiled program."""
  max_new_tokens: int
  sampling: SamplingConfig
  eos_id: int | tuple[int, ...] | None = None  # One id or several (`eos_ids`).
  mesh: Mesh | None = None
  rules: sharding.Rules = sharding.DEFAULT_RULES
  # XLA options of the program (`jax.jit`'s compiler_options), as sorted (name, value) pairs.
  compiler_options: tuple[tuple[str, Any], ...] = ()

  @property
  def native_kernel(self) -> bool:
    """Whether the native sampling kernel computes the distributions (one device: no mesh)."""
    return self.mesh is None

  @property
  def platform(self) -> str:
    """The platform the program is for: its mesh's devices' ('cpu', 'gpu', 'tpu'), else JAX's
    default backend's."""
    return self.mesh.devices.flat[0].platform if self.mesh is not None else jax.default_backend()


def compiler_options(options: Mapping[str, Any] | None) -> tuple[tuple[str, Any], ...]:
  """`LoopSettings.compiler_options` of a mapping of XLA option names to values (None: none)."""
  if options is None:
    return ()
  if not isinstance(options, Mapping) or not all(
      isinstance(k, str) and isinstance(v, (str, bool, int, float)) for k, v in options.items()):
    raise ValueError(f'compiler_options must map XLA option names to values (str, bool, int or '
                     f'float), got {options!r}.')
  return tuple(sorted(options.items()))


def program(method: Callable) -> Callable:
  """Jits a loop's `run(self, *args)` with `self` static and `self.compiler_options` as XLA's
  options: one `jax.jit` per set of options, each caching its programs as jit does. The result
  has jit's `lower(self, *args)` and `__wrapped__` (the method itself)."""

  @functools.cache
  def jitted(options):
    return jax.jit(method, static_argnums=0, compiler_options=dict(options) or None)

  @functools.wraps(method)
  def run(self, *args):
    return jitted(self.compiler_options)(self, *args)

  run.lower = lambda self, *args: jitted(self.compiler_options).lower(self, *args)
  return run


def local_rows(x) -> dict[int, np.ndarray]:
  """{global row index: row} of the rows of `x` this process holds: every row of a host array or
  of a fully addressable jax.Array, else those of its addressable shards (split by rows only)."""
  if not isinstance(x, jax.Array) or x.is_fully_addressable:
    return dict(enumerate(np.asarray(x)))
  rows = {}
  for shard in x.addressable_shards:
    if any(i.indices(n) != (0, n, 1) for i, n in zip(shard.index[1:], x.shape[1:])):
      raise ValueError(f'An array spread over processes must be split by rows only; a shard of '
                       f'shape {shard.data.shape} of {x.shape} splits another dimension.')
    data = np.asarray(shard.data)
    for i, row in zip(range(*shard.index[0].indices(x.shape[0])), data):
      rows[i] = row
  return rows


EosIds = int | Sequence[int] | None


def eos_ids(eos_id: EosIds) -> tuple[int, ...]:
  """A sampler's `eos_id` as the tuple of ids a row stops after: none, one, or several (an
  instruct model's end of turn beside its end of text); raises ValueError for anything else."""
  if eos_id is None:
    return ()
  ids = (eos_id,) if np.ndim(eos_id) == 0 else tuple(eos_id)
  if not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in ids):
    raise ValueError(f'eos_id must be an integer id, a sequence of them or None, got {eos_id!r}.')
  return tuple(int(i) for i in ids)


def check_inputs(model: Model, prompts, prompt_lengths, *, max_new_tokens: int,
                 eos_id: EosIds, mesh: Mesh | None, headroom: int = 0) -> None:
  """Raises ValueError naming the problem; `headroom` is extra cache a sampler needs past the end.

  Prompts may be jax.Arrays spread over processes (rows on the mesh's `data` axis): each process
  then checks the values of the rows it holds, and all of them the shapes.
  """
  config = model.config
  shape_of = lambda x: tuple(x.shape) if hasattr(x, 'shape') else np.shape(x)
  dtype_of = lambda x: np.dtype(x.dtype) if hasattr(x, 'dtype') else np.asarray(x).dtype
  if len(shape_of(prompts)) != 2 or not np.issubdtype(dtype_of(prompts), np.integer):
    raise ValueError(f'prompts must be an integer array [B, P], got '
                     f'{dtype_of(prompts)}{shape_of(prompts)}.')
  batch, width = shape_of(prompts)
  if (shape_of(prompt_lengths) != (batch,)
      or not np.issubdtype(dtype_of(prompt_lengths), np.integer)):
    raise ValueError(f'prompt_lengths must be integers of shape ({batch},), got '
                     f'{dtype_of(prompt_lengths)}{shape_of(prompt_lengths)}.')
  if batch == 0:
    raise ValueError('The batch is empty.')
  if mesh is None and any(isinstance(x, jax.Array) and not x.is_fully_addressable
                          for x in (prompts, prompt_lengths)):
    raise ValueError('Prompts spread over processes need the mesh they are laid out on.')
  length_rows = local_rows(prompt_lengths)
  prompt_rows = {i: row for i, row in local_rows(prompts).items() if i in length_rows}
  if not prompt_rows:  # This process holds no row with its length: the others check them.
    sharding.check_batch(batch, mesh)
    return
  prompts = np.stack([prompt_rows[i] for i in sorted(prompt_rows)])
  prompt_lengths = np.asarray([length_rows[i] for i in sorted(prompt_rows)])
  if prompt_lengths.min() < 1 or prompt_lengths.max() > width:
    raise ValueError(f'Every prompt length must be in [1, P={width}]; got lengths from '
                     f'{prompt_lengths.min()} to {prompt_lengths.max()}.')
  if int(max_new_tokens) != max_new_tokens or max_new_tokens < 1:
    raise ValueError(f'max_new_tokens must be an integer >= 1, got {max_new_tokens}.')
  need = int(prompt_lengths.max()) + max_new_tokens + headroom
  if need > config.max_seq_len:
    extra = f' + {headroom} positions of headroom the sampler needs' if headroom else ''
    raise ValueError(
        f'Longest prompt ({prompt_lengths.max()}) + max_new_tokens ({max_new_tokens}){extra} = '
        f'{need} exceeds the model max_seq_len ({config.max_seq_len}).')
  valid = np.arange(width)[None, :] < prompt_lengths[:, None]
  ids = prompts[valid]
  if ids.min() < 0 or ids.max() >= config.vocab_size:
    raise ValueError(f'Prompt token ids must be in [0, vocab_size={config.vocab_size}); got ids '
                     f'from {ids.min()} to {ids.max()}.')
  if any(not 0 <= i < config.vocab_size for i in eos_ids(eos_id)):
    raise ValueError(f'eos_id must be in [0, vocab_size={config.vocab_size}), got {eos_id}.')
  sharding.check_batch(batch, mesh)


def clean_padding(prompts_BxP: jax.Array, prompt_lengths_B: jax.Array) -> jax.Array:
  """Replaces padding (which may hold any id) by 0 so the prefill never embeds an invalid id."""
  valid_BxP = jnp.arange(prompts_BxP.shape[1])[None, :] < prompt_lengths_B[:, None]
  return jnp.where(valid_BxP, prompts_BxP, 0).astype(jnp.int32)


def check_rng(rng) -> None:
  """Raises TypeError unless `rng` is one JAX key: typed (`jax.random.key`) or legacy
  (`jax.random.PRNGKey`: uint32 key data). Both give the same tokens for the same seed."""
  dtype = rng.dtype if hasattr(rng, 'dtype') else np.asarray(rng).dtype
  if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    ok = np.ndim(rng) == 0
  else:
    ok = dtype == np.uint32 and np.shape(rng) == jax.random.key_data(jax.random.key(0)).shape
  if not ok:
    raise TypeError(f'rng must be one JAX key (jax.random.key(seed) or jax.random.PRNGKey(seed)), '
                    f'got {getattr(rng, "dtype", type(rng).__name__)}{tuple(np.shape(rng))}.')


def row_keys(rng: jax.Array, batch: int) -> jax.Array:
  """One independent typed key per row, from a typed or legacy key; a row's draws never depend
  on the other rows."""
  return jax.random.split(typed_keys(rng), batch)


def step_keys(row_keys_B: jax.Array, counters_B: jax.Array) -> jax.Array:
  """Per-row keys for one step, derived from a per-row counter (e.g. tokens generated so far)."""
  return jax.vmap(jax.random.fold_in)(row_keys_B, counters_B)


def whole_vocabulary(logits_BxV: jax.Array, mesh: Mesh | None,
                     rules: sharding.Rules = sharding.DEFAULT_RULES) -> jax.Array:
  """Logits [B, ..., V] about to be drawn from, their rows on `data` and each row whole on every
  device of `model` (no-op without a mesh or where `model` is 1). The model's output layer leaves
  the vocabulary split over `model`, and a draw's prefix sums gather it anyway (one all-gather);
  gathered before the draw, its max, sum, total and first-token reductions need no collective
  each, nor top-p's search (llama1b on 4 TPU v5e chips, compiled without one, with `draw_with`'s
  single reduction: an ArS step 34 collectives instead of 42, an SpS loop with its draft at
  k = 4 67 instead of 100; at top-p 0.95, 34 and 74 instead of 49 and 135)."""
  if mesh is None or mesh.shape['model'] == 1:
    return logits_BxV
  return jax.lax.with_sharding_constraint(logits_BxV, sharding.named(
      ('batch',) + (None,) * (logits_BxV.ndim - 1), logits_BxV.shape, mesh, rules))


def place(model: Model, prompts, prompt_lengths, mesh: Mesh | None,
          rules: sharding.Rules = sharding.DEFAULT_RULES):
  """Puts params, prompts and lengths on the mesh (params by their logical rules, rows on `data`)."""
  if mesh is None:
    return model, jnp.asarray(prompts, jnp.int32), jnp.asarray(prompt_lengths, jnp.int32)
  as_int32 = lambda x: x.astype(jnp.int32) if isinstance(x, jax.Array) else np.asarray(x, np.int32)
  prompts, prompt_lengths = as_int32(prompts), as_int32(prompt_lengths)
  prompts, prompt_lengths = sharding.put(
      (prompts, prompt_lengths),
      (sharding.named(('batch', 'length'), prompts.shape, mesh, rules),
       sharding.named(('batch',), prompt_lengths.shape, mesh, rules)))
  return place_params(model, mesh, rules), prompts, prompt_lengths


def place_params(model: Model, mesh: Mesh | None,
                 rules: sharding.Rules = sharding.DEFAULT_RULES) -> Model:
  """The model with its parameters laid out on `mesh` by their logical names.

  A model packed for the CPU kernel is unpacked first: on a mesh, XLA's dots do the products.
  """
  if mesh is None:
    return model
  model = unpack(model)
  if feature_head.is_head(model):
    shardings = feature_head.param_shardings(feature_head.kind(model), model.config, mesh, rules)
  else:
    shardings = param_shardings(model.config, mesh, rules)
  if all(isinstance(x, jax.Array) and x.sharding.is_equivalent_to(s, x.ndim)
         for x, s in zip(jax.tree.leaves(model.params), jax.tree.leaves(shardings))):
    return model  # Placed already (the binaries place once, at load): nothing to move per call.
  return model.replace(params=sharding.put(model.params, shardings))


def active_counts(active_B: jax.Array, positions: int) -> jax.Array:
  """`models.extend`'s counts for a decoding call of `positions` tokens per row: all of them for
  active rows, 0 for rows that stopped (a model packed for CPU decoding then skips their work)."""
  return jnp.where(active_B, positions, 0).astype(jnp.int32)


def initial_present(sampling: SamplingConfig, prompts_BxP: jax.Array, prompt_lengths_B: jax.Array,
                    vocab_size: int) -> jax.Array | None:
  """bool[B, V]: the tokens of each row's prompt, which a repetition penalty reads (the samplers
  then mark each committed token, `processors.mark_present`); None without a penalty (nothing
  tracked, the program unchanged)."""
  if not sampling.penalised:
    return None
  return mark_present(jnp.zeros((prompts_BxP.shape[0], vocab_size), bool), prompts_BxP,
                      prompt_lengths_B)


def output_buffer(batch: int, max_new_tokens: int, block: int) -> jax.Array:
  """PAD-filled output with room for one more block past max_new_tokens, so writes never clamp."""
  return jnp.full((batch, max_new_tokens + block), PAD_ID, jnp.int32)


def commit(tokens_BxW, num_generated_B, done_B, block_BxT, count_B, *, eos_id: EosIds,
           max_new_tokens: int):
  """Appends the first `count_B[b]` tokens of each active row's block to its output.

  A row takes no more than its remaining room, stops after an eos (any of `eos_ids(eos_id)`)
  inside the block (the eos is kept) and is marked done at eos or max_new_tokens. Returns
  (tokens, num_generated, done, emitted_B). Stopped rows are left untouched.
  """
  T = block_BxT.shape[1]
  position_T = jnp.arange(T)
  count_B = jnp.where(done_B, 0, jnp.minimum(count_B, max_new_tokens - num_generated_B))
  hit_eos_B = jnp.zeros_like(done_B)
  if eos_ids(eos_id):
    is_eos_BxT = functools.reduce(jnp.logical_or, [block_BxT == i for i in eos_ids(eos_id)])
    eos_BxT = is_eos_BxT & (position_T[None, :] < count_B[:, None])
    hit_eos_B = jnp.any(eos_BxT, axis=1)
    count_B = jnp.where(hit_eos_B, jnp.argmax(eos_BxT, axis=1) + 1, count_B)
  block_BxT = jnp.where(position_T[None, :] < count_B[:, None], block_BxT, PAD_ID)
  # Slots at and past num_generated are PAD, so writing PAD past count_B changes nothing.
  write = lambda row_W, block_T, start: jax.lax.dynamic_update_slice(row_W, block_T, (start,))
  tokens_BxW = jax.vmap(write)(tokens_BxW, block_BxT.astype(jnp.int32), num_generated_B)
  num_generated_B = num_generated_B + count_B
  done_B = done_B | hit_eos_B | (num_generated_B >= max_new_tokens)
  return tokens_BxW, num_generated_B, done_B, count_B


def last_token(prompts_BxP, prompt_lengths_B, tokens_BxW, num_generated_B, back: int = 1):
  """The `back`-th last committed token of each row (prompt followed by generated tokens)."""
  from_output_B = jnp.take_along_axis(
      tokens_BxW, jnp.maximum(num_generated_B - back, 0)[:, None], axis=1)[:, 0]
  from_prompt_B = jnp.take_along_axis(
      prompts_BxP, jnp.maximum(prompt_lengths_B + num_generated_B - back, 0)[:, None],
      axis=1)[:, 0]
  return jnp.where(num_generated_B >= back, from_output_B, from_prompt_B)
