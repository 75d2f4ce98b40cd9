"""Samples from a model and prints the generated ids and throughput.

  python experiments/sample.py --config=configs/sample.py:batch=2,max_new_tokens=32

Until trained checkpoints exist the model is randomly initialised (said in the output).
"""

import time

from absl import app, flags, logging
import jax
import numpy as np
from ml_collections import config_flags

from spsjax import models, sampling, sharding

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Config file.', lock_config=True)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  c = _CONFIG.value
  logging.info('JAX %s, process %d of %d, devices: %s', jax.__version__, jax.process_index(),
               jax.process_count(), jax.devices())
  if c.method != 'ars':
    raise app.UsageError(f'config.method must be "ars", got {c.method!r}.')
  config = models.TransformerConfig(**c.model)
  mesh = None
  if c.mesh.data * c.mesh.model > 1:
    mesh = sharding.make_mesh(c.mesh.data, c.mesh.model)
  rng_init, rng_prompt, rng_sample = jax.random.split(jax.random.key(c.seed), 3)
  model = models.Model(config, models.init_params(config, rng_init, mesh=mesh))
  print(f'NOTE: randomly initialised model ({models.num_params(model.params):,} parameters); '
        'its text is noise. Trained checkpoints arrive with the training issue.')
  prompts = np.asarray(jax.random.randint(rng_prompt, (c.batch, c.prompt_len), 0,
                                          config.vocab_size), np.int32)
  lengths = np.full((c.batch,), c.prompt_len, np.int32)
  sampling_config = sampling.SamplingConfig(**c.sampling)
  eos_id = None if c.eos_id < 0 else c.eos_id

  def run(rng):
    out = sampling.autoregressive_sample(model, prompts, lengths, rng,
                                         max_new_tokens=c.max_new_tokens, sampling=sampling_config,
                                         eos_id=eos_id, mesh=mesh)
    return jax.block_until_ready(out)

  start = time.perf_counter()
  run(rng_sample)
  compile_s = time.perf_counter() - start
  times, out = [], None
  for i in range(c.repeats):
    start = time.perf_counter()
    out = run(jax.random.fold_in(rng_sample, i))
    times.append(time.perf_counter() - start)
  tokens = int(np.sum(out.num_generated))
  for row in range(c.batch):
    n = int(out.num_generated[row])
    print(f'row {row}: {np.asarray(out.tokens[row, :n]).tolist()}')
  best = min(times)
  print(f'method=ars batch={c.batch} new_tokens={tokens} first call (compile + run) '
        f'{compile_s:.2f}s; run {best * 1e3:.1f} ms (best of {c.repeats}): '
        f'{tokens / best:.1f} tokens/s, {best / c.max_new_tokens * 1e3:.2f} ms per decode step')


if __name__ == '__main__':
  app.run(main)
