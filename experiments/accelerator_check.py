"""Checks and measures spsjax on the default JAX backend, in one process, and writes a report.

  python experiments/accelerator_check.py                     # on a GPU or TPU: the full run
  python experiments/accelerator_check.py --small             # tiny sizes (the default on a CPU)
  python experiments/accelerator_check.py --out=report.md --presets=bench150m --batches=1

Exactness on XLA's ops (SpS against the enumerated law in float32 and against ArS in bfloat16,
greedy SpS == greedy ArS), one compiled program per generation, and per model preset and batch:
ArS time per token and per step, the weights' read rate against the copy bandwidth, s(k + 1) for
each k and the scoring call of trees of drafts (s(tree b)), and the perfect-draft ceiling at batch 1 (`spsjax.bench.accelerator`). The report goes to
`--out` and stdout, with the wall time and the part of it spent compiling, by program (each log
line has both too). Imports only what a stock accelerator image has (jax, flax, numpy, scipy,
absl, etils): no datasets, tokenizers or config files.
"""

import dataclasses
import os
import shlex
import sys
import tempfile
import time

from absl import app, flags
import jax

from spsjax import models, storage
from spsjax.bench import accelerator, ceiling, decode, sampling_costs, timing, variants
from spsjax.models import presets
from spsjax.sampling import dynamic_trees, tree_drafters

_SMALL = flags.DEFINE_bool('small', None, 'Tiny sizes (a smoke run); default: on a CPU only.')
_OUT = flags.DEFINE_string('out', 'results/accelerator_check.md', 'Where the report goes.')
_PRESETS = flags.DEFINE_list('presets', None, 'Model presets to time (default: llama1b, '
                             'bench150m; small: tiny_target).')
_DTYPE = flags.DEFINE_enum('dtype', 'bfloat16', ['bfloat16', 'float32'], 'Timed models\' dtype.')
_BATCHES = flags.DEFINE_list('batches', None, 'Batch sizes (default 1, 8, 32; small: 1, 8).')
_KS = flags.DEFINE_list('ks', None, 'Lookaheads k of s(k + 1) (default 1..8; small: 1, 4).')
_TREES = flags.DEFINE_list('trees', None, 'Trees of drafts whose scoring call is timed (s(tree b) '
                           'beside s(k + 1)), as branching factors joined by + (TreeDrafter\'s); '
                           'default 2+2+1+1 (17 nodes and root); small: 2+1; empty: none.')
_CEILING_KS = flags.DEFINE_list('ceiling_ks', None, 'k of the perfect-draft ceiling (default '
                                '4, 8; small: 4; empty: no ceiling).')
_CEILING_TREES = flags.DEFINE_list(
    'ceiling_trees', [], 'Dynamic trees whose perfect-draft ceiling is measured (and profiled '
    'with --profile_ceilings) beside the chain\'s, as NODES:WIDTH:K (EAGLE-2\'s sizes: 60:10:6): '
    'a loop\'s level calls, its score call on the nodes and root, its accept walk.')
_CEILING_TOP_P = flags.DEFINE_float(
    'ceiling_top_p', 1.0, 'Top-p of the perfect-draft ceilings\' ArS and SpS (temperature 1; 1: '
    'off). Below 1 the calls also pay nucleus sampling, which the formula\'s c and s leave out.')
_ROWS = flags.DEFINE_integer('rows', None, 'Rows of each law check (default 100,000; small: '
                             '20,000).')
_REPEATS = flags.DEFINE_integer('repeats', None, 'Timed calls per figure (default 7; small 2).')
_COMPILE_THREADS = flags.DEFINE_integer(
    'compile_threads', 1, 'Programs compiled side by side: the law checks, a figure\'s extend '
    'programs, its ArS and a ceiling\'s samplers (1: one after another). On a GPU, XLA times '
    'candidate kernels while compiling: beside other compiles it may pick slower ones (an H200 '
    'run at 8 was 7% slower at llama1b batch 1, XLA warning "Delay kernel timed out").')
_VARIANTS = flags.DEFINE_list(
    'variants', [], 'Step variants to compile and time beside each preset\'s one-position '
    f'extend at the first batch (`spsjax.bench.variants`), of {", ".join(variants.NAMES)}.')
_DUMP_DIR = flags.DEFINE_string(
    'dump_dir', None, 'With --variants: write each variant\'s optimized HLO and a profiler trace of '
    'one call under DIR/<preset>_b<batch>/ (local or gs://); with --profile_ceilings, their '
    'traces under DIR/<preset>_ceiling/.')
_PROFILE_CEILINGS = flags.DEFINE_bool(
    'profile_ceilings', False, 'Profile one SpS call of each perfect-draft ceiling: a loop\'s wall '
    'time and its op time per phase beside the d c + s steps the formula charges it (k c + s '
    'for a chain).')
_FUSED = flags.DEFINE_bool(
    'fused', False, 'Time the decode figures and ceilings on models fused for XLA (`models.fuse`: '
    'q, k and v one product, gate and input one); their rows say "fused".')
_SAMPLING_COSTS = flags.DEFINE_bool(
    'sampling_costs', False, 'Time sampling per call at the first preset\'s vocabulary, by '
    'setting (top-k 8 / 50, top-k 50 without lax.top_k, top-p), at 1 and 5 rows '
    '(`spsjax.bench.sampling_costs`).')
_EXACTNESS = flags.DEFINE_list('exactness', ['float32', 'bfloat16'], 'dtypes of the exactness '
                                'checks (empty: none, nor the one-program check).')


def _ints(values, default):
  return [int(v) for v in values] if values else list(default)


@dataclasses.dataclass(frozen=True)
class _Plan:
  """What a run measures, from the flags and the backend's defaults."""
  small: bool
  presets: tuple[str, ...]
  batches: tuple[int, ...]
  ks: tuple[int, ...]
  ceiling_ks: tuple[int, ...]
  rows: int
  repeats: int
  prompt_len: int
  max_new: int
  compile_threads: int
  trees: tuple[str, ...] = ()  # Branching factors, '2+2+1+1'.
  ceiling_trees: tuple[tuple[int, int, int], ...] = ()  # Dynamic trees: (nodes, width, k).

  @property
  def tree_models(self) -> dict[str, models.TokenTree]:
    return {b: models.TokenTree.full(tuple(int(x) for x in b.split('+'))) for b in self.trees}

  @property
  def capacity(self) -> int:
    """The cache every cost is measured at: one size, so the ceilings reuse the figures'
    compiled `extend` programs."""
    return self.prompt_len + self.max_new + max(
        [k + 1 for k in self.ks + self.ceiling_ks]
        + [t.num_nodes + 1 for t in self.tree_models.values()]
        + [nodes + 1 for nodes, _, _ in self.ceiling_trees])


def _plan() -> _Plan:
  small = jax.default_backend() == 'cpu' if _SMALL.value is None else _SMALL.value
  try:
    plan = _make_plan(small)
  except ValueError as e:
    raise app.UsageError(f'--batches, --ks and --ceiling_ks take integers: {e}') from e
  if min(plan.batches + plan.ks + plan.ceiling_ks + (plan.compile_threads,)) < 1:
    raise app.UsageError('--batches, --ks, --ceiling_ks and --compile_threads take positive '
                         'integers.')
  try:
    _ = plan.tree_models
  except ValueError as e:
    raise app.UsageError(f'--trees takes branching factors >= 1 joined by + (e.g. 2+2+1+1), '
                         f'got {list(plan.trees)}.') from e
  if not 0.0 < _CEILING_TOP_P.value <= 1.0:
    raise app.UsageError(f'--ceiling_top_p must be in (0, 1], got {_CEILING_TOP_P.value}.')
  if unknown := [name for name in plan.presets if name not in presets.PRESETS]:
    raise app.UsageError(f'Unknown --presets {unknown}; known: '
                         f'{", ".join(sorted(presets.PRESETS))}.')
  if unknown := set(_EXACTNESS.value) - set(accelerator.LAWS):
    raise app.UsageError(f'--exactness takes {", ".join(accelerator.LAWS)}; got {unknown}.')
  try:
    variants.check_names(_VARIANTS.value)
  except ValueError as e:
    raise app.UsageError(f'--variants: {e}') from e
  if _DUMP_DIR.value and not (_VARIANTS.value or _PROFILE_CEILINGS.value):
    raise app.UsageError('--dump_dir writes the step variants\' programs and the ceilings\' '
                         'traces: pass --variants or --profile_ceilings too.')
  return plan


def _make_plan(small: bool) -> _Plan:
  return _Plan(
      small=small, presets=tuple(_PRESETS.value or (['tiny_target'] if small
                                                    else ['llama1b', 'bench150m'])),
      batches=tuple(sorted(_ints(_BATCHES.value, (1, 8) if small else (1, 8, 32)))),
      ks=tuple(_ints(_KS.value, (1, 4) if small else range(1, 9))),
      ceiling_ks=tuple((4,) if small else (4, 8)) if _CEILING_KS.value is None else tuple(
          int(k) for k in _CEILING_KS.value),
      rows=_ROWS.value or (20_000 if small else 100_000), repeats=_REPEATS.value or (
          2 if small else 7), prompt_len=16 if small else 128, max_new=16 if small else 128,
      compile_threads=_COMPILE_THREADS.value,
      trees=tuple(_TREES.value if _TREES.value is not None else
                  (['2+1'] if small else ['2+2+1+1'])),
      ceiling_trees=tuple(_dynamic_tree(t) for t in _CEILING_TREES.value))


def _dynamic_tree(text: str) -> tuple[int, int, int]:
  """(nodes, width, k) of a --ceiling_trees entry; a usage error for a bad one."""
  parts = text.split(':')
  if len(parts) != 3 or not all(p.isdigit() for p in parts):
    raise app.UsageError(f'--ceiling_trees takes NODES:WIDTH:K (e.g. 60:10:6), got {text!r}.')
  nodes, width, k = map(int, parts)
  try:
    dynamic_trees.check_sizes(nodes, width, k)
  except ValueError as e:
    raise app.UsageError(f'--ceiling_trees={text}: {e}') from e
  return nodes, width, k


def _layout(model):
  """(the model as the decode figures and ceilings time it, what their rows add to its name)."""
  return (models.fuse(model), ' fused') if _FUSED.value else (model, '')


def _ceilings(plan, report, name, target, i, write, log):
  """The perfect-draft ceilings of `target` (as `_layout` gave it) with its family's draft."""
  draft_name = name.replace('_target', '_draft') if name.endswith('_target') else f'{name}_draft'
  if draft_name not in presets.PRESETS:
    return
  draft, label = _layout(accelerator.random_model(presets.get(draft_name), _DTYPE.value,
                                                  seed=2 * i + 1))
  with tempfile.TemporaryDirectory(prefix='spsjax-ceiling-') as scratch:
    traces = (None if not _PROFILE_CEILINGS.value else
              f'{_DUMP_DIR.value}/{name}_ceiling' if _DUMP_DIR.value else scratch)
    runs = [(k, None, '') for k in plan.ceiling_ks] + [
        (k, tree_drafters.DynamicTreeDrafter(nodes, width), f', dynamic tree {nodes} (width {width})')
        for nodes, width, k in plan.ceiling_trees]
    for k, drafter, tree in runs:
      what = f'{name} perfect-draft ceiling k={k}{tree}'
      c = report.attempt(what, lambda: accelerator.ceilings(
          target, draft, ks=[k], prompt_len=plan.prompt_len, max_new_tokens=plan.max_new,
          repeats=plan.repeats, capacity=plan.capacity, compile_threads=plan.compile_threads,
          profile_dir=traces and (f'{traces}/tree{drafter.nodes}' if drafter else traces),
          top_p=_CEILING_TOP_P.value, drafter=drafter)[0])
      if c and c.loop and c.loop.error:
        report.errors.append(f'{what}, its profile: {c.loop.error}')
      if c:
        row = f'{name} / {draft_name}{label}{tree}' + (
            f', top-p {c.top_p:g}' if c.top_p < 1 else '')
        report.ceiling_rows.append((row, c))
        log(ceiling.report(c, row)[0])
        write()  # Each row as it comes: a run cut short keeps it.


def _variants(plan, report, name, target, batch, write, log):
  dump = storage.join(_DUMP_DIR.value, f'{name}_b{batch}') if _DUMP_DIR.value else None
  found = report.attempt(f'{name} step variants', lambda: variants.probe(
      target, plan.capacity, _VARIANTS.value, batch=batch, repeats=plan.repeats, dump_dir=dump))
  if found:
    report.variant_rows.append((name, batch, found))
    for v in found:
      log(f'{name} batch {batch}, {v.name}: ' + (f'failed: {v.error}' if v.error else
          f'compile {v.compile_seconds:.2f} s, step {v.step_seconds * 1e3:.3f} ms, {v.ops} ops, '
          f'logits within {v.logit_diff:.1e}'))
    write()


def _measure(plan, report, write, log):
  """The checks, then per preset the decode figures and the ceilings, into `report`."""
  if _EXACTNESS.value:
    for dtype in _EXACTNESS.value:
      report.checks += accelerator.exactness_checks(dtype, rows=plan.rows,
                                                    threads=plan.compile_threads)
      write()
    report.checks.append(accelerator.guarded('one compiled program per generation',
                                               accelerator.one_program_check))
    for c in report.checks:
      log(f'{"pass" if c.passed else "FAIL"}: {c.name}: {c.detail}')
    write()

  report.copy = report.attempt('copy bandwidth', lambda: decode.copy_bandwidth(
      (16 if plan.small else 1024) * 2**20, repeats=plan.repeats))
  if report.copy:
    log(f'copy bandwidth {report.copy.best:.0f} GB/s')
  if _SAMPLING_COSTS.value:
    vocab = presets.get(plan.presets[0])['vocab_size']
    found = report.attempt('sampling costs', lambda: sampling_costs.costs(
        vocab, [1, 5], repeats=plan.repeats))
    if found:
      report.sampling = (vocab, found)
      for c in found:
        log(f'sampling {c.setting}, {c.rows} rows: {c.seconds * 1e6:.0f} us a call'
            + (' NOT the top-k law' if c.law_differs else ''))
      if any(c.law_differs for c in found):
        report.errors.append('sampling costs: top-k by search kept other tokens than lax.top_k')
      write()
  for i, name in enumerate(plan.presets):
    # Batch 1 and the ceilings first: what a run cut short should still have.
    target = accelerator.random_model(presets.get(name), _DTYPE.value, seed=2 * i)
    log(f'{name}: random weights ready')  # Where a slow start goes: init or the first step.
    timed, label = _layout(target)
    for j, batch in enumerate(plan.batches):
      row = report.attempt(f'{name} batch {batch}', lambda: accelerator.decode_figures(
          timed, name + label, batch=batch, blocks=[k + 1 for k in plan.ks],
          prompt_len=plan.prompt_len, max_new_tokens=plan.max_new, repeats=plan.repeats,
          capacity=plan.capacity, compile_threads=plan.compile_threads,
          trees=plan.tree_models))
      if row:
        report.rows.append(row)
        log(f'{name} batch {batch}: ArS {row.ars_step * 1e3:.3f} ms/step, weights '
            f'{row.weight_rate:.0f} GB/s, {row.launches} ops a step, s = '
            + ', '.join(f'{T}: {s:.2f}' for T, s in sorted(row.s.items()))
            + ''.join(f', tree {b}: {s:.2f}' for b, s in row.s_tree.items()))
      write()
      if j == 0:
        _ceilings(plan, report, name, timed, i, write, log)
        if _VARIANTS.value:
          _variants(plan, report, name, target, batch, write, log)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  plan = _plan()
  device = accelerator.device_description()
  print(f'{device}; {"small" if plan.small else "full"} run', flush=True)
  # The XLA flags the figures ran under are part of the command that reproduces them.
  xla_flags = os.environ.get('XLA_FLAGS', '').strip()
  command = (f'XLA_FLAGS={shlex.quote(xla_flags)} ' if xla_flags else '') + 'python ' + ' '.join(
      sys.argv)
  report = accelerator.Report(device=device, command=command)
  start = time.perf_counter()
  # Where the wall time goes: on an accelerator most of it is compiling, not the timed calls.
  with timing.CompileClock() as compiling:

    def write():
      report.time_spent = (f'Wall time {time.perf_counter() - start:.0f} s; '
                           f'{compiling.summary()}.' + (
                               ' Compile times add up the threads that compiled side by side.'
                               if plan.compile_threads > 1 else ''))
      storage.write_text(_OUT.value, report.markdown())

    def log(text):
      print(f'[{time.perf_counter() - start:6.1f} s, compiling {compiling.seconds:6.1f} s] '
            f'{text}', flush=True)

    _measure(plan, report, write, log)
    for error in report.errors:
      log(f'ERROR {error}')
    write()
  print(report.markdown(), flush=True)
  if report.errors or not all(c.passed for c in report.checks):
    sys.exit(1)


if __name__ == '__main__':
  app.run(main)
