"""Trains a target or a draft; running the same command again resumes from the latest checkpoint.

  python experiments/train.py --config=configs/train.py:size=tiny,model=target
  python experiments/train.py --config=configs/train.py:size=tiny,model=draft_wide
  python experiments/train.py --config=configs/train.py:size=tiny,model=draft_wide,distill=1
"""

from absl import logging
from ml_collections import config_flags

from spsjax import cli, distributed
from spsjax.train import experiment, xla_flags

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Config file.', lock_config=True)
_RUNTIME = distributed.define_flags()


def main(argv):
  xla_flags.use_for_training()  # Before the runtime starts a backend.
  distributed.start(argv, _RUNTIME())
  metrics = experiment.run(experiment.from_config(_CONFIG.value))
  logging.info('Final metrics: %s', {k: round(v, 4) for k, v in metrics.items()})


if __name__ == '__main__':
  cli.run(main)
