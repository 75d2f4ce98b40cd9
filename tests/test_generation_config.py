"""A checkpoint's generation_config.json becomes the SamplingConfig transformers would sample with.

The defaults and the refused settings were read from transformers 5.25.0
(`GenerationConfig._get_default_generation_params`, `GenerationMixin._get_logits_processor`)."""

import json
import re

import numpy as np
import pytest

from spsjax.sampling import SamplingConfig, generation_config


def _write(tmp_path, settings):
  (tmp_path / generation_config.FILE).write_text(json.dumps(settings))
  return str(tmp_path)


@pytest.mark.parametrize('settings, want', [
    ({}, SamplingConfig(temperature=0.0)),
    # Llama 3 Instruct's file: transformers' top_k 50 applies (it sets none).
    ({'bos_token_id': 128000, 'do_sample': True, 'eos_token_id': [128001, 128009],
      'temperature': 0.6, 'top_p': 0.9}, SamplingConfig(temperature=0.6, top_k=50, top_p=0.9)),
    ({'do_sample': True}, SamplingConfig(temperature=1.0, top_k=50)),
    ({'do_sample': True, 'top_k': 0, 'min_p': 0.05}, SamplingConfig(top_k=0, min_p=0.05)),
    ({'do_sample': True, 'temperature': None, 'top_k': 20, 'top_p': 0.8},
     SamplingConfig(top_k=20, top_p=0.8)),
    # Sampling settings without do_sample: transformers decodes greedily (penalised).
    ({'temperature': 0.7, 'top_p': 0.8, 'repetition_penalty': 1.2},
     SamplingConfig(temperature=0.0, repetition_penalty=1.2)),
    # Qwen2.5 Instruct's file.
    ({'do_sample': True, 'temperature': 0.7, 'top_k': 20, 'top_p': 0.8,
      'repetition_penalty': 1.05},
     SamplingConfig(temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.05)),
    # Typical-p and the epsilon and eta cutoffs when sampling; a cutoff outside (0, 1) is off in
    # transformers (no warper), and greedy decoding applies none.
    ({'do_sample': True, 'top_k': 0, 'typical_p': 0.9, 'epsilon_cutoff': 3e-4,
      'eta_cutoff': 2e-3}, SamplingConfig(top_k=0, typical_p=0.9, epsilon_cutoff=3e-4,
                                          eta_cutoff=2e-3)),
    ({'do_sample': True, 'epsilon_cutoff': 1.0, 'eta_cutoff': 0.0, 'typical_p': 1.5},
     SamplingConfig(top_k=50)),
    ({'typical_p': 0.5, 'eta_cutoff': 0.1}, SamplingConfig(temperature=0.0)),
    # The n-gram ban applies greedy or not (a processor, not a warper), as the penalty does.
    ({'no_repeat_ngram_size': 3}, SamplingConfig(temperature=0.0, no_repeat_ngram_size=3)),
    ({'do_sample': True, 'top_k': 0, 'no_repeat_ngram_size': 2, 'repetition_penalty': 1.2},
     SamplingConfig(top_k=0, no_repeat_ngram_size=2, repetition_penalty=1.2)),
    # Biases, banned words (not the eos alone, as transformers) and suppressed tokens, greedy too.
    ({'sequence_bias': [[[5, 6], 1.5], [[7], -0.5]], 'bad_words_ids': [[9], [2], [3, 4]],
      'suppress_tokens': [11], 'eos_token_id': [2, 8]},
     SamplingConfig(temperature=0.0, sequence_bias=(
         ((5, 6), 1.5), ((7,), -0.5), ((9,), -np.inf), ((3, 4), -np.inf), ((11,), -np.inf)))),
    # Minimum lengths ban the eos ids; begin_suppress_tokens bans at the first new token.
    ({'do_sample': True, 'top_k': 0, 'min_new_tokens': 4, 'min_length': 9,
      'begin_suppress_tokens': [3, 5], 'eos_token_id': [2, 8]},
     SamplingConfig(top_k=0, ban_before_new=(((2, 8), 4), ((3, 5), 1)),
                    ban_before_length=(((2, 8), 9),))),
    ({'min_new_tokens': 2, 'eos_token_id': 7},
     SamplingConfig(temperature=0.0, ban_before_new=(((7,), 2),))),
    ({'min_new_tokens': 0, 'min_length': 0, 'begin_suppress_tokens': []},
     SamplingConfig(temperature=0.0)),
    # Settings at the values that do nothing, or that do not change the law.
    ({'do_sample': True, 'repetition_penalty': 1.0, 'num_beams': 1, 'bad_words_ids': None,
      'max_new_tokens': 512, 'pad_token_id': 0}, SamplingConfig(top_k=50)),
])
def test_the_law_transformers_samples(tmp_path, settings, want):
  assert generation_config.sampling_config(_write(tmp_path, settings)) == want


def test_no_file_is_transformers_defaults(tmp_path):
  assert generation_config.sampling_config(str(tmp_path)) == SamplingConfig(temperature=0.0)


@pytest.mark.parametrize('settings, named', [
    ({'do_sample': True, 'top_k': 20, 'top_h': 0.4}, 'top_h=0.4'),
    ({'do_sample': False, 'forced_eos_token_id': 3}, 'forced_eos_token_id=3'),
    ({'do_sample': True, 'typical_p': 0.9, 'guidance_scale': 2.0, 'num_beams': 2},
     'guidance_scale=2.0, num_beams=2'),
    ({'num_beams': 4}, 'num_beams=4'),
])
def test_settings_spsjax_cannot_sample_are_refused_by_name(tmp_path, settings, named):
  path = _write(tmp_path, settings)
  with pytest.raises(ValueError, match=re.escape(f'{path}: generation_config.json sets {named}:')):
    generation_config.sampling_config(path)


def test_ignore_drops_what_it_names_only(tmp_path):
  path = _write(tmp_path, {'do_sample': True, 'top_k': 20, 'typical_p': 0.9,
                           'num_beams': 4, 'forced_eos_token_id': 3})
  with pytest.raises(ValueError, match='num_beams=4'):
    generation_config.sampling_config(path, ignore=['forced_eos_token_id'])
  got = generation_config.sampling_config(path, ignore=['forced_eos_token_id', 'num_beams'])
  assert got == SamplingConfig(top_k=20, typical_p=0.9)
  with pytest.raises(ValueError, match=r"\['top_p', 'typical_p'\] are not"):
    generation_config.sampling_config(path, ignore=['top_p', 'typical_p'])


def test_minimum_lengths_need_the_eos_ids(tmp_path):
  for name in ('min_new_tokens', 'min_length'):
    with pytest.raises(ValueError, match='no eos_token_id'):
      generation_config.sampling_config(_write(tmp_path, {name: 3}))


def test_sampling_at_temperature_zero_is_refused(tmp_path):
  with pytest.raises(ValueError, match='temperature 0.0'):
    generation_config.sampling_config(_write(tmp_path, {'do_sample': True, 'temperature': 0.0}))
