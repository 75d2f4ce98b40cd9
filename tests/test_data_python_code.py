"""python_code: the stdlib file list, stable hash splits, skipped non-UTF-8 files."""

import collections
import random

from spsjax.data import datasets, python_code
from tests import data_helpers

ROOT = python_code.stdlib_root()


def test_file_list_is_sorted_relative_and_excludes_site_packages():
  paths = python_code.list_files(ROOT)
  assert paths == sorted(paths) and len(paths) > 1000
  assert 'os.py' in paths and 'json/decoder.py' in paths and 'test/test_json/test_dump.py' in paths
  assert not any('site-packages/' in p or '__pycache__' in p or p.startswith('/') for p in paths)
  assert all(p.endswith('.py') for p in paths)


def test_split_depends_on_the_path_alone():
  paths = python_code.list_files(ROOT)
  shuffled = random.Random(0).sample(paths, len(paths))
  by_path = {p: python_code.split_of(p) for p in shuffled}
  assert [by_path[p] for p in paths] == [python_code.split_of(p) for p in paths]
  counts = collections.Counter(by_path.values())
  assert 0.85 < counts['train'] / len(paths) < 0.95
  assert 0.02 < counts['validation'] / len(paths) < 0.08
  assert 0.02 < counts['test'] / len(paths) < 0.08


def test_built_splits_match_split_of_and_are_reproducible(tmp_path):
  first = {s: datasets.load_records('python_code', s, data_helpers.data_dir(), data_helpers.SUBSET)
           for s in ('train', 'validation', 'test')}
  datasets.builder('python_code', str(tmp_path), data_helpers.SUBSET)  # A second, fresh build.
  for split, records in first.items():
    again = datasets.load_records('python_code', split, str(tmp_path), data_helpers.SUBSET)
    paths = [records[i]['path'] for i in range(len(records))]
    assert len(paths) > 0 and paths == sorted(paths)
    assert all(python_code.split_of(p) == split for p in paths)
    assert [again[i] for i in range(len(again))] == [records[i] for i in range(len(records))]


def test_texts_are_the_files_and_non_utf8_files_are_skipped():
  builder = datasets.builder('python_code', data_helpers.data_dir(), data_helpers.SUBSET)
  skipped = builder.info.metadata['skipped_not_utf8']
  assert 'test/encoded_modules/module_koi8_r.py' in skipped
  records = datasets.load_records('python_code', 'train', data_helpers.data_dir(),
                                  data_helpers.SUBSET)
  paths = set()
  for i in range(len(records)):
    record = records[i]
    with open(f"{ROOT}/{record['path']}", 'rb') as f:
      assert f.read() == record['text'].encode('utf-8')
    paths.add(record['path'])
  assert not paths & set(skipped)
  total = sum(builder.info.splits[s].num_examples for s in ('train', 'validation', 'test'))
  assert total + len(skipped) == len(python_code.list_files(ROOT, data_helpers.SUBSET.prefixes))
