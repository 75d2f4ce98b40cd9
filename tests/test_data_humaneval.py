"""humaneval: all 164 problems with their five fields, in order."""

from spsjax.data import datasets, humaneval
from tests import data_helpers


def test_164_problems_with_the_right_fields():
  records = datasets.load_records('humaneval', 'test', data_helpers.data_dir())
  assert len(records) == humaneval.NUM_PROBLEMS == 164
  problems = humaneval.read_problems()
  for i in range(len(records)):
    record = records[i]
    assert set(record) == set(humaneval.FIELDS)
    assert record == {f: problems[i][f] for f in humaneval.FIELDS}
    assert record['task_id'] == f'HumanEval/{i}'
    assert f"def {record['entry_point']}(" in record['prompt']
    assert 'def check(' in record['test']


def test_text_field_is_the_prompt():
  prompts = datasets.load('humaneval', 'test', data_helpers.data_dir())
  assert prompts[0].startswith('from typing import List')
