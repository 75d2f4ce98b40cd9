"""Text prompts become right-padded, bucketed id arrays; long prompts keep their end."""

import numpy as np
import pytest

from spsjax.data import prompts
from tests import data_helpers


def test_right_padded_bucketed_and_truncated_from_the_left():
  tok = data_helpers.small_tokenizer()
  texts = ['def f(x):\n    return x', 'import os\n' * 30, 'x']
  ids = [tok.encode(t) for t in texts]
  out, lengths = prompts.encode_prompts(tok, texts, max_len=40, bucket=16)
  assert out.dtype == np.int32 and lengths.dtype == np.int32
  assert out.shape == (3, 48) and lengths.tolist() == [len(ids[0]), 40, len(ids[2])]
  assert out[0, :lengths[0]].tolist() == ids[0]
  assert out[1, :40].tolist() == ids[1][-40:]  # The end of a long prompt is kept.
  assert (out[2, lengths[2]:] == tok.pad_id).all()


def test_bad_prompts():
  tok = data_helpers.small_tokenizer()
  with pytest.raises(ValueError, match='No prompts'):
    prompts.encode_prompts(tok, [])
  with pytest.raises(ValueError, match=r'Prompts \[1\] encode to no tokens'):
    prompts.encode_prompts(tok, ['x', ''])


def test_bucket_widths_are_few_and_hold_the_prompt():
  widths = [prompts.bucket_width(n) for n in range(1, 600)]
  assert all(w >= n for n, w in zip(range(1, 600), widths))
  assert all(w - n < 64 for n, w in zip(range(129, 600), widths[128:]))  # At most 63 padding.
  assert sorted(set(widths[:128])) == [16, 32, 64, 128]
  assert len(set(widths)) == 4 + (600 - 128 + 63) // 64


def test_for_call_cuts_a_call_to_its_own_width():
  ids = np.arange(3 * 300, dtype=np.int32).reshape(3, 300)
  lengths = np.array([20, 290, 40], np.int32)
  cut, cut_lengths = prompts.for_call(ids, lengths, [0, 2])
  assert cut.shape == (2, 64) and cut_lengths.tolist() == [20, 40]
  np.testing.assert_array_equal(cut, ids[[0, 2], :64])
  assert prompts.for_call(ids, lengths, [1])[0].shape == (1, 300)  # Never wider than the input.
  assert prompts.for_call(ids, lengths, [0])[0].shape == (1, 32)
