"""Test-wide JAX setup: 8 fake CPU devices and strict rank promotion.

The device count must be in XLA_FLAGS before JAX initialises its backends, so this runs at import,
before any test module imports jax.
"""

import os

_DEVICES_FLAG = '--xla_force_host_platform_device_count=8'
if _DEVICES_FLAG not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICES_FLAG}".strip()

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
