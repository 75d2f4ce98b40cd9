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

`data_dir` defaults to $SPSJAX_DATA_DIR, else `~/.cache/spsjax/tfds`. A build writes into a
temporary directory and renames it when done, so an interrupted build is never read.
"""

import operator
import os
from collections.abc import Sequence
from typing import Any

import tensorflow_datasets as tfds

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
  """The prepared builder of `name` (a built-in or a TFDS dataset), building it if needed."""
  data_dir = data_dir or default_data_dir()
  if name in BUILTIN:
    ds_builder = BUILTIN[name][0](data_dir=data_dir, config=config, file_format=FILE_FORMAT)
  else:
    try:
      ds_builder = tfds.builder(name, data_dir=data_dir, config=config, file_format=FILE_FORMAT)
    except tfds.core.registered.DatasetNotFoundError as e:
      raise ValueError(
          f'Unknown dataset {name!r}: not built in ({", ".join(sorted(BUILTIN))}) and not a TFDS '
          f'dataset registered here or prepared in {data_dir}.') from e
  if not ds_builder.is_prepared():
    ds_builder.download_and_prepare()
  file_format = ds_builder.info.file_format
  if file_format is not None and file_format.value != FILE_FORMAT:
    raise ValueError(
        f'Dataset {name!r} in {data_dir} is stored as {file_format.value}; random access needs '
        f'{FILE_FORMAT}: rebuild it with `tfds build {name} --file_format={FILE_FORMAT}`.')
  return ds_builder


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
  return Records(builder(name, data_dir, config).as_data_source(split))


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
  return Records(ds_builder.as_data_source(split), text_field)
