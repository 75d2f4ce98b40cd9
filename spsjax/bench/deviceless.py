"""What a program becomes on a GPU, from a machine without one: XLA:GPU's compile-only devices.

JAX's CUDA plugin compiles for a GPU described by a target config (`jax.experimental.topologies`)
without opening one. The optimized HLO it returns is what the GPU would run: each fusion, GEMM
and copy in it launches about one kernel, so `hlo.launches_by_phase` counts a decoding loop's
kernels per phase, and which products XLA:GPU makes GEMMs and which a multiply and a reduce, for
the 80% of sessions lent no GPU. `experiments/gpu_launches.py` reports them for the accelerator
check's programs (a step, ArS, SpS).

What it does not give: times, and autotuning: Triton GEMMs get default tiles, often split in K
(a GEMM and a reduce where the autotuned program may have one kernel). The plugin's XLA is the
installed JAX's, and layouts move between versions: at fd1366c llama1b's unpadded step loop
compiled this way by JAX 0.10.2 for an H200 launched 426 ops, the H200's own JAX 0.11.2 compile
362 (0.10.2 carried the value cache in another layout and transposed it there and back every
step, 4 ops a layer that a batch of one's write as one dynamic-update-slice now avoids); the
projections' forms and the attention's kernels agreed.

Needs the plugin of the installed JAX (`pip install jax-cuda12-plugin==V jax-cuda12-pjrt==V`,
V = `jax.__version__`) and, on a machine without CUDA, `JAX_PLATFORMS=cpu` before JAX starts: the
plugin then registers without looking for a GPU (`experiments/gpu_launches.py` sets it).
"""

import functools

import jax
import jax.numpy as jnp

from spsjax import models, sharding
from spsjax.bench import decode
from spsjax.models import feature_head
from spsjax.sampling import SamplingConfig, autoregressive, drafters, speculative

# Hopper GPUs as XLA's own target specs describe them (xla/backends/gpu/target_config/specs),
# in the fields JAX 0.10's GpuTargetConfigProto reads: (name, HBM bytes/s, HBM bytes).
_HOPPER = {
    'h100': ('NVIDIA H100 80GB HBM3', 3_352_320_000_000, 84_942_979_072),
    'h200': ('NVIDIA H200 141GB HBM3e', 4_800_000_000_000, 151_397_597_184),
}
TARGETS = tuple(_HOPPER)


def target_config(target: str) -> str:
  """The GpuTargetConfigProto (text format) of `target`, one of `TARGETS`."""
  if target not in _HOPPER:
    raise ValueError(f'Unknown GPU target {target!r}; known: {list(TARGETS)}.')
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


@functools.cache
def device(target: str) -> jax.Device:
  """A compile-only device of `target` (one of `TARGETS`): programs lower and compile for it,
  none runs. Raises RuntimeError, saying what to install, where JAX has no CUDA plugin."""
  config = target_config(target)
  try:
    from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
    topology = topologies.get_topology_desc(platform='cuda', topology='1x1x1',
                                            target_config=config)
  except (NotImplementedError, RuntimeError) as e:
    v = jax.__version__
    raise RuntimeError(
        f'No compile-only {target} device: JAX {v} has no CUDA plugin it could start ({e}). '
        f'Install `jax-cuda12-plugin=={v} jax-cuda12-pjrt=={v}` and, without CUDA on this '
        'machine, set JAX_PLATFORMS=cpu before JAX starts.') from e
  return topology.devices[0]


def _abstract(tree, dev: jax.Device):
  one = jax.sharding.SingleDeviceSharding(dev)
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), tree)


def abstract_model(config: models.TransformerConfig, dev: jax.Device) -> models.Model:
  """A model of `config` whose parameters are shapes placed on `dev`: enough to compile."""
  return models.Model(config, _abstract(models.param_shapes(config), dev))


def abstract_head(kind: str, target: models.TransformerConfig, dev: jax.Device, *,
                  num_layers: int = 1) -> models.Model:
  """A `feature_head` of `kind` over `target`'s features ('feature': `num_layers` blocks,
  'heads': `num_layers` heads) whose parameters are shapes placed on `dev`."""
  config = feature_head.head_config(target, num_layers)
  return models.Model(config, _abstract(feature_head.param_shapes(kind, config), dev))


def _key(dev: jax.Device):
  return _abstract(jax.eval_shape(lambda: jax.random.key(0)), dev)


def step_hlo(model: models.Model, dev: jax.Device, *, batch: int = 1, capacity: int = 258,
             steps: int = 4) -> str:
  """The optimized HLO of `variants`' plain step program: `steps` one-position extends at lengths
  capacity - 1 (the accelerator check's llama1b step had 258 slots)."""
  cache = _abstract(jax.eval_shape(lambda: models.init_cache(model.config, batch, capacity)), dev)
  tokens_Bx1, lengths_B = _abstract((jax.ShapeDtypeStruct((batch, 1), jnp.int32),
                                     jax.ShapeDtypeStruct((batch,), jnp.int32)), dev)
  return decode.extend_program.lower(model.config, steps, model.params, cache, tokens_Bx1,
                                     lengths_B).compile().as_text()


def _prompts(dev: jax.Device, batch: int, prompt_len: int):
  return _abstract((jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32),
                    jax.ShapeDtypeStruct((batch,), jnp.int32)), dev)


def ars_hlo(model: models.Model, dev: jax.Device, *, batch: int = 1, prompt_len: int = 64,
            max_new_tokens: int = 128, sampling: SamplingConfig = SamplingConfig()) -> str:
  """The optimized HLO of ArS's whole generation (`autoregressive.Loop.run`) on a 1 x 1 mesh of
  `dev` (XLA's ops, as on any accelerator)."""
  loop = autoregressive.Loop(max_new_tokens=max_new_tokens, sampling=sampling,
                             mesh=sharding.make_mesh(1, 1, [dev]))
  return autoregressive.Loop.run.lower(loop, model, *_prompts(dev, batch, prompt_len),
                                       _key(dev)).compile().as_text()


def sps_hlo(target: models.Model, draft: models.Model | None, dev: jax.Device, *, k: int = 4,
            batch: int = 1, prompt_len: int = 64, max_new_tokens: int = 128,
            sampling: SamplingConfig = SamplingConfig(),
            drafter: drafters.Drafter = drafters.ModelDrafter()) -> str:
  """The optimized HLO of SpS's whole generation (`speculative.Loop.run`) on a 1 x 1 mesh of
  `dev`, drafting up to k tokens a loop with `drafter` and `draft` (a transformer, a head of
  `abstract_head`, or None for prompt lookup)."""
  speculative.check_pair(target, draft, k, drafter)
  loop = speculative.Loop(k=k, max_new_tokens=max_new_tokens, sampling=sampling,
                          draft_sampling=sampling, mesh=sharding.make_mesh(1, 1, [dev]),
                          drafter=drafter)
  return speculative.Loop.run.lower(loop, target, draft, *_prompts(dev, batch, prompt_len),
                                    _key(dev)).compile().as_text()
