"""k = 'auto' (`bench.auto_k`, issue 44): the policy's arithmetic, the acceptance estimate, the
calibration and its disk cache, and that a call is exactly the sampler call it chose."""

import dataclasses
import importlib.util
import os

import jax
import numpy as np
import pytest

from spsjax import models, sampling
from spsjax.bench import auto_k, theory
from spsjax.sampling import SampleOutput, SamplingConfig, drafters

COSTS = auto_k.LoopCosts(batch=1, k_max=4, ars_step=1.0, loop_1=1.2, loop_max=1.8)


def test_the_policy_picks_the_highest_predicted_rate():
  assert [round(COSTS.loop(k), 6) for k in range(1, 5)] == [1.2, 1.4, 1.6, 1.8]
  useless = auto_k.choose(COSTS, 0.0)
  assert useless.k == 0 and useless.predicted_speedup == 1.0  # A loop of one token costs more.
  for alpha in (0.3, 0.6, 0.9, 1.0):
    choice = auto_k.choose(COSTS, alpha)
    want = [1.0] + [theory.expected_tokens_per_loop(alpha, k) / COSTS.loop(k) for k in range(1, 5)]
    np.testing.assert_allclose(choice.rates, want)
    assert choice.k == int(np.argmax(want))
  assert auto_k.choose(COSTS, 1.0).k == 4  # 5 tokens for 1.8 steps.
  assert auto_k.choose(COSTS, 0.15).k == 0  # 1.15 tokens for 1.2 steps at k = 1: ArS.
  assert auto_k.choose(COSTS, 0.3).k == 1  # 1.3 for 1.2.
  with pytest.raises(ValueError, match='k must be in'):
    COSTS.loop(5)
  # A k = 1 loop timed below an ArS step (noise: it runs the target once, and drafts) costs a
  # step, so a useless draft still gets ArS.
  noisy = dataclasses.replace(COSTS, loop_1=0.9, loop_max=1.5)
  assert noisy.loop(1) == 1.0 and noisy.loop(2) == pytest.approx(1.1)
  assert auto_k.choose(noisy, 0.0).k == 0
  with pytest.raises(ValueError, match='positive times'):
    auto_k.LoopCosts(batch=1, k_max=2, ars_step=0.0, loop_1=1.0, loop_max=1.0)


def test_fixed_costs_price_whole_calls():
  """With the prefills in, a call's prediction is its whole time: a draft's prefill can outweigh
  what its loops save on a short call, and not on a long one."""
  calls = dict(ars_fixed=30.0, sps_fixed=40.0)
  short = dataclasses.replace(COSTS, new_tokens=24, **calls)
  alpha = 0.5  # At k = 1: 1.5 tokens per 1.2-step loop, 25% more tokens per second decoding.
  assert auto_k.choose(COSTS, alpha).k == 1
  assert short.call(0, alpha) == 30.0 + 24 * 1.0
  assert short.call(1, alpha) == pytest.approx(40.0 + 24 / 1.5 * 1.2)
  assert auto_k.choose(short, alpha).k == 0  # 54 s against 59.2 s.
  long = dataclasses.replace(short, new_tokens=512)
  choice = auto_k.choose(long, alpha)
  assert choice.k == 1 and choice.predicted_speedup == pytest.approx(
      long.call(0, alpha) / long.call(1, alpha))
  with pytest.raises(ValueError, match='fixed costs'):
    dataclasses.replace(COSTS, sps_fixed=-1.0)


def test_measure_splits_steps_loops_and_fixed_costs(monkeypatch):
  """`measure`'s arithmetic on made-up call times: a call of n tokens costs fixed + n steps
  (ArS) or fixed + loops per row x loop (SpS); the calibration recovers each part."""
  batch, n, k_max = 2, 48, 4
  ars = (0.3, 0.006)  # (fixed, per step)
  sps = {1: (0.35, 0.010, [30, 34]), k_max: (0.36, 0.016, [14, 16])}  # Loops per row at n.

  def out(loops):
    loops = np.array(loops)
    return SampleOutput(tokens=None, num_generated=None, num_loops=loops,
                        num_accepted=np.full(len(loops), n) - loops,
                        num_full_loops=np.zeros(len(loops), np.int32))

  def fake_calls(runs, repeats):
    del repeats
    assert set(runs) == {(k, m) for k in (0, 1, k_max) for m in (n, 1)}
    timed = {}
    for k, m in runs:
      if k == 0:
        timed[k, m] = (ars[0] + m * ars[1], SampleOutput(tokens=None, num_generated=None))
      else:
        fixed, loop, loops = sps[k]
        loops = loops if m == n else [1] * batch
        timed[k, m] = (fixed + np.mean(loops) * loop, out(loops))
    return timed

  monkeypatch.setattr(auto_k, '_fastest_calls', fake_calls)
  costs = auto_k.measure(None, None, np.zeros((batch, 3), np.int32), np.array([3, 2]),
                         k_max=k_max, max_new_tokens=n)
  assert (costs.batch, costs.k_max, costs.new_tokens) == (batch, k_max, n)
  np.testing.assert_allclose([costs.ars_fixed, costs.ars_step, costs.sps_fixed, costs.loop_1,
                              costs.loop_max], [0.3, 0.006, 0.35, 0.010, 0.016], atol=1e-12)
  assert costs.prior_loops == 30 and costs.alpha == pytest.approx(
      auto_k.alpha_for((2 * n - 30 + 30) / 30, k_max))
  with pytest.raises(ValueError, match='max_new_tokens >= 2'):
    auto_k.measure(None, None, np.zeros((1, 3), np.int32), np.array([3]), k_max=2,
                   max_new_tokens=1)


def test_acceptance_inverts_tokens_per_loop():
  for alpha, k in ((0.0, 3), (0.42, 1), (0.8, 4), (0.97, 8)):
    assert auto_k.alpha_for(theory.expected_tokens_per_loop(alpha, k), k) == pytest.approx(
        alpha, abs=1e-9)
  assert auto_k.alpha_for(0.5, 2) == pytest.approx(0.0, abs=1e-9)  # Clipped to [1, k + 1].
  out = lambda accepted, loops: SampleOutput(
      tokens=None, num_generated=None, num_loops=np.array(loops), num_accepted=np.array(accepted),
      num_full_loops=np.zeros(len(loops), np.int32))
  seen = auto_k.Acceptance().observe(out([3, 3], [2, 2]), 2)  # 10 tokens in 4 loops at k = 2.
  assert seen.loops == 4 and seen.alpha == pytest.approx(auto_k.alpha_for(2.5, 2))
  more = seen.observe(out([0], [4]), 4)  # 4 loops that accepted nothing: alpha 0.
  assert more.alpha == pytest.approx(seen.alpha / 2)
  ars = SampleOutput(tokens=None, num_generated=None)
  after_ars = more.observe(ars, 0)  # Counted as an ArS call, no evidence on alpha.
  assert (after_ars.alpha, after_ars.loops, after_ars.ars_calls) == (more.alpha, 8, 1)
  assert after_ars.observe(out([1], [1]), 1).ars_calls == 0 and auto_k.Acceptance().alpha == 0.0


def test_after_a_run_of_ars_calls_the_policy_probes_at_k_1():
  """ArS calls see no acceptances: every `probe_every` + 1-th call of an ArS run is an SpS call
  at k = 1, whose counts can bring speculation back."""
  policy = auto_k.Policy(dataclasses.replace(COSTS, alpha=0.1, prior_loops=20), probe_every=3)
  ars = SampleOutput(tokens=None, num_generated=None)
  for _ in range(3):
    assert policy.next().k == 0
    policy.observe(ars)
  probe = policy.next()
  assert (probe.k, probe.probe) == (1, True) and probe.predicted_speedup < 1.0
  # The text turned easy: 100 loops at k = 1 that accepted 95 drafts.
  policy.observe(SampleOutput(tokens=None, num_generated=None, num_loops=np.array([100]),
                              num_accepted=np.array([95]), num_full_loops=np.array([95])))
  assert policy.acceptance.alpha == pytest.approx((0.1 * 20 + 0.95 * 100) / 120)
  back = policy.next()
  assert back.k > 0 and not back.probe
  summary = policy.summary()
  assert summary['ks'] == [0, 0, 0, 1] and summary['probes'] == 1
  never = auto_k.Acceptance(0.0, 10, ars_calls=1000)
  assert auto_k.decide(COSTS, never, probe_every=0).k == 0
  assert auto_k.decide(COSTS, never).k == 1 and auto_k.decide(COSTS, never, 1001).k == 0


@pytest.fixture(scope='module')
def pair():
  config = models.TransformerConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4,
                                    num_kv_heads=2, d_ff=64, max_seq_len=128)
  target = models.Model(config, models.init_params(config, jax.random.key(0)))
  draft_config = dataclasses.replace(config, num_layers=1)
  draft = models.Model(draft_config, models.init_params(draft_config, jax.random.key(1)))
  prompts = np.array([[5, 9, 3, 7], [1, 2, 0, 0]], np.int32)
  return target, draft, prompts, np.array([4, 2], np.int32)


def test_calibration_is_measured_once_and_cached(pair, tmp_path, monkeypatch):
  target, draft, prompts, lengths = pair
  greedy = SamplingConfig(temperature=0.0)
  kw = dict(k_max=3, sampling_config=greedy, max_new_tokens=12, directory=str(tmp_path))
  # The target drafting for itself at greedy: every draft accepted, alpha 1.
  costs, path = auto_k.calibrated(target, target, prompts, lengths, **kw)
  assert costs.batch == 2 and costs.k_max == 3 and costs.alpha == pytest.approx(1.0, abs=1e-6)
  assert costs.prior_loops > 0 and min(costs.ars_step, costs.loop_1, costs.loop_max) > 0
  assert costs.new_tokens == 12 and min(costs.ars_fixed, costs.sps_fixed) >= 0
  assert auto_k.prior(costs).alpha == pytest.approx(1.0, abs=1e-6)

  def no_measuring(*args, **kwargs):
    raise AssertionError('measured again')

  monkeypatch.setattr(auto_k, 'measure', no_measuring)
  again, again_path = auto_k.calibrated(target, target, prompts, lengths, **kw)
  assert again == costs and again_path == path
  with pytest.raises(AssertionError, match='measured again'):  # Asked for.
    auto_k.calibrated(target, target, prompts, lengths, recalibrate=True, **kw)
  with pytest.raises(AssertionError, match='measured again'):  # Another draft shape.
    auto_k.calibrated(target, draft, prompts, lengths, **kw)
  reweighted = models.Model(target.config, jax.tree.map(lambda x: x * 0.5, target.params))
  with pytest.raises(AssertionError, match='measured again'):  # Its weights: another prior.
    auto_k.calibrated(target, reweighted, prompts, lengths, **kw)
  with pytest.raises(AssertionError, match='measured again'):  # Another sampling setting.
    auto_k.calibrated(target, target, prompts, lengths,
                      **dict(kw, sampling_config=SamplingConfig()))
  key = lambda **c: auto_k.cache_key(target, target, drafters.ModelDrafter(), greedy,
                                     **dict(dict(batch=2, k_max=3, max_new_tokens=12), **c))
  assert key() in path and len({key(), key(batch=1), key(k_max=4)}) == 3
  assert 'avx' in auto_k._cpu() or 'x86' not in auto_k._cpu()  # Vector extensions are named.


@pytest.mark.parametrize('alpha,want_k,alternatives', [(0.0, 0, 0), (1.0, 4, 0), (1.0, 4, 2)])
def test_a_call_is_the_sampler_call_it_chose(pair, alpha, want_k, alternatives):
  """The policy's call gives exactly the tokens of ArS (useless draft) or of SpS at the chosen k
  (perfect draft; a chain, or a tree with 2 alternatives beside each draft) with the same key:
  each call is exact as the sampler it runs."""
  target, draft, prompts, lengths = pair
  cfg = SamplingConfig(temperature=0.9)
  prior = auto_k.Acceptance(alpha * 10, 10)
  key = jax.random.key(7)
  drafter = drafters.ModelDrafter(alternatives=alternatives)
  out, choice, seen = auto_k.sample(COSTS, prior, target, draft, prompts, lengths, key,
                                    max_new_tokens=10, sampling=cfg, drafter=drafter)
  assert choice.k == want_k
  if want_k == 0:
    want = sampling.autoregressive_sample(target, prompts, lengths, key, max_new_tokens=10,
                                          sampling=cfg)
    assert seen == dataclasses.replace(prior, ars_calls=1)
  else:
    want = sampling.speculative_sample(target, draft, prompts, lengths, key, k=want_k,
                                       max_new_tokens=10, sampling=cfg, drafter=drafter)
    assert seen.loops == 10 + int(np.sum(want.num_loops)) and seen.alpha < alpha
  np.testing.assert_array_equal(out.tokens, want.tokens)


def test_the_policy_records_each_calls_choice():
  policy = auto_k.Policy(dataclasses.replace(COSTS, alpha=0.9, prior_loops=50))
  assert policy.acceptance == auto_k.Acceptance(45.0, 50)
  with pytest.raises(ValueError, match='follows next'):
    policy.observe(SampleOutput(tokens=None, num_generated=None))
  first = policy.next()
  assert policy.pending == first and first.k == auto_k.choose(COSTS, 0.9).k
  useless = SampleOutput(tokens=None, num_generated=None, num_loops=np.array([200]),
                         num_accepted=np.array([0]), num_full_loops=np.array([0]))
  policy.observe(useless)  # 200 loops that accepted nothing: alpha falls to 0.9 * 50 / 250.
  assert policy.acceptance.alpha == pytest.approx(0.18)
  assert policy.next().k == 0 and policy.summary()['ks'] == [first.k]  # 1.18 tokens, 1.2 steps.


def test_the_sweeps_end_with_auto_points():
  spec = importlib.util.spec_from_file_location(
      'sweep_config', os.path.join(os.path.dirname(os.path.dirname(__file__)), 'configs',
                                   'sweep.py'))
  config = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(config)
  labels = lambda arg: [(p['label'], p['k'], p['auto']) for p in config.get_config(arg).points]
  assert labels('sweep=k')[-2:] == [('8', 8, False), ('auto', 8, True)]
  assert not any(auto for *_, auto in labels('sweep=k,auto=0'))
  assert config.get_config('sweep=k,recalibrate=1').recalibrate
  assert not config.get_config('sweep=k').recalibrate
  assert labels('sweep=drafter_k,draft=d,feature=f,ks=2+5')[-2:] == [('d auto', 5, True),
                                                                      ('f auto', 5, True)]
  assert labels('sweep=drafter_k,draft=none,heads=h,ks=3') == [('h k=3', 3, False),
                                                               ('h auto', 3, True)]
  falcon = config.get_config('sweep=drafter_k,draft=none,falcon=f,mlp=m,ks=3').points
  assert [(p['label'], p['drafter']['kind']) for p in falcon] == [
      ('f k=3', 'falcon'), ('m k=3', 'mlp'), ('f auto', 'falcon'), ('m auto', 'mlp')]
  assert [l for l, _, auto in labels('sweep=drafter') if auto] == [
      'model auto', 'lookup auto', 'hybrid auto']
