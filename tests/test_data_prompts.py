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
