"""Profile parsing: HLO phase rules, a real SpS trace, and attribution that follows the work."""

import dataclasses
import functools
import glob
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spsjax import models
from spsjax.bench import hlo as hlo_lib
from spsjax.bench import profile
from spsjax.sampling import SamplingConfig, speculative, speculative_sample

# --- HLO rules on a hand-written module ---------------------------------------------------------

HLO = """HloModule jit_f, entry_computation_layout={(f32[4]{0})->(s32[], f32[4]{0})}

%fused_computation (param_0: f32[4]) -> f32[4] {
  %param_0 = f32[4]{0} parameter(0)
  %mul.1 = f32[4]{0} multiply(%param_0, %param_0), metadata={op_name="jit(f)/score/mul"}
  %sin.1 = f32[4]{0} sine(%mul.1), metadata={op_name="jit(f)/score/sin"}
  %cos.1 = f32[4]{0} cosine(%sin.1), metadata={op_name="jit(f)/score/cos"}
  ROOT %add.1 = f32[4]{0} add(%cos.1, %param_0), metadata={op_name="jit(f)/add"}
}

%fused_computation.1 (param_1: f32[4]) -> f32[4] {
  %param_1 = f32[4]{0} parameter(0)
  %exp.1 = f32[4]{0} exponential(%param_1), metadata={op_name="jit(f)/draft/exp"}
  ROOT %log.1 = f32[4]{0} log(%exp.1), metadata={op_name="jit(f)/accept/log"}
}

%fused_computation.2 (param_2: f32[4], param_3: f32[4,4]) -> f32[4] {
  %param_2 = f32[4]{0} parameter(0)
  %param_3 = f32[4,4]{1,0} parameter(1)
  %dot.1 = f32[4]{0} dot(%param_2, %param_3), lhs_contracting_dims={0}, rhs_contracting_dims={0}, metadata={op_name="jit(f)/score/dot_general"}
  %exp.2 = f32[4]{0} exponential(%dot.1), metadata={op_name="jit(f)/accept/exp"}
  ROOT %mul.2 = f32[4]{0} multiply(%exp.2, %exp.2), metadata={op_name="jit(f)/accept/mul"}
}

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add.2 = f32[] add(%a, %b), metadata={op_name="jit(f)/accept/reduce_sum"}
}

%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p = (s32[], f32[4]{0}) parameter(0)
  %x = f32[4]{0} get-tuple-element(%p), index=1
  %copy.1 = f32[4]{0} copy(%x)
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[4]{0}) tuple(%i, %copy.1)
}

%cond (p.1: (s32[], f32[4])) -> pred[] {
  %p.1 = (s32[], f32[4]{0}) parameter(0)
  ROOT %c = pred[] constant(false)
}

ENTRY %main (x.1: f32[4]) -> (s32[], f32[4]) {
  %x.1 = f32[4]{0} parameter(0), metadata={op_name="x"}
  %fusion.1 = f32[4]{0} fusion(%x.1), calls=%fused_computation, metadata={op_name="jit(f)/add"}
  %fusion.2 = f32[4]{0} fusion(%fusion.1), calls=%fused_computation.1, metadata={op_name="jit(f)/accept/log"}
  %w = f32[4,4]{1,0} constant({...})
  %fusion.3 = f32[4]{0} fusion(%fusion.2, %w), kind=kCustom, calls=%fused_computation.2, metadata={op_name="jit(f)/accept/mul"}
  %dot.2 = f32[4]{0} dot(%fusion.1, %w), lhs_contracting_dims={0}, rhs_contracting_dims={0}
  %copy.2 = f32[4]{0} copy(%dot.2)
  %zero = f32[] constant(0)
  %reduce.1 = f32[] reduce(%fusion.2, %zero), dimensions={0}, to_apply=%sum, metadata={op_name="jit(f)/draft/reduce_sum"}
  %n = s32[] constant(0)
  %tuple.1 = (s32[], f32[4]{0}) tuple(%n, %fusion.2)
  ROOT %while.1 = (s32[], f32[4]{0}) while(%tuple.1), condition=%cond, body=%body, metadata={op_name="jit(f)/draft/while"}
}
"""


def test_hlo_rules():
  hlo = profile.parse_hlo(HLO)
  assert hlo.module == 'jit_f'
  phase = hlo.phase
  assert phase['mul.1'] == 'score' and phase['add.1'] == 'other' and phase['x.1'] == 'other'
  assert phase['fusion.1'] == 'score'  # Own metadata unscoped: 3 score ops outvote 2 unscoped.
  assert phase['fusion.2'] == 'accept'  # Own metadata wins over the fused draft op,
  assert 'fusion.2' in hlo.mixed and 'fusion.1' not in hlo.mixed  # and it is counted as mixed.
  # A fusion holding a matrix product takes the product's phase, over its own metadata and the
  # majority of its elementwise ops (the output layer fused with the softmax that follows it).
  assert phase['fusion.3'] == 'score' and 'fusion.3' in hlo.mixed
  # No metadata: the operands' phase (fusion.1 is score), passed along to copy.2.
  assert phase['dot.2'] == 'score' and phase['copy.2'] == 'score'
  assert phase['reduce.1'] == 'draft' and 'reduce.1' not in hlo.mixed  # Reducers do not vote.
  assert phase['copy.1'] == 'draft'  # No metadata: the phase of the while running its body.
  assert phase['while.1'] == 'draft'
  assert hlo.main_loop().name == 'while.1'
  assert profile.hlo_phases(HLO) == dict(phase)


# --- A real SpS profile -------------------------------------------------------------------------

CONFIG = models.TransformerConfig(vocab_size=48, d_model=32, num_layers=2, num_heads=4,
                                  num_kv_heads=2, d_ff=64, max_seq_len=64)
DRAFT_CONFIG = models.TransformerConfig(vocab_size=48, d_model=32, num_layers=1, num_heads=4,
                                        num_kv_heads=2, d_ff=64, max_seq_len=64)
PROMPTS, LENGTHS = jnp.array([[1, 2, 3, 4], [5, 6, 7, 0]], jnp.int32), jnp.array([4, 3], jnp.int32)


def random_model(config, seed):
  """Gaussian weights of the right shapes, drawn by numpy: timing needs no trained values, and
  this skips compiling `init_params` (seconds on a busy 2-core machine)."""
  shapes = jax.eval_shape(functools.partial(models.init_params, config), jax.random.key(0))
  rng = np.random.default_rng(seed)
  return models.Model(config, jax.tree.map(
      lambda s: jnp.asarray(rng.normal(0.0, 0.3, s.shape), s.dtype), shapes))


@pytest.fixture(scope='module')
def sps(tmp_path_factory):
  target, draft = random_model(CONFIG, 0), random_model(DRAFT_CONFIG, 1)
  log_dir = str(tmp_path_factory.mktemp('sps_trace'))
  out, prof = profile.profile_speculative(target, draft, PROMPTS, LENGTHS, jax.random.key(2), k=3,
                                          max_new_tokens=12, log_dir=log_dir)
  return target, draft, log_dir, out, prof


def test_sps_hlo_has_all_three_phases(sps):
  target, draft, *_ = sps
  loop = speculative.Loop(k=3, max_new_tokens=12, sampling=SamplingConfig(),
                          draft_sampling=SamplingConfig())
  text = speculative.Loop.run.lower(
      loop, target, draft, PROMPTS, LENGTHS, jax.random.key(2)).compile().as_text()
  hlo = profile.parse_hlo(text)
  assert set(hlo.phase.values()) == {'draft', 'score', 'accept', 'other'}
  body = hlo.subtree([hlo.main_loop().body])
  assert {hlo.phase[n] for n in body} == {'draft', 'score', 'accept', 'other'}
  for name, i in hlo.instructions.items():  # Own metadata decides whenever it names a phase.
    if i.op_name and '/score/' in i.op_name:
      assert hlo.phase[name] == 'score'


def test_sps_profile(sps):
  target, draft, log_dir, out, prof = sps
  ref = speculative_sample(target, draft, PROMPTS, LENGTHS, jax.random.key(2), k=3,
                           max_new_tokens=12)
  np.testing.assert_array_equal(out.tokens, ref.tokens)  # Profiling runs the same program.

  assert os.path.dirname(prof.trace_dir) == os.path.join(log_dir, 'plugins', 'profile')
  assert glob.glob(os.path.join(prof.trace_dir, '*.xplane.pb'))
  assert glob.glob(os.path.join(prof.trace_dir, '*.trace.json.gz'))
  assert prof.module == 'jit_run'

  for p in ('draft', 'score', 'accept'):
    assert prof.phase_s[p] > 0 and prof.phase_ops[p] > 0 and prof.per_loop_s(p) > 0
  assert 0 < prof.busy_s <= prof.total_s
  assert sum(prof.phase_wall_s.values()) == pytest.approx(prof.busy_s, rel=1e-9)
  assert sum(prof.phase_s.values()) == pytest.approx(prof.busy_s + prof.overlap_s, rel=1e-9)
  assert sum(prof.phase_wall_s[p] for p in ('draft', 'score', 'accept')) <= prof.total_s
  assert 0 <= prof.loop_other_s <= prof.phase_s['other']

  # Loops: the caller's count (the program's iterations) matches the iterations in the trace.
  assert prof.num_loops == int(jnp.max(out.num_loops))
  assert prof.iterations is not None and len(prof.iterations) == prof.num_loops
  walls = [it.wall_s for it in prof.iterations]
  assert min(walls) > 0 and sum(walls) <= prof.total_s
  for p in ('draft', 'score', 'accept'):  # These run in the loop, but for what XLA hoists out.
    in_iterations = sum(it.phase_s[p] for it in prof.iterations)
    assert 0.5 * prof.phase_s[p] < in_iterations <= prof.phase_s[p] * (1 + 1e-9)
  for it in prof.iterations:
    assert sum(it.phase_wall_s.values()) + sum(it.phase_gap_s.values()) <= it.wall_s * (1 + 1e-9)
  gaps = sum(prof.phase_gap_s.values())
  assert 0 < gaps <= prof.idle_s * (1 + 1e-9)  # Thunks of one phase run with gaps between them.
  assert sum(sum(it.phase_gap_s.values()) for it in prof.iterations) <= gaps * (1 + 1e-9)

  lines = prof.report()
  assert all(isinstance(line, str) for line in lines)
  text = '\n'.join(lines)
  assert 'MISMATCH' not in text and 'not identified' not in text
  for p in ('draft', 'score', 'accept', 'other (in loop)', 'between ops', 'loop wall'):
    assert f'  {p}' in text


def test_idle_gaps_go_to_the_phase_on_both_sides_else_to_none():
  ev = lambda name, start, end: profile.OpEvent(name, start, end, '0', 'r')
  phase_of = {'d1': 'draft', 'd2': 'draft', 'd3': 'draft', 's1': 'score', 's2': 'score'}
  events = [ev('d1', 0, 10), ev('d2', 5, 20),  # Overlapping: no gap.
            ev('d3', 25, 30),  # 5 idle after d2, both draft.
            ev('s1', 40, 50),  # 10 idle at the change draft -> score: charged to none.
            ev('s2', 42, 45),  # Inside s1's span: no gap, though it starts after a shorter op.
            ev('d1', 47, 60),
            ev('s2', 70, 71)]  # After d1 (ended last, at 60), not s2 (45): a change of phase.
  assert profile._gaps_ns(events, phase_of) == [
      (0.0, None), (0.0, None), (5.0, 'draft'), (10.0, None), (0.0, None), (0.0, None),
      (10.0, None)]


# --- Attribution follows the work ---------------------------------------------------------------

@jax.jit
def _toy(x_NxN, n):
  """`light` (a scalar add) runs before `heavy` (a 256^3 matmul) in each of n loop iterations."""
  def body(carry):
    i, x_NxN, acc = carry
    with jax.named_scope('light'):
      acc = acc + x_NxN[0, 0]
    with jax.named_scope('heavy'):
      x_NxN = jnp.tanh(x_NxN @ x_NxN)
    return i + 1, x_NxN, acc

  return jax.lax.while_loop(lambda carry: carry[0] < n, body, (0, x_NxN, 0.0))


LOOPS = 5


@pytest.fixture(scope='module')
def toy():
  args = (jnp.full((256, 256), 0.01, jnp.float32), jnp.int32(LOOPS))
  return _toy.lower(*args).compile(), args


def test_heavy_scope_gets_the_time(toy, tmp_path):
  compiled, args = toy
  _, prof = profile.profile_compiled(compiled, *args, log_dir=str(tmp_path),
                                     phases=('light', 'heavy'), num_loops=LOOPS)
  # Structure: one light op per iteration, the heavy ones at least as often, every iteration
  # holding both, and the iterations together holding all of both phases' time.
  assert prof.phase_ops['light'] == LOOPS and prof.phase_ops['heavy'] >= LOOPS
  assert len(prof.iterations) == LOOPS
  for it in prof.iterations:
    assert it.phase_s['heavy'] > 0 and it.phase_s['light'] > 0
    assert it.phase_wall_s['heavy'] > 0 and it.phase_wall_s['light'] > 0
  for p in ('light', 'heavy'):
    assert sum(it.phase_s[p] for it in prof.iterations) == pytest.approx(prof.phase_s[p])
  # The work: a 256^3 matmul and a scalar add differ ~1000x (0.4 ms and 0.4 us here). A preempted
  # op can take milliseconds, so no single op is compared: the median over the iterations of the
  # heavy / light ratio stands even if two of the five light ops were preempted.
  for field in ('phase_s', 'phase_wall_s'):
    ratios = [getattr(it, field)['heavy'] / getattr(it, field)['light'] for it in prof.iterations]
    assert np.median(ratios) > 20, (field, ratios)


def test_refuses_two_runs_and_foreign_hlo(toy, tmp_path):
  compiled, args = toy
  jax.block_until_ready(compiled(*args))
  _, xplane, _ = profile.record(lambda: (compiled(*args), compiled(*args)), str(tmp_path))
  hlo = profile.parse_hlo(compiled.as_text(), ('light', 'heavy'))
  events = profile.read_op_events(xplane, hlo.module)
  with pytest.raises(profile.ProfileError, match='2 runs'):
    profile.attribute(events, hlo)
  one_run = [e for e in events if e.run == events[0].run]
  other = profile.parse_hlo(HLO.replace('HloModule jit_f', f'HloModule {hlo.module}'))
  with pytest.raises(profile.ProfileError, match='different compilations'):
    profile.attribute(one_run, other)
  # A GPU's kernels inside a CUDA graph carry the graph's thunk as their op (the H100 trace).
  graphed = [dataclasses.replace(e, name='command_buffer_71') for e in one_run[:1]] + one_run[1:]
  with pytest.raises(profile.ProfileError, match='xla_gpu_enable_command_buffer='):
    profile.attribute(graphed, hlo)
  with pytest.raises(profile.ProfileError, match='No XLA op events'):
    profile.read_op_events(xplane, 'jit_not_run')


LOOP_HLO = """HloModule jit_g, entry_computation_layout={(f32[4]{0})->(s32[], f32[4]{0})}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(f32[] %a, f32[] %b)
}

%fused_computation (p0: f32[4]) -> f32[4] {
  %p0 = f32[4]{0} parameter(0)
  %e = f32[4]{0} exponential(f32[4]{0} %p0)
  ROOT %n = f32[4]{0} negate(f32[4]{0} %e)
}

%inner_body (s: (s32[], f32[4])) -> (s32[], f32[4]) {
  %s = (s32[], f32[4]{0}) parameter(0)
  %j = s32[] get-tuple-element((s32[], f32[4]{0}) %s), index=0
  %y = f32[4]{0} get-tuple-element((s32[], f32[4]{0}) %s), index=1
  %one = s32[] constant(1)
  %j1 = s32[] add(s32[] %j, s32[] %one)
  ROOT %inner_out = (s32[], f32[4]{0}) tuple(s32[] %j1, f32[4]{0} %y)
}

%inner_cond (s: (s32[], f32[4])) -> pred[] {
  %s = (s32[], f32[4]{0}) parameter(0)
  %j = s32[] get-tuple-element((s32[], f32[4]{0}) %s), index=0
  %three = s32[] constant(3)
  ROOT %lt = pred[] compare(s32[] %j, s32[] %three), direction=LT
}

%body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element((s32[], f32[4]{0}) %t), index=0
  %x = f32[4]{0} get-tuple-element((s32[], f32[4]{0}) %t), index=1
  %f = f32[4]{0} fusion(f32[4]{0} %x), kind=kLoop, calls=%fused_computation
  %c = f32[4]{0} copy(f32[4]{0} %f)
  %v = f32[2,2]{1,0} bitcast(f32[4]{0} %c)
  %zero = f32[] constant(0)
  %r = f32[] reduce(f32[4]{0} %c, f32[] %zero), dimensions={0}, to_apply=%add
  %start = (s32[], f32[4]{0}) tuple(s32[] %i, f32[4]{0} %c)
  %w = (s32[], f32[4]{0}) while((s32[], f32[4]{0}) %start), condition=%inner_cond, body=%inner_body
  %z = f32[4]{0} get-tuple-element((s32[], f32[4]{0}) %w), index=1
  %one = s32[] constant(1)
  %i1 = s32[] add(s32[] %i, s32[] %one)
  ROOT %out = (s32[], f32[4]{0}) tuple(s32[] %i1, f32[4]{0} %z)
}

%cond (t: (s32[], f32[4])) -> pred[] {
  %t = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element((s32[], f32[4]{0}) %t), index=0
  %eight = s32[] constant(8)
  ROOT %lt = pred[] compare(s32[] %i, s32[] %eight), direction=LT
}

ENTRY %main (x: f32[4]) -> (s32[], f32[4]) {
  %x = f32[4]{0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[4]{0}) tuple(s32[] %zero, f32[4]{0} %x)
  ROOT %loop = (s32[], f32[4]{0}) while((s32[], f32[4]{0}) %init), condition=%cond, body=%body
}
"""


def test_launches_count_what_runs_work_once_and_fused_code_not_at_all():
  hlo = hlo_lib.parse_hlo(LOOP_HLO)
  assert hlo.main_loop().body == 'body'
  # The fusion, the copy, the reduce and the counter's add; the inner loop's add and compare.
  # Not: the fused exponential and negate, the reducer's add, the bitcast, plumbing, the while.
  assert hlo_lib.launches(hlo, 'body') == 6
  assert hlo_lib.launches(hlo, 'inner_body') == 1
  assert hlo_lib.launches(hlo, 'main') == 6 + 1  # The outer condition's compare too.
