"""One training run from a config: data, shared tokenizer, model, optional teacher, then `trainer`.

The layout on disk, for a family of models that speculate together (a target and its drafts):

  <root>/tokenizer.model   the family's SentencePiece model, trained once from the train split
  <root>/<name>/           one orbax checkpoint directory per model (target, draft_wide, ...)

The root is local or a URI (`gs://bucket/family`): every file under it goes through `storage`.

Invariants: every model of a family uses the family's tokenizer (each checkpoint also stores it, and
`load.load_model` loads it back); a distilled draft's teacher is a finished checkpoint of the
same family, checked at start. Everything that can be wrong with a config (unknown dataset or
preset, a tokenizer or teacher of another vocabulary, a missing teacher checkpoint) fails before the
first step with a message that names it.
"""

import dataclasses
import functools
from collections.abc import Callable

from absl import logging
import jax

from spsjax import distributed, models, sharding, storage
from spsjax.data import datasets, pipeline
from spsjax.data.tokenizer import Tokenizer
from spsjax.train import load, optimizer, trainer

TOKENIZER_FILE = 'tokenizer.model'


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Which TFDS dataset and text field to train on; any prepared TFDS dataset works."""
  name: str = 'python_code'
  text_field: str | None = None  # None: the built-in default of `name`.
  train_split: str = 'train'
  eval_split: str = 'validation'
  data_dir: str | None = None  # None: `datasets.default_data_dir()`.
  config: str | None = None  # A TFDS builder config name; None: the dataset's default.


@dataclasses.dataclass(frozen=True)
class Experiment:
  """A training run: what to train, on what, where, and from which teacher (if any)."""
  train: trainer.TrainConfig
  data: DataConfig
  root: str  # The family directory (tokenizer and sibling checkpoints), local or a URI.
  name: str  # This model's checkpoint directory under `root`.
  teacher: str | None = None  # Name of a finished checkpoint under `root` to distil from.
  tokenizer_seed: int = 0
  mesh_data: int = 1
  mesh_model: int = 1

  @property
  def workdir(self) -> str:
    return storage.join(self.root, self.name)

  @property
  def tokenizer_path(self) -> str:
    return storage.join(self.root, TOKENIZER_FILE)


def family_tokenizer(path: str, texts: Callable[[], list[str]], vocab_size: int,
                     seed: int = 0) -> Tokenizer:
  """The tokenizer at `path`, trained from `texts()` and saved there first if it is missing.

  Process 0 trains and writes it (to a temporary name, then renamed, so a crash never leaves half
  a tokenizer); the other processes wait for it, then read it (the root is storage they share). A
  tokenizer that exists with another vocabulary size is an error, not silently retrained.
  """
  if distributed.is_main() and not storage.path(path).exists():
    _train_tokenizer(path, texts, vocab_size, seed)
  distributed.barrier(f'tokenizer {path}')
  tok = Tokenizer.load(path)
  if tok.vocab_size != vocab_size:
    raise ValueError(f'Tokenizer {path} has vocab_size {tok.vocab_size}, but the model config '
                     f'asks for {vocab_size}: a family shares one tokenizer (use another root).')
  return tok


def _train_tokenizer(path: str, texts: Callable[[], list[str]], vocab_size: int,
                     seed: int) -> None:
  logging.info('Training a %d-piece tokenizer for %s ...', vocab_size, path)
  tok = Tokenizer.train(texts(), vocab_size, seed=seed)
  storage.write_bytes(path, tok.to_bytes(), atomic=True)


def load_docs(data: DataConfig, split: str):
  return datasets.load(data.name, split, data.data_dir, data.text_field, data.config)


def _all_texts(source) -> list[str]:
  return [source[i] for i in range(len(source))]


def held_out(docs, tok: Tokenizer, batch_size: int, seq_len: int) -> pipeline.PackedBatches:
  """The held-out global batches, the same on every process: always the same ones (seed 0,
  epoch 0)."""
  return pipeline.PackedBatches(docs, tok, batch_size, seq_len, seed=0)


def _load_teacher(exp: Experiment, tok: Tokenizer, mesh) -> models.Model:
  teacher_dir = storage.join(exp.root, exp.teacher)
  model, teacher_tok, _ = load.load_model(teacher_dir, mesh=mesh)
  if teacher_tok.to_bytes() != tok.to_bytes():
    raise ValueError(f'Teacher checkpoint {teacher_dir} has another tokenizer than {exp.root}: '
                     'target and draft must share one.')
  if model.config.vocab_size != exp.train.model.vocab_size:
    raise ValueError(f'Teacher vocab_size ({model.config.vocab_size}) differs from the '
                     f'student\'s ({exp.train.model.vocab_size}).')
  return model


def run(exp: Experiment) -> dict:
  """Trains (or resumes) `exp` to its last step; returns the final metrics."""
  if (exp.train.distill_weight > 0 or exp.train.init_from_teacher) and not exp.teacher:
    raise ValueError('distill_weight > 0 and init_from_teacher need a teacher checkpoint name '
                     '(config.teacher).')
  if exp.teacher and not storage.path(storage.join(exp.root, exp.teacher)).is_dir():
    raise FileNotFoundError(f'Teacher checkpoint directory {storage.join(exp.root, exp.teacher)} '
                            'does not exist: train the target first.')
  mesh = sharding.run_mesh(exp.mesh_data, exp.mesh_model)
  sharding.check_batch(exp.train.batch_size, mesh)
  d = exp.data
  train_docs, eval_docs = load_docs(d, d.train_split), load_docs(d, d.eval_split)
  tok = family_tokenizer(exp.tokenizer_path, lambda: _all_texts(train_docs),
                         exp.train.model.vocab_size, exp.tokenizer_seed)
  teacher = _load_teacher(exp, tok, mesh) if exp.teacher else None

  c = exp.train
  train_batches = pipeline.PackedBatches(train_docs, tok, c.batch_size, c.seq_len, c.seed)
  eval_pipeline = held_out(eval_docs, tok, c.batch_size, c.seq_len)
  eval_start = eval_pipeline.get_state()

  def eval_batches():
    eval_pipeline.set_state(eval_start)  # The same held-out batches every time.
    return eval_pipeline

  logging.info('Training %s (%s parameters) in %s on a %s mesh%s.', exp.name,
               f'{num_params(c):,}', exp.workdir, dict(mesh.shape),
               ''.join(f', {what} {exp.teacher}' for what, on in (
                   ('starting from', exp.train.init_from_teacher),
                   ('distilling from', exp.train.distill_weight > 0),
                   (f'a {exp.train.head} head over the features of', exp.train.head)) if on))
  _, metrics = trainer.train(
      c, workdir=exp.workdir, train_batches=train_batches, eval_batches=eval_batches,
      tokenizer_bytes=tok.to_bytes(), mesh=mesh, teacher=teacher,
      meta=dict(data=dataclasses.asdict(d), teacher=exp.teacher),
      # A head's draft vocabulary: the most frequent tokens of what it trains on.
      draft_vocab=lambda: train_batches.most_frequent(
          c.model.draft_vocab_size, c.model.vocab_size,
          max_tokens=c.steps * c.batch_size * (c.seq_len + 1)))
  return metrics


def num_params(config: trainer.TrainConfig) -> int:
  """Parameters of what `config` trains, counted as `models.num_params` counts them, without
  allocating them."""
  return models.num_params(jax.eval_shape(functools.partial(trainer.init_params, config),
                                          jax.random.key(0)))


def from_config(c) -> Experiment:
  """The typed, frozen experiment of a config file's ConfigDict."""
  train = trainer.TrainConfig(model=models.TransformerConfig(**c.model),
                              optimizer=optimizer.OptimizerConfig(**c.optimizer), **c.train)
  # Config files write '' for "none" (ConfigDict fields keep one type).
  data = DataConfig(**{k: (v or None) if k in ('text_field', 'data_dir', 'config') else v
                       for k, v in c.data.items()})
  return Experiment(train=train, data=data, root=c.root, name=c.name, teacher=c.teacher or None,
                    tokenizer_seed=c.tokenizer_seed, mesh_data=c.mesh.data,
                    mesh_model=c.mesh.model)
