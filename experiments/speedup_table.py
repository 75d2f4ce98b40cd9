"""Table 1 of the paper for a trained family: ArS vs SpS on HumanEval, docstrings and code completion.

  python experiments/speedup_table.py --config=configs/speedup.py:root=checkpoints/reference
  python experiments/speedup_table.py --config=configs/speedup.py:root=checkpoints/tiny,runlocal

Prints the table and writes `table.md` and `table.json` (with every completion) to the config's
results directory (local or a URI such as gs://bucket/results; process 0 writes), and one profiler
trace per SpS row under `traces/` (XProf / Perfetto).
"""

import time

from absl import logging
import jax
from ml_collections import config_flags

from spsjax import cli, distributed, models, sharding, storage
from spsjax.bench import comparison, decode, speedup, table1
from spsjax.eval import tasks
from spsjax.sampling import SamplingConfig, drafter_config
from spsjax.train import load

print0 = distributed.print0
_CONFIG = config_flags.DEFINE_config_file('config', None, 'Config file.', lock_config=True)
_RUNTIME = distributed.define_flags()


def main(argv):
  distributed.start(argv, _RUNTIME())
  c = _CONFIG.value
  started = time.time()
  if c.note:
    print0(c.note)
  mesh = sharding.mesh_from_axes(c.mesh.data, c.mesh.model)
  drafter = drafter_config.build(**c.drafter)
  names = [c.draft] if drafter.needs_model else []
  target, drafts, tok, _ = load.load_family(c.root, c.target, names, mesh=mesh,
                                            draft_weights=c.draft_weights)
  draft = drafts.get(c.draft)
  draft_params = models.num_params(draft.params) if draft else 0
  c_hat = draft_params / models.num_params(target.params)
  lossy = (f'; LOSSY: lenience {c.lenience}, the output law is not the target\'s'
           if c.lenience < 1 else '')
  print0(f'{c.target_path}: target {models.num_params(target.params):,} parameters, drafter {drafter}'
         + (f' with draft {c.draft} {draft_params:,}' if draft else '')
         + f'; k={c.k}{lossy}; JAX {jax.__version__} on {jax.devices()[0].device_kind}'
         + (f', mesh {dict(mesh.shape)}' if mesh else ''), flush=True)
  kw = dict(mesh=mesh, drafter=drafter, lenience=c.lenience)

  comparisons = []
  for task_name in sorted(c.tasks, key=tasks.TASKS.index):  # The paper's order, then ours.
    task_config = c.tasks[task_name]
    task = tasks.load_task(task_name, task_config.num, task_config.max_new_tokens,
                             config=c.data_config or None)
    capacity = speedup.halfway_capacity(task, tok, target, draft, c.k)
    for decoding, settings in (('nucleus', task_config.nucleus), ('greedy', c.greedy)):
      sampling_config = SamplingConfig(**settings)
      for batch in c.batches:
        rows = speedup.run_rows(target, draft, tok, task, decoding, sampling_config, batch, c.k,
                                c.seed, **kw)
        costs = decode.measure_costs(target, draft, c.k, batch, capacity, c.cost_repeats,
                                     mesh=mesh)
        loop_profile = speedup.profile_row(
            target, draft, tok, task, sampling_config, batch, c.k, c.seed,
            storage.join(c.results, 'traces', f'{task_name}_{decoding}_b{batch}'), **kw)
        cmp = comparison.Comparison(ars=rows[0], sps=rows[1], costs=costs, k=c.k, c_hat=c_hat,
                                    loop_profile=loop_profile, drafter=drafter)
        comparisons.append(cmp)
        logging.info('%s %s batch %d: %s %.3f vs %.3f, speedup %.2fx (predicted %.2fx) '
                     '[%.0f s elapsed]', task_name, decoding, batch, rows[0].metric,
                     rows[0].metric_mean, rows[1].metric_mean, cmp.speedup,
                     cmp.prediction.speedup, time.time() - started)

  table = c.title.format(**c) + '\n\n' + table1.markdown(comparisons)
  print0(table)
  storage.write_text(storage.join(c.results, 'table.md'), table + '\n')
  records = [dict(task=cmp.sps.task, decoding=cmp.sps.decoding, batch=cmp.sps.batch,
                  **cmp.summary(),
                  **{row.method: dict(metric=row.metric, mean=row.metric_mean,
                                      stderr=row.metric_stderr, scores=row.scores,
                                      logprobs=row.logprobs, log_ratios=row.log_ratios,
                                      extra=row.extra,
                                      timing=row.timing, completions=row.completions)
                     for row in (cmp.ars, cmp.sps)}) for cmp in comparisons]
  storage.write_json(storage.join(c.results, 'table.json'), dict(config=c.to_dict(), rows=records),
                     indent=1)
  print0(f'Wrote {c.results}/table.md and table.json ({time.time() - started:.0f} s).')


if __name__ == '__main__':
  cli.run(main)
