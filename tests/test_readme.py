"""The README's Python quickstart runs as written, on what a user has at the paths it names:
checkpoints of the reference family's layout as the trainer writes them (tiny models, random
weights, a small tokenizer), and Hugging Face directories (the test fixtures) in their place."""

import contextlib
import dataclasses
import inspect
import io
import json
import math
import os
import re
import shutil
import string

import pytest

from spsjax import models
from spsjax.data import tokenizer
from tests import train_helpers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HF_FIXTURES = os.path.join(ROOT, 'tests', 'fixtures', 'hf')
TARGET = 'checkpoints/reference/target'
DRAFT = 'checkpoints/reference/draft_trunc_distill_3000'


def quickstart() -> str:
  """The README's one ```python block."""
  with open(os.path.join(ROOT, 'README.md'), encoding='utf-8') as f:
    blocks = re.findall(r'^```python\n(.*?)^```', f.read(), re.S | re.M)
  assert len(blocks) == 1, 'The README should hold exactly one Python block (the quickstart).'
  return blocks[0]


def _run(code: str) -> str:
  """Runs `code` as a script in the current directory; returns what it printed."""
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    exec(compile(code, 'README.md', 'exec'), {'__name__': '__main__'})  # pylint: disable=exec-used
  return printed.getvalue()


def _check_printed(printed: str) -> None:
  lines = printed.splitlines()
  assert lines[-1].startswith('alpha '), printed
  alpha = float(lines[-1].split()[1])
  assert math.isnan(alpha) or 0 <= alpha <= 1, printed


def test_quickstart_on_our_checkpoints(tmp_path, monkeypatch):
  """The family `make train-reference` leaves: a target and its draft with one tokenizer."""
  sources = [inspect.getsource(m) for m in (string, json, dataclasses, contextlib)]
  tok = tokenizer.Tokenizer.train(sources, 400, num_threads=1)
  target = models.TransformerConfig(vocab_size=tok.vocab_size, d_model=32, num_layers=2,
                                    num_heads=2, num_kv_heads=1, d_ff=64, max_seq_len=128)
  draft = dataclasses.replace(target, num_layers=1)
  train_helpers.save_untrained(str(tmp_path / TARGET), target, 0, tok.to_bytes(), 1)
  train_helpers.save_untrained(str(tmp_path / DRAFT), draft, 1, tok.to_bytes(), 1)
  monkeypatch.chdir(tmp_path)
  _check_printed(_run(quickstart()))


@pytest.mark.parametrize('target, draft', [('llama_gqa', 'llama_tied_mqa')])
def test_quickstart_on_hugging_face_directories(tmp_path, monkeypatch, target, draft):
  """The comment's promise: Hugging Face directories at the same paths load the same way."""
  shutil.copytree(os.path.join(HF_FIXTURES, target), tmp_path / TARGET)
  shutil.copytree(os.path.join(HF_FIXTURES, draft), tmp_path / DRAFT)
  monkeypatch.chdir(tmp_path)
  _check_printed(_run(quickstart()))
