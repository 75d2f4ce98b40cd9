"""The safetensors files of a Hugging Face checkpoint directory, read by spsjax.

A directory holds `model.safetensors`, or shards listed by `model.safetensors.index.json`.
`read_tensors` yields every tensor one at a time (views of a memory map of a local file; a URI's
file is read whole first) in any of safetensors' dtypes: bfloat16 (most of the Hub) and the
float8s through ml_dtypes, which safetensors' own numpy reader refuses. `parse` reads one file's
bytes: an 8-byte little-endian header size, a JSON header of {name: dtype, shape,
data_offsets}, then the data; an entry whose bytes do not hold its dtype and shape is refused.
"""

import json
import math
import os
from collections.abc import Iterator

import ml_dtypes
import numpy as np

from spsjax import storage
from spsjax.models.hf_config import UnsupportedCheckpoint

WEIGHTS = 'model.safetensors'
INDEX = 'model.safetensors.index.json'


def weight_files(path: str) -> list[str]:
  folder = storage.path(path)
  if (folder / WEIGHTS).is_file():
    return [WEIGHTS]
  if (folder / INDEX).is_file():
    return sorted(set(json.loads((folder / INDEX).read_text(encoding='utf-8'))['weight_map']
                      .values()))
  raise FileNotFoundError(f'{path}: no {WEIGHTS} and no {INDEX}.')


# safetensors' dtype names -> numpy dtypes (ml_dtypes' for the ones numpy lacks: bfloat16, the
# float8s, which safetensors' own numpy reader refuses).
_DTYPES = {'F64': np.float64, 'F32': np.float32, 'F16': np.float16,
           'BF16': ml_dtypes.bfloat16, 'F8_E4M3': ml_dtypes.float8_e4m3fn,
           'F8_E5M2': ml_dtypes.float8_e5m2, 'I64': np.int64, 'I32': np.int32, 'I16': np.int16,
           'I8': np.int8, 'U8': np.uint8, 'BOOL': np.bool_}


def parse(buffer, where: str) -> Iterator[tuple[str, np.ndarray]]:
  """The tensors of a safetensors file held in `buffer` (bytes, or a read-only memory map), as
  views of it: an 8-byte little-endian header size, a JSON header of {name: dtype, shape,
  data_offsets}, then the data."""
  size = int.from_bytes(bytes(buffer[:8]), 'little')
  header = json.loads(bytes(buffer[8:8 + size]))
  for name, entry in header.items():
    if name == '__metadata__':
      continue
    if entry['dtype'] not in _DTYPES:
      raise UnsupportedCheckpoint(f'{where}: tensor {name} has dtype {entry["dtype"]}; '
                                  f'supported: {sorted(_DTYPES)}.')
    start, stop = (8 + size + offset for offset in entry['data_offsets'])
    dtype = np.dtype(_DTYPES[entry['dtype']])
    if not start <= stop <= len(buffer) or stop - start != dtype.itemsize * math.prod(
        entry['shape']):
      raise UnsupportedCheckpoint(f'{where}: tensor {name}\'s bytes [{start}, {stop}) do not hold '
                                  f'{entry["dtype"]}{entry["shape"]} in a file of {len(buffer)}.')
    yield name, np.frombuffer(buffer[start:stop], dtype).reshape(entry['shape'])


def read_tensors(path: str) -> Iterator[tuple[str, np.ndarray]]:
  """Every tensor of the checkpoint, in any of safetensors' dtypes (bfloat16 included: most
  checkpoints on the Hub): one at a time from a local file (mapped); from a URI, a file's bytes
  are read whole first."""
  for name in weight_files(path):
    file = storage.path(path) / name
    if storage.is_uri(file):
      yield from parse(memoryview(file.read_bytes()), str(file))
    else:
      yield from parse(np.memmap(os.fspath(file), np.uint8, mode='r'), str(file))
