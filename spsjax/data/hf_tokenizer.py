"""A Hugging Face `tokenizer.json` behind the interface the binaries use (`data.tokenizer`).

`HFTokenizer.load(directory)` reads `tokenizer.json` with the `tokenizers` package. The eos ids
are those transformers' `generate` stops at: `eos_token_id` of `generation_config.json`, else of
`config.json` (one id or a list: an instruct model's end of turn beside its end of text), else
the tokenizer's `eos_token` in `tokenizer_config.json`; none if nothing names one (generation
then runs to max_new_tokens). `eos_ids` are all of them (what the binaries pass the samplers),
`eos_id` the first. The pad id is `pad_token_id`, else the eos id, else 0. `encode` adds no
special tokens; `prompt_prefix` holds those the tokenizer's post-processor puts before a text
(Llama's and Gemma's BOS, which transformers' tokenizer adds by default and Gemma needs), which
`data.prompts` puts before every prompt; `decode` drops special tokens. `to_bytes` is the
tokenizer.json text: two tokenizers are the same if their bytes are.
"""

import json
from collections.abc import Iterable, Sequence

import tokenizers

from spsjax import storage

FILE = 'tokenizer.json'


def _json(path) -> dict:
  return json.loads(path.read_text(encoding='utf-8')) if path.is_file() else {}


def _first(value):
  return value[0] if isinstance(value, list) and value else value


class HFTokenizer:
  """`tokenizers.Tokenizer` with the eos and pad ids of its checkpoint."""

  def __init__(self, tokenizer_json: str, eos_id: int | Sequence[int] | None = None,
               pad_id: int | None = None):
    self._json = tokenizer_json
    self._tok = tokenizers.Tokenizer.from_str(tokenizer_json)
    self._eos_ids = () if eos_id is None else tuple(
        int(i) for i in (eos_id if isinstance(eos_id, (list, tuple)) else [eos_id]))
    self._pad_id = pad_id if pad_id is not None else (self.eos_id if self._eos_ids else 0)
    probe = 'x = 1'
    plain = self._tok.encode(probe, add_special_tokens=False).ids
    full = self._tok.encode(probe, add_special_tokens=True).ids
    starts = [i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain]
    self._prompt_prefix = tuple(full[:starts[0]]) if starts else ()

  @classmethod
  def load(cls, directory: str) -> 'HFTokenizer':
    folder = storage.path(directory)
    if not (folder / FILE).is_file():
      raise FileNotFoundError(f'{directory} has no {FILE}: a Hugging Face checkpoint needs its '
                              f'tokenizer beside it.')
    text = (folder / FILE).read_text(encoding='utf-8')
    config = _json(folder / 'config.json')
    generation = _json(folder / 'generation_config.json')
    eos_id = generation.get('eos_token_id')
    if eos_id is None or eos_id == []:
      eos_id = config.get('eos_token_id')
    if eos_id == []:
      eos_id = None
    tok = cls(text)
    if eos_id is None:
      eos = _json(folder / 'tokenizer_config.json').get('eos_token')
      eos = eos.get('content') if isinstance(eos, dict) else eos
      eos_id = tok._tok.token_to_id(eos) if eos else None
    pad_id = _first(config.get('pad_token_id'))
    return cls(text, eos_id, pad_id)

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  @property
  def eos_id(self) -> int | None:
    return self._eos_ids[0] if self._eos_ids else None

  @property
  def eos_ids(self) -> tuple[int, ...]:
    return self._eos_ids

  @property
  def pad_id(self) -> int:
    return self._pad_id

  @property
  def prompt_prefix(self) -> tuple[int, ...]:
    return self._prompt_prefix

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False).ids

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

  def decode(self, ids: Iterable[int]) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

  def id_to_piece(self, token_id: int) -> str:
    return self._tok.id_to_token(int(token_id))

  def to_bytes(self) -> bytes:
    return self._json.encode('utf-8')

  def save(self, directory: str) -> None:
    """Writes tokenizer.json into `directory` (an exported checkpoint's; process 0 writes)."""
    storage.write_text(storage.join(directory, FILE), self._json)

  def __repr__(self) -> str:
    return (f'HFTokenizer(vocab_size={self.vocab_size}, eos_ids={self.eos_ids}, '
            f'pad_id={self.pad_id})')
