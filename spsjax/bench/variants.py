"""Step variants: a model's decoding step compiled other ways, timed beside its own.

A probe for accelerators, where a batch-1 step is far from its weights' read time and a run of
many shapes is mostly compiling (`experiments/accelerator_check.py`). Each variant is the
one-position `extend` loop that `decode.extend_seconds` times ('plain': the model as it is, XLA's
path), changed in one respect:
- the parameters' layout: 'fused' (`models.fuse`: q, k and v one product, a gated MLP's gate and
  input one) or 'scanned' (`layer_scan`: the layers applied by `lax.scan` over stacked
  parameters and caches, so one layer is compiled);
- the products of a single row (`TransformerConfig.single_row`, which pads them on a GPU by
  default): 'padded' (always a second, zero row), 'unpadded' (never) or 'stream' (the residual
  stream carried at two rows);
- XLA's options, for this compile only (`Lowered.compile(compiler_options=)`). They name
  XLA:GPU's passes; another backend ignores them and compiles the plain program again.
`VARIANTS` names each (a layout and options).

For each: XLA's compile seconds, the median step (a `steps`-th of a call, so it carries a share of
what a call costs outside its steps: on an H200, llama1b's 4-step call spends ~0.9 ms on the
weight transposes XLA hoists out of the loop and a host gap before the loop's CUDA graph, which
XLA:GPU unrolls; every variant timed in turn, `timing.medians`),
the operations a step runs (`hlo.launches` of the loop body; 'scanned' counts its layer once)
and how far its logits are from the plain program's: the first vocabulary entry of each row's
last position, which every program's checksum carries (each step of the loop computes the same
logits: fixed lengths, and the slots before them never written). A cheap check of what runs; the
layouts' own tests compare every logit. A variant that fails to compile (an option this XLA does
not know) or to run is reported with its error; the others go on.

With `dump_dir`, each program's optimized HLO (`<name>.hlo.txt`) and a profiler trace of one call
(`<name>/plugins/profile/*/*.xplane.pb`, `trace.record`) are written there: what ran, kernel by
kernel, to study away from the machine that ran it.
"""

import dataclasses
import time
from collections.abc import Callable, Sequence

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from spsjax import models, storage
from spsjax.bench import decode, hlo, layer_scan, timing, trace

_GRAPHED = 'FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN'  # XLA:GPU's default CUDA-graph kinds.

# name -> (layout, XLA options). 'scanned_slices': XLA:GPU reads each layer's weights from the
# stack in place (dynamic-slice fusion) rather than copying them out every step; 'no_dot_merger':
# XLA:GPU merges small products that share an input into one, concatenating their weights inside
# the decoding loop (its pipeline has no pass hoisting loop-invariant code); 'cublas': no Triton
# GEMMs (cuBLAS for every product, batch 1's too); 'no_autotune': no GEMM autotuning (its share
# of a compile); 'parallel_compile': XLA:GPU's LLVM module split and compiled on 8 threads (jaxlib
# 0.11 dropped the separate switch `xla_gpu_enable_llvm_module_compilation_parallelism`);
# 'no_graphs': no CUDA graphs; 'graph_loops': the loop itself one CUDA graph (no host round trip
# for its condition each step).
VARIANTS = {
    'padded': ('padded', None),
    'unpadded': ('unpadded', None),
    'stream': ('stream', None),
    'fused': ('fused', None),
    'scanned': ('scanned', None),
    'scanned_slices': ('scanned', {'xla_gpu_enable_dynamic_slice_fusion': True}),
    'no_dot_merger': ('plain', {'xla_gpu_dot_merger_threshold_mb': 0}),
    'cublas': ('plain', {'xla_gpu_enable_triton_gemm': False}),
    'no_autotune': ('plain', {'xla_gpu_autotune_level': 0}),
    'parallel_compile': ('plain', {'xla_gpu_force_compilation_parallelism': 8}),
    'no_graphs': ('plain', {'xla_gpu_enable_command_buffer': ''}),
    'graph_loops': ('plain', {'xla_gpu_enable_command_buffer': _GRAPHED + ',WHILE,CONDITIONAL'}),
}
NAMES = tuple(VARIANTS)


@dataclasses.dataclass(frozen=True)
class Variant:
  """Seconds: XLA's compile of the variant's loop program, and the median step inside it."""
  name: str
  compile_seconds: float
  step_seconds: float
  ops: int | None  # Operations a step runs; None if XLA left no loop.
  logit_diff: float  # Largest |this - plain| of the logits the checksums carry.
  error: str | None = None  # Why it has no figures (they are then NaN).


def check_names(names: Sequence[str]) -> None:
  unknown = sorted(set(names) - set(VARIANTS))
  if unknown:
    raise ValueError(f'Unknown step variants {unknown}; known: {list(NAMES)}.')


@dataclasses.dataclass
class _Program:
  """A loop program of `steps` one-position extends: how to lower it, and its donated caches."""
  jitted: Callable
  static: tuple  # Leading static arguments (config, steps): lowered with, not passed.
  weights: tuple  # The parameters' arguments, before the caches.
  caches: list  # Donated, and returned before the checksum.
  inputs: tuple  # Tokens and lengths.
  options: dict | None = None
  compiled: Callable | None = None

  def compile(self) -> float:
    start = time.perf_counter()
    self.compiled = self.jitted.lower(*self.static, *self.weights, *self.caches,
                                      *self.inputs).compile(compiler_options=self.options)
    return time.perf_counter() - start

  def __call__(self) -> jax.Array:
    *self.caches, checksum_B = self.compiled(*self.weights, *self.caches, *self.inputs)
    return checksum_B


def _program(model: models.Model, name: str, steps: int, capacity: int, inputs) -> _Program:
  layout, options = VARIANTS.get(name, ('plain', None))
  config = model.config
  if layout == 'scanned':
    stacked, others = layer_scan.stack_layers(config, model.params)
    cache = models.init_cache(config, len(inputs[1]), capacity)
    return _Program(layer_scan.scanned_program, (config, steps), (others, stacked),
                    [jnp.stack(cache.k), jnp.stack(cache.v)], inputs, options)
  if layout == 'fused':
    model = models.fuse(model)
  elif layout in ('padded', 'unpadded', 'stream'):
    model = model.replace(config=dataclasses.replace(
        config, single_row={'unpadded': 'plain'}.get(layout, layout)))
  return _Program(decode.extend_program, (model.config, steps), (model.params,),
                  [models.init_cache(model.config, len(inputs[1]), capacity)], inputs, options)


def _dump(program: _Program, name: str, dump_dir: str) -> None:
  """Writes the program's HLO and a trace of one call; a failure (a profiler this machine lacks)
  is logged, and the figures stand."""
  try:
    storage.write_text(storage.join(dump_dir, f'{name}.hlo.txt'), program.compiled.as_text())
    trace.record(program, storage.join(dump_dir, name))
  except Exception as e:  # pylint: disable=broad-except
    logging.warning('Step variant %s: no dump in %s: %s: %s', name, dump_dir, type(e).__name__, e)


def probe(model: models.Model, capacity: int, names: Sequence[str], *, batch: int = 1,
          steps: int = 4, repeats: int = 5, dump_dir: str | None = None) -> list[Variant]:
  """'plain' and each variant in `names`: one-position extends of `model` at `batch` rows on a
  cache of `capacity` slots (lengths capacity - 1), loops of `steps` (a length no other
  measurement compiles, so every program here compiles afresh); with `dump_dir`, their HLO and
  a trace of one call each (module docstring)."""
  check_names(names)
  config = model.config
  if config.kernels != 'xla':
    raise ValueError(f'Step variants start from XLA\'s plain layout; this model has kernels '
                     f'{config.kernels!r} (`models.unpack`, `models.unfuse`).')
  if any(VARIANTS[n][0] == 'scanned' for n in names) and config.position != 'rope':
    raise ValueError('The scanned variant runs rotary models (`layer_scan`); this one has '
                     f'positions {config.position!r}.')
  inputs = (jnp.ones((batch, 1), jnp.int32), jnp.full((batch,), capacity - 1, jnp.int32))
  programs, errors, compile_seconds, checksums = {}, {}, {}, {}
  for name in ('plain', *names):
    try:  # Compiled and run once (its checksum); the plain program must work.
      programs[name] = _program(model, name, steps, capacity, inputs)
      compile_seconds[name] = programs[name].compile()
      checksums[name] = np.asarray(programs[name]())
    except Exception as e:  # pylint: disable=broad-except
      if name == 'plain':
        raise
      programs.pop(name, None)
      errors[name] = f'{type(e).__name__}: {e}'.splitlines()[0][:200]
  seconds = timing.medians(programs, repeats=repeats)
  for name, program in programs.items() if dump_dir else ():
    _dump(program, name, dump_dir)
  out = []
  for name in ('plain', *names):
    if name in errors:
      out.append(Variant(name=name, compile_seconds=float('nan'), step_seconds=float('nan'),
                         ops=None, logit_diff=float('nan'), error=errors[name]))
      continue
    diff = np.max(np.abs(checksums[name] - checksums['plain'])) / steps
    out.append(Variant(name=name, compile_seconds=compile_seconds[name],
                       step_seconds=seconds[name] / steps,
                       ops=hlo.loop_launches(programs[name].compiled.as_text()),
                       logit_diff=float(diff)))
  return out
