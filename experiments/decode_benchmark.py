"""Decode benchmark at batch 1: step time, s, weight bandwidth against copy bandwidth, the ceiling.

  python experiments/decode_benchmark.py --preset=reference_target --dtype=float32
  python experiments/decode_benchmark.py --preset=bench150m --dtype=float32 --ceiling=false
  python experiments/decode_benchmark.py --small  # A tiny model: a quick smoke run.
  python experiments/decode_benchmark.py --preset=bench150m --dtype=float32 --paths=native \
      --ceiling=false --batches=8 --block=4  # s at batch 8 too

For each dtype and path (`native`: packed for the CPU kernels, `models.pack`; `xla`: XLA's dots;
`xla_fused`: XLA's dots on fused weights, `models.fuse`),
one line each for: a 1-position `extend` and the bandwidth at which it reads the weights (as a
share of the copy bandwidth measured first), s = `extend` on `block` positions / on 1, and ArS;
with --batches, s at those batch sizes for 2 .. block positions.
With --ceiling, SpS with a perfect draft (`spsjax.bench.ceiling`: zero output layers, every draft
accepted) against ArS of the same target, beside (k + 1) / (k c + s). Models are randomly
initialised: decode time does not depend on the weights' values.
"""

import os

from absl import app, flags
import jax

from spsjax import cli, distributed, models, sharding
from spsjax.bench import ceiling, decode
from spsjax.models import presets

_DTYPE = flags.DEFINE_enum('dtype', 'both', ['float32', 'bfloat16', 'both'], 'Model dtype(s).')
_PATHS = flags.DEFINE_list('paths', ['native', 'xla'], 'Any of native (packed, float32 only), xla '
                           'and xla_fused (`models.fuse`).')
_PATH_NAMES = ('native', 'xla', 'xla_fused')
_REPEATS = flags.DEFINE_integer('repeats', 20, 'Timed calls per extend step and per copy.')
_ARS_REPEATS = flags.DEFINE_integer('ars_repeats', 3, 'Timed autoregressive_sample runs.')
_SMALL = flags.DEFINE_bool('small', False, 'A tiny model and a small copy: a quick smoke run.')
_PRESET = flags.DEFINE_string('preset', 'bench150m', 'Model preset (spsjax/models/presets.py).')
_PROMPT_LEN = flags.DEFINE_integer('prompt_len', 128, 'Prompt tokens; cache capacity is '
                                   'prompt_len + max_new_tokens.')
_MAX_NEW_TOKENS = flags.DEFINE_integer('max_new_tokens', 128, 'Tokens per ArS run.')
_BLOCK = flags.DEFINE_integer('block', 5, 'Tokens of the multi-token extend compared with T=1.')
_BATCHES = flags.DEFINE_list('batches', [], 'Also s = extend on 2 .. block positions / on 1 at '
                              'these batch sizes (e.g. 8), float32, per path.')
_COPY_MB = flags.DEFINE_integer('copy_mb', 1024, 'Size of the copied array in MiB.')
_CEILING = flags.DEFINE_bool('ceiling', True, 'Also the perfect-draft SpS/ArS ceiling (float32).')
_DRAFT_PRESET = flags.DEFINE_string('draft_preset', '', 'Draft of the ceiling; default: the '
                                    'target preset\'s family draft (reference_draft, tiny_draft).')
_K = flags.DEFINE_integer('k', 4, 'Lookahead of the ceiling.')
_CEILING_TOP_P = flags.DEFINE_float('ceiling_top_p', 1.0, 'Top-p of the ceiling\'s ArS and SpS '
                                    '(temperature 1; 1: off).')
_DRAFT_WEIGHTS = flags.DEFINE_enum('draft_weights', 'w8a8', list(models.WEIGHT_DTYPES),
                                   'How the native path stores the ceiling draft\'s packed weights.')
_CEILING_REPEATS = flags.DEFINE_integer('ceiling_repeats', 7, 'Timed calls per method of the '
                                        'ceiling (ArS, SpS and each one stopped after the prefill, '
                                        'in turn).')
_DATA = flags.DEFINE_integer('data', 1, 'Mesh data axis (batch 1: keep it 1).')
_MODEL_AXIS = flags.DEFINE_integer('model_axis', 1, 'Mesh model axis; above 1 the models are '
                                   'sharded Megatron-style and only --paths=xla runs.')
_RUNTIME = distributed.define_flags()
print0 = distributed.print0


def _draft_preset(preset: str) -> str:
  if _DRAFT_PRESET.value:
    return _DRAFT_PRESET.value
  family = preset.rsplit('_', 1)[0]
  if f'{family}_draft' not in presets.PRESETS:
    raise app.UsageError(f'No family draft for preset {preset!r}: pass --draft_preset.')
  return f'{family}_draft'


def _place(model: models.Model, path: str, weights: str = 'float32') -> models.Model:
  if path == 'xla':
    return model
  if path == 'xla_fused':
    return models.fuse(model)
  reason = models.packable(model)
  if reason:
    raise app.UsageError(f'The native path cannot run this model: {reason}.')
  return models.pack(model, weights)


def main(argv):
  distributed.start(argv, _RUNTIME())
  small = _SMALL.value
  preset = 'tiny_target' if small else _PRESET.value
  prompt_len, max_new_tokens = (16, 16) if small else (_PROMPT_LEN.value, _MAX_NEW_TOKENS.value)
  copy_mb = min(_COPY_MB.value, 16) if small else _COPY_MB.value
  mesh = sharding.mesh_from_axes(_DATA.value, _MODEL_AXIS.value)
  if unknown := [p for p in _PATHS.value if p not in _PATH_NAMES]:
    raise app.UsageError(f'--paths takes {", ".join(_PATH_NAMES)}; got {unknown}.')
  if mesh is not None and 'native' in _PATHS.value:
    raise app.UsageError('The native path runs on one device; on a mesh pass --paths=xla.')
  if not 0.0 < _CEILING_TOP_P.value <= 1.0:
    raise app.UsageError(f'--ceiling_top_p must be in (0, 1], got {_CEILING_TOP_P.value}.')
  print0(f'JAX {jax.__version__} on {jax.devices()[0].device_kind} ({os.cpu_count()} cores), '
         f'model preset {preset}, batch 1, prompt {prompt_len}, {max_new_tokens} new tokens, '
         f'median of {_REPEATS.value} steps / {_ARS_REPEATS.value} ArS runs; load average '
         f'{os.getloadavg()[0]:.2f} (other processes on these cores skew every figure)'
         + (f'; mesh {dict(mesh.shape)}' if mesh else ''))
  try:
    batches = [int(b) for b in _BATCHES.value]
  except ValueError:
    raise app.UsageError(f'--batches takes integers, got {_BATCHES.value}.') from None
  if batches and (min(batches) < 1 or _BLOCK.value < 2):
    raise app.UsageError(f'--batches needs batch sizes >= 1 and --block >= 2, got '
                         f'{_BATCHES.value} and --block={_BLOCK.value}.')
  copy = decode.copy_bandwidth(copy_mb * 2**20, repeats=_REPEATS.value)
  for line in decode.copy_report(copy):
    print0(line, flush=True)
  dtypes = ['float32', 'bfloat16'] if _DTYPE.value == 'both' else [_DTYPE.value]
  for dtype in dtypes:
    config = models.TransformerConfig(**presets.get(preset), dtype=dtype)
    model = models.Model(config, models.init_params(config, jax.random.key(0), mesh=mesh))
    for path in _PATHS.value:
      if path == 'native' and dtype != 'float32':
        continue
      placed = _place(model, path)
      result = decode.measure_decode(placed, prompt_len=prompt_len,
                                     max_new_tokens=max_new_tokens, block=_BLOCK.value,
                                     repeats=_REPEATS.value, ars_repeats=_ARS_REPEATS.value,
                                     mesh=mesh)
      for line in decode.report(result, copy):
        print0(line, flush=True)
      for batch in batches if dtype == 'float32' else ():
        for line in decode.batch_scoring_report(placed, batch, _BLOCK.value,
                                                prompt_len + max_new_tokens,
                                                repeats=_REPEATS.value, mesh=mesh):
          print0(line, flush=True)
  if _CEILING.value:
    draft_config = models.TransformerConfig(**presets.get(_draft_preset(preset)))
    target_config = models.TransformerConfig(**presets.get(preset))
    target, draft = ceiling.perfect_pair(
        models.Model(target_config, models.init_params(target_config, jax.random.key(0))),
        models.Model(draft_config, models.init_params(draft_config, jax.random.key(1))))
    for path in _PATHS.value:
      result = ceiling.measure(_place(target, path), _place(draft, path, _DRAFT_WEIGHTS.value),
                               k=_K.value, prompt_len=prompt_len, max_new_tokens=max_new_tokens,
                               repeats=_CEILING_REPEATS.value, mesh=mesh,
                               top_p=_CEILING_TOP_P.value)
      label = f'float32 {path}' + (f', draft weights {_DRAFT_WEIGHTS.value}'
                                   if path == 'native' else '')
      for line in ceiling.report(result, label):
        print0(line, flush=True)
  print0(f'load average at the end: {os.getloadavg()[0]:.2f} (1 min)')


if __name__ == '__main__':
  cli.run(main)
