"""XLA:CPU settings for training programs, applied by the training binary before JAX starts.

`--xla_cpu_experimental_ynn_fusion_type=dot` (the default is `individual_dot`) lets XLA fuse a
dot with the layout changes around it. A training step's backward products contract over the
batch x time rows; with each dot fused alone, XLA copied every such operand into a transposed
buffer first, inside loop fusions that ran at a fraction of memory speed (the reference target's
step spent a fifth of its op time in them). With the flag the reference target's step runs
~1.3x faster on this CPU (docs/training.md, "Throughput"), with the same losses.

The flags only concern the CPU backend (TPU and GPU ignore them) and only programs compiled after
the backend starts, so `use_for_training` must run before anything touches a device; flags the
user already set in XLA_FLAGS win.
"""

import os

from absl import logging
from jax._src import xla_bridge

TRAINING = ('--xla_cpu_experimental_ynn_fusion_type=dot',)


def use_for_training(environ=os.environ) -> list[str]:
  """Adds `TRAINING` to XLA_FLAGS (each flag the user has not set); returns the flags added."""
  if xla_bridge.backends_are_initialized():
    raise RuntimeError('XLA flags for training must be set before JAX starts a backend.')
  present = environ.get('XLA_FLAGS', '').split()
  names = {flag.split('=')[0] for flag in present}
  added = [flag for flag in TRAINING if flag.split('=')[0] not in names]
  if added:
    environ['XLA_FLAGS'] = ' '.join(present + added)
    logging.info('XLA flags for training: %s', ' '.join(added))
  return added
