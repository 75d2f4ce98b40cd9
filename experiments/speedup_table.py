"""Table 1 of the paper for a trained family: ArS vs SpS on HumanEval, docstrings and code completion.

  python experiments/speedup_table.py --config=configs/speedup.py:root=checkpoints/reference
  python experiments/speedup_table.py --config=configs/speedup.py:root=checkpoints/tiny,runlocal

Prints the table and writes `table.md` and `table.json` (with every completion) to the config's
results directory (local or a URI such as gs://bucket/results; process 0 writes), and one profiler
trace per SpS row under `traces/` (XProf / Perfetto).
"""

import collections
import time

from absl import logging
import jax
from ml_collections import config_flags

from spsjax import cli, distributed, models, sharding, storage
from spsjax.bench import auto_k, comparison, decode, speedup, table1
from spsjax.eval import tasks
from spsjax.sampling import SamplingConfig, drafter_config
from spsjax.train import load

print0 = distributed.print0
_CONFIG = config_flags.DEFINE_config_file('config', None, 'Config file.', lock_config=True)
_RUNTIME = distributed.define_flags()


def _most_run(policy: auto_k.Policy, k_max: int) -> int:
  """The k the policy's SpS calls ran most (k_max if it ran every call as ArS)."""
  ks = [choice.k for choice in policy.choices if choice.k]
  return collections.Counter(ks).most_common(1)[0][0] if ks else k_max


def _auto_line(cmp: comparison.Comparison, policy: auto_k.Policy) -> str:
  counts = collections.Counter(choice.k for choice in policy.choices)
  predicted = sum(choice.predicted_speedup for choice in policy.choices) / len(policy.choices)
  return (f'- {cmp.sps.task} {cmp.sps.decoding} batch {cmp.sps.batch}: '
          + ', '.join(f'k={k} x{n}' for k, n in sorted(counts.items()))
          + f'; predicted {predicted:.2f}x, measured {cmp.speedup:.2f}x')


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

  comparisons, auto_lines = [], []
  for task_name in sorted(c.tasks, key=tasks.TASKS.index):  # The paper's order, then ours.
    task_config = c.tasks[task_name]
    task = tasks.load_task(task_name, task_config.num, task_config.max_new_tokens,
                             config=c.data_config or None)
    k_max = c.k_max if c.k == 'auto' else c.k
    for decoding, settings in (('nucleus', task_config.nucleus), ('greedy', c.greedy)):
      sampling_config = SamplingConfig(**settings)
      for batch in c.batches:
        policy = None
        if c.k == 'auto':
          auto_costs, path = auto_k.calibrated(
              target, draft, *speedup.calibration_prompts(task, tok, target, draft, k_max, batch),
              k_max=k_max, drafter=drafter, sampling_config=sampling_config,
              max_new_tokens=task.max_new_tokens, recalibrate=c.recalibrate)
          policy = auto_k.Policy(auto_costs)
          print0(f'{task_name} {decoding} batch {batch}: k=auto, cost model {path}\n'
                 + '\n'.join(auto_k.report(auto_costs, policy.acceptance)), flush=True)
        rows = speedup.run_rows(target, draft, tok, task, decoding, sampling_config, batch,
                                k_max, c.seed, policy=policy, **kw)
        k = k_max if policy is None else _most_run(policy, k_max)
        tree = drafter.tree(k)  # A tree's score call and level calls are what a loop runs.
        capacity = speedup.halfway_capacity(task, tok, target, draft, k,
                                            None if tree is None else tree.num_nodes + 1)
        costs = decode.measure_costs(target, draft, k, batch, capacity, c.cost_repeats,
                                     mesh=mesh, tree=tree, draft_calls=drafter.draft_calls(k))
        loop_profile = None
        if policy is None or any(choice.k for choice in policy.choices):
          loop_profile = speedup.profile_row(
              target, draft, tok, task, sampling_config, batch, k, c.seed,
              storage.join(c.results, 'traces', f'{task_name}_{decoding}_b{batch}'), **kw)
        cmp = comparison.Comparison(ars=rows[0], sps=rows[1], costs=costs, k=k, c_hat=c_hat,
                                    loop_profile=loop_profile, drafter=drafter,
                                    auto=policy and policy.summary())
        if policy is not None:
          auto_lines.append(_auto_line(cmp, policy))
        comparisons.append(cmp)
        logging.info('%s %s batch %d: %s %.3f vs %.3f, speedup %.2fx (predicted %.2fx) '
                     '[%.0f s elapsed]', task_name, decoding, batch, rows[0].metric,
                     rows[0].metric_mean, rows[1].metric_mean, cmp.speedup,
                     cmp.prediction.speedup, time.time() - started)

  table = c.title.format(**c) + '\n\n' + table1.markdown(comparisons)
  if auto_lines:
    table += ('\n\nk = auto: the k each row\'s SpS calls ran (0: ArS), the speedup the policy '
              'predicted (mean over calls) and the measured one.\n\n' + '\n'.join(auto_lines))
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
