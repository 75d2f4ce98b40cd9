"""Held-out loss of trained checkpoints and alpha of target/draft pairs.

  python experiments/evaluate.py --config=configs/evaluate.py   # the reference pair
  python experiments/evaluate.py --config=configs/evaluate.py:size=tiny,drafts=all

Arguments: size (tiny | demo | reference: the family root checkpoints/<size>; default reference),
root (overrides it), target (checkpoint name), drafts ('+'-separated checkpoint names, or `all`:
every draft the families train, those missing reported and skipped; default the family's best,
`spsjax.config_args.best_draft`), batches (0: no held-out text), batch_size, seq_len, split (the
held-out text); tasks ('+'-separated Table 1 tasks whose prompts alpha is also measured on, along
the target's own samples; '' for none), num (prompts per task; 0: all), max_new_tokens (0: the
task's, as in Table 1), task_batch (rows per sampler call), k (prompts are cut as Table 1 cuts
them for this lookahead), seed.
"""

import ml_collections

from spsjax.config_args import best_draft, default_pair_note, parse_arg
from spsjax.eval import tasks

ALL_DRAFTS = ('draft_wide+draft_mid+draft_deep+draft_wide_distill+draft_deep_distill+'
              'draft_trunc_distill_3000')


def get_config(arg=None):
  a = parse_arg(arg, size='reference', root='', target='target', drafts='', batches=8,
                batch_size=8,
                seq_len=256, split='validation', data=1, model_axis=1, draft_weights='w8a8',
                tasks='humaneval', num=0, max_new_tokens=0, task_batch=8, k=4, seed=0)
  c = ml_collections.ConfigDict()
  c.note = default_pair_note(arg, ('size', 'root', 'drafts'))
  c.root = a.root or f'checkpoints/{a.size}'
  c.target = a.target
  c.draft_weights = a.draft_weights  # The drafts' packed weights (native CPU path).
  drafts = a.drafts or best_draft(c.root)
  c.drafts = [d for d in (ALL_DRAFTS if drafts == 'all' else drafts).split('+') if d]
  # Named drafts must exist; `all` is best effort.
  c.require_drafts = drafts != 'all'
  c.batches = a.batches
  c.batch_size = a.batch_size
  c.seq_len = a.seq_len
  c.split = a.split
  c.mesh = dict(data=a.data, model=a.model_axis)
  # alpha under each setting: the paper's HumanEval nucleus, its XSum nucleus, greedy, plain.
  c.sampling = dict(
      humaneval_nucleus=dict(temperature=0.8, top_k=0, top_p=0.95),
      xsum_nucleus=dict(temperature=1.0, top_k=0, top_p=0.8),
      greedy=dict(temperature=0.0, top_k=0, top_p=1.0),
      temperature_1=dict(temperature=1.0, top_k=0, top_p=1.0),
  )
  # alpha along generated text: the task's prompts, the paper's nucleus for the task and greedy.
  c.tasks = {}
  for name in [t for t in a.tasks.split('+') if t]:
    if name not in tasks.PAPER_SETTINGS:
      raise ValueError(f'tasks: unknown task {name!r}; known: {sorted(tasks.PAPER_SETTINGS)}.')
    paper = tasks.PAPER_SETTINGS[name]
    c.tasks[name] = dict(num=a.num, max_new_tokens=a.max_new_tokens or paper['max_new_tokens'],
                         sampling=dict(nucleus=paper['nucleus'], greedy=tasks.GREEDY))
  c.task_batch = a.task_batch
  c.k = a.k
  c.seed = a.seed
  return c
