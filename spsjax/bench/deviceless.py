"""What a program becomes on a GPU or a TPU, from a machine without one: compile-only devices.

JAX's CUDA plugin compiles for a GPU described by a target config, and libtpu for a TPU slice of
a named topology (`jax.experimental.topologies`), without opening one. The optimized HLO they
return is what the accelerator would run. On a GPU each fusion, GEMM and copy in it launches
about one kernel, so `hlo.launches_by_phase` counts a decoding loop's kernels per phase, and which
products XLA:GPU makes GEMMs and which a multiply and a reduce, for the sessions lent no GPU. On
a TPU the whole program is one, the counts are its ops (fusions, and the asynchronous copies
that stage weights in on-chip memory), and a mesh of several chips shows the collectives that
the model axis adds (`hlo.loop_collectives`). `experiments/compile_only.py` reports them for the
accelerator check's programs (a step, ArS, SpS), with the memory each device needs.

What it does not give: times (XLA's cost estimates of a program with loops are not times), and
autotuning: Triton GEMMs get default tiles, often split in K (a GEMM and a reduce where the
autotuned program may have one kernel). The plugin's XLA is the installed JAX's, and layouts
move between versions: at fd1366c llama1b's unpadded step loop compiled this way by JAX 0.10.2
for an H200 launched 426 ops, the H200's own JAX 0.11.2 compile 362 (0.10.2 carried the value
cache in another layout and transposed it there and back every step, 4 ops a layer that a batch
of one's write as one dynamic-update-slice now avoids); the projections' forms and the
attention's kernels agreed.

Needs, at the installed JAX's version V: for a GPU the CUDA plugin (`pip install
jax-cuda12-plugin==V jax-cuda12-pjrt==V`), for a TPU libtpu (the version `jax[tpu]==V` pins);
on a machine without the accelerator, `JAX_PLATFORMS=cpu` before JAX starts (the plugins then
register without looking for a device) and, for several processes compiling for a TPU at once,
`ALLOW_MULTIPLE_LIBTPU_LOAD=1` (libtpu otherwise locks itself to one process);
`experiments/compile_only.py` sets both.
"""

import functools
import importlib.metadata
import re

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from spsjax import models, sharding
from spsjax.bench import decode
from spsjax.models import feature_head, kv_cache
from spsjax.sampling import SamplingConfig, autoregressive, drafters, speculative

# Hopper GPUs as XLA's own target specs describe them (xla/backends/gpu/target_config/specs),
# in the fields JAX 0.10's GpuTargetConfigProto reads: (name, HBM bytes/s, HBM bytes).
_HOPPER = {
    'h100': ('NVIDIA H100 80GB HBM3', 3_352_320_000_000, 84_942_979_072),
    'h200': ('NVIDIA H200 141GB HBM3e', 4_800_000_000_000, 151_397_597_184),
}
# TPU generations with one JAX device per chip, by the rank of their topologies' chip grids.
_TPU_GRID_RANK = {'v5e': 2, 'v6e': 2, 'v5p': 3}
GPU_TARGETS = tuple(_HOPPER)
TPU_TARGETS = tuple(_TPU_GRID_RANK)
TARGETS = GPU_TARGETS + TPU_TARGETS
# A slice of n chips on one host, by grid rank: n -> its chips' grid (x, y, z).
_TPU_GRIDS = {2: {1: (1, 1, 1), 2: (1, 2, 1), 4: (2, 2, 1), 8: (2, 4, 1)},
              3: {1: (1, 1, 1), 2: (1, 2, 1), 4: (2, 2, 1), 8: (2, 2, 2)}}
TPU_CHIPS = (1, 2, 4, 8)


def target_config(target: str) -> str:
  """The GpuTargetConfigProto (text format) of `target`, one of `GPU_TARGETS`."""
  if target not in _HOPPER:
    raise ValueError(f'Unknown GPU target {target!r}; known: {list(GPU_TARGETS)}.')
  name, bandwidth, memory = _HOPPER[target]
  info = dict(threads_per_block_limit=1024, threads_per_warp=32, shared_memory_per_block=49152,
              shared_memory_per_core=233472, threads_per_core_limit=2048, core_count=132,
              fpus_per_core=128, block_dim_limit_x=2147483647, block_dim_limit_y=65535,
              block_dim_limit_z=65535, memory_bandwidth=bandwidth, l2_cache_size=52428800,
              clock_rate_ghz=1.98, device_memory_size=memory,
              shared_memory_per_block_optin=232448, registers_per_core_limit=65536,
              registers_per_block_limit=65536)
  fields = ''.join(f'  {key}: {value}\n' for key, value in info.items())
  return (f'gpu_device_info {{\n{fields}  cuda_compute_capability {{ major: 9 }}\n}}\n'
          f'platform_name: "CUDA"\ndnn_version_info {{ major: 9 minor: 10 patch: 0 }}\n'
          f'device_description_str: "{name}"\n')


def libtpu_requirement() -> str:
  """What to install for a compile-only TPU: the libtpu that `jax[tpu]` pins for this JAX."""
  for requirement in importlib.metadata.requires('jax') or ():
    found = re.match(r'\s*(libtpu\b[^;]*);.*extra\s*==\s*"tpu"', requirement)
    if found:
      return found.group(1).strip()
  return f'jax[tpu]=={jax.__version__}'


@functools.cache
def devices(target: str, chips: int = 1) -> tuple[jax.Device, ...]:
  """`chips` compile-only devices of `target` (one of `TARGETS`): programs lower and compile for
  them, none runs. A GPU comes alone; a TPU slice has 1, 2, 4 or 8 chips on one host, one device
  each. Raises ValueError for an unknown target or chip count, RuntimeError saying what to
  install where JAX cannot start the target's plugin."""
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  v = jax.__version__
  if target in _HOPPER:
    if chips != 1:
      raise ValueError(f'A compile-only GPU ({target}) comes alone; {chips} chips need a TPU '
                       f'target ({", ".join(TPU_TARGETS)}).')
    try:
      topology = topologies.get_topology_desc(platform='cuda', topology='1x1x1',
                                              target_config=target_config(target))
    except (NotImplementedError, RuntimeError) as e:
      raise RuntimeError(
          f'No compile-only {target} device: JAX {v} has no CUDA plugin it could start ({e}). '
          f'Install `jax-cuda12-plugin=={v} jax-cuda12-pjrt=={v}` and, without CUDA on this '
          'machine, set JAX_PLATFORMS=cpu before JAX starts.') from e
  elif target in _TPU_GRID_RANK:
    if chips not in TPU_CHIPS:
      raise ValueError(f'A compile-only TPU slice has {", ".join(map(str, TPU_CHIPS))} chips, '
                       f'not {chips}.')
    rank = _TPU_GRID_RANK[target]
    grid = _TPU_GRIDS[rank][chips]
    try:
      topology = topologies.get_topology_desc(
          topology_name=f'{target}:' + 'x'.join(map(str, grid[:rank])), platform='tpu',
          chips_per_host_bounds=grid)
    except (NotImplementedError, RuntimeError) as e:
      raise RuntimeError(
          f'No compile-only {target} slice: JAX {v} could not start libtpu ({e}). Install '
          f'`{libtpu_requirement()}` and, without a TPU on this machine, set JAX_PLATFORMS=cpu '
          'before JAX starts (and ALLOW_MULTIPLE_LIBTPU_LOAD=1 for several processes).') from e
  else:
    raise ValueError(f'Unknown target {target!r}; known: {list(TARGETS)}.')
  return tuple(topology.devices)


def device(target: str) -> jax.Device:
  """One compile-only device of `target` (`devices`)."""
  return devices(target)[0]


def _placed(shapes, shardings):
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes,
                      shardings)


def abstract_model(config: models.TransformerConfig, mesh: Mesh,
                   rules: sharding.Rules = sharding.DEFAULT_RULES) -> models.Model:
  """A model of `config` whose parameters are shapes laid out on `mesh` by their logical names
  (as `common.place_params` lays real ones): enough to compile."""
  return models.Model(config, _placed(models.param_shapes(config),
                                      models.param_shardings(config, mesh, rules)))


def abstract_head(kind: str, target: models.TransformerConfig, mesh: Mesh, *,
                  num_layers: int = 1,
                  rules: sharding.Rules = sharding.DEFAULT_RULES) -> models.Model:
  """A `feature_head` of `kind` over `target`'s features ('feature', 'falcon': `num_layers`
  blocks, a Falcon head's 2 drafts a pass; 'heads', 'mlp': `num_layers` heads or stages) whose
  parameters are shapes laid out on `mesh`."""
  config = feature_head.head_config(target, num_layers,
                                    drafts_per_pass=2 if kind == 'falcon' else 1)
  return models.Model(config, _placed(feature_head.param_shapes(kind, config),
                                      feature_head.param_shardings(kind, config, mesh, rules)))


def _rows(mesh: Mesh, rules: sharding.Rules, *shapes: tuple[int, ...]):
  """int32 inputs whose first dimension is the batch, its rows on `data`."""
  return tuple(jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding.named(
      ('batch',) + (None,) * (len(shape) - 1), shape, mesh, rules)) for shape in shapes)


def _key(mesh: Mesh):
  key = jax.eval_shape(lambda: jax.random.key(0))
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=replicated)


def compile_step(model: models.Model, mesh: Mesh, *, batch: int = 1, capacity: int = 258,
                 steps: int = 4,
                 rules: sharding.Rules = sharding.DEFAULT_RULES) -> jax.stages.Compiled:
  """`variants`' plain step program, compiled: `steps` one-position extends at lengths
  capacity - 1 (the accelerator check's llama1b step had 258 slots), the cache laid out like
  the weights and the rows on `data`."""
  sharding.check_batch(batch, mesh)
  cache = jax.eval_shape(lambda: models.init_cache(model.config, batch, capacity))
  cache = _placed(cache, kv_cache.shardings(cache, mesh, rules))
  tokens_Bx1, lengths_B = _rows(mesh, rules, (batch, 1), (batch,))
  return decode.extend_program.lower(model.config, steps, model.params, cache, tokens_Bx1,
                                     lengths_B).compile()


def compile_ars(model: models.Model, mesh: Mesh, *, batch: int = 1, prompt_len: int = 64,
                max_new_tokens: int = 128, sampling: SamplingConfig = SamplingConfig(),
                rules: sharding.Rules = sharding.DEFAULT_RULES) -> jax.stages.Compiled:
  """ArS's whole generation (`autoregressive.Loop.run`) on `mesh`, compiled (XLA's ops, as on
  any accelerator)."""
  sharding.check_batch(batch, mesh)
  loop = autoregressive.Loop(max_new_tokens=max_new_tokens, sampling=sampling, mesh=mesh,
                             rules=rules)
  return autoregressive.Loop.run.lower(loop, model, *_rows(mesh, rules, (batch, prompt_len),
                                                           (batch,)), _key(mesh)).compile()


def compile_sps(target: models.Model, draft: models.Model | None, mesh: Mesh, *, k: int = 4,
                batch: int = 1, prompt_len: int = 64, max_new_tokens: int = 128,
                sampling: SamplingConfig = SamplingConfig(),
                drafter: drafters.Drafter = drafters.ModelDrafter(),
                rules: sharding.Rules = sharding.DEFAULT_RULES) -> jax.stages.Compiled:
  """SpS's whole generation (`speculative.Loop.run`) on `mesh`, compiled, drafting up to k
  tokens a loop with `drafter` and `draft` (a transformer, a head of `abstract_head`, or None
  for prompt lookup)."""
  sharding.check_batch(batch, mesh)
  speculative.check_pair(target, draft, k, drafter)
  loop = speculative.Loop(k=k, max_new_tokens=max_new_tokens, sampling=sampling,
                          draft_sampling=sampling, mesh=mesh, rules=rules, drafter=drafter)
  return speculative.Loop.run.lower(loop, target, draft, *_rows(mesh, rules, (batch, prompt_len),
                                                                (batch,)), _key(mesh)).compile()


def device_bytes(compiled: jax.stages.Compiled) -> int | None:
  """Bytes one device holds while `compiled` runs, by XLA's memory analysis: its arguments,
  outputs and temporaries, less the outputs that reuse argument buffers; None where the
  backend gives no analysis."""
  stats = compiled.memory_analysis()
  if stats is None:
    return None
  return (stats.argument_size_in_bytes + stats.output_size_in_bytes
          + stats.temp_size_in_bytes - stats.alias_size_in_bytes)
