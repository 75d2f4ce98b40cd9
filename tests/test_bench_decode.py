"""The decode benchmark library on a tiny model: every figure is positive and self-consistent."""

import dataclasses
import functools
import math
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spsjax import models
from spsjax.bench import ceiling, decode, hlo, layer_scan, timing, trace, variants
from spsjax.sampling import SamplingConfig
from tests import xla_env


def zero_model(config):
  """Zero weights of the right shapes: timing needs no values, and this skips compiling init."""
  shapes = jax.eval_shape(functools.partial(models.init_params, config), jax.random.key(0))
  return models.Model(config, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes))


def test_measure_decode_tiny():
  config = models.TransformerConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=4,
                                    num_kv_heads=2, d_ff=64, max_seq_len=64, tie_embeddings=False)
  model = zero_model(config)
  r = decode.measure_decode(model, prompt_len=4, max_new_tokens=6, block=3, repeats=2,
                            ars_repeats=1, sampling_config=SamplingConfig(temperature=0.0))
  assert r.dtype == 'float32'
  assert r.num_params == models.num_params(model.params)
  assert r.param_bytes == 4 * r.num_params
  # Untied: the step reads one row of the input embedding, not the table.
  assert r.weight_bytes == r.param_bytes - 4 * 64 * 32 + 4 * 32
  assert r.capacity == 10 and r.block == 3
  assert r.kv_bytes == 2 * 1 * r.capacity * 2 * 8 * 4  # k and v, layers, B=1, S, K, H, float32.
  assert r.bytes_per_token == r.weight_bytes + r.kv_bytes
  assert r.cache_in_place
  for seconds in (r.step, r.block_step, r.prefill, r.ars, r.ars_first_call):
    assert seconds > 0
  assert abs(r.step_bandwidth - r.bytes_per_token / r.step / 1e9) < 1e-9
  assert abs(r.block_ratio * r.step - r.block_step) < 1e-12
  assert abs(r.ars_per_token * 6 - r.ars) < 1e-12
  assert abs(r.ars_per_decode_step * 5 - (r.ars - r.prefill)) < 1e-12
  assert len(decode.report(r)) == 4


def test_batch_scoring_report_gives_s_for_each_block_at_the_batch():
  config = models.TransformerConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=4,
                                    num_kv_heads=2, d_ff=64, max_seq_len=64)
  model = zero_model(config)
  [line] = decode.batch_scoring_report(model, 3, 3, 12, repeats=2)
  match = re.fullmatch(r'\[float32 xla\] batch 3: extend T=1 ([0-9.]+) ms, s\(2\) ([0-9.]+), '
                       r's\(3\) ([0-9.]+) \(blocks alternating in each repeat, capacity 12\)', line)
  assert match, line
  assert all(float(x) > 0 for x in match.groups())
  with pytest.raises(ValueError, match='block >= 2'):
    decode.batch_scoring_report(model, 3, 1, 12, repeats=2)
  with pytest.raises(ValueError, match='batch >= 1'):
    decode.batch_scoring_report(model, 0, 3, 12, repeats=2)


@pytest.mark.parametrize('flags, message', [
    (['--batches=x'], "--batches takes integers, got ['x']."),
    (['--batches=0'], "--batches needs batch sizes >= 1 and --block >= 2, got ['0'] and --block=5."),
    (['--batches=8', '--block=1'],
     "--batches needs batch sizes >= 1 and --block >= 2, got ['8'] and --block=1."),
    (['--paths=xla,cuda'], "--paths takes native, xla, xla_fused; got ['cuda']."),
    (['--ceiling_top_p=1.5'], '--ceiling_top_p must be in (0, 1], got 1.5.'),
])
def test_decode_benchmark_rejects_bad_batches_before_measuring(flags, message):
  repo = pathlib.Path(__file__).resolve().parents[1]
  run = subprocess.run([sys.executable, 'experiments/decode_benchmark.py', '--small', *flags],
                       cwd=repo, env=xla_env.subprocess_env(), capture_output=True, text=True,
                       timeout=120, check=False)
  assert run.returncode == 1, run.stderr
  assert run.stderr.strip().endswith(f'decode_benchmark.py: error: {message}'), run.stderr
  assert 'copy of' not in run.stdout  # Nothing was measured first.


def test_costs_measured_again_at_the_same_shapes_compile_nothing():
  config = models.TransformerConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=4,
                                    num_kv_heads=2, d_ff=64, max_seq_len=64)
  model = zero_model(config)
  decode.extend_seconds(model, (1, 3), 12, repeats=1)
  with timing.CompileClock() as clock:
    decode.extend_seconds(model, (3, 1), 12, repeats=1)
    decode.measure_costs(model, None, 2, batch=1, capacity=12, repeats=1)  # T = 1 and 3 again.
  assert clock.programs['jit(_extend_steps)'] == 0, clock.programs
  with timing.CompileClock() as clock:
    decode.extend_seconds(model, (1,), 13, repeats=1)  # Another cache size: another program.
  assert clock.programs['jit(_extend_steps)'] == 1, clock.programs


def test_extend_programs_compiled_side_by_side_are_not_compiled_again():
  config = models.TransformerConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=4,
                                    num_kv_heads=2, d_ff=64, max_seq_len=64)
  with timing.CompileClock() as clock:  # Capacity 11: no other test's programs.
    times, _, _ = decode.extend_seconds(zero_model(config), (1, 2, 3), 11, repeats=1,
                                        compile_threads=3)
  assert sorted(times) == [1, 2, 3] and all(t > 0 for t in times.values())
  assert clock.programs['jit(_extend_steps)'] == 3, clock.programs


def test_copy_bandwidth_small():
  copy = decode.copy_bandwidth(1 << 20, repeats=2)
  assert copy.nbytes == 1 << 20
  assert min(copy.jax_fresh, copy.jax_donated, copy.numpy) > 0
  assert len(decode.copy_report(copy)) == 1


def test_perfect_pair_accepts_every_draft(monkeypatch):
  """Zero output layers: p = q = uniform, so every loop emits k + 1 tokens, packed or not."""
  config = models.TransformerConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4,
                                    num_kv_heads=2, d_ff=64, max_seq_len=64)
  draft_config = models.TransformerConfig(vocab_size=64, d_model=16, num_layers=1, num_heads=2,
                                          d_ff=32, max_seq_len=64)
  target, draft = ceiling.perfect_pair(
      models.Model(config, models.init_params(config, jax.random.key(0))),
      models.Model(draft_config, models.init_params(draft_config, jax.random.key(1))))
  generated = {}  # Per timed method: (tokens, SpS loops) of its calls.
  time_interleaved = ceiling.timing.time_interleaved

  def recording(runs, num_calls, bucket, **kw):
    def seen(name, _, out):
      generated.setdefault(name, set()).add(
          (int(out.num_generated[0]), None if out.num_loops is None else int(out.num_loops[0])))
    return time_interleaved(runs, num_calls, bucket, **kw, on_output=seen)

  monkeypatch.setattr(ceiling.timing, 'time_interleaved', recording)
  for pack in (False, True):
    t, d = (models.pack(target), models.pack(draft)) if pack else (target, draft)
    generated.clear()
    r = ceiling.measure(t, d, k=3, prompt_len=5, max_new_tokens=17, repeats=1)
    assert r.tokens_per_loop == 4.0  # 16 tokens after the prefill's: 4 loops of k + 1.
    assert min(r.ars, r.sps, r.ars_prefill, r.sps_prefill, r.c, r.s) > 0
    # The `*_prefill` calls stop after the prefill's token; which is faster is the machine's say.
    assert generated == {'ars': {(17, None)}, 'sps': {(17, 4)}, 'ars_prefill': {(1, None)},
                         'sps_prefill': {(1, 0)}}
    assert abs(r.predicted - 4 / (3 * r.c + r.s)) < 1e-12
    decode = r.ars - r.ars_prefill
    if r.sps > r.sps_prefill:
      assert abs(r.decode_speedup - decode / (r.sps - r.sps_prefill)) < 1e-12
    else:  # One call each of a tiny model: on a busy machine the prefill call may take longer.
      assert math.isnan(r.decode_speedup)
    assert abs(r.predicted_whole - r.ars / (r.sps_prefill + decode / r.predicted)) < 1e-12
    assert len(ceiling.report(r, 'x')) == 1 and 'top-p' not in ceiling.report(r, 'x')[0]
  # Under top-p the uniform laws keep their first 90% of tokens, the same for target and draft:
  # every draft is still accepted, and the calls pay nucleus sampling's work.
  generated.clear()
  r = ceiling.measure(target, draft, k=3, prompt_len=5, max_new_tokens=17, repeats=1, top_p=0.9)
  assert r.top_p == 0.9 and r.tokens_per_loop == 4.0 and generated['sps'] == {(17, 4)}
  assert ', top-p 0.9 ' in ceiling.report(r, 'x')[0]
  with pytest.raises(ValueError, match='before packing'):
    ceiling.perfect_pair(models.pack(target), draft)


def test_ceiling_decode_speedup_subtracts_prefills_and_refuses_no_decoding():
  fields = dict(k=4, max_new_tokens=128, ars=0.2, ars_prefill=0.02, tokens_per_loop=5.0, c=0.05,
                s=1.2)
  r = ceiling.Ceiling(sps=0.1, sps_prefill=0.03, **fields)
  assert abs(r.decode_speedup - 0.18 / 0.07) < 1e-12
  assert math.isnan(ceiling.Ceiling(sps=0.03, sps_prefill=0.03, **fields).decode_speedup)
  # A loop as the formula charges it: k draft steps at c and a scoring call at s target steps.
  step = ceiling.Ceiling(sps=0.1, sps_prefill=0.03, target_step=0.002, **fields)
  assert abs(step.formula_loop - (4 * 0.05 + 1.2) * 0.002) < 1e-15
  loop = ceiling.LoopProfile(loops=25, wall=0.003, phase={'draft': 4e-4, 'score': 2e-3},
                             ops={'draft': 302.0})
  line = ceiling.report(dataclasses.replace(step, loop=loop), 'x')[0]
  assert line.endswith('; profiled: 25 loops, 3.000 ms a loop (d c + s steps: 2.800 ms), op time '
                       '(ms) draft 0.400 (302 ops), score 2.000'), line
  # A tree drafter's loop: its draft calls as d one-position steps (here 2.5), not k.
  tree = dataclasses.replace(step, drafter='DynamicTreeDrafter(nodes=5, width=2)', draft_steps=2.5)
  assert abs(tree.formula_loop - (2.5 * 0.05 + 1.2) * 0.002) < 1e-15
  assert abs(tree.predicted - 5 / (2.5 * 0.05 + 1.2)) < 1e-12
  assert ceiling.report(tree, 'x')[0].startswith(
      '[x] perfect draft, DynamicTreeDrafter(nodes=5, width=2) (d = 2.5 draft steps a loop), k=4,')
  failed = ceiling.LoopProfile(loops=0, wall=None, phase={}, error='ProfileError: no events')
  line = ceiling.report(dataclasses.replace(step, loop=failed), 'x')[0]
  assert line.endswith('; profile failed: ProfileError: no events'), line


def test_a_step_runs_as_many_more_operations_for_each_layer_and_counting_compiles_nothing():
  def model(layers):
    return zero_model(models.TransformerConfig(vocab_size=64, d_model=32, num_layers=layers,
                                               num_heads=4, num_kv_heads=2, d_ff=64,
                                               max_seq_len=64))

  by_layers = {layers: model(layers) for layers in (1, 2, 3)}
  for m in by_layers.values():  # Capacity 10: no other test's programs.
    decode.extend_seconds(m, (1,), 10, repeats=1)
  with timing.CompileClock() as clock:
    launches = {layers: decode.extend_launches(m, 1, 10) for layers, m in by_layers.items()}
  assert clock.programs['jit(_extend_steps)'] == 0, clock.programs
  assert 0 < launches[1] < launches[2] < launches[3], launches
  assert launches[3] - launches[2] == launches[2] - launches[1], launches


def test_scanned_layers_compute_the_models_extend():
  config = models.TransformerConfig(vocab_size=64, d_model=32, num_layers=3, num_heads=4,
                                    num_kv_heads=2, d_ff=64, max_seq_len=64)
  model = models.Model(config, models.init_params(config, jax.random.key(3)))
  stacked, others = layer_scan.stack_layers(config, model.params)
  assert jax.tree.leaves(stacked)[0].shape[0] == 3 and set(others) == {
      'embedding', 'final_norm'}  # A tied output layer.
  # A cache with something in it: 5 positions, then 2 more through each path.
  _, cache = models.extend(config, model.params, models.init_cache(config, 2, 9),
                           jnp.arange(10, dtype=jnp.int32).reshape(2, 5) % 64)
  tokens = jnp.array([[7, 8], [9, 10]], jnp.int32)
  logits, want = models.extend(config, model.params, cache, tokens)
  got_logits, k, v = layer_scan.scanned_extend(config, others, stacked, jnp.stack(cache.k),
                                               jnp.stack(cache.v), cache.lengths, tokens)
  np.testing.assert_allclose(got_logits, logits, atol=1e-5)
  np.testing.assert_allclose(k, jnp.stack(want.k), atol=1e-6)
  np.testing.assert_allclose(v, jnp.stack(want.v), atol=1e-6)



@pytest.mark.parametrize('name', [n for n, (_, options) in variants.VARIANTS.items() if options])
def test_this_xla_parses_every_variants_options(name):
  """XLA:GPU's options are parsed on every backend: a name or value this jaxlib does not know
  fails here rather than on the accelerator."""
  jax.jit(lambda x: x + 1).lower(1.0).compile(compiler_options=variants.VARIANTS[name][1])


def test_step_variants_compile_afresh_and_compute_the_plain_steps_logits(monkeypatch, tmp_path):
  config = models.TransformerConfig(vocab_size=64, d_model=32, num_layers=3, num_heads=4,
                                    num_kv_heads=2, d_ff=64, max_seq_len=64)
  model = models.Model(config, models.init_params(config, jax.random.key(3)))
  # An option this XLA does not know fails its variant only.
  monkeypatch.setitem(variants.VARIANTS, 'unknown_option', ('plain', {'xla_gpu_nope': 1}))
  names = ['fused', 'scanned', 'padded', 'no_dot_merger', 'unknown_option']
  with timing.CompileClock() as clock:  # Loops of 3 steps: no other test's programs.
    found = variants.probe(model, 12, names, steps=3, repeats=1, dump_dir=str(tmp_path))
  assert [v.name for v in found] == ['plain'] + names
  # Dumped: each working program's HLO and a trace of one call, whose ops are that HLO's.
  assert sorted(p.name for p in tmp_path.glob('*.hlo.txt')) == [
      f'{n}.hlo.txt' for n in sorted(['plain'] + names[:-1])]
  for name in ('plain', 'scanned'):
    parsed = hlo.parse_hlo((tmp_path / f'{name}.hlo.txt').read_text())
    xplane, = tmp_path.glob(f'{name}/plugins/profile/*/*.xplane.pb')
    events = trace.read_op_events(str(xplane), parsed.module)
    assert events and {e.name for e in events} <= set(parsed.instructions), name
  failed = found.pop()
  assert 'No such compile option' in failed.error and np.isnan(failed.step_seconds), failed
  assert failed.ops is None and all(v.error is None for v in found), found
  # Each options variant compiles the plain program again (its options name XLA:GPU's passes;
  # the unknown one's attempt counts too); 'padded' its own.
  assert clock.programs['jit(_extend_steps)'] == 5 and clock.programs['jit(_scanned_steps)'] == 1
  assert all(v.compile_seconds > 0 and v.step_seconds > 0 and v.logit_diff < 1e-4
             for v in found), found
  ops = {v.name: v.ops for v in found}
  # Fused: one product for q, k and v and one for gate and input (3 fewer a layer, less what
  # slicing the fused outputs costs XLA:CPU). Scanned: the scan's body, one layer, counts once.
  assert ops['fused'] < ops['plain'] and ops['no_dot_merger'] == ops['plain'], ops
  assert ops['scanned'] < ops['plain'], ops
  with pytest.raises(ValueError, match='Unknown step variants'):
    variants.probe(model, 12, ['fused', 'unrolled'])
  with pytest.raises(ValueError, match='rotary'):
    variants.probe(models.Model(dataclasses.replace(config, position='learned'), {}), 12,
                   ['scanned'])
  with pytest.raises(ValueError, match='plain layout'):
    variants.probe(models.fuse(model), 12, [])


def test_a_head_s_level_calls_are_timed_on_their_positions():
  """An EAGLE head drafting a tree: `measure_costs` times a head call on each level's pairs
  (one program per width), and the loop's draft time is the sum over its calls."""
  config = models.TransformerConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=4,
                                    num_kv_heads=2, d_ff=64, max_seq_len=64)
  target = zero_model(config)
  head_config = models.feature_head.head_config(config)
  head = models.Model(head_config, models.feature_head.init_head('feature', head_config,
                                                                 jax.random.key(0)))
  with timing.CompileClock() as clock:
    costs = decode.measure_costs(target, head, 3, batch=2, capacity=24, repeats=1,
                                 tree=models.TokenTree.full((3, 2, 1)), draft_calls=(1, 3, 6))
  assert clock.programs['jit(_head_steps)'] == 3, clock.programs  # Widths 1, 3 and 6.
  assert costs.scored == 1 + 3 + 6 + 6 and costs.draft_loop > 0
  assert costs.draft_steps == pytest.approx(costs.draft_loop / costs.draft_step)
  one = decode.measure_costs(target, head, 3, batch=2, capacity=24, repeats=1)
  assert one.draft_loop is None and one.draft_steps is None and one.scored is None
