"""Recording a program under `jax.profiler` and reading back its XLA op events.

Files. `jax.profiler.trace(log_dir)` writes `log_dir/plugins/profile/<YYYY_MM_DD_HH_MM_SS>/` with
`<host>.xplane.pb` (XSpace; open with XProf or TensorBoard `--logdir log_dir`) and
`<host>.trace.json.gz` (Chrome trace JSON; open in ui.perfetto.dev). `PhaseProfile.trace_dir` is
that directory. `log_dir` may be a URI (`gs://...`): the profiler writes into a local temporary
directory and process 0 copies the files there (`record`). The xplane file is parsed with
`jax.profiler.ProfileData` (ships with jaxlib).

Events. On CPU (jaxlib 0.10.2) the thunk executor emits one event per executed thunk, with stats
`hlo_op` (the HLO instruction name: `ynn_fusion.3`, `copy.6`, `while.638`), `hlo_module`
(`jit_run`), `run_id` and `device_ordinal`. Thunks run on the PjRt client thread and the
`tf_XLAEigen` pool, hopping between threads, and independent ones may run at the same time, so
events are taken from every line of every plane. Only events with an `hlo_op` stat of this module
are used: host events (Python, dispatch, `ThunkExecutor::Execute`, the `end: <op>` completion
markers, thread-pool markers) carry none, and small programs JAX runs around ours
(`jit__threefry_seed`) have another module. Durations are wall time on the thread, so they include
any time the thread was preempted. GPU kernel events carry the same stats, except that a kernel
launched from a CUDA graph (XLA's command buffers; stat `cuda_graph_id`) has the graph's thunk as
`hlo_op` (`command_buffer_71`, seen on an H100 and an H200): the event's own name, the kernel's,
is kept as `OpEvent.kernel`, from which `profile.attribute` finds the fusions
(`hlo.Hlo.kernel_owners`). With loops in graphs too (`--xla_gpu_enable_command_buffer=...,WHILE`)
an H200 trace held one iteration's kernels of a 4-iteration loop. On TPU the device planes'
`XLA Ops` line is used, named by instruction, with modules from the `XLA Modules` line (not run
here): the reader fails loudly if it finds no op events.
"""

import dataclasses
import glob
import os
import tempfile
from collections.abc import Callable
from typing import Any

import jax

from spsjax import storage


class ProfileError(RuntimeError):
  """The trace cannot give the numbers asked for (no op events, HLO and trace disagree, ...)."""


@dataclasses.dataclass(frozen=True)
class OpEvent:
  name: str  # HLO instruction name.
  start_ns: float
  end_ns: float
  device: str  # `device_ordinal` on CPU/GPU, the plane name on TPU.
  run: str  # One execution of the module.
  kernel: str = ''  # A GPU kernel run by a CUDA graph: its name (`name` is the graph's thunk).


def record(fn: Callable[[], Any], log_dir: str,
           options: jax.profiler.ProfileOptions | None = None) -> tuple[Any, str, bytes]:
  """Runs `fn()` under `jax.profiler.trace`, blocked on before the trace stops.

  Returns (outputs, the `.xplane.pb`'s path under `log_dir`, its XSpace bytes). The profiler
  writes local files only: it writes into a temporary directory, from which process 0 copies the
  run's files to `log_dir` (local or a URI: `storage`). The other processes copy nothing (their
  path names where their trace would be); each parses its own bytes. The Python tracer is off by
  default: it records host calls, not the program, and can make traces large.
  """
  if options is None:
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
  with tempfile.TemporaryDirectory(prefix='spsjax-trace-') as local:
    with jax.profiler.trace(local, profiler_options=options):
      outputs = jax.block_until_ready(fn())
    written = glob.glob(os.path.join(local, 'plugins', 'profile', '*', '*.xplane.pb'))
    if not written:
      raise ProfileError(f'jax.profiler.trace wrote no .xplane.pb under {local}/plugins/profile.')
    with open(written[0], 'rb') as f:  # The profiler's own temporary file.
      xspace = f.read()
    storage.copy_dir(local, log_dir)
  return outputs, os.fspath(storage.path(log_dir) / os.path.relpath(written[0], local)), xspace


def _module_matches(name: str, module: str) -> bool:
  return name == module or name.startswith(module + '(')


def read_op_events(xplane: str | bytes, module: str) -> list[OpEvent]:
  """The XLA op events of `module` in an XSpace: its serialized bytes, or the path of its file
  (see the module docstring for which)."""
  xspace = xplane if isinstance(xplane, bytes) else storage.path(xplane).read_bytes()
  data = jax.profiler.ProfileData.from_serialized_xspace(xspace)
  events = []
  for plane in data.planes:
    lines = list(plane.lines)
    tagged, by_line = [], []  # Events with `hlo_op` stats; else a device's `XLA Ops` line.
    modules = [e for line in lines if line.name == 'XLA Modules' for e in line.events
               if _module_matches(e.name, module)]
    for line in lines:
      for e in line.events:
        stats = dict(e.stats)
        if 'hlo_op' in stats:
          if _module_matches(str(stats.get('hlo_module', '')), module):
            tagged.append(OpEvent(str(stats['hlo_op']), e.start_ns, e.end_ns,
                                  str(stats.get('device_ordinal', plane.name)),
                                  str(stats.get('run_id', '')),
                                  e.name if 'cuda_graph_id' in stats else ''))
        elif line.name == 'XLA Ops' and plane.name.startswith('/device:'):
          runs = [i for i, m in enumerate(modules) if m.start_ns <= e.start_ns <= m.end_ns]
          if runs:
            by_line.append(OpEvent(e.name, e.start_ns, e.end_ns, plane.name, str(runs[0])))
    events += tagged or by_line
  if not events:
    raise ProfileError(f'No XLA op events of module {module} in the trace: this backend\'s '
                       'trace names no HLO ops (no `hlo_op` stats, no `XLA Ops` line).')
  return events


