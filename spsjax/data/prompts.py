"""Text prompts -> the samplers' input convention: right-padded `int32[B, P]` plus lengths.

Invariant: row b holds the ids of prompt b in positions [0, lengths[b]) and `pad_id` after them:
the tokenizer's `prompt_prefix` (a Hugging Face tokenizer's BOS), then the text's ids. A prompt
longer than `max_len` keeps its prefix and the last ids of its text (the end is what the model
continues).
P is the longest row rounded up to a multiple of `bucket`, so prompts of similar lengths share one
compiled program.

`for_call` cuts the rows of one sampler call to their own padded width (`bucket_width` of their
longest prompt): a prefill costs every position of the padded width, so padding a short prompt to
the longest of a whole task would charge each call the prefill of that longest prompt.
"""

import dataclasses
from collections.abc import Sequence

import numpy as np

from spsjax.data.tokenizer import Tokenizer


def encode_prompts(tok: Tokenizer, texts: list[str], *, max_len: int | None = None,
                   bucket: int = 16) -> tuple[np.ndarray, np.ndarray]:
  """(prompts int32[B, P], lengths int32[B]) for `texts`; see the module docstring."""
  if not texts:
    raise ValueError('No prompts.')
  prefix = list(tok.prompt_prefix)
  ids = [tok.encode(t) for t in texts]
  empty = [i for i, x in enumerate(ids) if not x]
  if empty:
    raise ValueError(f'Prompts {empty} encode to no tokens; every prompt needs at least one.')
  if max_len is not None and max_len <= len(prefix):
    raise ValueError(f'max_len={max_len} leaves no room after the prompt prefix {prefix}.')
  keep = None if max_len is None else max_len - len(prefix)
  ids = [prefix + (x if keep is None else x[-keep:]) for x in ids]
  lengths = np.array([len(x) for x in ids], np.int32)
  width = -(-int(lengths.max()) // bucket) * bucket
  prompts = np.full((len(ids), width), tok.pad_id, np.int32)
  for row, x in enumerate(ids):
    prompts[row, :len(x)] = x
  return prompts, lengths


@dataclasses.dataclass(frozen=True)
class Room:
  """Positions left for a prompt in a model's cache, and the arithmetic that gave them."""
  positions: int
  budget: str  # "the target's max_seq_len 512 - max_new_tokens 500 leaves 12 positions ..."


def prompt_room(max_seq_lens: Sequence[tuple[str, int]], max_new_tokens: int,
                headroom: int = 0) -> Room:
  """The longest prompt that fits with max_new_tokens (and `headroom` positions a sampler writes
  past them: k - 1 for SpS) in every named model's max_seq_len; ValueError naming the numbers
  when not even a 1-token prompt fits."""
  name, max_seq_len = min(max_seq_lens, key=lambda x: x[1])
  positions = max_seq_len - max_new_tokens - headroom
  extra = f' - (k - 1 = {headroom}, written past the end by SpS)' if headroom else ''
  budget = (f'the {name}\'s max_seq_len {max_seq_len} - max_new_tokens {max_new_tokens}{extra} '
            f'leaves {max(positions, 0)} positions for the prompt')
  if positions < 1:
    raise ValueError(f'max_new_tokens={max_new_tokens} is too large: {budget}; use '
                     f'max_new_tokens <= {max_seq_len - headroom - 1}.')
  return Room(positions, budget)


def cut_note(tok: Tokenizer, texts: Sequence[str], room: Room) -> str | None:
  """What `encode_prompts(..., max_len=room.positions)` cuts, as a NOTE line, or None."""
  lengths = (len(tok.prompt_prefix) + len(tok.encode(t)) for t in texts)
  cut = [(row, n) for row, n in enumerate(lengths) if n > room.positions]
  if not cut:
    return None
  rows = ', '.join(f'row {row} from {n}' for row, n in cut[:4]) + (', ...' if cut[4:] else '')
  return (f'NOTE: {len(cut)} of {len(texts)} prompts cut to their last {room.positions} tokens '
          f'({rows}): {room.budget}.')


def bucket_width(length: int) -> int:
  """Padded width for prompts of up to `length` tokens: a power of two (at least 16) up to 128,
  then a multiple of 64. Few widths, so few compiled programs, and at most 63 padding positions."""
  if length <= 128:
    return max(16, 1 << (max(1, length) - 1).bit_length())
  return -(-length // 64) * 64


def for_call(prompts_NxP: np.ndarray, lengths_N: np.ndarray,
             rows: list[int]) -> tuple[np.ndarray, np.ndarray]:
  """The prompts of `rows`, cut to `bucket_width` of their longest (never below its length)."""
  lengths = np.asarray(lengths_N)[rows]
  width = min(prompts_NxP.shape[1], bucket_width(int(lengths.max())))
  return np.asarray(prompts_NxP)[rows, :width], lengths
