"""Figure 1 of Chen et al. (2023): SpS time for a fixed number of tokens, acceptance and loop time
as a function of a swept setting (k, the draft, the temperature).

Each point samples `max_new_tokens` tokens (no eos, so every call makes the same number) per row
of a list of prompts, each batch of them (1 by default) one timed call (compile apart). Recorded
per point: mean and standard deviation of the time per call, mean tokens per loop divided by
k + 1, time per loop (wall time / loops), the draft's cost per step c (`decode.measure_costs`: a
draft step over a target step, measured right after the point; the draft-topology sweep compares
shapes at equal c), and the ArS time of the same prompts with the same sampling settings, timed
call by call in turn with SpS (`timing.time_interleaved`): a baseline measured minutes apart from a
point would carry this machine's drift (tens of percent) into its speedup.
"""

import collections
import csv
import dataclasses
import functools
import io
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from spsjax import models, sampling, storage
from spsjax.bench import auto_k, decode, theory, timing
from spsjax.data import prompts as prompts_lib
from spsjax.eval import acceptance
from spsjax.sampling import drafters


@dataclasses.dataclass(frozen=True)
class Point:
  label: str  # The swept value, e.g. 'k=4' or the draft's name.
  k: int  # 0 for the ArS baseline.
  draft: str
  temperature: float
  mean_seconds: float  # Per call (max_new_tokens tokens per row).
  std_seconds: float
  tokens_per_loop: float
  loop_seconds: float  # Wall time / loops (nan for ArS).
  acceptance_rate: float  # Accepted drafts / drafted tokens.
  alpha: float  # Per-draft acceptance (`theory.alpha_from_counts`).
  ars_seconds: float  # ArS per call on the same prompts, timed in turn with this point.
  c: float = float('nan')  # Draft step / target step (nan for ArS; 0 for a drafter without model).
  drafter: str = ''  # e.g. 'ModelDrafter(stop_below=0.0)'; '' for ArS.
  drafted_per_loop: float = float('nan')  # Drafts proposed per loop (k unless ragged).
  lenience: float = 1.0  # < 1: LOSSY.
  tv: float = 0.0  # Lenient draft slot's law against p: mean total variation along the outputs.
  # From alpha and the loops that proposed each number of drafts (`theory.Prediction`).
  predicted_tokens_per_loop: float = float('nan')
  # Acceptance of draft position 1 .. k (`timing.Timing.alpha_per_position`; empty if ragged).
  alpha_per_position: tuple[float, ...] = ()
  # k = 'auto' (`auto_k.Policy`; k is then k_max): each timed call's k (0: ArS) and the mean of
  # the speedups the policy predicted for them.
  auto_ks: tuple[int, ...] = ()
  auto_predicted_speedup: float = float('nan')

  @property
  def speedup(self) -> float:
    return self.ars_seconds / self.mean_seconds

  @property
  def accepted_fraction(self) -> float:
    """Mean tokens per loop / (k + 1): the middle panel of Figure 1 (an auto point's k is the
    one its calls ran at; nan for ArS, or if they ran at several)."""
    k = self.k if not self.auto_ks else (
        self.auto_ks[0] if len(set(self.auto_ks)) == 1 else 0)
    return self.tokens_per_loop / (k + 1) if k else float('nan')


def run_point(label: str, target: models.Model, draft: models.Model | None, draft_name: str,
              prompts_NxP: np.ndarray, lengths_N: np.ndarray, *, k: int,
              sampling_config: sampling.SamplingConfig, max_new_tokens: int, seed: int,
              mesh: Mesh | None = None, drafter: drafters.Drafter = drafters.ModelDrafter(),
              lenience: float = 1.0, trim_score: bool = False,
              policy: auto_k.Policy | None = None, batch: int = 1) -> Point:
  """Times SpS with `drafter` (or only ArS when it needs a draft model and `draft` is None) on
  the prompts, one call per `batch` of them (the N // batch first batches), with ArS on the same
  prompts in turn (on `mesh`, if given,
  with the models placed on it beforehand). With lenience < 1 (LOSSY) and a draft model, the
  point also carries the mean total variation of a draft slot's law from p along the outputs.
  With `policy` (k = 'auto', k its k_max), each SpS call runs at the k the policy picks (0: ArS),
  compiled before it is timed like any new shape."""
  ars_only = draft is None and drafter.needs_model
  if not 1 <= batch <= len(prompts_NxP):
    raise ValueError(f'batch must be in [1, {len(prompts_NxP)}] (the prompts), got {batch}.')
  tv = [0.0, 0]
  rows = lambda i: list(range(i * batch, (i + 1) * batch))  # Call i's prompts.

  def run(method, i):
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), i), method == 'SpS')
    args = prompts_lib.for_call(prompts_NxP, lengths_N, rows(i)) + (key,)
    call_k = policy.pending.k if policy is not None and method == 'SpS' else k
    if method == 'ArS' or not call_k:
      return sampling.autoregressive_sample(target, *args, max_new_tokens=max_new_tokens,
                                            sampling=sampling_config, mesh=mesh)
    return sampling.speculative_sample(target, draft, *args, k=call_k,
                                       max_new_tokens=max_new_tokens,
                                       sampling=sampling_config, mesh=mesh, drafter=drafter,
                                       lenience=lenience, trim_score=trim_score)

  def on_output(method, i, out):
    if method == 'SpS' and policy is not None:
      policy.observe(out)
    if method == 'SpS' and lenience < 1 and draft is not None:
      prompts_BxP, lengths_B = prompts_lib.for_call(prompts_NxP, lengths_N, rows(i))
      total, count = acceptance.lenient_tv(target, draft, sampling_config, lenience, prompts_BxP,
                                           lengths_B, out, mesh)
      tv[0] += total
      tv[1] += count

  methods = ('ArS',) if ars_only else ('ArS', 'SpS')
  # One compiled program per padded width (`prompts.for_call`), compiled before it is timed.
  width = lambda i: prompts_lib.for_call(prompts_NxP, lengths_N, rows(i))[0].shape[1]
  bucket = width if policy is None else lambda i: (width(i), policy.next().k)
  timings = timing.time_interleaved(
      {m: functools.partial(run, m) for m in methods}, len(prompts_NxP) // batch, bucket=bucket,
      ks={'SpS': k}, on_output=on_output)
  result = timings[methods[-1]]
  seconds = [c.seconds for c in result.calls]
  loops = sum(c.loops for c in result.calls)
  drafted = sum(c.drafted for c in result.calls)
  draft_cost = float('nan') if ars_only else 0.0
  if draft is not None:
    capacity = prompts_NxP.shape[1] + max_new_tokens + k
    draft_cost = decode.measure_costs(target, draft, k, batch=batch, capacity=capacity,
                                      mesh=mesh).c
  return Point(label=label, k=0 if ars_only else k, draft=draft_name if draft else '',
               temperature=sampling_config.temperature, mean_seconds=float(np.mean(seconds)),
               std_seconds=float(np.std(seconds, ddof=1)) if len(seconds) > 1 else 0.0,
               tokens_per_loop=result.tokens_per_loop,
               loop_seconds=sum(seconds) / loops if loops else float('nan'),
               acceptance_rate=result.acceptance_rate, alpha=result.alpha,
               ars_seconds=float(np.mean([c.seconds for c in timings['ArS'].calls])),
               c=draft_cost, drafter='' if ars_only else str(drafter),
               drafted_per_loop=drafted / loops if loops else float('nan'),
               lenience=lenience, tv=tv[0] / tv[1] if tv[1] else 0.0,
               predicted_tokens_per_loop=theory.expected_tokens_per_loop_proposed(
                   result.alpha, result.loops_by_proposed)
               if loops and result.loops_by_proposed and not np.isnan(result.alpha)
               else float('nan'),
               alpha_per_position=() if ars_only else result.alpha_per_position,
               auto_ks=tuple(c.k for c in policy.choices) if policy else (),
               auto_predicted_speedup=float(np.mean([c.predicted_speedup
                                                     for c in policy.choices]))
               if policy and policy.choices else float('nan'))


def write_csv(points: Sequence[Point], path: str) -> None:
  """The points as CSV at `path` (local or a URI; process 0 writes: `storage`)."""
  fields = [f.name for f in dataclasses.fields(Point)] + ['accepted_fraction']
  out = io.StringIO(newline='')
  writer = csv.writer(out)
  writer.writerow(fields)
  for p in points:
    writer.writerow([getattr(p, name) for name in fields])
  storage.write_text(path, out.getvalue())


def markdown(points: Sequence[Point]) -> str:
  """The points as a Markdown table: what a draft-topology or k sweep is read by (c and alpha
  beside the tokens per loop, measured and predicted from alpha, and the speedup over ArS timed in
  turn)."""
  fmt = lambda x, spec: '-' if np.isnan(x) else format(x, spec)
  lines = ['| point | k | draft | drafter | c | alpha | tokens/loop (measured / predicted) | '
           'ms per loop | ms per call (std) | speedup | alpha per draft position |',
           '|---|---|---|---|---|---|---|---|---|---|---|']
  for p in points:
    note = f' (LOSSY: lenience {p.lenience}, TV {p.tv:.3f})' if p.lenience < 1 else ''
    per_position = ' '.join(fmt(a, '.2f') for a in p.alpha_per_position) or '-'
    if p.auto_ks:  # k = 'auto': how often each k ran, and the speedup the policy predicted.
      counts = collections.Counter(p.auto_ks)
      note += (' (auto: ' + ', '.join(f'k={k} x{n}' for k, n in sorted(counts.items()))
                + f'; predicted {p.auto_predicted_speedup:.2f}x)')
    lines.append(
        f'| {p.label} | {p.k} | {p.draft or "-"} | {p.drafter or "ArS"}{note} | '
        f'{fmt(p.c, ".3f")} | '
        f'{fmt(p.alpha, ".3f")} | {fmt(p.tokens_per_loop, ".2f")} / '
        f'{fmt(p.predicted_tokens_per_loop, ".2f")} | {fmt(p.loop_seconds * 1e3, ".2f")} | '
        f'{p.mean_seconds * 1e3:.1f} ({p.std_seconds * 1e3:.1f}) | {p.speedup:.2f}x | '
        f'{per_position} |')
  return '\n'.join(lines)


def _pyplot():
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


def _save(fig, path: str) -> None:
  png = io.BytesIO()
  fig.savefig(png, format='png', dpi=110)
  _pyplot().close(fig)
  storage.write_bytes(path, png.getvalue())


def plot(points: Sequence[Point], path: str, title: str, x_label: str) -> None:
  """The three panels of Figure 1 against the swept value, saved as a PNG at `path` (local or a
  URI; process 0 writes: `storage`), the first with each point's own ArS time."""
  plt = _pyplot()

  labels = [p.label for p in points]
  x = np.arange(len(points))
  fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
  axes[0].errorbar(x, [p.mean_seconds * 1e3 for p in points],
                   yerr=[p.std_seconds * 1e3 for p in points], marker='o', capsize=3, label='SpS')
  axes[0].plot(x, [p.ars_seconds * 1e3 for p in points], color='gray', linestyle='--',
               marker='.', label='ArS (timed in turn)')
  axes[0].set_ylabel('ms per call')
  axes[0].legend()
  axes[1].plot(x, [p.accepted_fraction for p in points], marker='o')
  axes[1].set_ylabel('tokens per loop / (k + 1)')
  axes[1].set_ylim(0, 1.05)
  axes[2].plot(x, [p.loop_seconds * 1e3 for p in points], marker='o')
  axes[2].set_ylabel('ms per loop')
  for ax in axes:
    ax.set_xticks(x, labels, rotation=30 if max(len(l) for l in labels) > 4 else 0)
    ax.set_xlabel(x_label)
    ax.grid(alpha=0.3)
  fig.suptitle(title)
  fig.tight_layout()
  _save(fig, path)


def tokens_per_loop_lines(points: Sequence[Point]) -> dict[str, list[tuple[int, float]]]:
  """{draft (or drafter): [(k, tokens per loop)] by k} of the fixed-k SpS points (not ArS, not
  k = 'auto', whose k varies by call)."""
  lines = {}
  for p in points:
    if p.k and not p.auto_ks:
      lines.setdefault(p.draft or p.drafter, []).append((p.k, p.tokens_per_loop))
  return {name: sorted(line) for name, line in lines.items()}


def plot_tokens_per_loop(points: Sequence[Point], path: str, title: str) -> None:
  """Tokens per loop against k, a line per draft (`tokens_per_loop_lines`), with k + 1 (every
  draft accepted) for scale; a PNG at `path` as `plot`'s."""
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(6, 4))
  lines = tokens_per_loop_lines(points)
  ks = sorted({k for line in lines.values() for k, _ in line})
  ax.plot(ks, [k + 1 for k in ks], color='gray', linestyle='--', label='k + 1 (all accepted)')
  for name, line in lines.items():
    ax.plot([k for k, _ in line], [t for _, t in line], marker='o', label=name)
  ax.set_xlabel('k')
  ax.set_ylabel('tokens per loop')
  ax.set_xticks(ks)
  ax.grid(alpha=0.3)
  ax.legend()
  ax.set_title(title, fontsize=9)
  fig.tight_layout()
  _save(fig, path)
