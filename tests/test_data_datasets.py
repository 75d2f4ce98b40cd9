"""The generic loader: names, text fields, data dir, random access."""

import os

import pytest

from spsjax.data import datasets
from tests import data_helpers


def test_unknown_name_raises_a_clear_value_error(tmp_path):
  with pytest.raises(ValueError, match=r"Unknown dataset 'no_such_data'.*docstrings, humaneval, "
                     r'python_code'):
    datasets.load('no_such_data', 'train', str(tmp_path), text_field='text')


def test_other_datasets_need_a_text_field(tmp_path):
  with pytest.raises(ValueError, match='text_field'):
    datasets.load('xsum', 'train', str(tmp_path))


def test_unknown_field_lists_the_fields():
  with pytest.raises(ValueError, match=r"no field 'document'.*'prompt'"):
    datasets.load('humaneval', 'test', data_helpers.data_dir(), text_field='document')


def test_default_data_dir(monkeypatch):
  monkeypatch.setenv(datasets.DATA_DIR_ENV, '/some/dir')
  assert datasets.default_data_dir() == '/some/dir'
  monkeypatch.delenv(datasets.DATA_DIR_ENV)
  assert datasets.default_data_dir() == os.path.expanduser('~/.cache/spsjax/tfds')


def test_random_access_text():
  source = datasets.load('python_code', 'validation', data_helpers.data_dir(),
                         config=data_helpers.SUBSET)
  records = datasets.load_records('python_code', 'validation', data_helpers.data_dir(),
                                  data_helpers.SUBSET)
  assert len(source) == len(records) > 0
  assert isinstance(source[0], str) and source[-1] == records[len(records) - 1]['text']
  assert source[len(source) - 1] == source[-1]
  with pytest.raises(IndexError):
    source[len(source)]  # pylint: disable=pointless-statement
  with pytest.raises(TypeError):
    source[0:2]  # pylint: disable=pointless-statement
