"""Samples from a model (ArS or SpS) and prints the generations and throughput.

  python experiments/sample.py --config=configs/sample.py:root=checkpoints/tiny,method=sps,k=4
  python experiments/sample.py --config=configs/sample.py:batch=2,max_new_tokens=32   # random init
  python experiments/sample.py --config=configs/sample.py:hf_target=DIR,hf_draft=DIR,method=sps

With `root` (or Hugging Face checkpoints, `hf_target` and `hf_draft`) the target and draft are
trained models and the prompts are HumanEval's; without either, both models are randomly
initialised (said in the output) and the prompts are random ids.
"""

import dataclasses
import time

from absl import app
import jax
import numpy as np
from ml_collections import config_flags

from spsjax import cli, distributed, models, sampling, sharding
from spsjax.bench import auto_k
from spsjax.data import humaneval, prompts as prompts_lib
from spsjax.sampling import common, drafter_config, generation_config, speculative
from spsjax.train import load

print0 = distributed.print0
_CONFIG = config_flags.DEFINE_config_file('config', None, 'Config file.', lock_config=True)
_RUNTIME = distributed.define_flags()


def _random_models(c, mesh, rng):
  config = models.TransformerConfig(**c.model)
  target = models.Model(config, models.init_params(config, rng, mesh=mesh))
  key = jax.random.fold_in(rng, 1)
  if c.drafter.kind in drafter_config.HEAD_KINDS:  # A head over the target's features.
    falcon = c.drafter.kind == 'falcon'  # Two drafts a pass, Falcon's.
    head = models.feature_head.head_config(
        config, 1 if c.drafter.kind in ('feature', 'falcon') else c.k,
        drafts_per_pass=2 if falcon else 1)
    draft = common.place_params(models.Model(
        head, models.feature_head.init_head(c.drafter.kind, head, key)), mesh)
  else:
    draft_config = models.TransformerConfig(**c.draft)
    draft = models.Model(draft_config, models.init_params(draft_config, key, mesh=mesh))
  if mesh is None:  # Placed for decoding here: packed for the native CPU kernels where they run.
    target = models.for_decoding(target)
    draft = models.for_decoding(draft, c.draft_weights, target)
  print0(f'NOTE: randomly initialised target ({models.num_params(target.params):,} parameters) and '
         f'draft ({models.num_params(draft.params):,}); the ids are noise and acceptance is that '
         'of unrelated random models. Pass root=checkpoints/tiny after `make train-tiny`.')
  return target, draft


def _trained_models(c, mesh, needs_draft):
  names = [c.draft_name] if needs_draft else []
  target, drafts, tok, _ = load.load_family(c.root, c.target_name, names, mesh=mesh,
                                            draft_weights=c.draft_weights)
  draft = drafts.get(c.draft_name)
  where = lambda name: name if load.is_hf(name) else f'{c.root}/{name}'
  print0(f'Trained target {where(c.target_name)} ({models.num_params(target.params):,} '
         'parameters)' + (f' and draft {where(c.draft_name)} ({models.num_params(draft.params):,})'
                          if draft else ''))
  return target, draft, tok


def _humaneval_prompts(batch: int) -> list[str]:
  """The first `batch` HumanEval prompts; UsageError when there are not that many."""
  problems = humaneval.read_problems()
  if not 1 <= batch <= len(problems):
    raise app.UsageError(f'batch={batch}: with root the batch is the first `batch` HumanEval '
                         f'prompts, and there are {len(problems)}; use batch in [1, '
                         f'{len(problems)}].')
  return [p['prompt'] for p in problems[:batch]]


def _prompt_room(c, target: models.TransformerConfig,
                 draft: models.TransformerConfig | None) -> prompts_lib.Room:
  """Room for the prompt in every model the method runs (`prompts.prompt_room`)."""
  sizes = [('target', target.max_seq_len)]
  if c.method == 'sps' and draft is not None:
    sizes.append(('draft', draft.max_seq_len))
  k = c.k_max if c.k == 'auto' else c.k
  return prompts_lib.prompt_room(sizes, c.max_new_tokens,
                                 speculative.headroom(k) if c.method == 'sps' else 0)


def _with_min_new_tokens(sampling_config, min_new_tokens: int, eos_id):
  """The eos ids banned at each row's first `min_new_tokens` new tokens (transformers'
  min_new_tokens)."""
  eos = common.eos_ids(eos_id)
  if not eos:
    raise app.UsageError(f'min_new_tokens={min_new_tokens} bans the eos token, but this run has '
                         'none (eos_id, or a checkpoint\'s tokenizer).')
  return dataclasses.replace(sampling_config, ban_before_new=(
      sampling_config.ban_before_new + ((eos, int(min_new_tokens)),)))


def main(argv):
  distributed.start(argv, _RUNTIME())
  c = _CONFIG.value
  if c.method not in ('ars', 'sps'):
    raise app.UsageError(f'config.method must be "ars" or "sps", got {c.method!r}.')
  mesh = sharding.mesh_from_axes(c.mesh.data, c.mesh.model)
  if c.hf_sampling:
    sampling_config = generation_config.sampling_config(c.target_name, c.hf_ignore)
    print0(f'Sampling as {c.target_name}/{generation_config.FILE} asks: {sampling_config}'
           + (f' (dropped: {", ".join(c.hf_ignore)})' if c.hf_ignore else ''))
  else:
    sampling_config = sampling.SamplingConfig(**c.sampling)
  draft_sampling = sampling.SamplingConfig(**c.draft_sampling) if c.draft_sampling else None
  drafter = drafter_config.build(**c.drafter)
  needs_draft = c.method == 'sps' and drafter.needs_model
  rng_init, rng_prompt, rng_sample = jax.random.split(jax.random.key(c.seed), 3)
  tok = None
  if c.root or load.is_hf(c.target_name):
    texts = _humaneval_prompts(c.batch)  # Checked before the models load.
    target, draft, tok = _trained_models(c, mesh, needs_draft)
    room = _prompt_room(c, target.config, draft and draft.config)
    prompts, lengths = prompts_lib.encode_prompts(tok, texts, max_len=room.positions)
    note = prompts_lib.cut_note(tok, texts, room)
    if note:
      print0(note)
    eos_id = tok.eos_ids
  else:
    room = _prompt_room(c, models.TransformerConfig(**c.model),
                        models.TransformerConfig(**c.draft) if needs_draft else None)
    if c.prompt_len > room.positions:
      raise app.UsageError(f'prompt_len={c.prompt_len} does not fit: {room.budget}.')
    target, draft = _random_models(c, mesh, rng_init)
    draft = draft if needs_draft else None
    prompts = np.asarray(jax.random.randint(rng_prompt, (c.batch, c.prompt_len), 0,
                                            target.config.vocab_size), np.int32)
    lengths = np.full((c.batch,), c.prompt_len, np.int32)
    eos_id = None if c.eos_id < 0 else c.eos_id
  if c.min_new_tokens:
    sampling_config = _with_min_new_tokens(sampling_config, c.min_new_tokens, eos_id)
  if c.min_new_tokens or not c.hf_sampling:
    print0(f'Sampling: {sampling_config}')

  policy = {}
  if c.method == 'sps' and c.k == 'auto':
    if mesh is not None:
      raise app.UsageError('k=auto calibrates on one device; run it without a mesh.')
    costs, path = auto_k.calibrated(target, draft, prompts, lengths, k_max=c.k_max,
                                    drafter=drafter, sampling_config=sampling_config,
                                    max_new_tokens=c.max_new_tokens,
                                    recalibrate=c.recalibrate)
    print0(f'k=auto: cost model {path}')
    policy.update(costs=costs, acceptance=auto_k.prior(costs), ks=[])
    for line in auto_k.report(costs, policy['acceptance']):
      print0(line)

  def run(rng):
    if policy:
      out, choice, policy['acceptance'] = auto_k.sample(
          policy['costs'], policy['acceptance'], target, draft, prompts, lengths, rng,
          max_new_tokens=c.max_new_tokens, drafter=drafter, sampling=sampling_config,
          eos_id=eos_id)
      policy['ks'].append(choice.k)
    elif c.method == 'sps':
      out = sampling.speculative_sample(target, draft, prompts, lengths, rng, k=c.k,
                                        max_new_tokens=c.max_new_tokens, sampling=sampling_config,
                                        draft_sampling=draft_sampling, eos_id=eos_id, mesh=mesh,
                                        drafter=drafter, lenience=c.lenience)
    else:
      out = sampling.autoregressive_sample(target, prompts, lengths, rng,
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
  out = distributed.gather(out)  # Rows may live on other processes' devices.
  tokens = int(np.sum(out.num_generated))
  for row in range(c.batch):
    ids = np.asarray(out.tokens[row, :int(out.num_generated[row])]).tolist()
    print0(f'--- row {row}: ' + (f'{tok.decode(ids)!r}' if tok else f'{ids}'))
  best = min(times)
  if policy:
    print0(f'k=auto chose k = {policy["ks"]} in its {len(policy["ks"])} calls (0: ArS); '
           f'alpha now {policy["acceptance"].alpha:.3f}')
  if c.method == 'sps' and out.num_loops is not None:
    loops, accepted = int(np.sum(out.num_loops)), int(np.sum(out.num_accepted))
    drafted = int(np.sum(out.num_drafted))
    if c.lenience < 1:
      print0(f'LOSSY: lenience {c.lenience} (accepts a draft with probability '
             f'min(1, p / ({c.lenience} q))); the output law is not the target\'s.')
    k = policy['ks'][-1] if policy else c.k
    print0(f'k={k}, drafter {drafter}: acceptance rate {accepted / max(1, drafted):.3f} '
           f'({accepted} of {drafted} drafts), mean tokens per loop '
           f'{(tokens - c.batch) / max(1, loops):.2f} (the first token of each row comes from the '
           f'prefill), accepted-drafts histogram {np.asarray(out.accepted_histogram).tolist()}'
           + (f', proposed-drafts histogram {np.asarray(out.proposed_histogram).tolist()}'
              if drafter.ragged else ''))
  print0(f'method={c.method} batch={c.batch} new_tokens={tokens} first call (compile + run) '
         f'{compile_s:.2f}s; run {best * 1e3:.1f} ms (best of {c.repeats}): '
         f'{tokens / best:.1f} tokens/s')


if __name__ == '__main__':
  cli.run(main)
