"""Packed, shuffled, resumable token batches for language-model training.

Epoch e is one stream: the documents in the order `epoch_order(num_docs, seed, e)`, each tokenised
and followed by `eos_id`. The stream is cut into consecutive, non-overlapping global batches of
`batch_size` rows of `seq_len + 1` tokens (inputs `[:, :-1]`, targets `[:, 1:]`); the tail too
short for a whole global batch is dropped, and epoch e + 1 starts with a fresh order. So within an
epoch no token is lost or repeated, and documents cross row and batch boundaries freely.

Invariants:
- deterministic: the batches depend only on (source, tokenizer, seed, batch_size, seq_len);
- resumable: `get_state()` is a small JSON-serialisable dict, and after `set_state(state)` a fresh
  pipeline yields exactly the batches the saved one would have yielded next;
- global: every batch is the whole global batch. With several processes each walks the same
  stream (tokenising every document, cheap next to a step) and gets the same batches, so the state
  does not depend on the number of processes (a state saved with N resumes with M), and each
  process builds from the global batch the rows its devices hold, wherever the mesh puts them
  (`trainer.global_batch`).
Documents are tokenised on first use and their tokens cached (`cache_tokens=False` to re-tokenise).
"""

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from spsjax.data.tokenizer import Tokenizer

_STATE_KEYS = ('epoch', 'doc', 'offset', 'batch_in_epoch')
_CONFIG_KEYS = ('seed', 'batch_size', 'seq_len', 'num_docs', 'tokenizer')


def epoch_order(num_docs: int, seed: int, epoch: int) -> np.ndarray:
  """The document order of an epoch: a permutation of range(num_docs) seeded by (seed, epoch)."""
  return np.random.default_rng([seed, epoch]).permutation(num_docs)


class PackedBatches:
  """Yields global batches `int32[batch_size, seq_len + 1]` forever (see the module doc).

  `source` is random access (len and [i]) to documents: str (or bytes), or records whose
  `text_field` holds the text.
  """

  def __init__(self, source: Sequence[Any], tokenizer: Tokenizer, batch_size: int, seq_len: int,
               seed: int = 0, text_field: str | None = None, cache_tokens: bool = True):
    if batch_size < 1 or seq_len < 1:
      raise ValueError(f'batch_size and seq_len must be >= 1, got {batch_size} and {seq_len}.')
    if len(source) == 0:
      raise ValueError('The source has no documents.')
    self._source, self._tokenizer, self._text_field = source, tokenizer, text_field
    self._batch_size, self._seq_len, self._seed = batch_size, seq_len, seed
    self._cache = {} if cache_tokens else None
    self._tokenizer_id = hashlib.sha256(tokenizer.to_bytes()).hexdigest()[:16]
    self._epoch = self._doc = self._offset = self._batch_in_epoch = 0
    self._order = epoch_order(len(source), seed, 0)

  def __iter__(self) -> 'PackedBatches':
    return self

  def __next__(self) -> np.ndarray:
    """The next global batch: int32[batch_size, seq_len + 1]."""
    needed = self._batch_size * (self._seq_len + 1)
    while True:
      pieces, have = [], 0
      doc, offset = self._doc, self._offset
      while have < needed and doc < len(self._order):
        tokens = self.document_tokens(int(self._order[doc]))
        take = min(len(tokens) - offset, needed - have)
        pieces.append(tokens[offset:offset + take])
        have += take
        offset += take
        if offset == len(tokens):
          doc, offset = doc + 1, 0
      if have == needed:
        break
      if self._batch_in_epoch == 0:
        raise ValueError(f'One epoch has {have} tokens, fewer than one global batch ({needed}).')
      self._start_epoch(self._epoch + 1)  # The tail is dropped.
    self._doc, self._offset = doc, offset
    self._batch_in_epoch += 1
    return np.concatenate(pieces).reshape(self._batch_size, self._seq_len + 1)

  def document_tokens(self, index: int) -> np.ndarray:
    """int32 tokens of document `index` followed by eos (cached)."""
    if self._cache is not None and index in self._cache:
      return self._cache[index]
    text = self._source[index]
    if self._text_field is not None:
      text = text[self._text_field]
    if isinstance(text, bytes):
      text = text.decode('utf-8')
    tokens = np.asarray(self._tokenizer.encode(text) + [self._tokenizer.eos_id], np.int32)
    if self._cache is not None:
      self._cache[index] = tokens
    return tokens

  def most_frequent(self, n: int, vocab_size: int, max_tokens: int) -> np.ndarray:
    """The `n` most frequent tokens (ties: the smaller id; int32, increasing) of the first
    `max_tokens` of epoch 0's stream (or all of it), eos included: a head's draft vocabulary
    (`models.feature_head.DraftVocab`). The pipeline's position is not moved."""
    if not 1 <= n <= vocab_size or max_tokens < 1:
      raise ValueError(f'Want 1 <= n <= vocab_size ({vocab_size}) and max_tokens >= 1, got n={n},'
                       f' max_tokens={max_tokens}.')
    counts, seen = np.zeros(vocab_size, np.int64), 0
    for index in epoch_order(len(self._source), self._seed, 0):
      tokens = self.document_tokens(int(index))[:max_tokens - seen]
      if tokens.size and int(tokens.max()) >= vocab_size:
        raise ValueError(f'Token {int(tokens.max())} is outside a vocabulary of {vocab_size}.')
      counts += np.bincount(tokens, minlength=vocab_size)
      seen += tokens.size
      if seen >= max_tokens:
        break
    return np.sort(np.argsort(-counts, kind='stable')[:n]).astype(np.int32)

  def _start_epoch(self, epoch: int) -> None:
    self._epoch, self._doc, self._offset, self._batch_in_epoch = epoch, 0, 0, 0
    self._order = epoch_order(len(self._source), self._seed, epoch)

  def _config(self) -> dict[str, Any]:
    return {'seed': self._seed, 'batch_size': self._batch_size, 'seq_len': self._seq_len,
            'num_docs': len(self._source), 'tokenizer': self._tokenizer_id}

  def get_state(self) -> dict[str, Any]:
    """Where the stream stands (epoch, document, token offset) plus what it must be resumed with."""
    return {'epoch': self._epoch, 'doc': self._doc, 'offset': self._offset,
            'batch_in_epoch': self._batch_in_epoch, **self._config()}

  def set_state(self, state: dict[str, Any]) -> None:
    """Resumes at `state` (from `get_state`); ValueError if it belongs to another configuration."""
    missing = [k for k in _STATE_KEYS + _CONFIG_KEYS if k not in state]
    if missing:
      raise ValueError(f'Pipeline state lacks {missing}.')
    config = self._config()
    changed = {k: (state[k], config[k]) for k in _CONFIG_KEYS if state[k] != config[k]}
    if changed:
      raise ValueError(f'Pipeline state is for another configuration (saved, now): {changed}.')
    self._start_epoch(int(state['epoch']))
    self._doc, self._offset = int(state['doc']), int(state['offset'])
    self._batch_in_epoch = int(state['batch_in_epoch'])
