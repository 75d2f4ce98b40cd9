"""Figure 1 sweeps: `--config=configs/sweep.py:root=checkpoints/reference,sweep=k`.

Arguments: root (family), sweep (k | draft | temperature), draft (the draft of the k and temperature
sweeps), drafts (the draft sweep's checkpoints, '+'-separated; default all three topologies),
k (of the draft and temperature sweeps), prompts (HumanEval prompts, one timed call each),
max_new_tokens (128 as in the paper), temperature (of the k and draft sweeps), seed, results, runlocal.
The swept points are `points(sweep, ...)` below: a list of overrides, one per point.
"""

import os

import ml_collections

from spsjax.config_args import parse_arg

DRAFTS = ('draft_wide', 'draft_mid', 'draft_deep', 'draft_wide_distill')


def points(sweep: str, k: int, draft: str, temperature: float,
           drafts: tuple[str, ...] = DRAFTS) -> list[dict]:
  if sweep == 'k':
    return [dict(label=str(i), k=i, draft=draft, temperature=temperature) for i in range(1, 9)]
  if sweep == 'draft':
    return [dict(label=d, k=k, draft=d, temperature=temperature) for d in drafts]
  if sweep == 'temperature':
    return [dict(label=str(t), k=k, draft=draft, temperature=t) for t in (0.0, 0.5, 0.8, 1.0)]
  raise ValueError(f'sweep must be k, draft or temperature, got {sweep!r}.')


def get_config(arg=None):
  a = parse_arg(arg, root='checkpoints/tiny', sweep='k', draft='draft_wide', k=4, prompts=16,
                max_new_tokens=128, temperature=0.8, seed=0, results='', runlocal=False,
                drafts='+'.join(DRAFTS), data=1, model_axis=1, draft_weights='bfloat16')
  drafts = tuple(d for d in a.drafts.split('+') if d)
  if not drafts:
    raise ValueError('drafts names no checkpoint.')
  c = ml_collections.ConfigDict()
  c.root = a.root
  c.sweep = a.sweep
  c.draft_weights = a.draft_weights  # The drafts' packed weights (native CPU path).
  c.points = points(a.sweep, a.k, a.draft, a.temperature, drafts)
  if a.runlocal:
    c.points = c.points[:2]
  c.prompts = 2 if a.runlocal else a.prompts
  c.max_new_tokens = 16 if a.runlocal else a.max_new_tokens
  c.top_p = 0.95  # HumanEval's nucleus, as in the paper.
  c.seed = a.seed
  c.mesh = dict(data=a.data, model=a.model_axis)  # Batch 1 per call: data must be 1.
  c.results = a.results or os.path.join(
      'results', f'sweep_{a.sweep}_' + os.path.basename(os.path.normpath(a.root)))
  return c
