"""eval.tasks: the code_completion task's prompts in the builder's order and its two metrics."""

import pytest

from spsjax.data import datasets
from spsjax.eval import metrics, tasks
from tests import data_helpers


def test_code_scores_cut_the_completion_to_the_reference_s_lines():
  reference = '        total += x\n    return total'
  scores = tasks.code_scores(
      ['        total += x\n    return total\n\ndef other():\n    pass\n',  # Then more code.
       '    total += x\n    return total\n',  # Wrong indentation: not the next line.
       '        total += x   \r\n',  # Trailing whitespace and \r\n do not count.
       ''],
      [reference] * 4)
  assert scores['next-line EM'] == [1.0, 0.0, 1.0, 0.0]
  # chrF of the completion's first two lines (the reference has two): the first is identical.
  assert scores['chrF'][0] == 1.0
  assert scores['chrF'][1] == 1.0  # chrF ignores whitespace; exact match does not.
  assert scores['chrF'][2] == pytest.approx(
      metrics.chrf_scores(['        total += x   '], [reference])[0])
  assert 0.0 < scores['chrF'][2] < 1.0 and scores['chrF'][3] == 0.0


def test_code_completion_task_takes_the_first_records_and_scores_a_row():
  data_dir = data_helpers.data_dir()
  task = tasks.load_task('code_completion', 5, 64, data_dir, data_helpers.SUBSET)
  records = datasets.load_records('code_completion', 'test', data_dir, data_helpers.SUBSET)
  assert task.prompts == tuple(records[i]['input'] for i in range(5))
  assert task.references == tuple(records[i]['reference'] for i in range(5))
  scores = tasks.score(task, list(task.references))  # The references score perfectly.
  assert scores.headline == 'chrF' and scores.values['chrF'] == [1.0] * 5
  assert scores.values['next-line EM'] == [1.0] * 5
  with pytest.raises(ValueError, match='4 completions for 5 prompts'):
    tasks.score(task, ['x'] * 4)
