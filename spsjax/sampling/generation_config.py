"""The sampling a Hugging Face checkpoint asks for: its `generation_config.json` as a SamplingConfig.

`sampling_config(directory)` gives the law transformers' `generate` samples from by default for
that checkpoint (transformers 5): the file's settings, then transformers' global defaults where
it sets none (`do_sample` false, temperature 1, top_k 50, top_p 1, no min_p, typical_p,
epsilon_cutoff or eta_cutoff; no file: all defaults). Without `do_sample` generation is greedy
(temperature 0, none of the cuts). The ban of repeated n-grams and the repetition penalty
(greedy or not), then temperature,
top-k (0 off), top-p, min-p, typical-p and the epsilon and eta cutoffs, in transformers' order,
which is `processors`'; as in transformers, a typical_p of 1 or more and a cutoff outside (0, 1)
are off.

`sequence_bias` ([token ids, bias] pairs), `bad_words_ids` (a bias of -inf on each, but a word
that is one eos id, as transformers drops it) and `suppress_tokens` (-inf on each) become
`SamplingConfig.sequence_bias`, greedy or not. `min_new_tokens` and `begin_suppress_tokens`
become `SamplingConfig.ban_before_new` (the file's eos ids banned at the first min_new_tokens new
tokens; the suppressed ids at the first), `min_length` `ban_before_length` (the eos ids).

Settings that make transformers sample another law than those give (beams, forced tokens,
guidance, an exponential length penalty, ...) are refused by name: spsjax would
sample a different law and say nothing. `ignore` names those the caller drops knowingly. Settings
that do not change the law (eos and pad ids, maximum lengths, caching, output options) are not
read here (the eos ids: `data.hf_tokenizer`; the minimum lengths read them from the file).
"""

import json
from collections.abc import Iterable
from typing import Any

from spsjax import storage
from spsjax.sampling.processors import SamplingConfig

FILE = 'generation_config.json'

# transformers' `GenerationConfig._get_default_generation_params` for the settings read here.
_DEFAULTS = dict(do_sample=False, temperature=1.0, top_k=50, top_p=1.0, min_p=None,
                 repetition_penalty=1.0, typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0,
                 no_repeat_ngram_size=0)

# Settings that change what transformers samples, with the values at which they do nothing
# (None: unset does nothing too). Each is a processor of `GenerationMixin._get_logits_processor`
# or another decoding method.
_NO_EFFECT: dict[str, tuple[Any, ...]] = {
    'top_h': (),
    'guidance_scale': (1.0,), 'forced_bos_token_id': (), 'forced_eos_token_id': (),
    'exponential_decay_length_penalty': (),
    'num_beams': (1,), 'num_beam_groups': (1,), 'diversity_penalty': (0.0,),
    'penalty_alpha': (), 'dola_layers': (), 'watermarking_config': (),
    'encoder_repetition_penalty': (1.0,), 'encoder_no_repeat_ngram_size': (0,),
}


def read(directory: str) -> dict:
  """The checkpoint's generation_config.json as a dict ({} if it has none)."""
  path = storage.path(directory) / FILE
  return json.loads(path.read_text(encoding='utf-8')) if path.is_file() else {}


def _changes_law(name: str, value) -> bool:
  return value is not None and value not in _NO_EFFECT[name] and value != [] and value != {}


def from_dict(settings: dict, ignore: Iterable[str] = ()) -> SamplingConfig:
  """`sampling_config` of a generation config's dict (module docstring)."""
  ignore = set(ignore)
  unknown = ignore - set(_NO_EFFECT)
  if unknown:
    raise ValueError(f'ignore names settings that spsjax refuses; {sorted(unknown)} are not '
                     f'among them: {sorted(_NO_EFFECT)}.')
  refused = sorted(name for name in _NO_EFFECT
                   if name not in ignore and _changes_law(name, settings.get(name)))
  if refused:
    raise ValueError(
        'generation_config.json sets ' + ', '.join(f'{n}={settings[n]!r}' for n in refused) +
        ': transformers would sample another law than spsjax can (repetition_penalty, '
        'temperature, top_k, top_p, min_p, typical_p, epsilon_cutoff, eta_cutoff, '
        'no_repeat_ngram_size, sequence biases, banned or suppressed tokens and minimum '
        'lengths only). Pass the sampling settings yourself, or '
        'ignore=(...) to drop these.')
  value = lambda name: _DEFAULTS[name] if settings.get(name) is None else settings[name]
  penalty = float(value('repetition_penalty'))
  ngram = int(value('no_repeat_ngram_size'))
  bias = _sequence_bias(settings)
  bans = _bans_by_position(settings)
  if not value('do_sample'):
    return SamplingConfig(temperature=0.0, repetition_penalty=penalty,
                          no_repeat_ngram_size=ngram, sequence_bias=bias, **bans)
  if not value('temperature') > 0:
    raise ValueError(f'generation_config.json samples (do_sample) at temperature '
                     f'{value("temperature")!r}; transformers needs it > 0.')
  cutoff = lambda name: float(value(name)) if 0.0 < float(value(name)) < 1.0 else 0.0
  return SamplingConfig(temperature=float(value('temperature')), top_k=int(value('top_k')),
                        top_p=float(value('top_p')), min_p=float(value('min_p') or 0.0),
                        repetition_penalty=penalty, no_repeat_ngram_size=ngram,
                        sequence_bias=bias,
                        typical_p=min(float(value('typical_p')), 1.0),
                        epsilon_cutoff=cutoff('epsilon_cutoff'), eta_cutoff=cutoff('eta_cutoff'),
                        **bans)


def _eos(settings: dict) -> list[int]:
  eos = settings.get('eos_token_id')
  return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def _bans_by_position(settings: dict) -> dict:
  """`min_new_tokens`, `begin_suppress_tokens` and `min_length` as `SamplingConfig`'s
  ban_before_new and ban_before_length (transformers adds the first and last only with eos ids,
  and only above 0)."""
  new, length = [], []
  minimum = lambda name: int(settings.get(name) or 0)
  if minimum('min_new_tokens') > 0 or minimum('min_length') > 0:
    eos = _eos(settings)
    if not eos:
      raise ValueError('generation_config.json sets min_new_tokens or min_length but no '
                       'eos_token_id: which tokens to ban is in the model\'s config; pass the '
                       'sampling settings yourself.')
    if minimum('min_new_tokens') > 0:
      new.append((tuple(eos), minimum('min_new_tokens')))
    if minimum('min_length') > 0:
      length.append((tuple(eos), minimum('min_length')))
  if settings.get('begin_suppress_tokens'):
    new.append((tuple(settings['begin_suppress_tokens']), 1))
  return dict(ban_before_new=tuple(new), ban_before_length=tuple(length))


def _sequence_bias(settings: dict) -> tuple:
  """`sequence_bias`, `bad_words_ids` and `suppress_tokens` as (token ids, bias) pairs, in
  transformers' order of processors (the biases add; the bans are -inf)."""
  bias = settings.get('sequence_bias') or []
  if isinstance(bias, dict):
    raise ValueError('generation_config.json gives sequence_bias as a dict; spsjax reads the '
                     'list form, [[token ids], bias] pairs.')
  eos = _eos(settings)
  bad_words = [w for w in settings.get('bad_words_ids') or [] if list(w) not in [[e] for e in eos]]
  suppressed = [[t] for t in settings.get('suppress_tokens') or []]
  return tuple((tuple(tokens), float(b)) for tokens, b in bias) + tuple(
      (tuple(tokens), float('-inf')) for tokens in bad_words + suppressed)


def sampling_config(directory: str, ignore: Iterable[str] = ()) -> SamplingConfig:
  """The SamplingConfig of the Hugging Face checkpoint in `directory` (module docstring)."""
  try:
    return from_dict(read(directory), ignore)
  except ValueError as e:
    raise ValueError(f'{directory}: {e}') from None
