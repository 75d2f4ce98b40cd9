"""The benchmark harness: compile kept apart from timed calls, model-based alpha, Table 1 rows and
Figure 1 points on tiny random models (fast; the real figures come from the binaries)."""

import csv
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spsjax import models, sampling
from spsjax.bench import auto_k, comparison, decode, speedup, sweep, table1, theory, timing
from spsjax.data import prompts as prompts_lib
from spsjax.eval import acceptance, likelihood, metrics
from spsjax.sampling import drafters, tree_drafters
from tests import data_helpers, forwards, stats


STRICT_LEVEL = 1e-3  # Family-wise level of the negative control's exact half.


def _fake_output(tokens_per_row, rows, loops=0, accepted=0, histogram=None):
  n = np.full((rows,), tokens_per_row, np.int32)
  return sampling.SampleOutput(tokens=np.zeros((rows, tokens_per_row), np.int32), num_generated=n,
                               num_loops=np.full((rows,), loops, np.int32) if loops else None,
                               num_accepted=np.full((rows,), accepted, np.int32) if loops else None,
                               accepted_histogram=histogram)


def test_time_calls_warms_each_bucket_once_and_times_every_call():
  runs = []

  def run(i):
    runs.append(i)
    time.sleep(0.02 if i < 2 else 0.01)
    # Per row 4 loops accepting 2, 2, 1, 1 drafts (k = 2): 2 full loops per row.
    return _fake_output(tokens_per_row=10, rows=2, loops=4, accepted=6,
                        histogram=np.array([0, 4, 4], np.int32))

  seen = []
  result = timing.time_calls(run, 4, bucket=lambda i: i % 2, k=2,
                             on_output=lambda i, out: seen.append(i))
  assert runs == [0, 0, 1, 1, 2, 3] and seen == [0, 1, 2, 3]
  assert len(result.compile_seconds) == 2 and len(result.calls) == 4
  call = result.calls[0]
  assert call.rows == 2 and call.tokens == 20 and call.loops == 8 and call.accepted == 12
  assert call.full_loops == 4
  assert call.token_time == pytest.approx(call.seconds / 10)
  assert result.tokens_per_loop == pytest.approx((80 - 8) / 32)
  assert result.acceptance_rate == pytest.approx(48 / (2 * 32))
  assert result.alpha == pytest.approx(48 / (48 + 32 - 16))  # Accepted / (accepted + rejections).
  # Each timed call holds its run's sleep (a lower bound whatever the machine's load).
  assert [c.seconds >= (0.02 if i < 2 else 0.01) for i, c in enumerate(result.calls)] == [True] * 4
  # The summary's figures from the four token times v0 <= .. <= v3, by hand (linear interpolation
  # between order statistics: the q-th percentile sits at rank 3 q / 100).
  v = sorted(c.seconds / 10 * 1e3 for c in result.calls)
  s = result.summary()
  assert (s['calls'], s['tokens']) == (4, 80)
  assert s['mean_ms_per_token'] == pytest.approx(sum(v) / 4)
  assert s['std_ms_per_token'] == pytest.approx(np.std(v, ddof=1))
  assert s['p50_ms'] == pytest.approx(v[1] + 0.5 * (v[2] - v[1]))
  assert s['p90_ms'] == pytest.approx(v[2] + 0.7 * (v[3] - v[2]))
  assert s['p99_ms'] == pytest.approx(v[2] + 0.97 * (v[3] - v[2]))
  assert s['compile_s'] == pytest.approx(sum(result.compile_seconds), abs=1e-3)
  assert min(result.compile_seconds) >= 0.02  # Buckets 0 and 1 warm with calls 0 and 1.


def test_time_interleaved_takes_turns_call_by_call():
  order = []

  def run(name, i):
    order.append((name, i))
    return _fake_output(tokens_per_row=4, rows=1)

  seen = []
  timings = timing.time_interleaved(
      {'a': lambda i: run('a', i), 'b': lambda i: run('b', i)}, 3, bucket=lambda i: i // 2,
      ks={'b': 4}, on_output=lambda name, i, out: seen.append((name, i)))
  # Each new bucket compiles (an untimed call) for both methods before either is timed.
  assert order == [('a', 0), ('b', 0), ('a', 0), ('b', 0), ('a', 1), ('b', 1),
                   ('a', 2), ('b', 2), ('a', 2), ('b', 2)]
  assert seen == [('a', 0), ('b', 0), ('a', 1), ('b', 1), ('a', 2), ('b', 2)]
  assert [len(t.calls) for t in timings.values()] == [3, 3]
  assert [len(t.compile_seconds) for t in timings.values()] == [2, 2]
  assert (timings['a'].k, timings['b'].k) == (0, 4)


@pytest.fixture(scope='module', name='family')
def fixture_family():
  tok = data_helpers.small_tokenizer()
  make = lambda seed, **kw: (lambda c: models.Model(c, models.init_params(
      c, jax.random.key(seed))))(models.TransformerConfig(
          vocab_size=tok.vocab_size, max_seq_len=96, num_heads=2, d_ff=64, **kw))
  return make(0, d_model=32, num_layers=2), make(1, d_model=32, num_layers=1), tok


def test_compile_clock_counts_each_compile_while_open_by_program_name():
  def clocked_program(x):
    return jnp.sin(x) * 2

  f = jax.jit(clocked_program)
  with timing.CompileClock() as clock:
    f(jnp.ones(3, jnp.float32))
    f(jnp.ones(3, jnp.float32))  # Compiled already: not counted again.
    f(jnp.ones(4, jnp.float32))  # A new shape: a new program.
  assert clock.programs['jit(clocked_program)'] == 2
  assert clock.program_seconds['jit(clocked_program)'] > 0
  assert all(clock.phases[p] > 0 for p in ('tracing', 'lowering', 'XLA')), clock.phases
  assert clock.seconds == pytest.approx(sum(clock.phases.values()))
  assert 'jit(clocked_program) 2 x in' in clock.summary(top=10)
  f(jnp.ones(5, jnp.float32))  # Closed: no longer counting.
  assert clock.programs['jit(clocked_program)'] == 2


@pytest.mark.parametrize('threads', [1, 3])
def test_warm_runs_every_call_once_and_raises_a_call_s_error(threads):
  def warmed_program(x):
    return jnp.cos(x) + 1

  f = jax.jit(warmed_program)
  ran = []
  calls = [lambda n=n: ran.append(n) or f(jnp.ones(n, jnp.float32)) for n in (2, 3, 4, 5)]
  with timing.CompileClock() as clock:
    timing.warm(calls, threads=threads)
    for call in calls:  # Compiled by warm: the calls find their programs.
      call()
  assert sorted(ran) == [2, 2, 3, 3, 4, 4, 5, 5]
  assert clock.programs['jit(warmed_program)'] == 4

  def broken():
    raise ValueError('no program')

  with pytest.raises(ValueError, match='no program'):
    timing.warm([calls[0], broken], threads=threads)


def test_rows_and_table_on_a_tiny_docstring_task(family, tmp_path):
  target, draft, tok = family
  task = speedup.Task('docstrings', ('def add(a, b):\n    """', 'def f():\n    """', 'x = 1\n'),
                      ('Add two numbers.', 'Do f.', 'Set x.'), max_new_tokens=6)
  greedy = sampling.SamplingConfig(temperature=0.0)
  ars, sps = speedup.run_rows(target, draft, tok, task, 'greedy', greedy, batch=2, k=3, seed=0)
  assert (ars.method, sps.method) == ('ArS', 'SpS') and np.isnan(ars.alpha_model)
  assert ars.completions == sps.completions  # Greedy SpS is greedy ArS.
  assert len(ars.values) == 3 and all(0.0 <= v <= 1.0 for v in ars.values)
  assert ars.timing['calls'] == 2 and 0.0 <= sps.alpha_model <= 1.0
  assert sps.timing['tokens_per_loop'] >= 1.0
  costs = decode.measure_costs(target, draft, 3, batch=1, capacity=32, repeats=2)
  assert costs.c > 0 and costs.s > 0
  loop_profile = speedup.profile_row(target, draft, tok, task, greedy, 2, 3, 0, str(tmp_path))
  assert loop_profile.loops >= 1 and loop_profile.trace_dir.startswith(str(tmp_path))
  assert 0 < loop_profile.draft + loop_profile.score < loop_profile.loop
  assert 0 <= loop_profile.forward_gaps < loop_profile.draft + loop_profile.score
  # The call is its loops plus the time outside them (the prefills come first).
  assert 0 < loop_profile.outside_loop < loop_profile.call
  np.testing.assert_allclose(loop_profile.loops * loop_profile.loop + loop_profile.outside_loop,
                             loop_profile.call, rtol=1e-6)
  # Every draft accepted: the slowest row's tokens after the first, k + 1 = 4 a loop, from the
  # same call run again (greedy, so the same tokens).
  texts = task.prompts[:2]
  prompts_NxP, lengths_N = prompts_lib.encode_prompts(
      tok, texts, max_len=target.config.max_seq_len - task.max_new_tokens - 3)
  again = sampling.speculative_sample(target, draft, prompts_NxP, lengths_N, jax.random.key(0),
                                      k=3, max_new_tokens=task.max_new_tokens, sampling=greedy,
                                      eos_id=tok.eos_id)
  assert loop_profile.perfect_loops == max(-(-(int(g) - 1) // 4) for g in again.num_generated)
  assert 1 <= loop_profile.perfect_loops <= loop_profile.loops
  np.testing.assert_allclose(
      loop_profile.perfect_call,
      loop_profile.outside_loop + loop_profile.perfect_loops * loop_profile.loop, rtol=1e-6)
  cmp = comparison.Comparison(ars=ars, sps=sps, costs=costs, k=3, c_hat=0.5,
                           loop_profile=loop_profile)
  np.testing.assert_allclose(cmp.perfect_draft_speedup,
                             cmp.speedup * loop_profile.call / loop_profile.perfect_call)
  assert cmp.perfect_draft_speedup >= cmp.speedup  # Fewer loops at the same cost.
  # A free draft: the draft phase's time gone from every loop, with the loops taken or with the
  # loops of every draft accepted.
  np.testing.assert_allclose(
      loop_profile.free_draft_call,
      loop_profile.call - loop_profile.loops * loop_profile.draft, rtol=1e-6)
  np.testing.assert_allclose(
      loop_profile.free_perfect_call,
      loop_profile.perfect_call - loop_profile.perfect_loops * loop_profile.draft, rtol=1e-6)
  np.testing.assert_allclose(cmp.free_draft_speedup,
                             cmp.speedup * loop_profile.call / loop_profile.free_draft_call)
  np.testing.assert_allclose(cmp.free_perfect_draft_speedup,
                             cmp.speedup * loop_profile.call / loop_profile.free_perfect_call)
  assert cmp.speedup < cmp.free_draft_speedup <= cmp.free_perfect_draft_speedup
  assert cmp.perfect_draft_speedup < cmp.free_perfect_draft_speedup
  unprofiled = comparison.Comparison(ars=ars, sps=sps, costs=costs, k=3, c_hat=0.5)
  assert all(np.isnan(x) for x in (unprofiled.perfect_draft_speedup,
                                   unprofiled.free_draft_speedup,
                                   unprofiled.free_perfect_draft_speedup))
  summary = cmp.summary()
  assert summary['perfect_draft_speedup'] == cmp.perfect_draft_speedup
  assert summary['free_draft_speedup'] == cmp.free_draft_speedup
  assert summary['free_perfect_draft_speedup'] == cmp.free_perfect_draft_speedup
  assert summary['speedup'] > 0 and summary['metrics_differ_beyond_noise'] is False
  # Greedy: the same completions, so the same target log-probabilities, and a parity test with no
  # noise (MDE 0) that sees no difference.
  assert ars.logprobs == sps.logprobs and all(v < 0 for v in ars.logprobs)
  assert set(summary['parity']) == {'rouge2', 'log p', 'log p/q'}
  assert ars.log_ratios == sps.log_ratios
  assert summary['parity']['log p']['mde'] == 0.0 and not summary['parity']['log p']['differs']
  assert 0 < summary['outside_forward_passes'] <= summary['outside_forward_ops'] < 1
  table = table1.markdown([cmp])
  assert '| docstrings | greedy | 2 | ArS |' in table and '| docstrings | greedy | 2 | SpS |' in table
  ms = lambda x: f'{x * 1e3:.3f}'
  lp = loop_profile  # The third table: the loop profile's row, with its own figures.
  assert (f'| docstrings | greedy | 2 | {lp.loops} | {ms(lp.loop)} | {ms(lp.draft)} | '
          f'{ms(lp.score)} | {ms(lp.accept)} | {lp.outside_forward_passes:.1%} | '
          f'{lp.outside_forward_ops:.1%} | {ms(lp.call)} | {ms(lp.outside_loop)} '
          f'({lp.outside_loop / lp.call:.0%}) | {cmp.perfect_draft_speedup:.2f}x '
          f'({lp.perfect_loops} loops) | {cmp.free_draft_speedup:.2f}x '
          f'({cmp.free_perfect_draft_speedup:.2f}x) |') in table.splitlines()
  assert table.count('| docstrings | greedy | 2 |') == 4  # ArS, SpS, the theory and the profile.
  assert '| rouge2 +0.000 (0.000), log p +0.000 (0.000), log p/q +0.000 (0.000) | no |' in table
  assert table1.PARITY_NOTE in table


def test_logprob_column_is_the_target_s_log_softmax_of_each_generated_token(family):
  target, _, tok = family
  prompts, lengths = np.array([[5, 6, 7, 0], [8, 9, 10, 11]], np.int32), np.array([3, 4], np.int32)
  out = sampling.SampleOutput(tokens=np.array([[3, 4, 0], [7, 8, 9]], np.int32),
                              num_generated=np.array([2, 3], np.int32))
  got = likelihood.mean_logprobs(target, prompts, lengths, out)
  for row, want_tokens in enumerate(([5, 6, 7, 3, 4], [8, 9, 10, 11, 7, 8, 9])):
    L, n = int(lengths[row]), int(out.num_generated[row])
    logp = np.asarray(jax.nn.log_softmax(forwards.logits(target, want_tokens)))
    want = np.mean([logp[L - 1 + j, want_tokens[L + j]] for j in range(n)])
    assert got[row] == pytest.approx(float(want), abs=1e-5)
  del tok



def test_pair_statistics_give_each_column_as_its_own_pass_does(family):
  target, draft, _ = family
  prompts, lengths = np.array([[5, 6, 7, 0], [8, 9, 10, 11]], np.int32), np.array([3, 4], np.int32)
  out = sampling.SampleOutput(tokens=np.array([[3, 4, 0], [7, 8, 9]], np.int32),
                              num_generated=np.array([2, 3], np.int32))
  cfg = sampling.SamplingConfig(temperature=0.8, top_p=0.9)
  stats = acceptance.pair_statistics(target, draft, cfg, prompts, lengths, out, lenience=0.5)
  assert stats.count == 5
  assert stats.logp == pytest.approx(likelihood.mean_logprobs(target, prompts, lengths, out))
  want = [p - q for p, q in zip(stats.logp, likelihood.mean_logprobs(draft, prompts, lengths, out))]
  assert stats.log_ratios == pytest.approx(want, abs=1e-5)
  assert stats.log_ratios == pytest.approx(likelihood.mean_log_ratios(target, draft, prompts,
                                                                      lengths, out), abs=1e-5)
  assert min(map(abs, stats.log_ratios)) > 1e-3
  assert (stats.beta, stats.count) == acceptance.model_alpha(target, draft, cfg, prompts, lengths,
                                                             out, lenience=0.5)
  assert 0 < stats.tv == acceptance.lenient_tv(target, draft, cfg, 0.5, prompts, lengths, out)[0]


def test_log_p_over_q_skips_the_tokens_a_draft_vocabulary_leaves_out(family):
  """A head drafting 3, 7, 9 and 0 .. 2 (not 4, 8): log p/q averages over the generated tokens
  it can propose; a row with none of them counts 0."""
  target, _, _ = family
  config = models.feature_head.head_config(target.config, 1, (), 6)
  head = models.feature_head.with_draft_vocab(models.Model(config, models.feature_head.init_head(
      'feature', config, jax.random.key(0))), [0, 1, 2, 3, 7, 9])
  prompts = np.array([[5, 6, 7, 0], [8, 9, 10, 11], [5, 6, 0, 0]], np.int32)
  lengths = np.array([3, 4, 2], np.int32)
  out = sampling.SampleOutput(tokens=np.array([[3, 4, 0], [7, 8, 9], [4, 8, 0]], np.int32),
                              num_generated=np.array([2, 3, 2], np.int32))
  got = likelihood.mean_log_ratios(target, head, prompts, lengths, out)
  for row, (seq, kept) in enumerate((([5, 6, 7, 3, 4], [3]), ([8, 9, 10, 11, 7, 8, 9], [4, 6]),
                                     ([5, 6, 4, 8], []))):
    logp = np.asarray(jax.nn.log_softmax(forwards.logits(target, seq)))
    logq = np.asarray(jax.nn.log_softmax(models.feature_head.next_token_logits(
        head, target, jnp.asarray([seq], jnp.int32))[0]))
    want = np.mean([logp[t - 1, seq[t]] - logq[t - 1, seq[t]] for t in kept]) if kept else 0.0
    assert got[row] == pytest.approx(float(want), abs=1e-4)
  stats = acceptance.pair_statistics(target, head, sampling.SamplingConfig(), prompts, lengths,
                                     out)
  assert stats.log_ratios == pytest.approx(got, abs=1e-5) and stats.count == 7


def test_alpha_skips_a_row_without_generated_tokens_where_the_log_columns_refuse_it(family):
  target, draft, _ = family
  prompts, lengths = np.array([[5, 6, 7], [8, 9, 10]], np.int32), np.array([3, 3], np.int32)
  out = sampling.SampleOutput(tokens=np.array([[3, 4], [0, 0]], np.int32),
                              num_generated=np.array([2, 0], np.int32))
  cfg = sampling.SamplingConfig(temperature=1.0)
  stats = acceptance.pair_statistics(target, draft, cfg, prompts, lengths, out)
  assert stats.count == 2 and 0 < stats.beta < 2
  assert acceptance.model_alpha(target, draft, cfg, prompts, lengths, out) == (stats.beta, 2)
  with pytest.raises(ValueError, match='generated no tokens'):
    _ = stats.logp

@pytest.fixture(scope='module', name='peaked_family')
def fixture_peaked_family():
  """Random pair with scaled heads: far-from-uniform, different next-token laws (alpha ~0.3)."""
  tok = data_helpers.small_tokenizer()
  config = lambda layers: models.TransformerConfig(
      vocab_size=tok.vocab_size, max_seq_len=64, d_model=32, num_layers=layers, num_heads=2,
      d_ff=64, tie_embeddings=False)
  return stats.scaled_model(config(2), 0, 3.0), stats.scaled_model(config(1), 1, 3.0), tok


def test_parity_columns_flag_a_biased_sampler_and_pass_the_exact_one(peaked_family):
  """The negative control: SpS that accepts (almost) every draft samples the draft's law, not the
  target's; the parity test must flag it on a task (at the table's family-wise level, 0.05), and
  must not flag exact SpS on the same one. The exact half is judged at a family-wise level of
  1e-3 (STRICT_LEVEL): a new draw of its random numbers (a JAX upgrade re-rolls them) fails it
  with probability <= 1e-3, as the paired t-tests are calibrated, where the table's level would
  fail it one time in twenty."""
  target, draft, tok = peaked_family
  prompts = tuple(f'def f{i}(a):\n    b = a + {i}\n' for i in range(16))
  references = tuple(f'    return b * {i}' for i in range(16))
  task = speedup.Task('code_completion', prompts, references, max_new_tokens=8)
  cfg = sampling.SamplingConfig(temperature=1.0)
  costs = decode.Costs(target_step=1e-3, draft_step=1e-4, score_call=1.2e-3)
  compare = lambda rows: comparison.Comparison(ars=rows[0], sps=rows[1], costs=costs, k=3,
                                            c_hat=0.5)
  exact = compare(speedup.run_rows(target, draft, tok, task, 'nucleus', cfg, batch=8, k=3,
                                   seed=0))
  # Lenience 1e-30 accepts every draft the target gives any mass (1e-4 still rejected a third of
  # them in a pair drawn by JAX 0.12, whose random weights differ from 0.10's).
  biased = compare(speedup.run_rows(target, draft, tok, task, 'nucleus', cfg, batch=8, k=3,
                                    seed=0, lenience=1e-30))
  assert set(exact.parity) == {'chrF', 'next-line EM', 'log p', 'log p/q'}
  assert all(p.level == pytest.approx(0.05 / 4) for p in exact.parity.values())
  strict = {name: metrics.parity(exact.ars.columns[name], exact.sps.columns[name],
                                 level=STRICT_LEVEL, tests=len(exact.parity))
            for name in exact.parity}
  assert not any(p.differs for p in strict.values()), strict
  # The pair's laws are far apart (exact alpha ~0.06); the biased sampler accepts most drafts.
  assert exact.sps.timing['alpha'] < 0.25 and biased.sps.timing['alpha'] > 0.75
  assert biased.metrics_differ and biased.parity['log p'].differs
  assert biased.parity['log p'].difference < -biased.parity['log p'].mde < 0
  # log p - log q: positive on the target's samples (KL(p || q) per token), negative on the
  # draft's; the biased sampler's moves down, beyond what the test detects.
  assert np.mean(biased.ars.log_ratios) > 0 > np.mean(biased.sps.log_ratios)
  assert biased.parity['log p/q'].differs
  assert biased.parity['log p/q'].difference < -biased.parity['log p/q'].mde
  # The exact pair's log p difference is within what the strict test could have seen.
  assert abs(strict['log p'].difference) < strict['log p'].mde
  assert '| yes |' in table1.markdown([biased])
  assert ('| yes |' if exact.metrics_differ else '| no |') in table1.markdown([exact])


def test_sweep_point_csv_and_plot(family, tmp_path):
  target, draft, tok = family
  prompts, lengths = np.array([[5, 6, 7], [8, 9, 10]], np.int32), np.array([3, 2], np.int32)
  cfg = sampling.SamplingConfig(temperature=0.8)
  base = sweep.run_point('ArS', target, None, '', prompts, lengths, k=0, sampling_config=cfg,
                         max_new_tokens=8, seed=0)
  point = sweep.run_point('2', target, draft, 'd', prompts, lengths, k=2, sampling_config=cfg,
                          max_new_tokens=8, seed=0)
  assert base.k == 0 and np.isnan(base.loop_seconds) and point.k == 2
  # The point's counts are those of the same calls (prompt i, SpS's key fold_in(fold_in(seed, i),
  # 1), ArS's fold_in(..., 0)) made here.
  outs = [sampling.speculative_sample(
      target, draft, *prompts_lib.for_call(prompts, lengths, [i]),
      jax.random.fold_in(jax.random.fold_in(jax.random.key(0), i), 1), k=2, max_new_tokens=8,
      sampling=cfg) for i in range(2)]
  loops = sum(int(o.num_loops[0]) for o in outs)
  assert point.tokens_per_loop == pytest.approx((2 * 8 - 2) / loops)  # The prefill's token aside.
  assert point.accepted_fraction == pytest.approx(point.tokens_per_loop / 3)
  # An auto point (k its k_max) counts at the k its calls ran at, if one.
  ran = lambda ks: dataclasses.replace(point, k=8, auto_ks=ks).accepted_fraction
  assert ran((2, 2)) == pytest.approx(point.tokens_per_loop / 3)
  assert np.isnan(ran((2, 4))) and np.isnan(ran((0, 0)))
  assert point.acceptance_rate == pytest.approx(
      sum(int(o.num_accepted[0]) for o in outs) / (2 * loops))
  assert point.loop_seconds * loops == pytest.approx(2 * point.mean_seconds)  # Same two calls.
  assert np.isnan(base.tokens_per_loop) and base.mean_seconds > 0
  sweep.write_csv([base, point], str(tmp_path / 'p.csv'))
  with open(tmp_path / 'p.csv', encoding='utf-8') as f:
    rows = list(csv.DictReader(f))
  assert [r['label'] for r in rows] == ['ArS', '2'] and float(rows[1]['k']) == 2
  # ArS is timed in turn with every point: the ArS point's own time, the SpS point's ArS calls.
  assert base.ars_seconds == base.mean_seconds and point.ars_seconds > 0
  assert point.speedup == pytest.approx(point.ars_seconds / point.mean_seconds)
  table = sweep.markdown([base, point]).splitlines()
  assert table[2].startswith('| ArS | 0 | - | ArS | - | - | - / - | - | ')
  assert table[3] == (
      f'| 2 | 2 | d | {point.drafter} | {point.c:.3f} | {point.alpha:.3f} | '
      f'{point.tokens_per_loop:.2f} / {point.predicted_tokens_per_loop:.2f} | '
      f'{point.loop_seconds * 1e3:.2f} | {point.mean_seconds * 1e3:.1f} '
      f'({point.std_seconds * 1e3:.1f}) | {point.speedup:.2f}x | '
      + ' '.join(f'{a:.2f}' for a in point.alpha_per_position) + ' |')
  # Acceptance per draft position from the same calls' loops by accepted drafts.
  by_accepted = np.sum([np.asarray(o.accepted_histogram) for o in outs], axis=0)
  assert len(point.alpha_per_position) == 2 and base.alpha_per_position == ()
  np.testing.assert_allclose(point.alpha_per_position, theory.alpha_per_position(by_accepted))
  sweep.plot([point], str(tmp_path / 'fig.png'), 'test', 'k')
  assert (tmp_path / 'fig.png').stat().st_size > 1000
  other = dataclasses.replace(point, k=3, draft='e', tokens_per_loop=2.5)
  auto = dataclasses.replace(other, auto_ks=(0, 3))  # Its k varies by call: not on a line.
  curves = [base, point, other, dataclasses.replace(other, k=1, tokens_per_loop=1.5), auto]
  assert sweep.tokens_per_loop_lines(curves) == {
      'd': [(2, point.tokens_per_loop)], 'e': [(1, 1.5), (3, 2.5)]}
  sweep.plot_tokens_per_loop(curves, str(tmp_path / 'k.png'), 'test')
  assert (tmp_path / 'k.png').stat().st_size > 1000
  del tok


def test_sweep_point_in_batches(family):
  """batch = 2 over 3 prompts: one timed call of prompts 0 and 1 (the last left out), its counts
  those of that call made here; a batch larger than the prompts is refused."""
  target, draft, _ = family
  prompts = np.array([[5, 6, 7], [8, 9, 10], [11, 12, 13]], np.int32)
  lengths = np.array([3, 2, 3], np.int32)
  cfg = sampling.SamplingConfig(temperature=0.8)
  point = sweep.run_point('2', target, draft, 'd', prompts, lengths, k=2, sampling_config=cfg,
                          max_new_tokens=8, seed=0, batch=2)
  out = sampling.speculative_sample(
      target, draft, *prompts_lib.for_call(prompts, lengths, [0, 1]),
      jax.random.fold_in(jax.random.fold_in(jax.random.key(0), 0), 1), k=2, max_new_tokens=8,
      sampling=cfg)
  loops = int(np.sum(out.num_loops))
  assert point.tokens_per_loop == pytest.approx((2 * 8 - 2) / loops)
  assert point.loop_seconds * loops == pytest.approx(point.mean_seconds)  # One call.
  assert point.std_seconds == 0.0 and point.speedup > 0
  with pytest.raises(ValueError, match='batch must be'):
    sweep.run_point('2', target, draft, 'd', prompts, lengths, k=2, sampling_config=cfg,
                    max_new_tokens=8, seed=0, batch=4)


def test_sweep_point_with_k_auto(family):
  """A k = 'auto' point: each SpS call runs at the policy's k (here ArS for the first call, whose
  prior sees no acceptance, then k = 2 once the policy is told alpha is high), the call's counts
  feed the policy, and the table says which k ran."""
  target, draft, _ = family
  prompts, lengths = np.array([[5, 6, 7], [8, 9, 10], [4, 4, 4]], np.int32), np.array([3, 2, 3],
                                                                                     np.int32)
  cfg = sampling.SamplingConfig(temperature=0.8)
  costs = auto_k.LoopCosts(batch=1, k_max=2, ars_step=1.0, loop_1=1.1, loop_max=1.2)
  policy = auto_k.Policy(costs)
  observe = policy.observe

  def observe_then_believe(out):  # After the first call, a prior of alpha 0.9 over 100 loops.
    observe(out)
    if len(policy.choices) == 1:
      policy.acceptance = auto_k.Acceptance(90.0, 100)

  policy.observe = observe_then_believe
  point = sweep.run_point('auto', target, draft, 'd', prompts, lengths, k=2, sampling_config=cfg,
                          max_new_tokens=8, seed=0, policy=policy)
  assert point.auto_ks == (0, 2, 2) and point.k == 2
  assert point.auto_predicted_speedup == pytest.approx(
      np.mean([1.0] + [theory.expected_tokens_per_loop(c.alpha, 2) / 1.2
                       for c in policy.choices[1:]]))
  assert policy.acceptance.loops > 100  # The k = 2 calls' loops were observed.
  # The SpS calls are ArS's (call 0) and SpS's at k = 2 with the same keys.
  outs = [sampling.speculative_sample(
      target, draft, *prompts_lib.for_call(prompts, lengths, [i]),
      jax.random.fold_in(jax.random.fold_in(jax.random.key(0), i), 1), k=2, max_new_tokens=8,
      sampling=cfg) for i in (1, 2)]
  loops = sum(int(o.num_loops[0]) for o in outs)
  assert point.tokens_per_loop == pytest.approx(
      (sum(int(o.num_accepted[0]) for o in outs) + loops) / loops)
  assert point.alpha_per_position == ()  # Calls at different k (ArS among them).
  assert '(auto: k=0 x1, k=2 x2; predicted ' in sweep.markdown([point])


def test_sweep_points_of_other_drafters_and_of_lenience(family):
  """A lookup point runs without a draft model (c = 0, ragged drafts); a lenient point is labelled
  with its lenience and carries the total variation `lenient_tv` gives on the same outputs."""
  target, draft, _ = family
  prompts, lengths = np.array([[5, 6, 5, 6, 5], [8, 9, 8, 9, 0]], np.int32), np.array([5, 4],
                                                                                       np.int32)
  cfg = sampling.SamplingConfig(temperature=0.8)
  lookup = sweep.run_point('lookup', target, None, '', prompts, lengths, k=3, sampling_config=cfg,
                           max_new_tokens=8, seed=0, drafter=drafters.PromptLookup())
  assert lookup.k == 3 and lookup.c == 0.0 and lookup.drafter.startswith('PromptLookup(')
  assert 0 < lookup.drafted_per_loop <= 3 and lookup.tv == 0.0
  assert 1.0 <= lookup.predicted_tokens_per_loop <= 1.0 + lookup.drafted_per_loop
  lenient = sweep.run_point('0.5', target, draft, 'd', prompts, lengths, k=2, sampling_config=cfg,
                            max_new_tokens=8, seed=0, lenience=0.5)
  outs = [sampling.speculative_sample(
      target, draft, *prompts_lib.for_call(prompts, lengths, [i]),
      jax.random.fold_in(jax.random.fold_in(jax.random.key(0), i), 1), k=2, max_new_tokens=8,
      sampling=cfg, lenience=0.5) for i in range(2)]
  sums = [acceptance.lenient_tv(target, draft, cfg, 0.5,
                                *prompts_lib.for_call(prompts, lengths, [i]), outs[i])
          for i in range(2)]
  assert lenient.lenience == 0.5 and lenient.tv == pytest.approx(
      sum(s[0] for s in sums) / sum(s[1] for s in sums), rel=1e-5)
  assert 0 < lenient.tv < 1


def test_lossy_rows_are_labelled_with_their_total_variation(family):
  target, draft, tok = family
  task = speedup.Task('docstrings', ('def add(a, b):\n    """', 'x = 1\n'), ('Add.', 'Set x.'),
                      max_new_tokens=6)
  cfg = sampling.SamplingConfig(temperature=0.9)
  ars, sps = speedup.run_rows(target, draft, tok, task, 'nucleus', cfg, batch=1, k=2, seed=0,
                              drafter=drafters.Hybrid(), lenience=0.5)
  assert ars.lenience == 1.0 and sps.lenience == 0.5 and 0 < sps.tv < 1
  costs = decode.Costs(target_step=1e-3, draft_step=1e-4, score_call=1.2e-3)
  table = table1.markdown([comparison.Comparison(ars=ars, sps=sps, costs=costs, k=2, c_hat=0.1)])
  assert f'| SpS (LOSSY: lenience 0.5, TV {sps.tv:.3f}) |' in table
  assert '| ArS |' in table


def test_table_rows_with_k_auto(family):
  """Table 1 rows with a k = 'auto' policy that runs every SpS call as ArS (a prior of alpha 0):
  the SpS row's completions are ArS's with the SpS keys, it ran no loop, and its theory columns
  fall back to the policy's alpha; the comparison's JSON keeps the policy's record."""
  target, draft, tok = family
  task = speedup.Task('docstrings', ('def add(a, b):\n    """', 'x = 1\n'), ('Add.', 'Set x.'),
                      max_new_tokens=5)
  greedy = sampling.SamplingConfig(temperature=0.0)
  policy = auto_k.Policy(auto_k.LoopCosts(batch=1, k_max=3, ars_step=1.0, loop_1=1.1,
                                          loop_max=1.3))
  ars, sps = speedup.run_rows(target, draft, tok, task, 'greedy', greedy, batch=1, k=3, seed=0,
                              policy=policy)
  assert [c.k for c in policy.choices] == [0, 0] and ars.completions == sps.completions
  assert np.isnan(sps.timing['tokens_per_loop'])
  costs = decode.Costs(target_step=1e-3, draft_step=1e-4, score_call=1.2e-3)
  cmp = comparison.Comparison(ars=ars, sps=sps, costs=costs, k=3, c_hat=0.5,
                              auto=policy.summary())
  assert cmp.prediction.alpha == 0.0 and cmp.summary()['auto']['ks'] == [0, 0]
  prompts, lengths = speedup.calibration_prompts(task, tok, target, draft, 3, batch=3)
  assert len(lengths) == 3 and lengths[2] == lengths[0]  # Rows past the prompts wrap around.


def test_table_theory_for_prompt_lookup_uses_the_proposals_made(family):
  """Prompt lookup proposes no drafts where it finds no match: the predicted tokens per loop come
  from the loops that proposed each count, the cost has no draft steps, and there is no model
  alpha to show."""
  target, _, tok = family
  task = speedup.Task('docstrings', ('ab ab ab ab', 'x = 1\n'), ('ab', 'Set x.'), max_new_tokens=6)
  greedy = sampling.SamplingConfig(temperature=0.0)
  lookup = drafters.PromptLookup()
  ars, sps = speedup.run_rows(target, None, tok, task, 'greedy', greedy, batch=1, k=3, seed=0,
                              drafter=lookup)
  assert ars.completions == sps.completions and np.isnan(sps.alpha_model)
  assert sps.log_ratios is None and set(sps.columns) == {'rouge2', 'log p'}  # No draft model.
  t = sps.timing
  assert sum(t['loops_by_proposed']) >= 2 and len(t['loops_by_proposed']) == 4
  costs = decode.Costs(target_step=1e-3, draft_step=0.0, score_call=1.2e-3)
  cmp = comparison.Comparison(ars=ars, sps=sps, costs=costs, k=3, c_hat=0.0, drafter=lookup)
  p = cmp.prediction
  assert p.loops_by_proposed == tuple(t['loops_by_proposed']) and p.draft_steps == 0.0
  assert p.tokens_per_loop == pytest.approx(
      theory.expected_tokens_per_loop_proposed(t['alpha'], t['loops_by_proposed']))
  assert p.speedup == pytest.approx(p.tokens_per_loop / 1.2)
  assert f'| docstrings | greedy | 1 | {p.alpha:.3f} / - | 0.000 | 1.20 |' in table1.markdown(
      [cmp])


def test_peer_report_rates_each_method_against_its_own_framework():
  """Tokens/s are generated tokens over summed wall time; speedups are over the same
  framework's ArS; SpS is set against transformers' assisted generation."""
  from spsjax.bench import peer  # pylint: disable=g-import-not-at-top
  seconds = dict(hf_ars=4.0, hf_assisted=2.0, ars=1.0, sps=0.5)
  timings = {m: timing.Timing(calls=(timing.Call(seconds=s / 2, rows=1, tokens=64),) * 2,
                              compile_seconds=(), k=4 if m == 'sps' else 0)
             for m, s in seconds.items()}
  row = peer.Row(decoding='greedy', timings=timings, identical=3, prompts=4)
  assert row.tokens_per_second('hf_ars') == 32.0 and row.tokens_per_second('sps') == 256.0
  assert row.speedup('hf_assisted') == 2.0 and row.speedup('sps') == 2.0
  assert row.sps_over_assisted == 4.0
  table = peer.markdown([row])
  assert '| greedy | transformers ArS | 32.0 | 1.00x |  | 3 of 4 |' in table
  assert '| greedy | spsjax SpS | 256.0 | 2.00x |' in table and '| greedy | 4.00x |' in table


def test_pooled_token_time_weighs_calls_by_their_tokens():
  """A call that stops after one token (its fixed cost on that token) counts once in the mean
  over calls and by its one token in the pooled time."""
  short, long = timing.Call(seconds=0.030, rows=1, tokens=1), timing.Call(seconds=0.2, rows=2,
                                                                        tokens=200)
  t = timing.Timing(calls=(short, long), compile_seconds=())
  assert t.mean_token_time == pytest.approx((0.030 + 0.002) / 2)
  assert t.pooled_token_time == pytest.approx(0.230 / 101)
  assert t.summary()['pooled_ms_per_token'] == pytest.approx(230 / 101)


def test_costs_are_measured_halfway_through_a_generation(family):
  target, draft, tok = family
  task = speedup.Task('docstrings', ('ab', 'abcdefgh'), ('x', 'y'), max_new_tokens=10)
  lengths = [len(tok.encode(p)) for p in task.prompts]
  want = round(sum(lengths) / 2) + 10 // 2 + 3 + 1
  assert speedup.halfway_capacity(task, tok, target, draft, 3) == want


def test_theory_of_a_tree_drafter_measures_its_tree_and_level_calls(family):
  """A tree drafter's prediction: s of the target's call on the tree's nodes and root, draft
  steps from its level calls' measured time, operations over the positions both read; alpha per
  depth (`alpha_from_counts` of the path's accepted drafts) predicts the tokens per loop."""
  target, draft, tok = family
  task = speedup.Task('docstrings', ('def add(a, b):\n    """', 'x = 1\n'), ('Add.', 'Set x.'),
                      max_new_tokens=6)
  tree_drafter = tree_drafters.TreeDrafter(branching=(2, 2, 1))
  tree = tree_drafter.tree(3)
  assert tree_drafter.draft_calls(3) == (1, 2, 4) and tree.num_nodes == 10
  greedy = sampling.SamplingConfig(temperature=0.0)
  ars, sps = speedup.run_rows(target, draft, tok, task, 'greedy', greedy, batch=1, k=3, seed=0,
                              drafter=tree_drafter)
  assert ars.completions == sps.completions
  capacity = speedup.halfway_capacity(task, tok, target, draft, 3, tree.num_nodes + 1)
  assert capacity == speedup.halfway_capacity(task, tok, target, draft, 3) + 11 - 4
  costs = decode.measure_costs(target, draft, 3, batch=1, capacity=capacity, repeats=2,
                               tree=tree, draft_calls=tree_drafter.draft_calls(3))
  assert costs.scored == 11 and costs.draft_loop > 0 and costs.draft_steps > 0
  assert costs.draft_steps == pytest.approx(costs.draft_loop / costs.draft_step)
  cmp = comparison.Comparison(ars=ars, sps=sps, costs=costs, k=3, c_hat=0.5,
                              drafter=tree_drafter)
  p = cmp.prediction
  assert (p.scored, p.draft_positions, p.draft_steps) == (11, 7.0, costs.draft_steps)
  assert p.s == costs.s and p.speedup == pytest.approx(
      p.tokens_per_loop / (costs.draft_steps * costs.c + costs.s))
  assert p.operations == pytest.approx((7 * 0.5 + 11) / p.tokens_per_loop)
  t = sps.timing
  assert p.alpha == t['alpha'] and p.tokens_per_loop == pytest.approx(
      theory.expected_tokens_per_loop(t['alpha'], 3))
  # A chain's costs (no tree measured) fall back to the drafter's k steps and k + 1 positions.
  chain_costs = decode.Costs(target_step=1e-3, draft_step=1e-4, score_call=1.2e-3)
  chain = comparison.Comparison(ars=ars, sps=sps, costs=chain_costs, k=3, c_hat=0.5,
                                drafter=tree_drafter).prediction
  assert (chain.draft_steps, chain.scored) == (3.0, None)
  assert chain.operations == pytest.approx((7 * 0.5 + 4) / chain.tokens_per_loop)


def test_a_dynamic_tree_row_runs_measures_and_profiles(family, tmp_path):
  """A dynamic tree (`DynamicTreeDrafter`): greedy SpS gives ArS's completions; its costs are the
  target's call on its N + 1 nodes and its level calls of w positions; the row's loop profile
  finds the loop's iterations (XLA:CPU runs its sorts as several events an iteration)."""
  target, draft, tok = family
  task = speedup.Task('docstrings', ('def add(a, b):\n    """', 'x = 1\n'), ('Add.', 'Set x.'),
                      max_new_tokens=6)
  drafter = tree_drafters.DynamicTreeDrafter(nodes=4, width=2)
  assert drafter.draft_calls(3) == (1, 2, 2) and drafter.tree(3).num_nodes == 4
  greedy = sampling.SamplingConfig(temperature=0.0)
  ars, sps = speedup.run_rows(target, draft, tok, task, 'greedy', greedy, batch=1, k=3, seed=0,
                              drafter=drafter)
  assert ars.completions == sps.completions
  costs = decode.measure_costs(target, draft, 3, batch=1, capacity=64, repeats=2,
                               tree=drafter.tree(3), draft_calls=drafter.draft_calls(3))
  assert costs.scored == 5 and costs.draft_loop > 0
  loop_profile = speedup.profile_row(target, draft, tok, task, greedy, 1, 3, 0, str(tmp_path),
                                     drafter=drafter)
  assert loop_profile.loops >= 1 and 0 < loop_profile.draft + loop_profile.score < loop_profile.loop
