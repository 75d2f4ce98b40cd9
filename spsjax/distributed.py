"""Multi-process runs through JAX's multi-controller runtime, and nothing home-made on top of it.

A binary defines the flags (`define_flags()`, once, at import) and calls `start(argv, options)`
first. With `--coordinator_address` (plus `--num_processes` and `--process_id`) it calls
`jax.distributed.initialize` with them; with `--distributed` alone it calls it with no arguments, so
JAX detects the cluster itself (Cloud TPU VMs of a pod slice, SLURM, Open MPI, Kubernetes). Without
either, the run is one process. Importing this module defines no flag. Then every process sees all
devices in `jax.devices()`, meshes span them (`sharding.make_mesh`), inputs are host arrays equal on
every process or global jax.Arrays whose rows live where the mesh puts them, and every process reads
back what it needs (`gather`).

Invariant: after `initialize()`, only process 0 logs below ERROR and prints (`print0`), so a pod
slice's log reads as one run.

One writer: process 0 writes what all processes share (tokenizer, results, traces: `storage`),
the others wait where they read it (`barrier`); what every process computes for itself and must
agree on (the data it loaded) is compared across processes (`check_same`). Both are collective:
every process calls them, in the same order, as an SPMD program calls everything.
"""

import dataclasses
import functools
import hashlib
import socket
from collections.abc import Callable

from absl import app, flags, logging
import jax
from jax.experimental import multihost_utils
import numpy as np

from spsjax import logs


@dataclasses.dataclass(frozen=True)
class Options:
  """How to start the multi-controller runtime (the flags of `define_flags`)."""
  coordinator_address: str | None = None  # host:port of process 0.
  num_processes: int | None = None
  process_id: int | None = None
  auto: bool = False  # jax.distributed.initialize() detects the cluster itself.
  cpu_collectives: str = 'gloo'  # Collectives between CPU processes (a mesh across them needs one).


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> Callable[[], Options]:
  """Defines the multi-process flags (a binary calls this once, at import); returns a function
  that reads them into `Options` once they are parsed."""
  holders = dict(
      coordinator_address=flags.DEFINE_string(
          'coordinator_address', None, 'host:port of process 0 for jax.distributed '
          '(multi-process).', flag_values=flag_values),
      num_processes=flags.DEFINE_integer('num_processes', None, 'Processes in the run.',
                                         flag_values=flag_values),
      process_id=flags.DEFINE_integer('process_id', None, 'This process, in [0, num_processes).',
                                      flag_values=flag_values),
      auto=flags.DEFINE_bool(
          'distributed', False, 'Initialise jax.distributed from the environment (TPU pod '
          'slices, SLURM, ...) when no coordinator address is given.', flag_values=flag_values),
      cpu_collectives=flags.DEFINE_string(
          'cpu_collectives', 'gloo', 'Collectives between CPU processes (JAX needs one to run a '
          'mesh that spans CPU processes).', flag_values=flag_values))
  return lambda: Options(**{name: holder.value for name, holder in holders.items()})


def initialize(options: Options = Options()) -> None:
  """Starts the multi-controller runtime if `options` ask for it; then quiets processes > 0."""
  if options.coordinator_address or options.auto:
    if options.coordinator_address and (options.num_processes is None
                                        or options.process_id is None):
      raise ValueError('--coordinator_address needs --num_processes and --process_id.')
    jax.config.update('jax_cpu_collectives_implementation', options.cpu_collectives)
    if options.coordinator_address:
      jax.distributed.initialize(options.coordinator_address, options.num_processes,
                                 options.process_id)
    else:
      jax.distributed.initialize()
  if jax.process_index() != 0:
    logging.set_verbosity(logging.ERROR)
  logging.info('JAX %s: process %d of %d, %d local of %d devices (%s).', jax.__version__,
               jax.process_index(), jax.process_count(), jax.local_device_count(),
               jax.device_count(), jax.devices()[0].platform)


def start(argv, options: Options = Options()) -> None:
  """What every binary's `main(argv)` does first: reject stray arguments, quiet the libraries' info
  logs, start the multi-controller runtime as `options` (from `define_flags`) say."""
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  logs.quiet_libraries()
  initialize(options)


def is_main() -> bool:
  return jax.process_index() == 0


def barrier(name: str) -> None:
  """Waits until every process reaches the barrier `name` (the same name on all; a no-op with one
  process)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def _digests(value: bytes) -> np.ndarray:
  """int32[processes, 32]: the SHA-256 of each process's `value`, row p from process p."""
  mine = np.frombuffer(hashlib.sha256(value).digest(), np.uint8).astype(np.int32)
  if jax.process_count() == 1:
    return mine[None]
  return np.asarray(multihost_utils.process_allgather(mine)).reshape(jax.process_count(), -1)


def check_same(name: str, value: bytes | str, hint: str = '') -> None:
  """Raises ValueError on every process unless all processes hold the same `value` (compared by
  SHA-256; a no-op with one process). `name` says what differs ('dataset python_code/train'),
  `hint` what to do about it."""
  if jax.process_count() == 1:
    return
  value = value.encode('utf-8') if isinstance(value, str) else value
  digests = _digests(value)
  groups = {}
  for p, row in enumerate(digests):
    groups.setdefault(bytes(row.astype(np.uint8)).hex()[:12], []).append(p)
  if len(groups) > 1:
    held = '; '.join(f'processes {ps} hold {digest}' for digest, ps in groups.items())
    raise ValueError(f'{name} differs between processes ({held}; SHA-256 prefixes).'
                     + (f' {hint}' if hint else ''))


@functools.cache
def host_leader() -> bool:
  """Whether this process has the lowest index among the processes on its host (by host name):
  the one that writes a host's local files. Collective on its first call; True with one process."""
  if jax.process_count() == 1:
    return True
  hosts = _digests(socket.gethostname().encode('utf-8'))
  mine = hosts[jax.process_index()]
  return next(p for p, row in enumerate(hosts) if np.array_equal(row, mine)) == jax.process_index()


def print0(*args, **kwargs) -> None:
  """`print` on process 0 only."""
  if is_main():
    kwargs.setdefault('flush', True)
    print(*args, **kwargs)


def gather(tree):
  """A pytree of (possibly multi-process, sharded) arrays as host numpy arrays on every process.

  Host values (numpy arrays, scalars) are taken as they are, so gathering twice is harmless.
  """

  def one(x):
    if not isinstance(x, jax.Array) or x.is_fully_addressable or jax.process_count() == 1:
      return np.asarray(jax.device_get(x))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))

  return jax.tree.map(one, tree)
