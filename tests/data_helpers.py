"""Shared by the data tests: a small stdlib subset, built once per test session into a temp dir.

The subset (`SUBSET`) has files in all three splits, functions with docstrings in the test split,
three files that are not UTF-8 and files that do not parse, and ~1.9M characters.
"""

import atexit
import functools
import os
import shutil
import tempfile

from spsjax.data import datasets, python_code, tokenizer
from tests import xla_env

SUBSET = python_code.SMALL
SMALL_VOCAB = 1024
_DATA_DIR_ENV = 'SPSJAX_TEST_DATA_DIR'


@functools.cache
def data_dir() -> str:
  """A temp TFDS data dir holding the subset's `python_code`, `docstrings`, `code_completion`
  and `humaneval`.

  A subprocess of a test reuses its parent's through $SPSJAX_TEST_DATA_DIR (`subprocess_env`).
  """
  if os.environ.get(_DATA_DIR_ENV):
    return os.environ[_DATA_DIR_ENV]
  path = tempfile.mkdtemp(prefix='spsjax_data_test_')
  atexit.register(shutil.rmtree, path, ignore_errors=True)
  for name in ('python_code', 'docstrings', 'code_completion'):
    datasets.builder(name, path, config=SUBSET)
  datasets.builder('humaneval', path)
  return path


def subprocess_env() -> dict[str, str]:
  """The environment for a test's subprocess: this data dir, and JAX on one CPU device."""
  return xla_env.subprocess_env(**{_DATA_DIR_ENV: data_dir()})


def texts(split: str) -> list[str]:
  source = datasets.load('python_code', split, data_dir(), config=SUBSET)
  return [source[i] for i in range(len(source))]


@functools.cache
def small_tokenizer() -> tokenizer.Tokenizer:
  return tokenizer.Tokenizer.train(texts('train'), SMALL_VOCAB)
