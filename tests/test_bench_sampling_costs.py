"""Sampling costs: every setting timed at every row count, top-k by search checked against top-k."""

import dataclasses

import pytest

from spsjax.bench import accelerator, sampling_costs


def test_every_setting_is_timed_at_every_row_count_and_the_search_keeps_the_top_k_law():
  found = sampling_costs.costs(300, [1, 3], repeats=1, calls=2)
  assert [(c.setting, c.rows) for c in found] == [
      (s, R) for R in (1, 3) for s in sampling_costs.SETTINGS]
  assert all(c.seconds > 0 for c in found)
  assert [c.same_law for c in found if c.setting == sampling_costs.SEARCHED] == [True, True]
  assert all(c.same_law is None for c in found if c.setting != sampling_costs.SEARCHED)
  table = accelerator.markdown(device='cpu', copy=None, checks=[], rows=[], ceiling_rows=[],
                               command='x', sampling=(300, found))
  assert '| setting | 1 row | 3 rows |' in table and 'NOT' not in table
  # A search that kept other tokens is flagged in its cell.
  found[3] = dataclasses.replace(found[3], same_law=False)
  table = accelerator.markdown(device='cpu', copy=None, checks=[], rows=[], ceiling_rows=[],
                               command='x', sampling=(300, found))
  assert '| top-k 50, search | ' in table and '(NOT the top-k law)' in table


@pytest.mark.parametrize('kwargs, match', [
    (dict(settings=['top-k 7']), 'Unknown sampling settings'),
    (dict(calls=0), 'must be >= 1'), (dict(rows=[]), 'must be >= 1')])
def test_bad_arguments_raise(kwargs, match):
  with pytest.raises(ValueError, match=match):
    sampling_costs.costs(300, kwargs.pop('rows', [1]), repeats=1, **kwargs)
