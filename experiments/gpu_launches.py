"""Counts the kernels the accelerator check's programs launch on a GPU, compiled without one.

  pip install jax-cuda12-plugin==$V jax-cuda12-pjrt==$V   # V: the installed JAX's version
  python experiments/gpu_launches.py                       # llama1b on an H200, padded and not
  python experiments/gpu_launches.py --target=cpu --target_preset=tiny_target \\
      --draft_preset=tiny_draft                            # this machine's CPU, for comparison
  python experiments/gpu_launches.py --program=sps --single_row=padded \\
      --drafter=model --drafter=lookup --drafter=hybrid --drafter=feature --drafter=heads

For each program (`step`: the plain one-position extend loop `variants` times; `ars`, `sps`: the
whole generations of the perfect-draft ceiling, batch 1, temperature 1; `sps` with each
`--drafter`: the draft preset, prompt lookup, both, an EAGLE head or k parallel heads over the
target's features) and each treatment of single-row products (`TransformerConfig.single_row`:
'padded' is what a GPU runs by default), the operations one iteration of its main loop launches,
per phase (`hlo.launches_by_phase`; an inner loop times its trip count where XLA knows it, else
once: dynamic k's drafting, whose every step then also reads its condition on the host), from
XLA:GPU's optimized HLO (`spsjax.bench.deviceless`): no times, no autotuning. With --dump_dir
each program's HLO is written there. JAX_PLATFORMS defaults to cpu here, so the CUDA plugin
starts without a GPU.
"""

import dataclasses
import os
import time

os.environ.setdefault('JAX_PLATFORMS', 'cpu')

from absl import app, flags  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax  # pylint: disable=g-import-not-at-top,wrong-import-position

from spsjax import cli, models, storage  # pylint: disable=wrong-import-position
from spsjax.bench import deviceless, hlo  # pylint: disable=wrong-import-position
from spsjax.models import presets  # pylint: disable=wrong-import-position
from spsjax.sampling import drafter_config  # pylint: disable=wrong-import-position

_PROGRAMS = ('step', 'ars', 'sps')
_TARGET = flags.DEFINE_enum('target', 'h200', [*deviceless.TARGETS, 'cpu'],
                            'The GPU to compile for, or cpu: this machine\'s CPU.')
_TARGET_PRESET = flags.DEFINE_string('target_preset', 'llama1b', 'The target model\'s preset.')
_DRAFT_PRESET = flags.DEFINE_string('draft_preset', 'llama1b_draft', 'The draft\'s preset (sps).')
_DTYPE = flags.DEFINE_enum('dtype', 'bfloat16', ['bfloat16', 'float32'], 'The models\' dtype.')
_SINGLE_ROW = flags.DEFINE_multi_enum('single_row', ['padded', 'plain'], ['padded', 'plain'],
                                      'Single-row products: padded (a GPU\'s default) or plain.')
_PROGRAM = flags.DEFINE_multi_enum('program', list(_PROGRAMS), list(_PROGRAMS), 'Programs.')
_K = flags.DEFINE_integer('k', 4, 'SpS lookahead.')
_DRAFTER = flags.DEFINE_multi_enum('drafter', ['model'], list(drafter_config.KINDS),
                                   'SpS drafters (`sampling.drafter_config`); feature: a 1-block '
                                   'EAGLE head, heads: k parallel heads.')
_STOP_BELOW = flags.DEFINE_float('stop_below', 0.0, 'Dynamic k for the model and hybrid drafters: '
                                 'a row stops drafting below this draft probability.')
_DUMP_DIR = flags.DEFINE_string('dump_dir', None, 'Write each program\'s HLO here: '
                                '<program>[_<drafter>][_dynamic]_<single_row>.hlo.txt.')
_OUT = flags.DEFINE_string('out', None, 'Also write the table (Markdown) to this file.')


@dataclasses.dataclass(frozen=True)
class Row:
  program: str
  drafter: str  # SpS's drafter; '-' for the other programs.
  single_row: str
  launches: dict[str, int]  # Phase -> operations one iteration of the main loop launches.
  compile_seconds: float


def _model(preset: str, single_row: str, dev: jax.Device) -> models.Model:
  config = models.TransformerConfig(**dict(presets.get(preset), dtype=_DTYPE.value,
                                           single_row=single_row))
  return deviceless.abstract_model(config, dev)


def _draft(kind: str, target: models.Model, single_row: str, dev: jax.Device):
  """The draft `kind`'s drafter reads: the draft preset, a head over `target`, or None."""
  if kind in drafter_config.HEAD_KINDS:
    return deviceless.abstract_head(kind, target.config, dev,
                                    num_layers=_K.value if kind == 'heads' else 1)
  return None if kind == 'lookup' else _model(_DRAFT_PRESET.value, single_row, dev)


def count(program: str, single_row: str, dev: jax.Device, dump_dir: str | None,
          drafter: str = 'model') -> Row:
  """One program's launches per phase (`Row`), its HLO written to `dump_dir` if given."""
  start = time.perf_counter()
  target = _model(_TARGET_PRESET.value, single_row, dev)
  name, label = program, '-'
  if program == 'step':
    text = deviceless.step_hlo(target, dev)
  elif program == 'ars':
    text = deviceless.ars_hlo(target, dev)
  else:
    stop_below = _STOP_BELOW.value if drafter in ('model', 'hybrid') else 0.0
    text = deviceless.sps_hlo(target, _draft(drafter, target, single_row, dev), dev, k=_K.value,
                              drafter=drafter_config.build(drafter, stop_below=stop_below))
    name = f'{program}_{drafter}' if drafter != 'model' else program
    label = f'{drafter}, stop_below {stop_below:g}' if stop_below else drafter
    name += '_dynamic' if stop_below else ''
  seconds = time.perf_counter() - start
  if dump_dir:
    storage.write_text(storage.join(dump_dir, f'{name}_{single_row}.hlo.txt'), text)
  launches = hlo.loop_launches_by_phase(text, trips=True)
  if launches is None:
    raise RuntimeError(f'{name} ({single_row}): XLA left no loop to count.')
  return Row(program, label, single_row, launches, seconds)


def table(rows: list[Row], device: str) -> str:
  phases = (*hlo.PHASES, hlo.OTHER)
  lines = [f'Operations one loop iteration launches on {device} (JAX {jax.__version__}; '
           f'{_TARGET_PRESET.value}, draft {_DRAFT_PRESET.value}, k = {_K.value}, {_DTYPE.value})',
           '', '| program | drafter | single rows | ' + ' | '.join(phases) + ' | all | compile s |',
           '|---' * (len(phases) + 5) + '|']
  for r in rows:
    lines.append(f'| {r.program} | {r.drafter} | {r.single_row} | '
                 + ' | '.join(str(r.launches.get(p, 0)) for p in phases)
                 + f' | {sum(r.launches.values())} | {r.compile_seconds:.0f} |')
  return '\n'.join(lines) + '\n'


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if (_DRAFTER.value != ['model'] or _STOP_BELOW.value) and 'sps' not in _PROGRAM.value:
    raise app.UsageError('--drafter and --stop_below are SpS\'s: pass --program=sps too.')
  if _STOP_BELOW.value and not {'model', 'hybrid'} & set(_DRAFTER.value):
    raise app.UsageError('--stop_below is dynamic k of the model and hybrid drafters: pass '
                         '--drafter=model or hybrid.')
  if _TARGET.value == 'cpu':
    dev = jax.devices('cpu')[0]
  else:
    try:
      dev = deviceless.device(_TARGET.value)
    except RuntimeError as e:  # No CUDA plugin: what to install, in one line.
      raise app.UsageError(str(e)) from e
  rows = [count(p, s, dev, _DUMP_DIR.value, d)
          for p in _PROGRAMS if p in _PROGRAM.value
          for d in (_DRAFTER.value if p == 'sps' else ['model']) for s in _SINGLE_ROW.value]
  text = table(rows, f'{_TARGET.value} ({getattr(dev, "device_kind", dev.platform)})')
  print(text)
  if _OUT.value:
    storage.write_text(_OUT.value, text)


if __name__ == '__main__':
  cli.run(main)
