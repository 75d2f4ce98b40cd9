"""`python_code`: the running interpreter's standard library as a TFDS dataset of `.py` files.

One example per file: `path` (relative to the stdlib root, '/'-separated) and `text` (the file,
byte for byte, decoded as UTF-8). The corpus is every `.py` under `sysconfig.get_paths()['stdlib']`,
tests included, `site-packages`/`dist-packages` and `__pycache__` excluded, listed in sorted order.
Files that are not valid UTF-8 are skipped; their number and paths are logged and stored in the
dataset's metadata (`skipped_not_utf8`).

Invariant: a file's split depends on its relative path alone (`split_of`, a sha256 bucket: 90%
train, 5% validation, 5% test), so it does not move when files are added, removed or reordered.

The default config is named after the interpreter (e.g. `cpython_3_11_7`) so a cached build is never
read by another Python. `PythonCodeConfig(name=..., prefixes=('json/', ...))` builds a subset (only
paths starting with one of the prefixes); `SMALL` is the registered one that tests and smoke runs
use to stay fast. Writing and reading
use array_record files and need no TensorFlow.
"""

import dataclasses
import hashlib
import os
import sys
import sysconfig
from collections.abc import Iterator

from absl import logging
import tensorflow_datasets as tfds

from spsjax.data import local_builder

SPLITS = (('train', 90), ('validation', 5), ('test', 5))  # Percent of files per split.
_EXCLUDED_DIRS = frozenset({'site-packages', 'dist-packages', '__pycache__'})


def split_of(path: str) -> str:
  """The split of a relative path: a stable hash bucket in [0, 100) against `SPLITS`."""
  bucket = int.from_bytes(hashlib.sha256(path.encode('utf-8')).digest()[:8], 'big') % 100
  for name, percent in SPLITS:
    if bucket < percent:
      return name
    bucket -= percent
  raise AssertionError('SPLITS must add up to 100.')


def stdlib_root() -> str:
  return sysconfig.get_paths()['stdlib']


def list_files(root: str, prefixes: tuple[str, ...] = ()) -> list[str]:
  """Sorted '/'-separated relative paths of the `.py` files under `root` (see module docstring)."""
  paths = []
  for directory, dirnames, filenames in os.walk(root):
    dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
    rel_dir = os.path.relpath(directory, root)
    for filename in filenames:
      if filename.endswith('.py'):
        path = filename if rel_dir == '.' else f'{rel_dir}/{filename}'.replace(os.sep, '/')
        if not prefixes or path.startswith(prefixes):
          paths.append(path)
  return sorted(paths)


def read_sources(root: str, paths: list[str]) -> tuple[list[tuple[str, str]], list[str]]:
  """`([(path, text), ...], skipped)`: the files that decode as UTF-8, and the paths that do not."""
  sources, skipped = [], []
  for path in paths:
    with open(os.path.join(root, path), 'rb') as f:
      data = f.read()
    try:
      sources.append((path, data.decode('utf-8')))
    except UnicodeDecodeError:
      skipped.append(path)
  return sources, skipped


def test_sources(prefixes: tuple[str, ...] = ()) -> list[tuple[str, str]]:
  """`[(path, text), ...]` of the test split's files (under `prefixes`) that decode as UTF-8: what
  the task builders (`docstrings`, `code_completion`) make their held-out examples from."""
  root = stdlib_root()
  paths = [p for p in list_files(root, prefixes) if split_of(p) == 'test']
  return read_sources(root, paths)[0]


def interpreter_config_name() -> str:
  version = '_'.join(map(str, sys.version_info[:3]))
  return f'{sys.implementation.name}_{version}'


@dataclasses.dataclass(eq=False)
class PythonCodeConfig(tfds.core.BuilderConfig):
  """Which files: all of the stdlib (`prefixes=()`) or those under the given path prefixes."""
  prefixes: tuple[str, ...] = ()


STDLIB = PythonCodeConfig(
    name=interpreter_config_name(),
    description=f'Every .py file of the Python {sys.version.split()[0]} standard library.')
# About 2M characters in all three splits, with files that are not UTF-8 or do not parse: for
# tests and smoke runs (`DataConfig(config=SMALL.name)`).
SMALL = PythonCodeConfig(
    name=f'{interpreter_config_name()}_small',
    description='A few packages of the standard library (json, email, asyncio, ...).',
    prefixes=('json/', 'email/', 'asyncio/', 'collections/', 'unittest/', 'test/test_json/',
              'test/tokenizedata/', 'test/encoded_modules/'))


class PythonCode(local_builder.LocalBuilder):
  """The `.py` files of the interpreter's standard library; see the module docstring."""

  name = 'python_code'
  SOURCE = f'the .py files of this interpreter\'s standard library ({stdlib_root()})'
  VERSION = tfds.core.Version('1.0.0')
  RELEASE_NOTES = {'1.0.0': 'Initial release.'}
  BUILDER_CONFIGS = [STDLIB, SMALL]

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self,
        description=__doc__,
        features=tfds.features.FeaturesDict({
            'path': tfds.features.Text(),
            'text': tfds.features.Text(),
        }),
        disable_shuffling=True,  # Records stay in sorted path order.
        metadata=tfds.core.MetadataDict(),
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # Nothing to download.
    root = stdlib_root()
    sources, skipped = read_sources(root, list_files(root, self.builder_config.prefixes))
    if skipped:
      logging.warning('python_code: skipped %d files that are not valid UTF-8: %s',
                      len(skipped), skipped)
    self.info.metadata.update(
        stdlib_root=root, python_version=sys.version.split()[0], num_files=len(sources),
        skipped_not_utf8=skipped)
    splits = {name: [s for s in sources if split_of(s[0]) == name] for name, _ in SPLITS}
    # TFDS cannot write an empty split; only a small subset can have one.
    return {name: self._generate_examples(s) for name, s in splits.items() if s}

  def _generate_examples(self, sources: list[tuple[str, str]]) -> Iterator[tuple[str, dict]]:
    for path, text in sources:
      yield path, {'path': path, 'text': text}
