"""Compiles the accelerator check's programs for a GPU or a TPU without one: ops per loop phase,
collectives and memory per device.

  pip install jax-cuda12-plugin==$V jax-cuda12-pjrt==$V   # V: the installed JAX's version
  pip install "libtpu==0.0.42.*"                          # the libtpu jax[tpu]==$V pins (TPUs)
  python experiments/compile_only.py                      # llama1b on an H200, padded and not
  python experiments/compile_only.py --target=v5e --model_axis=4 --single_row=plain  # 4 chips
  python experiments/compile_only.py --target=cpu --target_preset=tiny_target \\
      --draft_preset=tiny_draft                           # this machine's CPU, for comparison
  python experiments/compile_only.py --program=sps --single_row=padded \\
      --drafter=model --drafter=lookup --drafter=hybrid --drafter=feature --drafter=heads

For each program (`step`: the plain one-position extend loop `variants` times; `ars`, `sps`: the
whole generations of the perfect-draft ceiling, at temperature 1 unless `--temperature`,
`--top_k`, `--top_p` say otherwise; `sps` with each `--drafter`: the draft preset, prompt
lookup, both, an EAGLE head or k parallel heads over the target's features) and each treatment
of single-row products (`TransformerConfig.single_row`: 'padded' is what a GPU runs by default),
on a ('data', 'model') mesh of `--data` x `--model_axis` devices (several: TPU chips, or this
machine's CPU devices): the operations one iteration of its main loop runs, per phase
(`hlo.launches_by_phase`; on a GPU each launches about one kernel; an inner loop times its trip
count where XLA knows it, else once: dynamic k's drafting, whose every step then also reads its
condition on the host), the collectives among them, and the memory a device holds
(`deviceless.device_bytes`), from XLA's optimized HLO (`spsjax.bench.deviceless`): no times, no
autotuning. For a GPU, --launches adds what an iteration launches, from XLA's thunk sequence
(`spsjax.bench.thunks`): the HLO counts a fusion once where some launch many kernels. Without a
GPU, XLA sorts with its own kernels, where a GPU would run CUB's radix sort. With --dump_dir each
program's HLO is written there. JAX_PLATFORMS defaults to cpu
here, so the plugins start without an accelerator, and ALLOW_MULTIPLE_LIBTPU_LOAD to 1, so that
several such processes can compile for a TPU at once.
"""

import dataclasses
import os
import shutil
import tempfile
import time

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')

from absl import app, flags  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax  # pylint: disable=g-import-not-at-top,wrong-import-position

from spsjax import cli, models, sharding, storage  # pylint: disable=wrong-import-position
from spsjax.bench import deviceless, hlo, thunks  # pylint: disable=wrong-import-position
from spsjax.models import presets  # pylint: disable=wrong-import-position
from spsjax.sampling import SamplingConfig, drafter_config  # pylint: disable=wrong-import-position

_PROGRAMS = ('step', 'ars', 'sps')
_TARGET = flags.DEFINE_enum('target', 'h200', [*deviceless.TARGETS, 'cpu'],
                            'The GPU or TPU to compile for, or cpu: this machine\'s CPU.')
_DATA = flags.DEFINE_integer('data', 1, 'Mesh data axis (several devices: a TPU target, or cpu '
                             'with that many devices).')
_MODEL_AXIS = flags.DEFINE_integer('model_axis', 1, 'Mesh model axis.')
_BATCH = flags.DEFINE_integer('batch', 1, 'Rows (a multiple of the mesh\'s data axis).')
_TARGET_PRESET = flags.DEFINE_string('target_preset', 'llama1b', 'The target model\'s preset.')
_DRAFT_PRESET = flags.DEFINE_string('draft_preset', 'llama1b_draft', 'The draft\'s preset (sps).')
_DTYPE = flags.DEFINE_enum('dtype', 'bfloat16', ['bfloat16', 'float32'], 'The models\' dtype.')
_SINGLE_ROW = flags.DEFINE_multi_enum('single_row', ['padded', 'plain'],
                                      ['padded', 'plain', 'stream'],
                                      'Single-row products: padded (a GPU\'s default), plain, '
                                      'or stream (the residual stream at two rows).')
_PROGRAM = flags.DEFINE_multi_enum('program', list(_PROGRAMS), list(_PROGRAMS), 'Programs.')
_K = flags.DEFINE_integer('k', 4, 'SpS lookahead.')
_TEMPERATURE = flags.DEFINE_float('temperature', 1.0, 'ArS\'s and SpS\'s sampling: temperature '
                                  '(0: greedy).')
_TOP_K = flags.DEFINE_integer('top_k', 0, 'Top-k (0: off).')
_TOP_P = flags.DEFINE_float('top_p', 1.0, 'Top-p (1: off).')
_DRAFTER = flags.DEFINE_multi_enum('drafter', ['model'], list(drafter_config.KINDS),
                                   'SpS drafters (`sampling.drafter_config`); feature: a 1-block '
                                   'EAGLE head, heads: k parallel heads.')
_STOP_BELOW = flags.DEFINE_float('stop_below', 0.0, 'Dynamic k for the model and hybrid drafters: '
                                 'a row stops drafting below this draft probability.')
_DUMP_DIR = flags.DEFINE_string('dump_dir', None, 'Write each program\'s HLO here: '
                                '<program>[_<drafter>][_dynamic]_<single_row>.hlo.txt.')
_OUT = flags.DEFINE_string('out', None, 'Also write the table (Markdown) to this file.')
_LAUNCHES = flags.DEFINE_bool(
    'launches', False, 'GPU targets: also what one loop iteration launches, from the thunk '
    'sequence XLA:GPU writes (`spsjax.bench.thunks`): kernels and copies (a sort XLA emits '
    'itself is many), CUDA graphs among them, launches outside any. Sets XLA_FLAGS to dump '
    'into a temporary directory.')


@dataclasses.dataclass(frozen=True)
class Row:
  program: str
  drafter: str  # SpS's drafter; '-' for the other programs.
  single_row: str
  launches: dict[str, int]  # Phase -> operations one iteration of the main loop runs.
  collectives: int  # Of those, the collectives (`hlo.COLLECTIVES`).
  device_bytes: int | None  # What one device holds (`deviceless.device_bytes`).
  compile_seconds: float
  launched: thunks.Loop | None = None  # With --launches.


def _model(preset: str, single_row: str, mesh) -> models.Model:
  config = models.TransformerConfig(**dict(presets.get(preset), dtype=_DTYPE.value,
                                           single_row=single_row))
  return deviceless.abstract_model(config, mesh)


def _draft(kind: str, target: models.Model, single_row: str, mesh):
  """The draft `kind`'s drafter reads: the draft preset, a head over `target`, or None."""
  if kind in drafter_config.HEAD_KINDS:
    return deviceless.abstract_head(kind, target.config, mesh,
                                    num_layers=_K.value if kind in ('heads', 'mlp') else 1)
  return None if kind == 'lookup' else _model(_DRAFT_PRESET.value, single_row, mesh)


def count(program: str, single_row: str, mesh, dump_dir: str | None,
          drafter: str = 'model', thunk_dir: str | None = None) -> Row:
  """One program's operations per phase (`Row`), its HLO written to `dump_dir` if given; with
  `thunk_dir` (where XLA_FLAGS dumps), what its loop launches."""
  dumped = set(os.listdir(thunk_dir)) if thunk_dir else set()
  start = time.perf_counter()
  target = _model(_TARGET_PRESET.value, single_row, mesh)
  name, label, batch = program, '-', _BATCH.value
  sampling = SamplingConfig(temperature=_TEMPERATURE.value, top_k=_TOP_K.value,
                            top_p=_TOP_P.value)
  if program == 'step':
    compiled = deviceless.compile_step(target, mesh, batch=batch)
  elif program == 'ars':
    compiled = deviceless.compile_ars(target, mesh, batch=batch, sampling=sampling)
  else:
    stop_below = _STOP_BELOW.value if drafter in ('model', 'hybrid') else 0.0
    compiled = deviceless.compile_sps(
        target, _draft(drafter, target, single_row, mesh), mesh, k=_K.value, batch=batch,
        sampling=sampling, drafter=drafter_config.build(drafter, stop_below=stop_below))
    name = f'{program}_{drafter}' if drafter != 'model' else program
    label = f'{drafter}, stop_below {stop_below:g}' if stop_below else drafter
    name += '_dynamic' if stop_below else ''
  seconds = time.perf_counter() - start
  text = compiled.as_text()
  if dump_dir:
    storage.write_text(storage.join(dump_dir, f'{name}_{single_row}.hlo.txt'), text)
  launches = hlo.loop_launches_by_phase(text, trips=True)
  if launches is None:
    raise RuntimeError(f'{name} ({single_row}): XLA left no loop to count.')
  return Row(program, label, single_row, launches, hlo.loop_collectives(text),
             deviceless.device_bytes(compiled), seconds,
             _loop_thunks(thunk_dir, dumped, name) if thunk_dir else None)


def _loop_thunks(thunk_dir: str, before: set[str], name: str) -> thunks.Loop:
  """The loop launches of the program this compile dumped (the largest new thunk sequence),
  its dump then removed."""
  new = sorted(set(os.listdir(thunk_dir)) - before)
  sequences = [f for f in new if f.endswith('thunk_sequence_after_thunk_passes.txt')]
  if not sequences:
    raise RuntimeError(f'{name}: XLA wrote no thunk sequence into {thunk_dir} (XLA_FLAGS was '
                       'set after XLA read it?).')
  largest = max(sequences, key=lambda f: os.path.getsize(os.path.join(thunk_dir, f)))
  with open(os.path.join(thunk_dir, largest), encoding='utf-8') as f:
    found = thunks.main_loop(f.read())
  for f in new:
    path = os.path.join(thunk_dir, f)
    if os.path.isdir(path):
      shutil.rmtree(path)
    else:
      os.remove(path)
  if found is None:
    raise RuntimeError(f'{name}: no loop in its thunk sequence.')
  return found


def _launch_text(loop: thunks.Loop | None) -> str:
  if loop is None:
    return ' - |'
  inner = f', {loop.inner_loops} inner loops once' if loop.inner_loops else ''
  return f' {loop.launches} ({loop.graphs}, {loop.outside}{inner}) |'


def table(rows: list[Row], device: str, mesh_shape: str) -> str:
  phases = (*hlo.PHASES, hlo.OTHER)
  launched = any(r.launched is not None for r in rows)
  lines = [f'Operations one loop iteration runs on {device}, mesh {mesh_shape} (JAX '
           f'{jax.__version__}; {_TARGET_PRESET.value}, draft {_DRAFT_PRESET.value}, batch '
           f'{_BATCH.value}, k = {_K.value}, {_DTYPE.value}, {_sampling_text()})', '',
           '| program | drafter | single rows | ' + ' | '.join(phases)
           + ' | all | collectives | MiB a device | compile s |'
           + (' launches (graphs, outside) |' if launched else ''),
           '|---' * (len(phases) + 7 + launched) + '|']
  for r in rows:
    mib = '-' if r.device_bytes is None else f'{r.device_bytes / 2**20:.1f}'
    lines.append(f'| {r.program} | {r.drafter} | {r.single_row} | '
                 + ' | '.join(str(r.launches.get(p, 0)) for p in phases)
                 + f' | {sum(r.launches.values())} | {r.collectives} | {mib} | '
                 f'{r.compile_seconds:.0f} |' + (_launch_text(r.launched) if launched else ''))
  return '\n'.join(lines) + '\n'


def _sampling_text() -> str:
  parts = [f'temperature {_TEMPERATURE.value:g}']
  if _TOP_K.value:
    parts.append(f'top-k {_TOP_K.value}')
  if _TOP_P.value < 1:
    parts.append(f'top-p {_TOP_P.value:g}')
  return ', '.join(parts)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if (_DRAFTER.value != ['model'] or _STOP_BELOW.value) and 'sps' not in _PROGRAM.value:
    raise app.UsageError('--drafter and --stop_below are SpS\'s: pass --program=sps too.')
  if _STOP_BELOW.value and not {'model', 'hybrid'} & set(_DRAFTER.value):
    raise app.UsageError('--stop_below is dynamic k of the model and hybrid drafters: pass '
                         '--drafter=model or hybrid.')
  try:
    SamplingConfig(temperature=_TEMPERATURE.value, top_k=_TOP_K.value, top_p=_TOP_P.value)
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  data, model_axis = _DATA.value, _MODEL_AXIS.value
  if data < 1 or model_axis < 1:
    raise app.UsageError(f'--data and --model_axis must be >= 1, got {data} and {model_axis}.')
  if _BATCH.value < 1 or _BATCH.value % data:
    raise app.UsageError(f'--batch={_BATCH.value} must be a positive multiple of the mesh\'s '
                         f'data axis ({data}).')
  thunk_dir = None
  if _LAUNCHES.value:
    if _TARGET.value not in deviceless.GPU_TARGETS:
      raise app.UsageError(f'--launches reads XLA:GPU\'s thunks: a GPU target '
                           f'({", ".join(deviceless.GPU_TARGETS)}), not {_TARGET.value}.')
    # Read when XLA first compiles, below: no program has been compiled yet.
    thunk_dir = tempfile.mkdtemp(prefix='spsjax-thunks-')
    os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                               f' --xla_dump_to={thunk_dir} --xla_dump_hlo_as_text').strip()
  if _TARGET.value == 'cpu':
    devices = jax.devices('cpu')
    if len(devices) < data * model_axis:
      raise app.UsageError(f'A {data} x {model_axis} mesh needs {data * model_axis} CPU devices, '
                           f'this process has {len(devices)} (XLA_FLAGS='
                           '--xla_force_host_platform_device_count=N).')
    devices = devices[:data * model_axis]
  else:
    try:
      devices = deviceless.devices(_TARGET.value, data * model_axis)
    except (RuntimeError, ValueError) as e:  # What to install, or what mesh it has: one line.
      raise app.UsageError(str(e)) from e
  mesh = sharding.make_mesh(data, model_axis, devices)
  try:
    rows = [count(p, s, mesh, _DUMP_DIR.value, d, thunk_dir)
            for p in _PROGRAMS if p in _PROGRAM.value
            for d in (_DRAFTER.value if p == 'sps' else ['model']) for s in _SINGLE_ROW.value]
  finally:
    if thunk_dir:
      shutil.rmtree(thunk_dir, ignore_errors=True)
  kind = getattr(devices[0], 'device_kind', devices[0].platform)
  text = table(rows, f'{_TARGET.value} ({kind})', f'{data} x {model_axis}')
  print(text)
  if _OUT.value:
    storage.write_text(_OUT.value, text)


if __name__ == '__main__':
  cli.run(main)
