"""Profile parsing: HLO phase rules, a real SpS trace, and attribution that follows the work."""

import collections
import dataclasses
import functools
import glob
import gzip
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spsjax import models
from spsjax.bench import hlo as hlo_lib
from spsjax.bench import profile
from spsjax.sampling import speculative, speculative_sample

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


@pytest.fixture(scope='module')
def sps_hlo(sps):
  """The HLO of the program `sps` profiled, compiled the way `profile_speculative` does."""
  target, draft, *_ = sps
  loop, placed = speculative.prepare(target, draft, PROMPTS, LENGTHS, k=3, max_new_tokens=12)
  return profile.parse_hlo(
      speculative.Loop.run.lower(loop, *placed, jax.random.key(2)).compile().as_text())


def test_sps_hlo_has_all_three_phases(sps_hlo):
  hlo = sps_hlo
  assert set(hlo.phase.values()) == {'draft', 'score', 'accept', 'other'}
  once = hlo_lib.launches_by_phase(hlo, hlo.main_loop().body)
  runs = hlo_lib.launches_by_phase(hlo, hlo.main_loop().body, trips=True)
  assert set(runs) == {'draft', 'score', 'accept', 'other'}
  assert all(runs[p] >= once[p] for p in runs)
  assert runs['draft'] > once['draft']  # k = 3: the draft's loop of k - 1 steps, twice more.
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
  assert profile._gaps_ns(events, [phase_of[e.name] for e in events]) == [
      (0.0, None), (0.0, None), (5.0, 'draft'), (10.0, None), (0.0, None), (0.0, None),
      (10.0, None)]


# --- GPU kernels run by CUDA graphs ------------------------------------------------------------

def _data(name):
  return os.path.join(os.path.dirname(__file__), 'data', name)


def test_graph_kernels_keep_their_names_on_the_h100_trace():
  """The H100 SpS trace: kernels run by CUDA graphs carry the graph's thunk as their op."""
  with gzip.open(_data('h100_sps_generation.xplane.pb.gz')) as f:
    events = profile.read_op_events(f.read(), 'jit_run')
  graphed = [e for e in events if e.kernel]
  assert len(graphed) == 1232 and all(e.name.startswith('command_buffer_') for e in graphed)
  assert not any(e.name.startswith('command_buffer_') for e in events if not e.kernel)
  assert {'fusion_939', 'memcpy32_post'} <= {e.kernel for e in graphed}


@pytest.fixture(scope='module')
def h200_step():
  """An H200 trace of llama1b's batch-1 step program (4 decode steps in a while loop, every
  kernel in CUDA graphs) with its HLO: `spsjax.bench.trace` events, kept as JSON rows."""
  with gzip.open(_data('h200_llama1b_step.kernels.json.gz'), 'rt') as f:
    data = json.load(f)
  events = [profile.OpEvent(name, start, end, data['device'], data['run'], kernel)
            for name, kernel, start, end in data['rows']]
  with gzip.open(_data('h200_llama1b_step.hlo.txt.gz'), 'rt') as f:
    return events, profile.parse_hlo(f.read(), ('attn', 'mlp'))


def test_kernels_of_a_real_h200_program_are_as_many_as_their_fusions_runs(h200_step):
  """Each class of equal fusions ran as often as its fusions together: once each outside the
  loop, 4 times in its body; only the graphs' memcpys name no fusion."""
  events, hlo = h200_step
  owners = hlo.kernel_owners()
  body = set(hlo.computations[hlo.main_loop().body])
  ran = collections.Counter(owners[e.kernel] for e in events if e.kernel in owners)
  assert len(ran) > 30 and max(len(own) for own in ran) == 32  # Every layer's wk and wv copies.
  for own, count in ran.items():
    assert count == sum(4 if n in body else 1 for n in own), own
  assert {e.kernel for e in events if e.kernel not in owners} == {'memcpy32_post'}


def test_a_real_h200_program_is_profiled_through_its_graphs(h200_step):
  events, hlo = h200_step
  prof = profile.attribute(events, hlo, num_loops=4)
  assert len(prof.iterations) == 4 and prof.unnamed_ops == 2
  assert sum(prof.phase_s.values()) == pytest.approx(prof.busy_s + prof.overlap_s, rel=1e-9)
  # 16 layers, each running the same kernels for its MLP at every step; attention every step.
  assert prof.phase_ops['mlp'] % (4 * 16) == 0 and prof.phase_ops['attn'] % 4 == 0
  for p in ('attn', 'mlp'):
    each = [it.phase_s[p] for it in prof.iterations]
    assert 0 < max(each) < 1.05 * min(each), (p, each)
  text = '\n'.join(prof.report())
  assert 'MISMATCH' not in text and '2 GPU kernels' in text


KERNELS_HLO = """HloModule jit_k

%fused_sine (p.1: f32[4]) -> f32[4] {
  %p.1 = f32[4]{0} parameter(0)
  ROOT %sin.1 = f32[4]{0} sine(%p.1), metadata={op_name="jit(k)/draft/sin"}
}

%fused_cosine (p.2: f32[4]) -> f32[4] {
  %p.2 = f32[4]{0} parameter(0)
  ROOT %cos.1 = f32[4]{0} cosine(%p.2), metadata={op_name="jit(k)/score/cos"}
}

%fused_exp (p.3: f32[4]) -> f32[4] {
  %p.3 = f32[4]{0} parameter(0)
  ROOT %exp.1 = f32[4]{0} exponential(%p.3), metadata={op_name="jit(k)/draft/exp"}
}

%fused_exp.1 (p.4: f32[4]) -> f32[4] {
  %p.4 = f32[4]{0} parameter(0)
  ROOT %exp.2 = f32[4]{0} exponential(%p.4), metadata={op_name="jit(k)/score/exp"}
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %d = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_sine, metadata={op_name="jit(k)/draft/sin"}
  %fusion.1 = f32[4]{0} fusion(%d), kind=kLoop, calls=%fused_exp, metadata={op_name="jit(k)/draft/exp"}
  %s = f32[4]{0} fusion(%fusion.1), kind=kLoop, calls=%fused_cosine, metadata={op_name="jit(k)/score/cos"}
  ROOT %fusion.2 = f32[4]{0} fusion(%s), kind=kLoop, calls=%fused_exp.1, metadata={op_name="jit(k)/score/exp"}
}
"""


def test_shared_and_library_kernels_go_to_the_phase_around_them():
  hlo = profile.parse_hlo(KERNELS_HLO)
  owners = hlo.kernel_owners()  # fusion.2 runs fusion.1's kernel: equal code, other names.
  assert owners['fusion_1'] == owners['fusion_2'] == ('fusion.1', 'fusion.2')
  assert owners['d'] == ('d',) and owners['s'] == ('s',)
  kernels = ['d', 'fusion_1', 'd',  # Between two draft ops: draft.
             's', 'fusion_1', 's',  # Between two score ops: score.
             'fusion_1', 'd',  # Between score and draft: the named fusion's (fusion.1), draft.
             'cublas_gemm', 's',  # Library kernel between draft and score: other.
             'cublas_gemm', 's']  # Between two score ops: score.
  events = [profile.OpEvent('command_buffer_3', 10 * i, 10 * i + 2 ** i, '0', 'r', kernel)
            for i, kernel in enumerate(kernels)]
  prof = profile.attribute(events, hlo)
  charged = {'draft': [0, 1, 2, 6, 7], 'score': [3, 4, 5, 9, 10, 11], 'other': [8]}
  for p, which in charged.items():
    assert prof.phase_s[p] == pytest.approx(sum(2 ** i for i in which) * 1e-9, rel=1e-12), p
  assert prof.phase_ops['accept'] == 0
  assert (prof.mixed_ops, prof.unnamed_ops) == (3, 2)
  assert prof.unnamed_s == pytest.approx((2 ** 8 + 2 ** 10) * 1e-9, rel=1e-12)


def _as_graph_kernels(events, hlo, kernel_of):
  """CPU op events as a GPU trace shows them: each fusion a kernel `kernel_of(name)` run by a CUDA
  graph, each custom call (the native kernels) a library kernel naming nothing."""
  def graphed(e):
    opcode = hlo.instructions[e.name].opcode
    if opcode == 'fusion':
      return dataclasses.replace(e, name='command_buffer_1', kernel=kernel_of(e.name))
    if opcode == 'custom-call':
      return dataclasses.replace(e, name='command_buffer_1', kernel='library_gemm_kernel')
    return e
  return [graphed(e) for e in events]


def test_graph_kernels_of_an_sps_program_are_charged_like_their_fusions(sps, sps_hlo):
  *_, out, prof = sps
  hlo = sps_hlo
  events = profile.read_op_events(glob.glob(os.path.join(prof.trace_dir, '*.xplane.pb'))[0],
                                  hlo.module)
  assert {'fusion', 'custom-call'} <= {hlo.instructions[e.name].opcode for e in events}
  ref = profile.attribute(events, hlo, num_loops=prof.num_loops)
  owners = hlo.kernel_owners()
  assert any(len({hlo.phase[n] for n in own}) > 1 for own in owners.values())  # Draft = target.

  # Each fusion its own kernel: only library kernels can go elsewhere than their instruction.
  own = profile.attribute(_as_graph_kernels(events, hlo, lambda n: n.replace('.', '_')), hlo,
                          num_loops=prof.num_loops)
  # The kernels as XLA:GPU names them: after the first of each class of equal fusions.
  first = profile.attribute(
      _as_graph_kernels(events, hlo, lambda n: owners[n.replace('.', '_')][0].replace('.', '_')),
      hlo, num_loops=prof.num_loops)
  library = sum(hlo.instructions[e.name].opcode == 'custom-call' for e in events)
  for got, unsure in ((own, own.unnamed_s), (first, first.unnamed_s + first.mixed_s)):
    assert got.unnamed_ops == library > 0
    assert (got.total_s, got.busy_s) == (ref.total_s, ref.busy_s)
    assert len(got.iterations) == len(ref.iterations) == prof.num_loops
    assert sum(got.phase_s.values()) == pytest.approx(sum(ref.phase_s.values()), rel=1e-9)
    for p in ref.phase_s:
      assert abs(got.phase_s[p] - ref.phase_s[p]) <= unsure + 1e-12, (p, got.phase_s, ref.phase_s)
  assert first.mixed_s > ref.mixed_s  # Kernels shared by the draft's and the target's fusions.


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
  # GPU kernels in CUDA graphs (op: the graph's thunk) of which none names a fusion of the HLO.
  graphed = [dataclasses.replace(e, name='command_buffer_71', kernel='sm90_gemm') for e in one_run]
  with pytest.raises(profile.ProfileError, match='different compilations'):
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


def test_launches_count_a_nested_loop_by_its_trip_count():
  known = LOOP_HLO.replace('body=%inner_body', 'body=%inner_body, backend_config='
                           '{"known_trip_count":{"n":"3"}}')
  hlo = hlo_lib.parse_hlo(known)
  assert hlo.instructions['w'].trip_count == 3
  assert hlo_lib.launches_by_phase(hlo, 'body') == {'other': 6}
  # The body's four, and the inner loop's add and compare three times each.
  assert hlo_lib.launches_by_phase(hlo, 'body', trips=True) == {'other': 4 + 2 * 3}
  assert hlo_lib.parse_hlo(LOOP_HLO).instructions['w'].trip_count is None
  assert hlo_lib.launches_by_phase(hlo_lib.parse_hlo(LOOP_HLO), 'body', trips=True) == {
      'other': 6}  # A trip count XLA does not know counts once.
  assert hlo_lib.loop_launches_by_phase(known, trips=True) == {'other': 10}
  assert hlo_lib.loop_launches(known) == 6


def test_an_op_run_in_parts_still_marks_the_iterations(h200_step):
  """XLA:CPU runs some ops (a sort) as several events an iteration: counts that are multiples
  of the fewest still give the loop's iterations; a count that is not gives none."""
  events, hlo = h200_step
  owners = hlo.kernel_owners()
  body = set(hlo.computations[hlo.main_loop().body])
  name = next(e.kernel for e in events
              if e.kernel in owners and all(n in body for n in owners[e.kernel]))
  split = lambda e: [dataclasses.replace(e, end_ns=(e.start_ns + e.end_ns) // 2),
                     dataclasses.replace(e, start_ns=(e.start_ns + e.end_ns) // 2)]
  parts = [p for e in events for p in (split(e) if e.kernel == name else [e])]
  assert len(parts) == len(events) + 4
  assert len(profile.attribute(parts, hlo, num_loops=4).iterations) == 4
  first = next(i for i, e in enumerate(events) if e.kernel == name)
  once = events[:first] + split(events[first]) + events[first + 1:]
  assert profile.attribute(once, hlo, num_loops=4).iterations is None
