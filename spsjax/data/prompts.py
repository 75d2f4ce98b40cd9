"""Text prompts -> the samplers' input convention: right-padded `int32[B, P]` plus lengths.

Invariant: row b holds the ids of prompt b in positions [0, lengths[b]) and `pad_id` after them;
a prompt longer than `max_len` keeps its last `max_len` ids (the end is what the model continues).
P is the longest row rounded up to a multiple of `bucket`, so prompts of similar lengths share one
compiled program.
"""

import numpy as np

from spsjax.data.tokenizer import Tokenizer


def encode_prompts(tok: Tokenizer, texts: list[str], *, max_len: int | None = None,
                   bucket: int = 16) -> tuple[np.ndarray, np.ndarray]:
  """(prompts int32[B, P], lengths int32[B]) for `texts`; see the module docstring."""
  if not texts:
    raise ValueError('No prompts.')
  ids = [tok.encode(t) for t in texts]
  empty = [i for i, x in enumerate(ids) if not x]
  if empty:
    raise ValueError(f'Prompts {empty} encode to no tokens; every prompt needs at least one.')
  if max_len is not None:
    ids = [x[-max_len:] for x in ids]
  lengths = np.array([len(x) for x in ids], np.int32)
  width = -(-int(lengths.max()) // bucket) * bucket
  prompts = np.full((len(ids), width), tok.pad_id, np.int32)
  for row, x in enumerate(ids):
    prompts[row, :len(x)] = x
  return prompts, lengths
