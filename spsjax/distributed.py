"""Multi-process runs through JAX's multi-controller runtime, and nothing home-made on top of it.

Every binary calls `initialize()` first. With `--coordinator_address` (plus `--num_processes` and
`--process_id`) it calls `jax.distributed.initialize` with them; with `--distributed` alone it calls
it with no arguments, so JAX detects the cluster itself (Cloud TPU VMs of a pod slice, SLURM, Open
MPI, Kubernetes). Without either, the run is one process. Then every process sees all devices in
`jax.devices()`, meshes span them (`sharding.make_mesh`), and each process feeds its own rows
(`global_rows`) and reads back what it needs (`gather`).

Invariant: after `initialize()`, only process 0 logs below ERROR and prints (`print0`), so a pod
slice's log reads as one run.
"""

from absl import app, flags, logging
import jax
from jax.experimental import multihost_utils
import numpy as np

from spsjax import logs

_COORDINATOR = flags.DEFINE_string(
    'coordinator_address', None, 'host:port of process 0 for jax.distributed (multi-process).')
_NUM_PROCESSES = flags.DEFINE_integer('num_processes', None, 'Processes in the run.')
_PROCESS_ID = flags.DEFINE_integer('process_id', None, 'This process, in [0, num_processes).')
_DISTRIBUTED = flags.DEFINE_bool(
    'distributed', False, 'Initialise jax.distributed from the environment (TPU pod slices, '
    'SLURM, ...) when no coordinator address is given.')
_CPU_COLLECTIVES = flags.DEFINE_string(
    'cpu_collectives', 'gloo', 'Collectives between CPU processes (JAX needs one to run a mesh '
    'that spans CPU processes).')


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, auto: bool | None = None) -> None:
  """Starts the multi-controller runtime if configured (arguments override the flags)."""
  address = coordinator_address or (_COORDINATOR.value if flags.FLAGS.is_parsed() else None)
  if num_processes is None and flags.FLAGS.is_parsed():
    num_processes = _NUM_PROCESSES.value
  if process_id is None and flags.FLAGS.is_parsed():
    process_id = _PROCESS_ID.value
  if auto is None:
    auto = _DISTRIBUTED.value if flags.FLAGS.is_parsed() else False
  if address or auto:
    if address and (num_processes is None or process_id is None):
      raise ValueError('--coordinator_address needs --num_processes and --process_id.')
    collectives = _CPU_COLLECTIVES.value if flags.FLAGS.is_parsed() else 'gloo'
    jax.config.update('jax_cpu_collectives_implementation', collectives)
    if address:
      jax.distributed.initialize(address, num_processes, process_id)
    else:
      jax.distributed.initialize()
  if jax.process_index() != 0:
    logging.set_verbosity(logging.ERROR)
  logging.info('JAX %s: process %d of %d, %d local of %d devices (%s).', jax.__version__,
               jax.process_index(), jax.process_count(), jax.local_device_count(),
               jax.device_count(), jax.devices()[0].platform)


def start(argv) -> None:
  """What every binary's `main(argv)` does first: reject stray arguments, quiet the libraries' info
  logs, start the multi-controller runtime if configured."""
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  logs.quiet_libraries()
  initialize()


def is_main() -> bool:
  return jax.process_index() == 0


def print0(*args, **kwargs) -> None:
  """`print` on process 0 only."""
  if is_main():
    kwargs.setdefault('flush', True)
    print(*args, **kwargs)


def gather(tree):
  """A pytree of (possibly multi-process, sharded) arrays as host numpy arrays on every process."""
  if jax.process_count() == 1:
    return jax.tree.map(np.asarray, jax.device_get(tree))
  return jax.tree.map(lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)),
                      tree)
