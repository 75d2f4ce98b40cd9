"""Held-out loss of a family's checkpoints and the expected acceptance alpha of each target/draft.

  python experiments/evaluate.py --config=configs/evaluate.py:size=tiny
  python experiments/evaluate.py --config=configs/evaluate.py:size=reference,tasks=humaneval+docstrings

Prints one line per model (loss, perplexity), one per pair with alpha on held-out text under each
sampling setting, and one per pair and task with alpha along the target's own samples from the
task's prompts (`spsjax.eval.acceptance`: what Table 1's loop counts measure for the same task and
decoding). The held-out data is the split named in the config, of the dataset the target was
trained on.
"""

import itertools

from absl import logging
import jax
from ml_collections import config_flags

from spsjax import cli, distributed, models, sharding, storage
from spsjax.eval import acceptance, tasks
from spsjax.sampling import SamplingConfig, speculative
from spsjax.train import evaluation, experiment, load, losses

print0 = distributed.print0
_CONFIG = config_flags.DEFINE_config_file('config', None, 'Config file.', lock_config=True)
_RUNTIME = distributed.define_flags()


def main(argv):
  distributed.start(argv, _RUNTIME())
  c = _CONFIG.value
  if c.note:
    print0(c.note)
  present = [d for d in c.drafts
             if c.require_drafts or storage.path(storage.join(c.root, d)).is_dir()]
  for name in sorted(set(c.drafts) - set(present)):
    logging.info('No checkpoint %s: skipped.', storage.join(c.root, name))
  mesh = sharding.mesh_from_axes(c.mesh.data, c.mesh.model)
  target, drafts, tok, meta = load.load_family(c.root, c.target, present, mesh=mesh,
                                               draft_weights=c.draft_weights)
  print0(f'{c.root}: {c.target} and drafts {", ".join(drafts) or "(none)"} '
         f'(JAX {jax.__version__})')
  if c.batches:
    held_out(c, target, drafts, tok, meta, mesh)
  if drafts:
    along_samples(c, target, drafts, tok, mesh)


def held_out(c, target, drafts, tok, meta, mesh):
  """Each model's held-out loss, and each pair's alpha on the held-out text."""
  data = experiment.DataConfig(**meta['data'])
  source = experiment.load_docs(data, c.split)
  batches = list(itertools.islice(
      experiment.held_out(source, tok, c.batch_size, c.seq_len), c.batches))
  settings = {name: SamplingConfig(**s) for name, s in c.sampling.items()}
  tokens = len(batches) * c.batch_size * c.seq_len
  print0(f'held-out: {data.name}/{c.split}, {len(batches)} batches of {c.batch_size} x '
         f'{c.seq_len} = {tokens:,} positions')
  loss = lambda name, model, value: print0(
      f'{name}: {models.num_params(model.params):,} parameters, loss {value:.4f}, perplexity '
      f'{losses.perplexity(value):.2f}')
  loss(c.target, target, evaluation.evaluate_model(target, batches, mesh=mesh)['loss'])
  pairs = {name: evaluation.evaluate_pair(target, draft, batches, settings, mesh=mesh)
           for name, draft in drafts.items()}
  for name, draft in drafts.items():  # A head's loss is its first draft's (from position 1).
    loss(name, draft, pairs[name]['draft_loss'])
  for name, result in pairs.items():
    alphas = ', '.join(f'{s} {result["alpha_" + s]:.3f}' for s in settings)
    print0(f'alpha({c.target}, {name}) on held-out text: {alphas}')


def along_samples(c, target, drafts, tok, mesh):
  """Each pair's alpha along the target's samples from each task's prompts."""
  lengths = [(name, d.config.max_seq_len) for name, d in drafts.items()]
  for task_name, t in c.tasks.items():
    task = tasks.load_task(task_name, t.num, t.max_new_tokens)
    alphas = {name: [] for name in drafts}
    for decoding, s in t.sampling.items():
      samples = acceptance.sample_task(
          target, tok, task, SamplingConfig(**s), batch=c.task_batch, seed=c.seed,
          max_seq_lens=lengths, headroom=speculative.headroom(c.k), mesh=mesh)
      for name, draft in drafts.items():
        alpha, count = acceptance.samples_alpha(target, draft, samples, mesh=mesh)
        alphas[name].append(f'{decoding} {alpha:.3f} ({count:,} positions)')
    for name in drafts:
      print0(f'alpha({c.target}, {name}) along the target\'s samples from {len(task.prompts)} '
             f'{task_name} prompts (max_new_tokens {t.max_new_tokens}): '
             f'{", ".join(alphas[name])}')


if __name__ == '__main__':
  cli.run(main)
