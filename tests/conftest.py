"""Test-wide JAX setup: 8 fake CPU devices, XLA:CPU's quicker compiler path (`tests/xla_env.py`),
strict rank promotion.

XLA flags must be in XLA_FLAGS before JAX initialises its backends, so this runs at import, before
any test module imports jax.
"""

import os

from tests import xla_env

for _flag in xla_env.flags(devices=8).split():
  if _flag.split('=')[0] not in os.environ.get('XLA_FLAGS', ''):
    os.environ['XLA_FLAGS'] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position

jax.config.update('jax_numpy_rank_promotion', 'raise')

import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position


@pytest.fixture(autouse=True, scope='module')
def _release_compiled_programs():
  """Drops JAX's compiled programs after each test module. Every XLA:CPU executable keeps its
  machine code in memory maps of its own; one process running the whole suite compiles over a
  thousand programs and would otherwise reach the kernel's limit on maps per process
  (vm.max_map_count, 65530 by default), where the next compile aborts the process."""
  yield
  jax.clear_caches()
