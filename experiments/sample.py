"""Samples from a model (ArS or SpS) and prints the generated ids and throughput.

  python experiments/sample.py --config=configs/sample.py:batch=2,max_new_tokens=32
  python experiments/sample.py --config=configs/sample.py --config.method=sps --config.k=4

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
  if c.method not in ('ars', 'sps'):
    raise app.UsageError(f'config.method must be "ars" or "sps", got {c.method!r}.')
  config = models.TransformerConfig(**c.model)
  mesh = None
  if c.mesh.data * c.mesh.model > 1:
    mesh = sharding.make_mesh(c.mesh.data, c.mesh.model)
  rng_init, rng_prompt, rng_sample = jax.random.split(jax.random.key(c.seed), 3)
  model = models.Model(config, models.init_params(config, rng_init, mesh=mesh))
  draft = None
  if c.method == 'sps':
    draft_config = models.TransformerConfig(**c.draft)
    draft = models.Model(draft_config, models.init_params(draft_config,
                                                          jax.random.fold_in(rng_init, 1),
                                                          mesh=mesh))
  print(f'NOTE: randomly initialised target ({models.num_params(model.params):,} parameters)'
        + (f' and draft ({models.num_params(draft.params):,})' if draft else '') +
        '; the text is noise and acceptance is that of unrelated random models. '
        'Trained checkpoints arrive with the training issue.')
  prompts = np.asarray(jax.random.randint(rng_prompt, (c.batch, c.prompt_len), 0,
                                          config.vocab_size), np.int32)
  lengths = np.full((c.batch,), c.prompt_len, np.int32)
  sampling_config = sampling.SamplingConfig(**c.sampling)
  draft_sampling = sampling.SamplingConfig(**c.draft_sampling) if c.draft_sampling else None
  eos_id = None if c.eos_id < 0 else c.eos_id

  def run(rng):
    if c.method == 'sps':
      out = sampling.speculative_sample(model, draft, prompts, lengths, rng, k=c.k,
                                        max_new_tokens=c.max_new_tokens, sampling=sampling_config,
                                        draft_sampling=draft_sampling, eos_id=eos_id, mesh=mesh)
    else:
      out = sampling.autoregressive_sample(model, prompts, lengths, rng,
                                           max_new_tokens=c.max_new_tokens,
                                           sampling=sampling_config, eos_id=eos_id, mesh=mesh)
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
  if c.method == 'sps':
    loops, accepted = int(np.sum(out.num_loops)), int(np.sum(out.num_accepted))
    print(f'k={c.k}: acceptance rate {accepted / max(1, c.k * loops):.3f} '
          f'({accepted} of {c.k * loops} drafts), mean tokens per loop '
          f'{(tokens - c.batch) / max(1, loops):.2f} (the first token of each row comes from the '
          f'prefill), accepted-drafts histogram {np.asarray(out.accepted_histogram).tolist()}')
  print(f'method={c.method} batch={c.batch} new_tokens={tokens} first call (compile + run) '
        f'{compile_s:.2f}s; run {best * 1e3:.1f} ms (best of {c.repeats}): '
        f'{tokens / best:.1f} tokens/s, {best / c.max_new_tokens * 1e3:.2f} ms per decode step')


if __name__ == '__main__':
  app.run(main)
