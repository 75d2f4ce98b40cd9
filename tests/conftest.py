"""Test-wide JAX setup: 8 fake CPU devices, XLA:CPU's quicker compiler path (`tests/xla_env.py`),
strict rank promotion, and one persistent compilation cache per test run.

Compiling is most of the suite's time, and many tests compile the same small programs (the same
toy models through the same samplers, binaries started by several tests): the run's xdist workers
and the processes they start share one JAX compilation cache in a fresh temporary directory,
removed when the run ends, so a program is compiled once per run. A run never reads another
run's cache.

XLA flags must be in XLA_FLAGS before JAX initialises its backends, so this runs at import, before
any test module imports jax.
"""

import os
import shutil
import tempfile

from tests import xla_env

for _flag in xla_env.flags(devices=8).split():
  if _flag.split('=')[0] not in os.environ.get('XLA_FLAGS', ''):
    os.environ['XLA_FLAGS'] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()

# The first process of a run (pytest itself, which starts the xdist workers) makes the cache
# directory; the workers and the processes tests start inherit it through the environment.
_OWNER = 'SPSJAX_TEST_COMPILE_CACHE_OWNER'
if 'JAX_COMPILATION_CACHE_DIR' not in os.environ:
  os.environ['JAX_COMPILATION_CACHE_DIR'] = tempfile.mkdtemp(prefix='spsjax-test-compile-cache-')
  os.environ[_OWNER] = str(os.getpid())
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', '-1')

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


# The test files that take longest (a worker's seconds on a 2-core AMD EPYC, AVX2, 2026-11-28:
# 367, 177, 141, 135, 133, 128, 122, 121, 93, 90, 80, 78, 69 s; the suite 2,250 s), started first:
# with `make test`'s `--no-loadscope-reorder` the two xdist workers take files in this order, the
# longest first, so that the run does not end with one worker on a long file and the other idle
# (xdist's own order, by the number of tests, started the 2-test multi-host file last).
LONGEST_FIRST = ('test_speculative', 'test_drafters', 'test_feature_drafters', 'test_multihost',
                 'test_experiments', 'test_sharding', 'test_native', 'test_train',
                 'test_bench_harness', 'test_accelerator_check', 'test_autoregressive',
                 'test_native_sanitized', 'test_token_tree', 'test_storage')


def pytest_collection_modifyitems(items):
  """The files of LONGEST_FIRST first, in its order; the others after, as collected."""
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))


def pytest_sessionfinish(session):  # pylint: disable=unused-argument
  """The run's compilation cache goes with it, removed by the process that made it."""
  if os.environ.get(_OWNER) == str(os.getpid()):
    shutil.rmtree(os.environ['JAX_COMPILATION_CACHE_DIR'], ignore_errors=True)
