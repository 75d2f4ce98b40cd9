"""Decode benchmark at batch 1: per-token time, bytes read per token, effective and copy bandwidth.

  python experiments/decode_benchmark.py --dtype=both --repeats=20
  python experiments/decode_benchmark.py --small  # A tiny model: a quick smoke run.
  python experiments/decode_benchmark.py --preset=reference_target --dtype=float32

The model (preset `bench150m` by default, `tiny_target` with --small) is randomly initialised:
decode time does not depend on the weights' values.
"""

import os

from absl import app, flags
import jax

from spsjax import distributed, models
from spsjax.bench import decode
from spsjax.models import presets

_DTYPE = flags.DEFINE_enum('dtype', 'both', ['float32', 'bfloat16', 'both'], 'Model dtype(s).')
_REPEATS = flags.DEFINE_integer('repeats', 20, 'Timed calls per extend step and per copy.')
_ARS_REPEATS = flags.DEFINE_integer('ars_repeats', 3, 'Timed autoregressive_sample runs.')
_SMALL = flags.DEFINE_bool('small', False, 'A tiny model and a small copy: a quick smoke run.')
_PRESET = flags.DEFINE_string('preset', 'bench150m', 'Model preset (spsjax/models/presets.py).')
_PROMPT_LEN = flags.DEFINE_integer('prompt_len', 128, 'Prompt tokens; cache capacity is '
                                   'prompt_len + max_new_tokens.')
_MAX_NEW_TOKENS = flags.DEFINE_integer('max_new_tokens', 128, 'Tokens per ArS run.')
_BLOCK = flags.DEFINE_integer('block', 5, 'Tokens of the multi-token extend compared with T=1.')
_COPY_MB = flags.DEFINE_integer('copy_mb', 1024, 'Size of the copied array in MiB.')
print0 = distributed.print0


def main(argv):
  distributed.start(argv)
  small = _SMALL.value
  preset = 'tiny_target' if small else _PRESET.value
  prompt_len, max_new_tokens = (16, 16) if small else (_PROMPT_LEN.value, _MAX_NEW_TOKENS.value)
  copy_mb = min(_COPY_MB.value, 16) if small else _COPY_MB.value
  print0(f'JAX {jax.__version__} on {jax.devices()[0].device_kind} ({os.cpu_count()} cores), '
         f'model preset {preset}, batch 1, prompt {prompt_len}, {max_new_tokens} new tokens, '
         f'median of {_REPEATS.value} steps / {_ARS_REPEATS.value} ArS runs; load average '
         f'{os.getloadavg()[0]:.2f} (other processes on these cores skew every figure)')
  for line in decode.copy_report(decode.copy_bandwidth(copy_mb * 2**20, repeats=_REPEATS.value)):
    print0(line, flush=True)
  dtypes = ['float32', 'bfloat16'] if _DTYPE.value == 'both' else [_DTYPE.value]
  for dtype in dtypes:
    config = models.TransformerConfig(**presets.get(preset), dtype=dtype)
    model = models.Model(config, models.init_params(config, jax.random.key(0)))
    result = decode.measure_decode(model, prompt_len=prompt_len, max_new_tokens=max_new_tokens,
                                   block=_BLOCK.value, repeats=_REPEATS.value,
                                   ars_repeats=_ARS_REPEATS.value)
    for line in decode.report(result):
      print0(line, flush=True)
  print0(f'load average at the end: {os.getloadavg()[0]:.2f} (1 min)')


if __name__ == '__main__':
  app.run(main)
