"""Datasets by name: built on first use as array_record TFDS datasets, read without TensorFlow.

```python
docs = datasets.load('python_code', 'train')         # Sequence[str]: len() and docs[i]
tasks = datasets.load_records('humaneval', 'test')   # Sequence[dict[str, str]]: every field
news = datasets.load('xsum', 'train', text_field='document')  # Any prepared TFDS dataset.
```

Built in (`BUILTIN`, name -> default text field): `python_code` ('text'), `humaneval` ('prompt'),
`docstrings` and `code_completion` ('input'). Any other name is looked up in the TFDS registry and in `data_dir` and needs
`text_field`; unknown names raise ValueError listing the built-in ones. Sources are random access
(`tfds.data_source`): reading record i never reads the records before it. Text comes back as `str`.

`data_dir` defaults to $SPSJAX_DATA_DIR, else `~/.cache/spsjax/tfds`. It is a local (or mounted)
directory, not a URI: array_record, the file format that gives random access, reads and writes
local files only (google/array_record#120). A build writes into a temporary directory and renames
it when done, so an interrupted build is never read.

Several processes (`distributed`): a dataset is built once per directory. Process 0 builds while
the others wait; a process whose directory still lacks it (one local to each host) then has it
built by the first process of its host, the others waiting again. A data directory is therefore
shared by all processes or local to one host. Every process then fingerprints what it loaded (the
record count and 16 evenly spaced records) and the processes compare fingerprints, so hosts that
built different data (another Python's stdlib, another TFDS version) fail at load, naming the split.
Loading is therefore collective: every process loads the same splits in the same order.
"""

import hashlib
import operator
import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import tensorflow_datasets as tfds

from spsjax import distributed, storage
from spsjax.data import code_completion, docstrings, humaneval, python_code

BUILTIN = {
    'python_code': (python_code.PythonCode, 'text'),
    'humaneval': (humaneval.Humaneval, 'prompt'),
    'docstrings': (docstrings.Docstrings, 'input'),
    'code_completion': (code_completion.CodeCompletion, 'input'),
}
DATA_DIR_ENV = 'SPSJAX_DATA_DIR'
FILE_FORMAT = 'array_record'


def default_data_dir() -> str:
  return os.environ.get(DATA_DIR_ENV) or os.path.expanduser('~/.cache/spsjax/tfds')


def builder(name: str, data_dir: str | None = None,
            config: str | tfds.core.BuilderConfig | None = None) -> tfds.core.DatasetBuilder:
  """The prepared builder of `name` (a built-in or a TFDS dataset), building it if needed, once
  per directory (module docstring)."""
  data_dir = data_dir or default_data_dir()
  if storage.is_uri(data_dir):
    raise ValueError(f'data_dir {data_dir} is a URI: TFDS data is stored as {FILE_FORMAT}, which '
                     'reads and writes local files only; use a local or mounted directory.')
  ds_builder = _builder(name, data_dir, config)
  config_name = getattr(config, 'name', config) or 'default'
  for builds, who in ((distributed.is_main(), 'process 0'),
                      (distributed.host_leader(), 'each host\'s first process')):
    if builds and not ds_builder.is_prepared():
      ds_builder.download_and_prepare()
    if jax.process_count() == 1:
      break
    distributed.barrier(f'dataset {name} ({config_name}) built by {who}')
    ds_builder = _builder(name, data_dir, config)  # What the directory holds now.
  file_format = ds_builder.info.file_format
  if file_format is not None and file_format.value != FILE_FORMAT:
    raise ValueError(
        f'Dataset {name!r} in {data_dir} is stored as {file_format.value}; random access needs '
        f'{FILE_FORMAT}: rebuild it with `tfds build {name} --file_format={FILE_FORMAT}`.')
  return ds_builder


def _builder(name: str, data_dir: str, config) -> tfds.core.DatasetBuilder:
  """The builder of `name` in `data_dir`, prepared or not."""
  if name in BUILTIN:
    ds_builder = BUILTIN[name][0](data_dir=data_dir, config=config, file_format=FILE_FORMAT)
  else:
    try:
      ds_builder = tfds.builder(name, data_dir=data_dir, config=config, file_format=FILE_FORMAT)
    except tfds.core.registered.DatasetNotFoundError as e:
      raise ValueError(
          f'Unknown dataset {name!r}: not built in ({", ".join(sorted(BUILTIN))}) and not a TFDS '
          f'dataset registered here or prepared in {data_dir}.') from e
  return ds_builder


def fingerprint(source: Sequence[dict[str, Any]]) -> bytes:
  """SHA-256 of a data source's record count and 16 evenly spaced records (the first and last
  among them): cheap to read with random access, and what two copies of a split must share."""
  n = len(source)
  digest = hashlib.sha256(f'{n} records'.encode('utf-8'))
  for index in sorted({n * j // 16 for j in range(16)} | {n - 1}) if n else ():
    for key, value in sorted(source[index].items()):
      array = np.asarray(value)
      data = repr(value).encode('utf-8') if array.dtype == object else array.tobytes()
      digest.update(f'{index} {key} {array.dtype} {array.shape}'.encode('utf-8') + data)
  return digest.digest()


def _same_everywhere(source, name: str, split: str, config) -> None:
  config_name = getattr(config, 'name', config)
  distributed.check_same(
      f'dataset {name}/{split}' + (f' ({config_name})' if config_name else ''), fingerprint(source),
      hint='The processes loaded different data: build the data directories from the same sources '
      '(the same Python for python_code, the same packages), or share one directory.')


class Records(Sequence):
  """Random access to a TFDS data source, bytes decoded to str; one field only if `field`."""

  def __init__(self, source: Sequence[dict[str, Any]], field: str | None = None):
    self._source = source
    self._field = field

  def __len__(self) -> int:
    return len(self._source)

  def __getitem__(self, index: int):
    index = operator.index(index)  # Integers only: no slices.
    if not -len(self) <= index < len(self):
      raise IndexError(f'Record {index} out of range for {len(self)} records.')
    record = self._source[index % len(self)]
    if self._field is not None:
      return _decode(record[self._field])
    return {key: _decode(value) for key, value in record.items()}

  def __repr__(self) -> str:
    return f'Records({self._source!r}, field={self._field!r})'


def _decode(value):
  return value.decode('utf-8') if isinstance(value, bytes) else value


def load_records(name: str, split: str, data_dir: str | None = None,
                 config: str | tfds.core.BuilderConfig | None = None) -> Records:
  """All fields of every record of `name`/`split` (see the module docstring)."""
  source = builder(name, data_dir, config).as_data_source(split)
  _same_everywhere(source, name, split, config)
  return Records(source)


def load(name: str, split: str, data_dir: str | None = None, text_field: str | None = None,
         config: str | tfds.core.BuilderConfig | None = None) -> Records:
  """The text field of every record of `name`/`split`: a random-access Sequence[str]."""
  if text_field is None:
    if name not in BUILTIN:
      raise ValueError(f'Dataset {name!r} is not built in: say which field holds the text '
                       '(text_field=...).')
    text_field = BUILTIN[name][1]
  ds_builder = builder(name, data_dir, config)
  fields = list(ds_builder.info.features.keys())
  if text_field not in fields:
    raise ValueError(f'Dataset {name!r} has no field {text_field!r}; its fields are {fields}.')
  source = ds_builder.as_data_source(split)
  _same_everywhere(source, name, split, config)
  return Records(source, text_field)
