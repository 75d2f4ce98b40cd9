"""The tokenizer is lossless on code and on anything else, and serialises completely.

Most tests train a small vocabulary on a stdlib subset and round-trip every file of the subset;
one trains the default 4096-piece vocabulary on the whole train split and round-trips every file of
the standard library (about 15 s).
"""

import random

import pytest

from spsjax.data import datasets, tokenizer
from tests import data_helpers

TRICKY = [
    '', ' ', '\n', '\t\t', '    x = 1  \n\n\n', ' leading space', 'trailing spaces   ',
    'a\r\nb\rc', '\x0c\x00\x7f\x1b', 'naïve café 😀 中文', 'a\u2581b \u2581\u2581 ▁', '\u2581',
    '<pad></s><unk><0x0A>', '\ufeffbom', '\u00a0\u2003\u3000', 'x' * 5000, ' ' * 33,
]


def test_round_trips_every_file_of_the_subset():
  tok = data_helpers.small_tokenizer()
  for split in ('train', 'validation', 'test'):
    texts = data_helpers.texts(split)
    ids = tok.encode_batch(texts)
    for text, text_ids in zip(texts, ids):
      assert tok.decode(text_ids) == text
      assert all(0 <= i < tok.vocab_size for i in text_ids)


def test_round_trips_tricky_and_random_strings():
  tok = data_helpers.small_tokenizer()
  rng = random.Random(0)
  alphabet = ' \t\n\r\x0b\x0c\x00abcXYZ019_():"\'\\é😀\u2581\u200b\ufffd<>/s'
  randoms = [''.join(rng.choice(alphabet) for _ in range(rng.randrange(60))) for _ in range(300)]
  for text in TRICKY + randoms:
    assert tok.decode(tok.encode(text)) == text, repr(text)
  assert tok.encode_batch(TRICKY) == [tok.encode(t) for t in TRICKY]


def test_whitespace_is_cheap_and_specials_are_not_text():
  tok = data_helpers.small_tokenizer()
  assert len(tok.encode('\n')) == 1 and len(tok.encode('\t')) == 1
  assert len(tok.encode('        return')) <= 3
  assert (tok.pad_id, tok.eos_id) == (tokenizer.PAD_ID, tokenizer.EOS_ID)
  assert tok.eos_id not in tok.encode('</s>') and tok.pad_id not in tok.encode('<pad>')
  assert tok.decode([tok.eos_id, tok.pad_id] + tok.encode('x')) == 'x'
  assert tok.vocab_size == data_helpers.SMALL_VOCAB


def test_serialisation(tmp_path):
  tok = data_helpers.small_tokenizer()
  again = tokenizer.Tokenizer.from_bytes(tok.to_bytes())
  path = str(tmp_path / 'tok.model')
  tok.save(path)
  loaded = tokenizer.Tokenizer.load(path)
  text = data_helpers.texts('test')[0]
  assert again.encode(text) == loaded.encode(text) == tok.encode(text)
  assert loaded.to_bytes() == tok.to_bytes()


def test_training_is_deterministic_and_samples_lines():
  texts = data_helpers.texts('validation')
  a = tokenizer.Tokenizer.train(texts, 400, max_lines=2000, seed=1)
  b = tokenizer.Tokenizer.train(texts, 400, max_lines=2000, seed=1)
  assert a.to_bytes() == b.to_bytes()
  assert all(a.decode(a.encode(t)) == t for t in texts)


def test_training_needs_text():
  with pytest.raises(ValueError, match='No text'):
    tokenizer.Tokenizer.train(['', '\n\n'], 300)


def test_full_corpus_round_trip(tmp_path):
  """Default settings, trained on the whole stdlib train split; every stdlib file round-trips."""
  data_dir = str(tmp_path)
  train = datasets.load('python_code', 'train', data_dir)
  tok = tokenizer.Tokenizer.train(train[i] for i in range(len(train)))
  assert tok.vocab_size == tokenizer.DEFAULT_VOCAB_SIZE
  for split in ('train', 'validation', 'test'):
    source = datasets.load('python_code', split, data_dir)
    texts = [source[i] for i in range(len(source))]
    failures = [i for i, ids in enumerate(tok.encode_batch(texts)) if tok.decode(ids) != texts[i]]
    assert not failures, [datasets.load_records('python_code', split, data_dir)[i]['path']
                          for i in failures]
