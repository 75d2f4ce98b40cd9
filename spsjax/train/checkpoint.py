"""Checkpoints with orbax's CheckpointManager: one step directory holds everything a run needs.

Items per step: `state` (params, optimizer state, step; StandardSave), `data` (the input iterator's
position, JSON), `meta` (the model config, the training config and the tokenizer, JSON). Saves are
asynchronous and atomic: a step directory becomes visible only when complete, so after a crash the
latest step is whole and its data position matches its parameters (no batch is seen twice).

A directory is local or a URI (`gs://bucket/...`), handed to orbax as an epath.Path (`storage`):
orbax reaches it through epath and, for the arrays, tensorstore's own drivers (on GCS, where a
rename is no atomic operation, a step is complete once its `commit_success.txt` is written).
"""

import base64
import dataclasses

import jax
import orbax.checkpoint as ocp

from spsjax import storage
from spsjax.models import TransformerConfig
from spsjax.models.config import COMPUTE_FIELDS


def manager(directory: str, *, keep: int = 3, save_every: int = 1,
            create: bool = True) -> ocp.CheckpointManager:
  directory = storage.path(directory)
  if not create and not directory.is_dir():
    raise FileNotFoundError(f'Checkpoint directory {directory} does not exist.')
  options = ocp.CheckpointManagerOptions(max_to_keep=keep, save_interval_steps=save_every,
                                         create=create, enable_async_checkpointing=True)
  return ocp.CheckpointManager(directory, options=options, item_names=('state', 'data', 'meta'))


def encode_meta(model_config: TransformerConfig, tokenizer_bytes: bytes, extra: dict) -> dict:
  # The model, not how a placed copy computes: `kernels` and `single_row` are left out
  # (parameters are saved in XLA's layout), so a checkpoint's meta reads the same without them.
  model = {k: v for k, v in dataclasses.asdict(model_config).items() if k not in COMPUTE_FIELDS}
  return dict(model=model,
              tokenizer=base64.b64encode(tokenizer_bytes).decode('ascii'), **extra)


def decode_meta(meta: dict) -> tuple[TransformerConfig, bytes]:
  return TransformerConfig(**meta['model']), base64.b64decode(meta['tokenizer'])


def same_model(meta: dict, model_config: TransformerConfig) -> bool:
  """Whether a checkpoint's meta describes `model_config`. A field the checkpoint predates takes
  its default (the model it trained computed exactly that), so adding an option with a default to
  TransformerConfig never strands a checkpoint; how `model_config` computes does not count."""
  defaults = {f.name: f.default for f in dataclasses.fields(TransformerConfig)
              if f.name in COMPUTE_FIELDS}
  return decode_meta(meta)[0] == dataclasses.replace(model_config, **defaults)


def save(mngr: ocp.CheckpointManager, step: int, state, data_state: dict, meta: dict,
         force: bool = False) -> bool:
  return mngr.save(step, args=ocp.args.Composite(
      state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state),
      meta=ocp.args.JsonSave(meta)), force=force)


def read_meta(mngr: ocp.CheckpointManager, step: int | None = None) -> dict:
  step = mngr.latest_step() if step is None else step
  if step is None:
    raise FileNotFoundError(f'No checkpoint in {mngr.directory}.')
  return mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))['meta']


def restore(mngr: ocp.CheckpointManager, abstract_state, step: int | None = None):
  """(state placed like `abstract_state`'s shardings, data position, meta) of a step (latest)."""
  step = mngr.latest_step() if step is None else step
  if step is None:
    raise FileNotFoundError(f'No checkpoint in {mngr.directory}.')
  restored = mngr.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore(),
      meta=ocp.args.JsonRestore()))
  return restored['state'], restored['data'], restored['meta']


def restore_params(mngr: ocp.CheckpointManager, abstract_params, step: int | None = None):
  """(params placed like `abstract_params`' shardings, meta) of a step (latest), reading nothing
  else of the state: no optimizer moments, no step counter (what sampling and evaluation need)."""
  step = mngr.latest_step() if step is None else step
  if step is None:
    raise FileNotFoundError(f'No checkpoint in {mngr.directory}.')
  item = {'params': abstract_params}
  restore_args = jax.tree.map(lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding), item)
  restored = mngr.restore(step, args=ocp.args.Composite(
      state=ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True),
      meta=ocp.args.JsonRestore()))
  return restored['state']['params'], restored['meta']


def abstract_like(tree):
  """ShapeDtypeStructs with shardings: the restore target for arrays laid out like `tree`."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
