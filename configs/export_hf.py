"""Export to Hugging Face: `--config=configs/export_hf.py:checkpoint=checkpoints/reference/target`.

Arguments: checkpoint (an spsjax checkpoint directory), step (0: the latest), out (the directory
to write; default exports/<parent>_<name>).
"""

import os

import ml_collections

from spsjax.config_args import parse_arg


def get_config(arg=None):
  a = parse_arg(arg, checkpoint='checkpoints/tiny/target', step=0, out='')
  c = ml_collections.ConfigDict()
  c.checkpoint = a.checkpoint
  c.step = a.step
  path = os.path.normpath(a.checkpoint)
  c.out = a.out or os.path.join(
      'exports', f'{os.path.basename(os.path.dirname(path))}_{os.path.basename(path)}')
  return c
