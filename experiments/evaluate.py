"""Held-out loss of a family's checkpoints and the expected acceptance alpha of each target/draft.

  python experiments/evaluate.py --config=configs/evaluate.py:size=tiny

Prints one line per model (loss, perplexity) and one per pair (alpha under each sampling setting).
The held-out data is the split named in the config, of the dataset the target was trained on.
"""

import itertools
import os

from absl import logging
import jax
from ml_collections import config_flags

from spsjax import cli, distributed, models, sharding
from spsjax.sampling import SamplingConfig
from spsjax.train import evaluation, experiment, load

print0 = distributed.print0
_CONFIG = config_flags.DEFINE_config_file('config', None, 'Config file.', lock_config=True)
_RUNTIME = distributed.define_flags()


def main(argv):
  distributed.start(argv, _RUNTIME())
  c = _CONFIG.value
  present = [d for d in c.drafts if c.require_drafts or os.path.isdir(os.path.join(c.root, d))]
  for name in sorted(set(c.drafts) - set(present)):
    logging.info('No checkpoint %s: skipped.', os.path.join(c.root, name))
  mesh = sharding.mesh_from_axes(c.mesh.data, c.mesh.model)
  target, drafts, tok, meta = load.load_family(c.root, c.target, present, mesh=mesh,
                                               draft_weights=c.draft_weights)
  data = experiment.DataConfig(**meta['data'])
  source = experiment.load_docs(data, c.split)
  batches = list(itertools.islice(
      experiment.held_out(source, tok, c.batch_size, c.seq_len), c.batches))
  settings = {name: SamplingConfig(**s) for name, s in c.sampling.items()}
  tokens = c.batches * c.batch_size * c.seq_len
  print0(f'held-out: {data.name}/{c.split}, {c.batches} batches of {c.batch_size} x {c.seq_len} '
         f'= {tokens:,} positions (JAX {jax.__version__})')
  for name, model in [(c.target, target)] + list(drafts.items()):
    result = evaluation.evaluate_model(model, batches, mesh=mesh)
    print0(f'{name}: {models.num_params(model.params):,} parameters, '
           f'loss {result["loss"]:.4f}, perplexity {result["perplexity"]:.2f}')
  for name, draft in drafts.items():
    result = evaluation.evaluate_pair(target, draft, batches, settings, mesh=mesh)
    alphas = ', '.join(f'{s} {result["alpha_" + s]:.3f}' for s in settings)
    print0(f'alpha({c.target}, {name}): {alphas}')


if __name__ == '__main__':
  cli.run(main)
