"""Loading a trained model for sampling or evaluation: (Model, Tokenizer, meta) from a checkpoint.

The checkpoint's `meta` holds the model config and the tokenizer, so the restore target (shapes,
dtypes and, with a mesh, shardings by logical names) is rebuilt from the checkpoint alone; no config
file has to agree with it. Only the parameters are read: nothing here depends on training (the
optimizer's state in the checkpoint is left on disk).

A Hugging Face checkpoint directory (config.json, safetensors, tokenizer.json, or the
spsjax_tokenizer.model that experiments/export_hf.py writes) loads as well, wherever a checkpoint
is named (`models.hf`, `data.hf_tokenizer`); its meta is {'hf': config}. Every location is local or
a URI (`storage`).

The draft name `random` (`RANDOM_DRAFT`) loads no checkpoint: it is a useless draft (alpha ~ 0),
the baseline that k = 'auto' must not lose to.
"""

import dataclasses
from collections.abc import Sequence

import jax
from jax.sharding import Mesh

from spsjax import models, sharding, storage
from spsjax.data.hf_tokenizer import HFTokenizer
from spsjax.data.tokenizer import Tokenizer
from spsjax.models import hf
from spsjax.train import checkpoint


SPSJAX_TOKENIZER = 'spsjax_tokenizer.model'  # Our tokenizer in an exported HF directory.


def _hf_tokenizer(path: str):
  """An HF directory's tokenizer: tokenizer.json, or spsjax's own where we exported it."""
  own = storage.join(path, SPSJAX_TOKENIZER)
  if storage.path(own).is_file():
    return Tokenizer.load(own)
  return HFTokenizer.load(path)


def is_hf(path: str) -> bool:
  """Whether `path` is a Hugging Face checkpoint directory (it has a config.json)."""
  return (storage.path(path) / hf.CONFIG).is_file()


def load_model(workdir: str, *, step: int | None = None, mesh: Mesh | None = None,
               rules: sharding.Rules = sharding.DEFAULT_RULES
               ) -> tuple[models.Model, Tokenizer, dict]:
  """The model, tokenizer and meta of checkpoint `step` (default: latest) in `workdir`.

  Parameters come back sharded on `mesh` by their logical names, or on the default device. A
  head trained over a target's features (meta `head`) loads as a `models.feature_head` model.
  Raises FileNotFoundError for a missing directory or an empty one.
  """
  if is_hf(workdir):
    if step is not None:
      raise ValueError(f'{workdir} is a Hugging Face checkpoint: it has no steps (step={step}).')
    return (hf.load(workdir, mesh=mesh, rules=rules), _hf_tokenizer(workdir),
            {'hf': hf.read_config(workdir)})
  mngr = checkpoint.manager(workdir, create=False)
  try:
    saved_meta = checkpoint.read_meta(mngr, step)
    config, tokenizer_bytes = checkpoint.decode_meta(saved_meta)
    mesh = mesh or sharding.make_mesh(1, 1, jax.devices()[:1])
    head = saved_meta.get('head')  # A head over a target's features (`models.feature_head`).
    if head:
      shapes = models.feature_head.param_shapes(head, config)
      shardings = models.feature_head.param_shardings(head, config, mesh, rules)
    else:
      shapes = models.param_shapes(config)
      shardings = models.param_shardings(config, mesh, rules)
    abstract = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            shapes, shardings)
    params, meta = checkpoint.restore_params(mngr, abstract, step)
  finally:
    mngr.close()
  return models.Model(config, params), Tokenizer.from_bytes(tokenizer_bytes), meta


RANDOM_DRAFT = 'random'
RANDOM_SHARPNESS = 10.0  # The random draft's final norm scale: q is near one-hot.


def random_draft(target: models.TransformerConfig, seed: int = 0,
                 mesh: Mesh | None = None) -> models.Model:
  """A useless draft of `target`'s vocabulary: its first-layer shape (the truncated draft's) with
  random weights and logits scaled by `RANDOM_SHARPNESS`, so that q puts nearly all its mass on
  one arbitrary token, which the target rarely picks."""
  config = dataclasses.replace(target, num_layers=1)
  params = models.init_params(config, jax.random.key(seed), mesh=mesh)
  params['final_norm'] = jax.tree.map(lambda x: x * RANDOM_SHARPNESS, params['final_norm'])
  return models.Model(config, params)


def load_family(root: str, target: str, drafts: Sequence[str], *, mesh: Mesh | None = None,
                draft_weights: str = 'float32'
                ) -> tuple[models.Model, dict[str, models.Model], Tokenizer, dict]:
  """(target, {name: draft}, tokenizer, the target's meta) of one family (`<root>/<name>` each,
  or a Hugging Face checkpoint directory given as the name), checked to share one tokenizer.

  Without a mesh the models come placed for decoding on this machine (`models.for_decoding`:
  packed for the native CPU kernels where they can run, the drafts' packed weights stored as
  `draft_weights`, one of `models.WEIGHT_DTYPES`); on a mesh they are sharded (and `draft_weights` does
  not apply: XLA's dots run on the float32 weights). The draft `random` is `random_draft`.
  """
  if draft_weights not in models.WEIGHT_DTYPES:
    raise ValueError(f'draft_weights must be one of {models.WEIGHT_DTYPES}, not {draft_weights!r}.')
  place = (lambda m, *_: m) if mesh is not None else models.for_decoding
  path = lambda name: name if is_hf(name) else storage.join(root, name)
  target_model, tok, meta = load_model(path(target), mesh=mesh)
  trained_config = target_model.config
  target_model = place(target_model)
  draft_models = {}
  for name in drafts:
    if name == RANDOM_DRAFT:
      draft_models[name] = place(random_draft(trained_config, mesh=mesh), draft_weights,
                                 target_model)
      continue
    draft_models[name], draft_tok, _ = load_model(path(name), mesh=mesh)
    if draft_tok.to_bytes() != tok.to_bytes():
      raise ValueError(f'{name} and {target} in {root} use different tokenizers: not a pair.')
    draft_models[name] = place(draft_models[name], draft_weights, target_model)
  return target_model, draft_models, tok, meta
