"""Alpha along generated text (`spsjax.eval.acceptance`) against beta recomputed here in float64
numpy from each model's logits on the generated sequences."""

import jax
import numpy as np
import pytest

from spsjax import models, sampling
from spsjax.eval import acceptance, tasks
from tests import data_helpers, forwards

PROMPTS = ('def add(a, b):\n    """', 'def f():\n    return', 'x = 1\n', 'import os\n',
           'class A:\n    def')


@pytest.fixture(scope='module', name='family')
def fixture_family():
  tok = data_helpers.small_tokenizer()
  make = lambda seed, layers: (lambda c: models.Model(c, models.init_params(
      c, jax.random.key(seed))))(models.TransformerConfig(
          vocab_size=tok.vocab_size, max_seq_len=48, d_model=32, num_layers=layers, num_heads=2,
          d_ff=64))
  return make(0, 2), make(1, 1), tok


def _task(max_new_tokens=6):
  return tasks.Task('docstrings', PROMPTS, ('',) * len(PROMPTS), max_new_tokens)


def _expected(target, draft, samples, laws):
  """Mean over generated positions of sum_x min(p, q), both laws from float64 `laws(logits)`."""
  betas = []
  for prompts_BxP, lengths_B, out in samples.calls:
    tokens_BxN, num_generated_B = np.asarray(out.tokens), np.asarray(out.num_generated)
    for b in range(prompts_BxP.shape[0]):
      L, n = int(lengths_B[b]), int(num_generated_B[b])
      seq = np.concatenate([prompts_BxP[b, :L], tokens_BxN[b, :n]])
      p, q = (laws(forwards.logits(m, seq)) for m in (target, draft))
      betas += list(np.minimum(p, q).sum(-1)[L - 1:L - 1 + n])
  return float(np.mean(betas)), len(betas)


def _softmax(temperature):
  def laws(logits):
    z = np.asarray(logits, np.float64) / temperature
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)
  return laws


def test_alpha_is_beta_over_every_generated_position_of_every_prompt_once(family):
  target, draft, tok = family
  cfg = sampling.SamplingConfig(temperature=0.7)
  samples = acceptance.sample_task(target, tok, _task(), cfg, batch=2, seed=3)
  # 5 prompts in calls of 2: three calls, the last one's padding row dropped.
  assert [c[0].shape[0] for c in samples.calls] == [2, 2, 1]
  alpha, count = acceptance.samples_alpha(target, draft, samples)
  want, positions = _expected(target, draft, samples, _softmax(0.7))
  assert count == positions == sum(int(np.sum(c[2].num_generated)) for c in samples.calls)
  assert alpha == pytest.approx(want, abs=1e-5) and 0.0 < alpha < 1.0
  assert acceptance.samples_alpha(target, target, samples)[0] == pytest.approx(1.0, abs=1e-5)


def test_greedy_alpha_is_how_often_the_draft_picks_the_target_s_token(family):
  target, draft, tok = family
  samples = acceptance.sample_task(target, tok, _task(8), sampling.SamplingConfig(temperature=0.0),
                                   batch=4)
  alpha, count = acceptance.samples_alpha(target, draft, samples)
  agree = []
  for prompts_BxP, lengths_B, out in samples.calls:
    tokens_BxN, num_generated_B = np.asarray(out.tokens), np.asarray(out.num_generated)
    for b in range(prompts_BxP.shape[0]):
      L, n = int(lengths_B[b]), int(num_generated_B[b])
      generated = tokens_BxN[b, :n]
      picks = np.argmax(forwards.logits(draft, np.concatenate([prompts_BxP[b, :L], generated])),
                        -1)
      agree += list(picks[L - 1:L - 1 + n] == generated)
  assert count == len(agree) and alpha == pytest.approx(np.mean(agree), abs=1e-6)


def test_model_alpha_is_one_for_the_target_itself_along_sps_outputs(family):
  target, draft, _ = family
  prompts, lengths = np.array([[5, 6, 7, 0], [8, 9, 0, 0]], np.int32), np.array([3, 2], np.int32)
  cfg = sampling.SamplingConfig(temperature=0.8, top_p=0.95)
  out = sampling.speculative_sample(target, draft, prompts, lengths, jax.random.key(0), k=2,
                                    max_new_tokens=5, sampling=cfg)
  total, count = acceptance.model_alpha(target, target, cfg, prompts, lengths, out)
  assert count == int(np.sum(out.num_generated)) and total / count == pytest.approx(1.0, abs=1e-5)
  total, count = acceptance.model_alpha(target, draft, cfg, prompts, lengths, out)
  assert 0.0 < total / count < 1.0


def test_prompts_are_cut_to_the_room_of_the_smallest_model(family):
  target, _, tok = family
  long_task = tasks.Task('docstrings', ('x = 1\n' * 40,), ('',), max_new_tokens=6)
  samples = acceptance.sample_task(target, tok, long_task, sampling.SamplingConfig(), batch=1,
                                   max_seq_lens=[('draft', 32)], headroom=3)
  assert int(samples.calls[0][1][0]) == 32 - 6 - 3


def test_lenient_alpha_and_total_variation(family):
  """l = 0.5: beta = sum min(q, p / l) and the total variation of the lenient draft slot's law
  from p, both recomputed here in float64 along the same outputs."""
  target, draft, tok = family
  cfg = sampling.SamplingConfig(temperature=0.9)
  samples = acceptance.sample_task(target, tok, _task(), cfg, batch=5, seed=1)
  prompts_BxP, lengths_B, out = samples.calls[0]
  beta, count = acceptance.model_alpha(target, draft, cfg, prompts_BxP, lengths_B, out,
                                       lenience=0.5)
  tv, tv_count = acceptance.lenient_tv(target, draft, cfg, 0.5, prompts_BxP, lengths_B, out)
  want_beta, want_tv = [], []
  laws = _softmax(0.9)
  tokens_BxN, num_generated_B = np.asarray(out.tokens), np.asarray(out.num_generated)
  for b in range(prompts_BxP.shape[0]):
    L, n = int(lengths_B[b]), int(num_generated_B[b])
    seq = np.concatenate([prompts_BxP[b, :L], tokens_BxN[b, :n]])
    p, q = (laws(forwards.logits(m, seq))[L - 1:L - 1 + n] for m in (target, draft))
    accepted = np.minimum(q, p / 0.5)
    residual = np.maximum(p - q, 0)
    law = accepted + (1 - accepted.sum(-1, keepdims=True)) * residual / residual.sum(
        -1, keepdims=True)
    want_beta += list(accepted.sum(-1))
    want_tv += list(0.5 * np.abs(law - p).sum(-1))
  assert count == tv_count == len(want_beta)
  assert beta / count == pytest.approx(np.mean(want_beta), abs=1e-5)
  assert tv / count == pytest.approx(np.mean(want_tv), abs=1e-5) and tv > 0
  exact, _ = acceptance.model_alpha(target, draft, cfg, prompts_BxP, lengths_B, out)
  assert exact < beta


def test_alpha_with_bans_by_position(family):
  """Half the vocabulary banned at each row's first 3 new tokens, a quarter while a row holds
  fewer than 12 tokens (prompts of different lengths): beta from both models' laws with those
  bans at each generated position's own count, recomputed here."""
  target, draft, tok = family
  V = tok.vocab_size
  half, quarter = tuple(range(0, V, 2)), tuple(range(1, V, 4))
  cfg = sampling.SamplingConfig(temperature=0.7, ban_before_new=((half, 3),),
                                ban_before_length=((quarter, 12),))
  samples = acceptance.sample_task(target, tok, _task(), cfg, batch=5, seed=2)
  alpha, count = acceptance.samples_alpha(target, draft, samples)
  betas, off_by_one = [], []
  prompts_BxP, lengths_B, out = samples.calls[0]
  tokens_BxN, num_generated_B = np.asarray(out.tokens), np.asarray(out.num_generated)
  assert len(set(lengths_B.tolist())) > 1
  for b in range(prompts_BxP.shape[0]):
    L, n = int(lengths_B[b]), int(num_generated_B[b])
    generated = tokens_BxN[b, :n]
    assert not set(generated[:3].tolist()) & set(half)
    assert not set(generated[:max(12 - L, 0)].tolist()) & set(quarter)
    seq = np.concatenate([prompts_BxP[b, :L], generated])
    p_logits, q_logits = (np.asarray(forwards.logits(m, seq), np.float64)[L - 1:L - 1 + n]
                          for m in (target, draft))
    def beta(g, at):
      banned = list(half) * (at < 3) + list(quarter) * (L + at < 12)
      p, q = (_softmax(0.7)(np.where(np.isin(np.arange(V), banned), -np.inf, x[g]))
              for x in (p_logits, q_logits))
      return np.minimum(p, q).sum()
    betas += [beta(g, g) for g in range(n)]
    off_by_one += [beta(g, g + 1) for g in range(n)]  # Bans counted one token late.
  assert count == len(betas) and alpha == pytest.approx(np.mean(betas), abs=1e-5)
  assert abs(np.mean(betas) - np.mean(off_by_one)) > 1e-3  # Well beyond the tolerance.
