"""Checks and measures spsjax on the default JAX backend, in one process, and writes a report.

  python experiments/accelerator_check.py                     # on a GPU or TPU: the full run
  python experiments/accelerator_check.py --small             # tiny sizes (the default on a CPU)
  python experiments/accelerator_check.py --out=report.md --presets=bench150m --batches=1

Exactness on XLA's ops (SpS against the enumerated law in float32 and against ArS in bfloat16,
greedy SpS == greedy ArS), one compiled program per generation, and per model preset and batch:
ArS time per token and per step, the weights' read rate against the copy bandwidth, s(k + 1) for
each k, and the perfect-draft ceiling at batch 1 (`spsjax.bench.accelerator`). The report goes to
`--out` and stdout. Imports only what a stock accelerator image has (jax, flax, numpy, scipy,
absl, etils): no datasets, tokenizers or config files.
"""

import sys

from absl import app, flags
import jax

from spsjax import storage
from spsjax.bench import accelerator, decode
from spsjax.models import presets

_SMALL = flags.DEFINE_bool('small', None, 'Tiny sizes (a smoke run); default: on a CPU only.')
_OUT = flags.DEFINE_string('out', 'results/accelerator_check.md', 'Where the report goes.')
_PRESETS = flags.DEFINE_list('presets', None, 'Model presets to time (default: bench150m, '
                             'llama1b; small: tiny_target).')
_DTYPE = flags.DEFINE_enum('dtype', 'bfloat16', ['bfloat16', 'float32'], 'Timed models\' dtype.')
_BATCHES = flags.DEFINE_list('batches', None, 'Batch sizes (default 1, 8, 32; small: 1, 8).')
_KS = flags.DEFINE_list('ks', None, 'Lookaheads k of s(k + 1) (default 1..8; small: 1, 4).')
_CEILING_KS = flags.DEFINE_list('ceiling_ks', None, 'k of the perfect-draft ceiling (default '
                                '4, 8; small: 4).')
_ROWS = flags.DEFINE_integer('rows', None, 'Rows of each law check (default 100,000; small: '
                             '20,000).')
_REPEATS = flags.DEFINE_integer('repeats', None, 'Timed calls per figure (default 7; small 2).')
_EXACTNESS = flags.DEFINE_bool('exactness', True, 'Run the exactness and one-program checks.')


def _ints(values, default):
  return [int(v) for v in values] if values else list(default)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  small = jax.default_backend() == 'cpu' if _SMALL.value is None else _SMALL.value
  names = _PRESETS.value or (['tiny_target'] if small else ['bench150m', 'llama1b'])
  batches = _ints(_BATCHES.value, (1, 8) if small else (1, 8, 32))
  ks = _ints(_KS.value, (1, 4) if small else range(1, 9))
  ceiling_ks = _ints(_CEILING_KS.value, (4,) if small else (4, 8))
  rows = _ROWS.value or (20_000 if small else 100_000)
  repeats = _REPEATS.value or (2 if small else 7)
  prompt_len, max_new = (16, 16) if small else (128, 128)
  for name in names:
    presets.get(name)  # Unknown names fail before anything runs.
  device = accelerator.device_description()
  print(f'{device}; {"small" if small else "full"} run', flush=True)

  checks = []
  if _EXACTNESS.value:
    for dtype in ('float32', 'bfloat16'):
      checks += accelerator.exactness_checks(dtype, rows=rows)
    checks.append(accelerator.one_program_check())
    for c in checks:
      print(f'{"pass" if c.passed else "FAIL"}: {c.name}: {c.detail}', flush=True)

  copy = decode.copy_bandwidth((16 if small else 1024) * 2**20, repeats=repeats)
  rows_out, ceiling_rows = [], []
  for i, name in enumerate(names):
    target = accelerator.random_model(presets.get(name), _DTYPE.value, seed=2 * i)
    draft_name = name.replace('_target', '_draft') if name.endswith('_target') else f'{name}_draft'
    for batch in batches:
      row = accelerator.decode_figures(target, name, batch=batch, blocks=[k + 1 for k in ks],
                                       prompt_len=prompt_len, max_new_tokens=max_new,
                                       repeats=repeats)
      rows_out.append(row)
      print(f'{name} batch {batch}: ArS {row.ars_step * 1e3:.3f} ms/step, weights '
            f'{row.weight_rate:.0f} GB/s', flush=True)
    if draft_name in presets.PRESETS:
      draft = accelerator.random_model(presets.get(draft_name), _DTYPE.value, seed=2 * i + 1)
      for c in accelerator.ceilings(target, draft, ks=ceiling_ks, prompt_len=prompt_len,
                                    max_new_tokens=max_new, repeats=repeats):
        ceiling_rows.append((f'{name} / {draft_name}', c))
  command = 'python ' + ' '.join(sys.argv)
  report = accelerator.markdown(device=device, copy=copy, checks=checks, rows=rows_out,
                                ceiling_rows=ceiling_rows, command=command)
  storage.write_text(_OUT.value, report)
  print(report, flush=True)
  if not all(c.passed for c in checks):
    sys.exit(1)


if __name__ == '__main__':
  app.run(main)
