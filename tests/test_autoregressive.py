"""ArS: its output law is the model's (against enumeration, with top-k, top-p and eos); greedy
equals an argmax rollout of the reference forward; one compilation; clear errors."""


import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spsjax import models, sharding
from spsjax.sampling import (PAD_ID, SamplingConfig, autoregressive, autoregressive_sample,
                             drafters, speculative_sample)
from tests.stats import (exact_sequence_law, g_test_pvalue, scaled_model, sequence_counts,
                         truncated_at_eos)

GREEDY = SamplingConfig(temperature=0.0)
# Every G-test here fails a correct sampler with probability 1e-5 (its p-value threshold), so the
# file's law tests together with probability < 1e-4.
P_MIN = 1e-5


@pytest.fixture(scope='module')
def model():
  config = models.TransformerConfig(vocab_size=40, d_model=32, num_layers=2, num_heads=4,
                                    num_kv_heads=2, d_ff=64, max_seq_len=48)
  return models.Model(config, models.init_params(config, jax.random.key(0)))


def argmax_rollout(model, prompt, max_new_tokens, eos_id=None):
  """Greedy decoding with the uncached reference forward only; stops after `eos_id` (one id or
  a tuple of them)."""
  eos_ids = eos_id if isinstance(eos_id, tuple) else (eos_id,)
  logits = jax.jit(models.logits, static_argnums=0)
  seq = list(prompt)
  out = []
  for _ in range(max_new_tokens):
    token = int(jnp.argmax(logits(model.config, model.params, jnp.asarray([seq]))[0, -1]))
    out.append(token)
    seq.append(token)
    if token in eos_ids:
      break
  return out


def ragged_prompts(rng, batch, width, vocab):
  lengths = np.asarray(jax.random.randint(rng, (batch,), 1, width + 1), np.int32)
  prompts = np.array(jax.random.randint(jax.random.fold_in(rng, 1), (batch, width), 0, vocab),
                       np.int32)
  prompts[np.arange(width)[None, :] >= lengths[:, None]] = 7  # Padding holds junk ids.
  return prompts, lengths


def test_greedy_equals_argmax_rollout_with_eos(model):
  prompts, lengths = ragged_prompts(jax.random.key(1), 5, 6, 40)
  rollouts = [argmax_rollout(model, prompts[b, :lengths[b]], 10) for b in range(5)]
  # An eos that some rows reach mid-way: the third token of row 0.
  eos_id = rollouts[0][2]
  out = autoregressive_sample(model, prompts, lengths, jax.random.key(0), max_new_tokens=10,
                              sampling=GREEDY, eos_id=eos_id)
  stopped = 0
  for b in range(5):
    expected = argmax_rollout(model, prompts[b, :lengths[b]], 10, eos_id=eos_id)
    stopped += len(expected) < 10
    n = int(out.num_generated[b])
    assert n == len(expected)
    np.testing.assert_array_equal(out.tokens[b, :n], expected)
    assert (np.asarray(out.tokens[b, n:]) == PAD_ID).all()
  assert stopped >= 1


# --- Output law at temperature > 0, against enumeration -----------------------------------------

V_SMALL, NEW, ROWS = 7, 3, 120_000
# Rows alternate between two prompts of different lengths, the shorter padded with a junk id.
PROMPTS, JUNK = ((1, 4, 2), (3, 5)), 6


@pytest.fixture(scope='module')
def tiny():
  return scaled_model(models.TransformerConfig(
      vocab_size=V_SMALL, d_model=16, num_layers=2, num_heads=2, d_ff=32, max_seq_len=16,
      tie_embeddings=False), 0, 1.5)


def _alternating_prompts(rows):
  prompts = np.full((rows, max(map(len, PROMPTS))), JUNK, np.int32)
  lengths = np.zeros((rows,), np.int32)
  for i, prompt in enumerate(PROMPTS):
    prompts[i::2, :len(prompt)] = prompt
    lengths[i::2] = len(prompt)
  return prompts, lengths


LAW_SETTINGS = {
    'temperature_1': SamplingConfig(),
    'temperature_0.7_top_k_3': SamplingConfig(temperature=0.7, top_k=3),
    'top_p_0.8_repetition_penalty_1.8': SamplingConfig(top_p=0.8, repetition_penalty=1.8),
    'temperature_1.3_top_k_5_top_p_0.9': SamplingConfig(temperature=1.3, top_k=5, top_p=0.9),
    'temperature_0.8_no_repeat_ngram_2': SamplingConfig(temperature=0.8, no_repeat_ngram_size=2),
    'sequence_bias': SamplingConfig(sequence_bias=(((3,), 1.0), ((4, 2), -np.inf), ((2, 5), 2.0))),
    # 4 banned while a row holds < 5 tokens: the first 2 new ones after (1, 4, 2), 3 after (3, 5).
    'bans_by_position': SamplingConfig(ban_before_new=(((6,), 2), ((1,), 1)),
                                       ban_before_length=(((4,), 5),)),
}


@pytest.mark.parametrize('setting, path', [(name, 'native') for name in LAW_SETTINGS] +
                         [('temperature_1.3_top_k_5_top_p_0.9', 'xla')])
def test_output_law_is_the_models_law(tiny, setting, path):
  """120k rows, 3 tokens each, against the exact law of each prompt's 343 sequences. Power: 60k
  rows per prompt detect at 80% any law within total variation 0.015-0.025 of the model's, by
  setting and prompt (`stats.detectable_tv`; at temperature 1 outcomes rarer than 5 expected
  draws, <= 0.3% of the mass, are pooled).

  `native`: no mesh, so the native sampling kernel draws where it is built; `xla`: a one-device
  mesh, so XLA's ops draw (the sampler picks the path by the mesh).
  """
  sampling = LAW_SETTINGS[setting]
  mesh = sharding.make_mesh(1, 1, jax.devices()[:1]) if path == 'xla' else None
  prompts, lengths = _alternating_prompts(ROWS)
  out = autoregressive_sample(tiny, prompts, lengths, jax.random.key(7), max_new_tokens=NEW,
                              sampling=sampling, mesh=mesh)
  tokens = np.asarray(out.tokens)
  assert (np.asarray(out.num_generated) == NEW).all()
  laws = [exact_sequence_law(tiny, prompt, NEW, sampling) for prompt in PROMPTS]
  # Non-vacuous: rows given the other prompt's law, or a lost top-k / top-p, would show.
  assert 0.5 * np.abs(laws[0] - laws[1]).sum() > 0.2
  assert ((laws[0] == 0).mean() > 0.3) == (setting not in (
      'temperature_1', 'temperature_0.8_no_repeat_ngram_2', 'sequence_bias'))
  if sampling.penalised or sampling.reads_context:  # Each prefix's tokens change the law.
    plain = exact_sequence_law(tiny, PROMPTS[0], NEW,
                               sampling.without_penalty().without_context())
    assert 0.5 * np.abs(laws[0] - plain).sum() > 0.1
  for i, (prompt, law) in enumerate(zip(PROMPTS, laws)):
    pvalue = g_test_pvalue(sequence_counts(tokens[i::2], V_SMALL), law)
    assert pvalue > P_MIN, f'{setting}, {path}, prompt {prompt}: G-test p-value {pvalue:.2e}'


def test_eos_at_temperature_above_0(tiny):
  """Rows stop at eos, keep it and hold PAD after it; the law is the model's law cut at eos.
  Power: detects at 80% any law within total variation 0.018 / 0.021 (per prompt) of it."""
  sampling = SamplingConfig(temperature=0.9, top_p=0.95)
  laws = [exact_sequence_law(tiny, p, NEW, sampling) for p in PROMPTS]
  eos_id = 1
  other = [t for t in range(V_SMALL) if t != eos_id]
  for law in laws:  # Non-vacuous: a fair share of the rows of each prompt stop early, not all.
    assert 0.2 < 1 - law[np.ix_(other, other, other)].sum() < 0.8
  prompts, lengths = _alternating_prompts(ROWS)
  out = autoregressive_sample(tiny, prompts, lengths, jax.random.key(8), max_new_tokens=NEW,
                              sampling=sampling, eos_id=eos_id)
  tokens, n = np.asarray(out.tokens), np.asarray(out.num_generated)
  positions = np.arange(NEW)[None, :]
  np.testing.assert_array_equal(tokens == PAD_ID, positions >= n[:, None])
  first_eos = np.where((tokens == eos_id).any(1), np.argmax(tokens == eos_id, axis=1), NEW)
  np.testing.assert_array_equal(n, np.minimum(first_eos + 1, NEW))
  assert 0 < (n < NEW).mean() < 1
  for i, (prompt, law) in enumerate(zip(PROMPTS, laws)):
    pvalue = g_test_pvalue(sequence_counts(tokens[i::2], V_SMALL, pad=True),
                           truncated_at_eos(law, eos_id))
    assert pvalue > P_MIN, f'prompt {prompt}: G-test p-value {pvalue:.2e}'


def test_compiler_options_reach_the_program(model):
  """XLA's options go to the program's compile: an unknown one fails it, a known one runs."""
  prompts, lengths = np.ones((2, 3), np.int32), np.array([3, 2], np.int32)
  sample = lambda options: autoregressive_sample(model, prompts, lengths, jax.random.key(0),
                                                 max_new_tokens=2, compiler_options=options)
  with pytest.raises(jax.errors.JaxRuntimeError, match="No such compile option: 'xla_no_such'"):
    sample({'xla_no_such': 1})
  assert np.asarray(sample({'xla_cpu_enable_fast_math': False}).num_generated).tolist() == [2, 2]


def test_rows_are_independent(model):
  prompts = np.tile(np.arange(1, 5, dtype=np.int32), (6, 1))
  lengths = np.full((6,), 4, np.int32)
  out = autoregressive_sample(model, prompts, lengths, jax.random.key(3), max_new_tokens=8)
  rows = {tuple(np.asarray(r).tolist()) for r in out.tokens}
  assert len(rows) > 1  # Identical prompts, independent draws.
  # A row's draws depend on its key only: changing another row's prompt leaves it unchanged.
  prompts2 = prompts.copy()
  prompts2[1:] = 9
  out2 = autoregressive_sample(model, prompts2, lengths, jax.random.key(3), max_new_tokens=8)
  np.testing.assert_array_equal(out.tokens[0], out2.tokens[0])


def test_one_compilation_per_bucket(model):
  """New prompts, lengths and keys of one shape, and a new (equal) `Loop` per call: one trace."""
  sampling = SamplingConfig(temperature=0.8, top_p=0.9)
  program = jax.jit(chex.assert_max_traces(autoregressive.Loop.run.__wrapped__, n=1),
                    static_argnames=('self',))
  for seed in range(4):
    prompts, lengths = ragged_prompts(jax.random.key(seed + 10), 4, 5, 40)
    loop, args = autoregressive.prepare(model, prompts, lengths, max_new_tokens=6,
                                        sampling=sampling)
    out = program(loop, *args, jax.random.key(seed))
    expected = autoregressive_sample(model, prompts, lengths, jax.random.key(seed),
                                     max_new_tokens=6, sampling=sampling)
    np.testing.assert_array_equal(out.tokens, expected.tokens)


def test_greedy_stops_at_any_of_several_eos_ids(model):
  """An instruct model's end of turn beside its end of text: ArS and SpS (prompt lookup) stop a
  row after whichever of the ids comes first, and keep it."""
  prompts, lengths = ragged_prompts(jax.random.key(1), 5, 6, 40)
  rollouts = [argmax_rollout(model, prompts[b, :lengths[b]], 10) for b in range(5)]
  first = rollouts[0][2]
  second = next(t for t in rollouts[1][1:] if t != first and t not in rollouts[0][:3])
  eos_ids = (first, second)
  expected = [argmax_rollout(model, prompts[b, :lengths[b]], 10, eos_id=eos_ids)
              for b in range(5)]
  assert expected[0][-1] == first and expected[1][-1] == second  # Each id stops a row.
  args = (prompts, lengths, jax.random.key(0))
  kw = dict(max_new_tokens=10, sampling=GREEDY, eos_id=list(eos_ids))
  for out in (autoregressive_sample(model, *args, **kw),
              speculative_sample(model, None, *args, k=2, drafter=drafters.PromptLookup(), **kw)):
    for b in range(5):
      n = int(out.num_generated[b])
      np.testing.assert_array_equal(out.tokens[b, :n], expected[b])
      assert (np.asarray(out.tokens[b, n:]) == PAD_ID).all()


@pytest.mark.parametrize('change, match', [
    (dict(lengths=[0, 3]), 'prompt length'),
    (dict(lengths=[3, 6]), 'prompt length'),
    (dict(max_new_tokens=45), 'max_seq_len'),
    (dict(max_new_tokens=0), 'max_new_tokens'),
    (dict(prompts=[[1, 2, 40, 0, 0], [1, 2, 3, 4, 5]]), 'vocab'),
    (dict(prompts=[[1, -2, 3, 0, 0], [1, 2, 3, 4, 5]]), 'vocab'),
    (dict(eos_id=40), 'eos_id'),
    (dict(eos_id=(3, 40)), 'eos_id'),
    (dict(eos_id=(3, 'x')), 'eos_id'),
    (dict(eos_id=True), 'eos_id'),
])
def test_bad_input_raises(model, change, match):
  args = dict(prompts=[[1, 2, 3, 0, 0], [1, 2, 3, 4, 5]], lengths=[3, 5], max_new_tokens=4,
              eos_id=None)
  args.update(change)
  with pytest.raises(ValueError, match=match):
    autoregressive_sample(model, np.asarray(args['prompts'], np.int32),
                          np.asarray(args['lengths'], np.int32), jax.random.key(0),
                          max_new_tokens=args['max_new_tokens'], eos_id=args['eos_id'])


def test_batch_not_divisible_by_data_axis(model):
  from spsjax import sharding  # pylint: disable=g-import-not-at-top
  mesh = sharding.make_mesh(data=2, model=1, devices=jax.devices()[:2])
  with pytest.raises(ValueError, match='data axis'):
    autoregressive_sample(model, np.ones((3, 2), np.int32), np.full((3,), 2, np.int32),
                          jax.random.key(0), max_new_tokens=2, mesh=mesh)
