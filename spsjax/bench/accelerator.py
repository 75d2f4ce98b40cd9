"""What `experiments/accelerator_check.py` checks and measures on whatever JAX backend runs it.

Three parts, each usable alone:
- `exactness_checks`: SpS on XLA's ops (a one-device mesh: the path TPUs and GPUs take) against
  the enumerated law of its target (G-tests, `eval.exactness`) at temperature 1 and top-p, k = 2
  and 4, 5 tokens per row, on a batch of two interleaved prompts of different lengths; in
  bfloat16, where the cached and uncached forwards round differently, SpS against ArS of the same
  bfloat16 model (a two-sample test); and greedy SpS against greedy ArS token for token.
- `one_program_check`: a whole SpS generation dispatches one executable (counted in a profiler
  trace of the call: every execution of every XLA module); the same trace gives its loop's time
  per phase (`profile.attribute`, through the CUDA graphs on a GPU).
- `decode_figures` / `ceilings`: per model and batch, ArS time per token and per decoding step,
  the rate at which a step reads the weights against the device's copy bandwidth, s(k + 1) =
  `extend` on k + 1 positions / on 1, s(tree) = the call scoring a tree of drafts / one step,
  and the perfect-draft ceiling (`bench.ceiling`).
`markdown` puts them on one screen.
"""

import concurrent.futures
import dataclasses
import functools
import tempfile
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from spsjax import models, sampling, sharding
from spsjax.bench import ceiling, decode, profile, sampling_costs, timing, trace, variants
from spsjax.eval import exactness
from spsjax.sampling import SamplingConfig, speculative

GREEDY = SamplingConfig(temperature=0.0)
# The exactness checks' tiny pair: 7 tokens, far-apart laws (as in tests/test_speculative.py).
_V = 7
_PROMPTS = ((1, 4, 2), (5,))
_NEW = 5
T = TypeVar('T')
# (name, sampling, k) of each law check, by dtype. bfloat16 checks untruncated laws only: its
# logits move with how XLA compiles a call (fusion, shapes), and a cut (top-k, top-p) turns that
# into a different support at near ties. On this tiny pair in bfloat16 the same forward, compiled
# alone or inside one program with the sampling, gives logits 0.2417 / 0.2423 or 0.2606 / 0.2322
# for two tokens at top-k 3's cut; SpS and ArS at top-k 3 then differ at p < 1e-100, on an H100
# and on a CPU, where float32 agrees with the enumerated law.
LAWS = {
    'float32': (('temperature 1', SamplingConfig(), 2),
                ('top-p 0.8', SamplingConfig(top_p=0.8), 4)),
    'bfloat16': (('temperature 1', SamplingConfig(), 2),
                 ('temperature 0.7', SamplingConfig(temperature=0.7), 4)),
}


@dataclasses.dataclass(frozen=True)
class Check:
  name: str
  passed: bool
  detail: str


def _cast(model: models.Model, dtype: str) -> models.Model:
  config = dataclasses.replace(model.config, dtype=dtype)
  return models.Model(config, jax.tree.map(lambda x: x.astype(dtype), model.params))


def one_device_mesh() -> jax.sharding.Mesh:
  """A 1 x 1 mesh: the samplers then run XLA's ops (no native CPU kernels), on any backend."""
  return sharding.make_mesh(1, 1, jax.devices()[:1])


@functools.cache
def _tiny_pair(dtype: str) -> tuple[models.Model, models.Model]:
  """The law checks' pair: the same float32 weights in every dtype (made once per process)."""
  if dtype != 'float32':
    return tuple(_cast(m, dtype) for m in _tiny_pair('float32'))
  config = lambda layers: models.TransformerConfig(
      vocab_size=_V, d_model=16, num_layers=layers, num_heads=2, d_ff=32, max_seq_len=16,
      tie_embeddings=False)
  return exactness.scaled_model(config(2), 0, 1.5), exactness.scaled_model(config(1), 1, 1.5)


def _interleaved(rows: int) -> tuple[np.ndarray, np.ndarray]:
  """`rows` prompts alternating between `_PROMPTS` (right-padded): a ragged batch."""
  prompts = np.zeros((rows, max(map(len, _PROMPTS))), np.int32)
  lengths = np.zeros((rows,), np.int32)
  for i, prompt in enumerate(_PROMPTS):
    prompts[i::2, :len(prompt)] = prompt
    lengths[i::2] = len(prompt)
  return prompts, lengths


def exactness_checks(dtype: str, *, rows: int, p_min: float = 1e-5, seed: int = 0,
                     laws: Sequence[tuple[str, SamplingConfig, int]] | None = None,
                     threads: int = 1) -> list[Check]:
  """The law checks (`LAWS`, each prompt its own G-test) and greedy SpS == greedy ArS, on XLA's
  ops in `dtype`. float32: against the enumerated law of the target; bfloat16: against ArS of
  the same model. A correct sampler fails each law check with probability p_min. The law checks
  run `threads` at a time (their programs compile side by side)."""
  mesh = one_device_mesh()
  target, draft = _tiny_pair(dtype)
  prompts, lengths = _interleaved(rows)

  def law_check(name: str, config: SamplingConfig, k: int) -> Check:
    key = jax.random.key(seed + k)
    sps = np.asarray(sampling.speculative_sample(
        target, draft, prompts, lengths, key, k=k, max_new_tokens=_NEW, sampling=config,
        mesh=mesh).tokens)
    if dtype == 'float32':
      against = 'the enumerated law'
      pvalues = [exactness.g_test_pvalue(exactness.sequence_counts(sps[i::2], _V),
                                         exactness.exact_sequence_law(target, prompt, _NEW, config))
                 for i, prompt in enumerate(_PROMPTS)]
    else:
      against = 'ArS'
      ars = np.asarray(sampling.autoregressive_sample(
          target, prompts, lengths, jax.random.fold_in(key, 1), max_new_tokens=_NEW,
          sampling=config, mesh=mesh).tokens)
      pvalues = [exactness.two_sample_pvalue(exactness.sequence_counts(sps[i::2], _V),
                                             exactness.sequence_counts(ars[i::2], _V))
                 for i in range(len(_PROMPTS))]
    return Check(
        _law_name(dtype, name, k), min(pvalues) > p_min,
        f'G-test against {against}, {rows // 2:,} rows per prompt: p = '
        + ', '.join(f'{p:.2g}' for p in pvalues) + f' (fails below {p_min:g})')

  jobs = [functools.partial(guarded, _law_name(dtype, name, k),
                            functools.partial(law_check, name, config, k))
          for name, config, k in (LAWS[dtype] if laws is None else laws)]
  with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
    checks = list(pool.map(lambda job: job(), jobs))
  return checks + [guarded(f'{dtype} greedy SpS == greedy ArS', lambda: greedy_check(dtype, mesh))]


def _law_name(dtype: str, name: str, k: int) -> str:
  return f'{dtype} SpS law, {name}, k={k}, {_NEW} tokens, ragged batch'


def guarded(name: str, check: Callable[[], Check]) -> Check:
  """`check()`, or a failed check named `name` that says what it raised."""
  try:
    return check()
  except Exception as e:  # pylint: disable=broad-except
    traceback.print_exc()
    return Check(name, False, f'raised {type(e).__name__}: {e}'[:500].replace('|', '/'))


def greedy_check(dtype: str, mesh, *, k_values: Sequence[int] = (2, 4)) -> Check:
  """Greedy SpS emits greedy ArS's tokens, on a ragged batch of a random pair."""
  config = lambda layers, width: models.TransformerConfig(
      vocab_size=64, d_model=width, num_layers=layers, num_heads=4, num_kv_heads=2, d_ff=2 * width,
      max_seq_len=64, dtype=dtype)
  target = models.Model(config(2, 32), models.init_params(config(2, 32), jax.random.key(0)))
  draft = models.Model(config(1, 24), models.init_params(config(1, 24), jax.random.key(1)))
  rng = np.random.default_rng(0)
  lengths = rng.integers(1, 9, size=6).astype(np.int32)
  prompts = rng.integers(0, 64, size=(6, 8)).astype(np.int32)
  ars = np.asarray(sampling.autoregressive_sample(target, prompts, lengths, jax.random.key(2),
                                                  max_new_tokens=24, sampling=GREEDY,
                                                  mesh=mesh).tokens)
  same = [np.array_equal(ars, np.asarray(sampling.speculative_sample(
      target, draft, prompts, lengths, jax.random.key(3), k=k, max_new_tokens=24,
      sampling=GREEDY, mesh=mesh).tokens)) for k in k_values]
  return Check(f'{dtype} greedy SpS == greedy ArS', all(same),
               ', '.join(f'k={k}: {"same tokens" if s else "DIFFERENT tokens"}'
                         for k, s in zip(k_values, same)) + ', 6 ragged rows x 24 tokens')


def executions(xspace: bytes) -> dict[str, int]:
  """{XLA module: times it ran} in a profiler trace. TPU: the `XLA Modules` lines of device
  planes. GPU: the host's `...Execute (<module>)` events, one per dispatch (stats `run_id`,
  `name`). CPU: the distinct run ids of op events (stats `hlo_module`, `run_id`)."""
  data = jax.profiler.ProfileData.from_serialized_xspace(xspace)
  by_line, dispatches, runs = {}, {}, set()
  for plane in data.planes:
    for line in plane.lines:
      for e in line.events:
        if line.name == 'XLA Modules' and plane.name.startswith('/device:'):
          by_line[e.name] = by_line.get(e.name, 0) + 1
        stats = dict(e.stats)
        if 'hlo_module' in stats and 'run_id' in stats:
          runs.add((str(stats['hlo_module']), str(stats['run_id'])))
        elif 'run_id' in stats and 'name' in stats and 'Execute' in e.name:
          dispatches[str(stats['name'])] = dispatches.get(str(stats['name']), 0) + 1
  if by_line or dispatches:
    return by_line or dispatches
  counts = {}
  for module, _ in runs:
    counts[module] = counts.get(module, 0) + 1
  if not counts:
    raise trace.ProfileError('The trace names no XLA module executions.')
  return counts


def device_to_host_copies(xspace: bytes) -> int:
  """Device-to-host copies on the device planes (a GPU runs a while loop's condition on the
  host: one 4-byte copy per iteration); 0 where the trace has none (CPU, TPU)."""
  data = jax.profiler.ProfileData.from_serialized_xspace(xspace)
  return sum(e.name == 'MemcpyD2H' for plane in data.planes if plane.name.startswith('/device:')
             for line in plane.lines for e in line.events)


@dataclasses.dataclass(frozen=True)
class GraphIdle:
  """Where a GPU's kernels leave it idle during a traced run; microseconds."""
  span_us: float  # First kernel's start to last kernel's end.
  busy_us: float  # Time some kernel runs.
  idle_in_graphs_us: float  # Gaps between kernels of one CUDA graph.
  idle_between_us: float  # Gaps where the next kernel is in another graph, or in none.
  boundaries: int  # Changes of graph (or into or out of a graph) along the run.


def graph_idle(xspace: bytes) -> GraphIdle | None:
  """The idle time of a GPU trace's kernels, split by where it falls: inside one CUDA graph
  (XLA's command buffers: kernel events carry `cuda_graph_id`) or between graphs, where the host
  launches the next one (and reads a loop's condition). None where no kernel ran in a graph (CPU,
  TPU, or a GPU run without command buffers)."""
  data = jax.profiler.ProfileData.from_serialized_xspace(xspace)
  kernels = sorted(((e.start_ns, e.end_ns, dict(e.stats).get('cuda_graph_id'))
                    for plane in data.planes if plane.name.startswith('/device:GPU')
                    for line in plane.lines for e in line.events), key=lambda k: k[0])
  if not any(graph is not None for _, _, graph in kernels):
    return None
  busy = inside = between = 0.0
  boundaries, (last_end, last_graph) = 0, kernels[0][1:]
  busy_from = kernels[0][0]
  for start, end, graph in kernels[1:]:
    if graph != last_graph:
      boundaries += 1
    if start > last_end:  # A gap: no kernel runs from last_end to start.
      busy += last_end - busy_from
      busy_from = start
      if graph == last_graph:
        inside += start - last_end
      else:
        between += start - last_end
    if end > last_end:
      last_end, last_graph = end, graph
  busy += last_end - busy_from
  return GraphIdle(span_us=(last_end - kernels[0][0]) / 1e3, busy_us=busy / 1e3,
                   idle_in_graphs_us=inside / 1e3, idle_between_us=between / 1e3,
                   boundaries=boundaries)


def one_program_check(*, k: int = 4, max_new_tokens: int = 10,
                      keep: Callable[[bytes], None] | None = None) -> Check:
  """A whole SpS generation (prefill and every loop, 6 ragged rows at temperature 1) dispatches
  exactly one executable: no host round trip between loops. The detail gives the loop's op time
  per phase from the same trace (or why not: the check does not depend on it)."""
  mesh = one_device_mesh()
  target, draft = _tiny_pair('float32')
  prompts, lengths = _interleaved(6)
  loop, args = speculative.prepare(target, draft, prompts, lengths, k=k,
                                   max_new_tokens=max_new_tokens, sampling=SamplingConfig(),
                                   mesh=mesh)
  args += (jax.random.key(0),)
  compiled = speculative.Loop.run.lower(loop, *args).compile()
  out = jax.block_until_ready(compiled(*args))
  with tempfile.TemporaryDirectory() as log_dir:
    out, _, xspace = trace.record(lambda: compiled(*args), log_dir)
  if keep:
    keep(xspace)
  ran = executions(xspace)
  loops = int(np.max(out.num_loops))
  copies = device_to_host_copies(xspace)
  idle = graph_idle(xspace)
  return Check('one compiled program per generation', sum(ran.values()) == 1 and loops > 1,
               f'{sum(ran.values())} executable(s) dispatched for {loops} loops: '
               + ', '.join(f'{m} x{n}' for m, n in sorted(ran.items()))
               + (f'; {copies} device-to-host copies (the while loops\' conditions)'
                  if copies else '')
               + (f'; kernels busy {idle.busy_us / idle.span_us:.0%} of {idle.span_us:.0f} us, '
                  f'idle {idle.idle_between_us:.0f} us at {idle.boundaries} CUDA-graph '
                  f'boundaries, {idle.idle_in_graphs_us:.0f} us inside graphs' if idle else '')
               + '; ' + loop_phases(xspace, compiled.as_text(), loops))


def loop_phases(xspace: bytes, hlo_text: str, loops: int) -> str:
  """'op time per loop: draft .. us, ...' of an SpS program's trace and HLO, or why not (any
  error: the one-program check does not depend on it)."""
  try:
    hlo = profile.parse_hlo(hlo_text)
    prof = profile.attribute(trace.read_op_events(xspace, hlo.module), hlo, num_loops=loops)
  except Exception as e:  # pylint: disable=broad-except
    return f'phases not attributed: {type(e).__name__}: {e}'
  found = (f'{len(prof.iterations)} found in the trace' if prof.iterations is not None
           else f'none found in the trace: {prof.iterations_note}')
  return ('op time per loop: ' + ', '.join(
      f'{p} {t * 1e6:.0f} us' for p, t in prof.per_loop().items())
          + f' (loops: {found}'
          + (f'; {prof.unnamed_ops} library kernels charged by their neighbours'
             if prof.unnamed_ops else '') + ')')


@dataclasses.dataclass(frozen=True)
class DecodeRow:
  """One model at one batch size; seconds, bytes."""
  preset: str
  dtype: str
  batch: int
  num_params: int
  weight_bytes: int  # What a step reads of the weights (`decode.weight_bytes_per_token`).
  step: float  # `extend` of 1 position per row, inside a jitted loop.
  s: dict[int, float]  # T -> `extend` of T positions / of 1.
  ars_call: float  # `autoregressive_sample` of max_new_tokens per row, whole call.
  ars_prefill: float  # The same call stopping after the prefill's token.
  max_new_tokens: int
  launches: int | None = None  # Operations a 1-position step runs (`decode.extend_launches`).
  # Label -> a call on that token tree (its nodes and root) / `extend` of 1 position.
  s_tree: dict[str, float] = dataclasses.field(default_factory=dict)

  @property
  def ars_step(self) -> float:
    """ArS time per decoding step (prefill subtracted)."""
    return (self.ars_call - self.ars_prefill) / (self.max_new_tokens - 1)

  @property
  def ars_per_token(self) -> float:
    """Whole ArS call per generated token of one row."""
    return self.ars_call / self.max_new_tokens

  @property
  def weight_rate(self) -> float:
    """GB/s of weights read by an ArS decoding step (all of its time charged to them)."""
    return self.weight_bytes / self.ars_step / 1e9


def decode_figures(model: models.Model, preset: str, *, batch: int, blocks: Sequence[int],
                   prompt_len: int, max_new_tokens: int, repeats: int,
                   capacity: int | None = None, compile_threads: int = 1,
                   trees: Mapping[str, models.TokenTree] | None = None) -> DecodeRow:
  """`extend` at 1 and each of `blocks` positions per row and on each of `trees` (a label
  each; the target's call scoring a tree of drafts), at a cache of `capacity` slots (default
  prompt, new tokens and the largest block), and ArS, at `batch` rows; each group's programs
  compiled `compile_threads` at a time (`timing.warm`)."""
  trees = dict(trees or {})
  largest = max(list(blocks) + [t.num_nodes + 1 for t in trees.values()])
  capacity = capacity or prompt_len + max_new_tokens + largest
  times, _, _ = decode.extend_seconds(model, (1,) + tuple(blocks) + tuple(trees.values()),
                                      capacity, repeats=repeats, batch=batch,
                                      compile_threads=compile_threads)
  prompts = (np.arange(batch * prompt_len, dtype=np.int32).reshape(batch, prompt_len) * 7
             + 1) % model.config.vocab_size
  lengths = np.full((batch,), prompt_len, np.int32)
  prompts, lengths = jnp.asarray(prompts), jnp.asarray(lengths)
  ars = lambda n: lambda i: sampling.autoregressive_sample(
      model, prompts, lengths, jax.random.key(i), max_new_tokens=n, sampling=SamplingConfig())
  runs = {'call': ars(max_new_tokens), 'prefill': ars(1)}
  if compile_threads > 1:
    timing.warm([functools.partial(run, 0) for run in runs.values()], threads=compile_threads)
  timed = timing.time_interleaved(runs, repeats, bucket=lambda i: 0)
  median = {name: float(np.median([c.seconds for c in t.calls])) for name, t in timed.items()}
  return DecodeRow(preset=preset, dtype=model.config.dtype, batch=batch,
                   num_params=models.num_params(model.params),
                   weight_bytes=decode.weight_bytes_per_token(model.config, model.params),
                   step=times[1], s={T: times[T] / times[1] for T in blocks},
                   ars_call=median['call'], ars_prefill=median['prefill'],
                   max_new_tokens=max_new_tokens,
                   launches=decode.extend_launches(model, 1, capacity, batch=batch),
                   s_tree={label: times[tree] / times[1] for label, tree in trees.items()})


def ceilings(target: models.Model, draft: models.Model, *, ks: Sequence[int], prompt_len: int,
             max_new_tokens: int, repeats: int, capacity: int | None = None,
             compile_threads: int = 1, profile_dir: str | None = None,
             top_p: float = 1.0, drafter=None) -> list[ceiling.Ceiling]:
  """The perfect-draft ceiling (zero output layers: every draft accepted) at each k, batch 1,
  temperature 1 and `top_p`, of the chain or of a tree `drafter` (`ceiling.measure`); c and s at
  a cache of `capacity` slots (`decode_figures`' capacity reuses its programs). With
  `profile_dir`, one SpS call per k is profiled under `profile_dir/k<k>`."""
  pair = ceiling.perfect_pair(target, draft)
  return [ceiling.measure(*pair, k=k, prompt_len=prompt_len, max_new_tokens=max_new_tokens,
                          repeats=repeats, capacity=capacity, compile_threads=compile_threads,
                          profile_dir=profile_dir and f'{profile_dir}/k{k}', top_p=top_p,
                          drafter=drafter)
          for k in ks]


@functools.partial(jax.jit, static_argnums=(2, 3))
def _random_leaf(key: jax.Array, index: jax.Array, shape: tuple[int, ...], dtype: str) -> jax.Array:
  if len(shape) == 1:  # Norm scales (biases would be 0; timing cannot tell).
    return jnp.ones(shape, dtype)
  key = jax.random.fold_in(key, index)  # Inside: no program per leaf to split the keys.
  return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def random_model(preset_kwargs: dict, dtype: str, seed: int) -> models.Model:
  """The preset with random weights for timing: normal with std 0.02, vectors 1. Each leaf is
  drawn by a small program of its shape (a few shapes in all), where `models.init_params` compiles
  one large program for the whole tree (`llama1b` on a 2-core CPU: 14-24 s of compiling, these
  7 programs 3 s)."""
  config = models.TransformerConfig(**dict(preset_kwargs, dtype=dtype))
  leaves, tree = jax.tree.flatten(models.param_shapes(config))
  key = jax.random.key(seed)
  params = [_random_leaf(key, i, x.shape, str(x.dtype)) for i, x in enumerate(leaves)]
  return models.Model(config, jax.tree.unflatten(tree, params))


def device_description() -> str:
  d = jax.devices()[0]
  return (f'{jax.device_count()} x {getattr(d, "device_kind", d.platform)} '
          f'({jax.default_backend()}), JAX {jax.__version__}')


@dataclasses.dataclass
class Report:
  """What a run has found so far; `markdown` renders it at any point (the binary rewrites the
  file after each step, so a run cut short keeps what it measured)."""
  device: str
  command: str
  checks: list[Check] = dataclasses.field(default_factory=list)
  copy: decode.CopyBandwidth | None = None
  rows: list[DecodeRow] = dataclasses.field(default_factory=list)
  ceiling_rows: list[tuple[str, ceiling.Ceiling]] = dataclasses.field(default_factory=list)
  variant_rows: list[tuple[str, int, list[variants.Variant]]] = dataclasses.field(
      default_factory=list)  # (preset, batch, the plain step and its variants).
  sampling: tuple[int, list[sampling_costs.Cost]] | None = None  # (vocabulary, costs).
  errors: list[str] = dataclasses.field(default_factory=list)
  time_spent: str = ''  # Where the run's wall time went (compiling, the rest).

  def attempt(self, what: str, measure: Callable[[], T]) -> T | None:
    """`measure()`, or None with the exception recorded in `errors` (the run goes on)."""
    try:
      return measure()
    except Exception as e:  # pylint: disable=broad-except
      self.errors.append(f'{what}: {type(e).__name__}: {e}'[:500])
      traceback.print_exc()
      return None

  def markdown(self) -> str:
    return markdown(device=self.device, copy=self.copy, checks=self.checks, rows=self.rows,
                    ceiling_rows=self.ceiling_rows, command=self.command, errors=self.errors,
                    time_spent=self.time_spent, variant_rows=self.variant_rows,
                    sampling=self.sampling)


def markdown(*, device: str, copy: decode.CopyBandwidth | None, checks: Sequence[Check],
             rows: Sequence[DecodeRow], ceiling_rows: Sequence[tuple[str, ceiling.Ceiling]],
             command: str, errors: Sequence[str] = (), time_spent: str = '',
             variant_rows: Sequence[tuple[str, int, Sequence[variants.Variant]]] = (),
             sampling: tuple[int, Sequence[sampling_costs.Cost]] | None = None) -> str:
  """The one-screen report."""
  lines = [f'# Accelerator check: {device}', '', f'`{command}`', '']
  if time_spent:
    lines += [time_spent, '']
  if errors:
    lines += ['Errors (the run went on without these figures):', '']
    lines += [f'- `{e}`' for e in errors]
    lines.append('')
  if checks:
    lines += ['| check | result | detail |', '|---|---|---|']
    lines += [f'| {c.name} | {"pass" if c.passed else "FAIL"} | {c.detail} |' for c in checks]
    lines.append('')
  if rows:
    copy_text = f'{copy.best:.0f} GB/s (read + written, best of three copies)' if copy else '-'
    blocks = sorted({T for r in rows for T in r.s})
    trees = list(dict.fromkeys(label for r in rows for label in r.s_tree))
    lines += [f'Copy bandwidth: {copy_text}. Random weights; ArS at temperature 1.'
              + (' s(tree b): the target\'s call on a tree of drafts (branching b; its nodes '
                 'and root) / one step.' if trees else ''), '',
              '| model | dtype | batch | params | ArS ms/token | ArS ms/step | weights GB/s (of copy) '
              '| ops/step | ' + ' | '.join([f's({T})' for T in blocks]
                                          + [f's(tree {label})' for label in trees]) + ' |',
              '|---|---|---|---|---|---|---|---|' + '---|' * (len(blocks) + len(trees))]
    for r in rows:
      share = f' ({r.weight_rate / copy.best:.0%})' if copy else ''
      lines.append(
          f'| {r.preset} | {r.dtype} | {r.batch} | {r.num_params / 1e6:.0f}M | '
          f'{r.ars_per_token * 1e3:.3f} | {r.ars_step * 1e3:.3f} | {r.weight_rate:.0f}{share} | '
          f'{"-" if r.launches is None else r.launches} | '
          + ' | '.join([f'{r.s[T]:.2f}' for T in blocks]
                       + [f'{r.s_tree[t]:.2f}' if t in r.s_tree else '-' for t in trees]) + ' |')
    lines.append('')
  if ceiling_rows:
    lines += ['| perfect draft | k | d | c | s | decoding SpS/ArS | formula (k+1)/(dc+s) | '
              'whole calls |', '|---|---|---|---|---|---|---|---|']
    for label, c in ceiling_rows:
      lines.append(f'| {label} | {c.k} | {c.d:.1f} | {c.c:.3f} | {c.s:.2f} | '
                   f'{c.decode_speedup:.2f}x | {c.predicted:.2f}x | {c.speedup:.2f}x |')
    if any(c.drafter for _, c in ceiling_rows):
      lines += ['', 'd: a loop\'s draft calls in one-position draft steps (k for a chain; a '
                'dynamic tree\'s level calls, timed); s: the score call on k + 1 positions, or on '
                'a tree\'s nodes and root.']
    profiled = [(label, c) for label, c in ceiling_rows if c.loop is not None and c.loop.phase]
    if profiled:
      phases = list(profiled[0][1].loop.phase)
      lines += ['', 'Perfect-draft loops profiled (one SpS call; ms a loop; op time per phase, '
                'with its ops a loop):',
                '', '| perfect draft | k | loops | wall | d c + s steps | ' + ' | '.join(phases)
                + ' |', '|---|---|---|---|---|' + '---|' * len(phases)]
      for label, c in profiled:
        wall = '-' if c.loop.wall is None else f'{c.loop.wall * 1e3:.3f}'
        lines.append(f'| {label} | {c.k} | {c.loop.loops} | {wall} | {c.formula_loop * 1e3:.3f} | '
                     + ' | '.join(c.loop.phase_text(p) for p in phases) + ' |')
  if variant_rows:
    lines += [''] if lines[-1] else []
    lines += ['Step variants (`spsjax.bench.variants`): one-position extend compiled other ways '
              'beside the plain one.', '',
              '| model | batch | variant | compile s | step ms | ops/step | logit diff |',
              '|---|---|---|---|---|---|---|']
    for preset, batch, found in variant_rows:
      lines += [f'| {preset} | {batch} | {v.name} | ' + (
          f'- | - | - | failed: `{v.error}` |' if v.error else
          f'{v.compile_seconds:.2f} | {v.step_seconds * 1e3:.3f} | '
          f'{"-" if v.ops is None else v.ops} | {v.logit_diff:.1e} |') for v in found]
  if sampling:
    lines += [''] if lines[-1] else []
    lines += _sampling_lines(*sampling)
  return '\n'.join(lines) + '\n'


def _sampling_lines(vocab: int, found: Sequence[sampling_costs.Cost]) -> list[str]:
  """The sampling costs as a table: a row per setting, a column per row count."""
  rows = sorted({c.rows for c in found})
  by = {(c.setting, c.rows): c for c in found}
  lines = [f'Sampling, us a call (`probabilities` and a draw, V = {vocab:,}; '
           '`spsjax.bench.sampling_costs`):', '',
           '| setting | ' + ' | '.join(f'{R} row{"s" * (R > 1)}' for R in rows) + ' |',
           '|---|' + '---|' * len(rows)]
  for setting in dict.fromkeys(c.setting for c in found):
    cells = []
    for R in rows:
      c = by.get((setting, R))
      cells.append('-' if c is None else f'{c.seconds * 1e6:.0f}' + (
          ' (NOT the top-k law)' if c.law_differs else ''))
    lines.append(f'| {setting} | ' + ' | '.join(cells) + ' |')
  return lines
