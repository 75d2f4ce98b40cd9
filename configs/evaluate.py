"""Held-out loss of trained checkpoints and alpha of target/draft pairs.

  python experiments/evaluate.py --config=configs/evaluate.py:size=tiny
  python experiments/evaluate.py --config=configs/evaluate.py:size=reference,drafts=draft_wide

Arguments: size (tiny | reference: the family root checkpoints/<size>), root (overrides it),
target (checkpoint name), drafts ('+'-separated checkpoint names; those missing are reported and
skipped unless listed explicitly), batches, batch_size, seq_len, split.
"""

import ml_collections

from spsjax.config_args import parse_arg

ALL_DRAFTS = 'draft_wide+draft_mid+draft_deep+draft_wide_distill+draft_deep_distill'


def get_config(arg=None):
  a = parse_arg(arg, size='tiny', root='', target='target', drafts='', batches=8, batch_size=8,
                seq_len=256, split='validation', data=1, model_axis=1, draft_weights='bfloat16')
  c = ml_collections.ConfigDict()
  c.root = a.root or f'checkpoints/{a.size}'
  c.target = a.target
  c.draft_weights = a.draft_weights  # The drafts' packed weights (native CPU path).
  c.drafts = [d for d in (a.drafts or ALL_DRAFTS).split('+') if d]
  c.require_drafts = bool(a.drafts)  # Named drafts must exist; the default list is best effort.
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
  return c
