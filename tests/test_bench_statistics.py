"""The statistics of Table 1 are unbiased: alpha from the model over real rows only (not the padding
of a last partial call), ArS and SpS on independent keys, and tokens per loop compared with the
formula before the output limit cuts a loop."""

import jax
import numpy as np
import pytest

from spsjax import models, sampling
from spsjax.bench import speedup, sweep, theory, timing
from spsjax.eval import tasks
from tests import data_helpers


@pytest.fixture(scope='module', name='family')
def fixture_family():
  tok = data_helpers.small_tokenizer()
  make = lambda seed, layers: (lambda c: models.Model(c, models.init_params(
      c, jax.random.key(seed))))(models.TransformerConfig(
          vocab_size=tok.vocab_size, max_seq_len=64, d_model=32, num_layers=layers, num_heads=2,
          d_ff=64))
  return make(0, 2), make(1, 1), tok


_TASK = tasks.Task('docstrings', ('def add(a, b):\n    """', 'def f():\n    """', 'x = 1\n'),
                     ('Add two numbers.', 'Do f.', 'Set x.'), max_new_tokens=5)


def test_model_alpha_counts_each_prompt_once_and_methods_get_their_own_keys(family, monkeypatch):
  target, draft, tok = family
  seen_rows, keys = [], {'ArS': [], 'SpS': []}
  pair_statistics = speedup.pair_statistics

  def recording_alpha(t, d, cfg, prompts_BxP, lengths_B, out, mesh=None, **kw):
    seen_rows.append([tuple(p[:n]) for p, n in zip(np.asarray(prompts_BxP), lengths_B)])
    return pair_statistics(t, d, cfg, prompts_BxP, lengths_B, out, mesh, **kw)

  def recording(method, fn):
    def run(*args, **kwargs):
      keys[method].append(np.asarray(jax.random.key_data(args[-1])).tolist())
      return fn(*args, **kwargs)
    return run

  monkeypatch.setattr(speedup, 'pair_statistics', recording_alpha)
  monkeypatch.setattr(sampling, 'autoregressive_sample',
                      recording('ArS', sampling.autoregressive_sample))
  monkeypatch.setattr(sampling, 'speculative_sample',
                      recording('SpS', sampling.speculative_sample))
  cfg = sampling.SamplingConfig(temperature=1.0)
  _, sps = speedup.run_rows(target, draft, tok, _TASK, 'nucleus', cfg, batch=2, k=2, seed=0)
  # 3 prompts in calls of 2: the second call pads with a copy of the third, which alpha skips.
  assert [len(rows) for rows in seen_rows] == [2, 1]
  assert len({row for rows in seen_rows for row in rows}) == 3
  assert 0 < sps.alpha_model < 1
  # The same calls (compile runs included), never the same key for ArS and SpS.
  assert len(keys['ArS']) == len(keys['SpS']) >= 2
  assert not {str(k) for k in keys['ArS']} & {str(k) for k in keys['SpS']}


def test_tokens_per_loop_before_the_cut_is_what_alpha_predicts():
  # Two rows, 4 loops with 7 accepted drafts (k = 3): the loops made 7 + 4 = 11 tokens, of which
  # max_new_tokens let 8 out (10 tokens in all with each row's prefill token).
  call = timing.Call(seconds=1.0, rows=2, tokens=10, loops=4, accepted=7, full_loops=1)
  t = timing.Timing(calls=(call,), compile_seconds=(0.0,), k=3)
  assert t.tokens_per_loop == pytest.approx(8 / 4)  # Emitted, after the cut.
  assert t.uncut_tokens_per_loop == pytest.approx(11 / 4)
  assert t.summary()['uncut_tokens_per_loop'] == t.uncut_tokens_per_loop
  # Without a cut the two agree, and at alpha = 1 both are the formula's k + 1.
  whole = timing.Timing(calls=(timing.Call(1.0, 1, 1 + 8, loops=2, accepted=6, full_loops=2),),
                        compile_seconds=(0.0,), k=3)
  assert whole.tokens_per_loop == whole.uncut_tokens_per_loop == 4.0
  assert theory.expected_tokens_per_loop(theory.alpha_from_counts(6, 2, 2), 3) == 4.0


def test_sweep_points_time_ars_in_turn_with_sps(family, monkeypatch):
  """Each sweep point's ArS time comes from calls that alternate with its SpS calls."""
  target, draft, _ = family
  order = []

  def recording(method, fn):
    def run(*args, **kwargs):
      order.append(method)
      return fn(*args, **kwargs)
    return run

  monkeypatch.setattr(sampling, 'autoregressive_sample',
                      recording('ArS', sampling.autoregressive_sample))
  monkeypatch.setattr(sampling, 'speculative_sample',
                      recording('SpS', sampling.speculative_sample))
  prompts, lengths = np.array([[5, 6, 7], [8, 9, 10], [4, 3, 2]], np.int32), np.full(3, 3, np.int32)
  point = sweep.run_point('2', target, draft, 'd', prompts, lengths, k=2,
                          sampling_config=sampling.SamplingConfig(temperature=0.8),
                          max_new_tokens=6, seed=0)
  assert order == ['ArS', 'SpS'] * 4  # A compile run of each, then one call of each per prompt.
  assert point.ars_seconds > 0 and point.speedup > 0
