"""Packed batches: exact packing, reshuffled epochs, exact resume, determinism."""

import json

import numpy as np
import pytest

from spsjax.data import datasets, pipeline
from tests import data_helpers

BATCH, SEQ_LEN, SEED = 4, 63, 3


@pytest.fixture(scope='module', name='docs')
def fixture_docs():
  return data_helpers.texts('validation')


@pytest.fixture(scope='module', name='tok')
def fixture_tok():
  return data_helpers.small_tokenizer()


def _stream(docs, tok, epoch, seed=SEED):
  """The epoch's documents in its order, each followed by eos, computed independently."""
  order = pipeline.epoch_order(len(docs), seed, epoch)
  return np.concatenate([tok.encode(docs[i]) + [tok.eos_id] for i in order]).astype(np.int32)


def _take(batches, n):
  return [next(batches) for _ in range(n)]


def test_an_epoch_is_the_shuffled_documents_joined_by_eos(docs, tok):
  batches = pipeline.PackedBatches(docs, tok, BATCH, SEQ_LEN, SEED)
  per_batch = BATCH * (SEQ_LEN + 1)
  stream = _stream(docs, tok, 0)
  num_batches = len(stream) // per_batch
  assert num_batches >= 3
  got = _take(batches, num_batches)
  assert all(b.shape == (BATCH, SEQ_LEN + 1) and b.dtype == np.int32 for b in got)
  flat = np.concatenate([b.reshape(-1) for b in got])
  np.testing.assert_array_equal(flat, stream[:len(flat)])
  assert len(stream) - len(flat) < per_batch  # Only the final remainder is dropped.
  # Decoding between eos tokens gives back the documents in the epoch's order.
  ends = np.flatnonzero(flat == tok.eos_id)
  starts = np.concatenate([[0], ends[:-1] + 1])
  pieces = [tok.decode(flat[s:e].tolist()) for s, e in zip(starts, ends)]
  order = pipeline.epoch_order(len(docs), SEED, 0)
  assert pieces == [docs[i] for i in order[:len(pieces)]]
  # The next batch starts epoch 1, in a new order.
  assert batches.get_state()['epoch'] == 0
  np.testing.assert_array_equal(next(batches).reshape(-1), _stream(docs, tok, 1)[:per_batch])
  assert batches.get_state()['epoch'] == 1 and batches.get_state()['batch_in_epoch'] == 1
  assert not np.array_equal(order, pipeline.epoch_order(len(docs), SEED, 1))


def test_resume_gives_the_same_next_batches_across_epochs(docs, tok):
  per_epoch = len(_stream(docs, tok, 0)) // (BATCH * (SEQ_LEN + 1))
  for n in (0, 1, per_epoch - 1, per_epoch, per_epoch + 2):
    first = pipeline.PackedBatches(docs, tok, BATCH, SEQ_LEN, SEED)
    _take(first, n)
    state = json.loads(json.dumps(first.get_state()))
    expected = _take(first, per_epoch + 1)
    resumed = pipeline.PackedBatches(docs, tok, BATCH, SEQ_LEN, SEED)
    resumed.set_state(state)
    for want, got in zip(expected, _take(resumed, per_epoch + 1)):
      np.testing.assert_array_equal(got, want)


def test_deterministic_per_seed_and_records_with_a_text_field(docs, tok):
  records = datasets.load_records('python_code', 'validation', data_helpers.data_dir(),
                                  data_helpers.SUBSET)
  a = _take(pipeline.PackedBatches(docs, tok, BATCH, SEQ_LEN, SEED), 3)
  b = _take(pipeline.PackedBatches(records, tok, BATCH, SEQ_LEN, SEED, text_field='text'), 3)
  c = _take(pipeline.PackedBatches(docs, tok, BATCH, SEQ_LEN, SEED + 1, cache_tokens=False), 3)
  np.testing.assert_array_equal(np.stack(a), np.stack(b))
  assert not np.array_equal(np.stack(a), np.stack(c))


def test_bad_arguments_and_states(docs, tok):
  with pytest.raises(ValueError, match='must be >= 1'):
    pipeline.PackedBatches(docs, tok, 0, 8)
  with pytest.raises(ValueError, match='no documents'):
    pipeline.PackedBatches([], tok, 8, 8)
  with pytest.raises(ValueError, match='fewer than one global batch'):
    next(pipeline.PackedBatches(['tiny', 'docs'], tok, 8, 8))
  batches = pipeline.PackedBatches(docs, tok, BATCH, SEQ_LEN, SEED)
  state = batches.get_state()
  with pytest.raises(ValueError, match='seed'):
    pipeline.PackedBatches(docs, tok, BATCH, SEQ_LEN, SEED + 1).set_state(state)
  with pytest.raises(ValueError, match='lacks'):
    batches.set_state({'epoch': 0})


def test_most_frequent_tokens_of_the_stream_leave_its_position(docs, tok):
  """A head's draft vocabulary: the n most frequent tokens of epoch 0's first tokens (ties: the
  smaller id), counted independently; the pipeline yields the batches it would have."""
  batches = pipeline.PackedBatches(docs, tok, BATCH, SEQ_LEN, SEED)
  first = next(batches)
  stream = _stream(docs, tok, 0)
  for n, budget in ((5, 3000), (100, 10**9)):
    counts = np.bincount(stream[:budget], minlength=tok.vocab_size)
    got = batches.most_frequent(n, tok.vocab_size, budget)
    assert got.dtype == np.int32 and list(got) == sorted(set(got.tolist())) and len(got) == n
    kept, rest = counts[got], np.delete(counts, got)
    assert kept.min() >= rest.max()
    ties = np.flatnonzero(counts == kept.min())  # The smaller ids among equal counts.
    np.testing.assert_array_equal(np.intersect1d(got, ties), ties[:np.isin(ties, got).sum()])
  np.testing.assert_array_equal(next(batches).reshape(-1), stream[BATCH * (SEQ_LEN + 1):][
      :BATCH * (SEQ_LEN + 1)])
  assert first.shape == (BATCH, SEQ_LEN + 1)
  with pytest.raises(ValueError, match='1 <= n <= vocab_size'):
    batches.most_frequent(0, tok.vocab_size, 10)
