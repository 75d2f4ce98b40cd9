"""Meshes and the logical-axis rules that place parameters, caches and batches on them.

Megatron-style tensor parallelism over mesh axis `model` (attention heads, MLP hidden units and the
vocabulary are split; the residual stream `embed` is replicated) and data parallelism over `data`.
Every array names its dimensions logically (`('embed', 'heads', 'head_dim')`); a rules table, kept in
config, maps the names to mesh axes.

Invariant: a dimension is sharded only if the mesh axis divides it; otherwise it is replicated (for
example kv heads under MQA, where one kv head cannot be split over the `model` axis).
"""

from collections.abc import Sequence
import math

from absl import logging
import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

Rules = tuple[tuple[str, str | None], ...]

# Logical name -> mesh axis. Cache names follow the weights they come from, so a row's keys and
# values live on the devices that hold that row's heads.
DEFAULT_RULES: Rules = (
    ('batch', 'data'),
    ('length', None),
    ('embed', None),
    ('heads', 'model'),
    ('kv_heads', 'model'),
    ('head_dim', None),
    ('mlp', 'model'),
    ('vocab', 'model'),
    ('cache_batch', 'data'),
    ('cache_sequence', None),
    ('cache_heads', 'model'),
    ('cache_head_dim', None),
    ('fuse', None),  # A feature head's two inputs (`models.feature_head`).
)

MESH_AXES = ('data', 'model')


def make_mesh(data: int = 1, model: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A ('data', 'model') mesh with explicit Auto axis types (JAX's default has changed before).

  `jax.make_mesh` orders the devices by the chips' topology (on a TPU slice: neighbours along
  each axis), not by host, so an axis may span processes; every input is built from global values
  each process computes (`put`), so any layout gives the same results.
  """
  devices = list(jax.devices() if devices is None else devices)
  if data < 1 or model < 1:
    raise ValueError(f'Mesh axes must be >= 1, got data={data}, model={model}.')
  if data * model != len(devices):
    raise ValueError(
        f'Mesh data={data} x model={model} needs {data * model} devices; {len(devices)} available.')
  return jax.make_mesh((data, model), MESH_AXES, axis_types=(AxisType.Auto,) * 2, devices=devices)


def mesh_of(devices_DxM) -> Mesh:
  """A ('data', 'model') mesh with exactly this layout of devices (rows: `data`, columns: `model`),
  for layouts `make_mesh` would not choose, such as a `model` axis across processes (2 processes
  of 2 devices: [[d0, d2], [d1, d3]]). `jax.make_mesh` reorders the devices it is given on some
  platforms (by id on GPUs); this one keeps them as they are."""
  devices_DxM = np.asarray(devices_DxM, dtype=object)
  if devices_DxM.ndim != 2:
    raise ValueError(f'A mesh layout is a 2-D array of devices [data, model], got shape '
                     f'{devices_DxM.shape}.')
  return Mesh(devices_DxM, MESH_AXES, axis_types=(AxisType.Auto,) * 2)


def run_mesh(data: int = 1, model: int = 1) -> Mesh:
  """A run's mesh from its `data` / `model_axis` settings: one process may use the first
  data x model of its devices (said in the log), several processes must use them all."""
  devices = jax.devices()
  if jax.process_count() == 1 and data * model < len(devices):
    logging.warning('Using %d of the %d devices (mesh data=%d x model=%d).', data * model,
                    len(devices), data, model)
    devices = devices[:data * model]
  return make_mesh(data, model, devices)


def mesh_from_axes(data: int = 1, model: int = 1) -> Mesh | None:
  """The sampling binaries' mesh: None for 1 x 1 (one device, where models are packed for the
  native CPU kernels), else `run_mesh`."""
  return None if data * model == 1 else run_mesh(data, model)


def validate_rules(rules: Rules) -> Rules:
  rules = tuple((str(name), axis) for name, axis in rules)
  for name, axis in rules:
    if axis is not None and axis not in MESH_AXES:
      raise ValueError(f'Rule {name!r} -> {axis!r}: mesh axis must be one of {MESH_AXES} or None.')
  names = [name for name, _ in rules]
  if len(set(names)) != len(names):
    raise ValueError(f'Logical axis rules name an axis twice: {names}.')
  return rules


def spec(names: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
         rules: Rules = DEFAULT_RULES) -> PartitionSpec:
  """PartitionSpec for logical `names`, replicating dimensions the mesh axis does not divide."""
  table = dict(rules)
  axes = []
  used = set()
  for name, size in zip(names, shape, strict=True):
    if name is not None and name not in table:
      raise ValueError(f'No sharding rule for logical axis {name!r}; rules cover {sorted(table)}.')
    axis = table.get(name) if name is not None else None
    if axis is None or axis in used or size % mesh.shape[axis]:
      axes.append(None)
    else:
      axes.append(axis)
      used.add(axis)
  return PartitionSpec(*axes)


def replicated_dims(dims: dict[str, int], mesh: Mesh,
                    rules: Rules = DEFAULT_RULES) -> dict[str, tuple[int, str, int]]:
  """{name: (size, mesh axis, axis size)} of the logical dimensions in `dims` (name -> size) whose
  rule names a mesh axis of more than one device that does not divide them: `spec` replicates
  them on that axis, so their work is repeated on every shard of it."""
  table = dict(rules)
  unfit = {}
  for name, size in dims.items():
    axis = table.get(name)
    if axis is not None and mesh.shape[axis] > 1 and size % mesh.shape[axis]:
      unfit[name] = (size, axis, mesh.shape[axis])
  return unfit


def named(names: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
          rules: Rules = DEFAULT_RULES) -> NamedSharding:
  return NamedSharding(mesh, spec(names, shape, mesh, rules))


def tree_shardings(boxed_abstract, mesh: Mesh, rules: Rules = DEFAULT_RULES):
  """Shardings for a tree of `nn.LogicallyPartitioned` abstract values (from `jax.eval_shape`)."""

  def one(leaf):
    if isinstance(leaf, nn.LogicallyPartitioned):
      return named(leaf.names, leaf.value.shape, mesh, rules)
    return NamedSharding(mesh, PartitionSpec())

  return jax.tree.map(one, boxed_abstract,
                      is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))


def put(tree, shardings):
  """Places a pytree on `shardings` (a matching tree), also across processes.

  Arrays already on devices are resharded by `jax.device_put`. Host values must be the same on
  every process (the global value); each process then builds the shards of its own devices
  (`jax.make_array_from_callback`), which works with one process or many.
  """

  def one(x, s):
    if isinstance(x, jax.Array):
      return jax.device_put(x, s)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, s, lambda index: host[index])

  return jax.tree.map(one, tree, shardings)


def check_batch(batch: int, mesh: Mesh | None) -> None:
  if mesh is not None and batch % mesh.shape['data']:
    raise ValueError(
        f'Batch size {batch} is not divisible by the mesh data axis ({mesh.shape["data"]}).')


def num_devices(mesh: Mesh | None) -> int:
  return 1 if mesh is None else math.prod(mesh.shape.values())
