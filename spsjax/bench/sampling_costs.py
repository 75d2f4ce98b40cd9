"""What sampling costs per call on the device at hand, by setting: `probabilities` and a draw.

SpS samples from its draft k times a loop (a row each at batch 1) and from its target once, on
k + 1 rows; ArS once a step. On an accelerator a step of a 1B model takes about a millisecond,
so a sampler's launches count: `lax.top_k` sorts the vocabulary on a GPU above k = 16, top-p
searches in 8 steps (`processors.CutSearch`). Each setting is timed per call, at each row
count: a program runs `calls` calls one after another, each on the logits shifted by a vanishing
multiple of the previous draw (so none is hoisted out or left out), median of `repeats` runs,
over `calls`. The calls are straight-line code, not a loop: on a GPU a loop reads its condition
on the host every trip, which would dwarf a call. A call's share of the program's launch stays in
its figure (a `calls`-th). The programs compile side by side, on as many threads as the process
may use CPUs (they have no products: XLA:GPU autotunes nothing, so no compile slows another's
kernels).

'top-k 50, search' is top-k 50 without `lax.top_k` (`probabilities(top_k_search=)`, the plan
the platform's top-p uses): the same law, which its row checks on the timed logits (the same
probabilities as 'top-k 50', to float32 rounding), and the measurement a default would follow.
"""

import dataclasses
import os
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from spsjax.bench import timing
from spsjax.sampling import SamplingConfig, processors

SEARCHED = 'top-k 50, search'
SETTINGS: Mapping[str, SamplingConfig] = {
    'temperature 1': SamplingConfig(),
    'top-k 8': SamplingConfig(top_k=8),
    'top-k 50': SamplingConfig(top_k=50),
    SEARCHED: SamplingConfig(top_k=50),
    'top-p 0.95': SamplingConfig(top_p=0.95),
    'top-k 50, top-p 0.95': SamplingConfig(top_k=50, top_p=0.95),
}


@dataclasses.dataclass(frozen=True)
class Cost:
  setting: str
  rows: int
  seconds: float  # Median per call.
  same_law: bool | None = None  # SEARCHED: its probabilities equal 'top-k 50''s.

  @property
  def law_differs(self) -> bool:
    """A search that kept other tokens than `lax.top_k` (a bug, not a cost)."""
    return self.same_law is False


def _search() -> processors.CutSearch:
  """The plan the default backend's top-p runs."""
  if jax.default_backend() == 'cpu':
    return processors.CPU_SEARCH
  return processors.ACCELERATOR_SEARCH


def _probabilities(setting: str):
  search = _search() if setting == SEARCHED else None
  return lambda logits: processors.probabilities(logits, SETTINGS[setting], top_k_search=search)


def _program(setting: str, calls: int):
  probabilities = _probabilities(setting)

  @jax.jit
  def run(logits_RxV, uniforms_CxR):
    def call(i, drawn_R):
      shifted_RxV = logits_RxV + drawn_R[:, None].astype(jnp.float32) * 1e-30
      return jax.vmap(processors.draw_with)(uniforms_CxR[i], probabilities(shifted_RxV))
    return jax.lax.fori_loop(0, calls, call, jnp.zeros(logits_RxV.shape[:1], jnp.int32),
                             unroll=True)

  return run


def _usable_cpus() -> int:
  if hasattr(os, 'sched_getaffinity'):  # Not on macOS.
    return len(os.sched_getaffinity(0))
  return os.cpu_count() or 1


def costs(vocab: int, rows: Sequence[int], *, repeats: int, calls: int = 4, seed: int = 0,
          settings: Sequence[str] = tuple(SETTINGS)) -> list[Cost]:
  """Seconds per call of each setting at each row count, on random logits (a spread like a
  trained model's: normal, scale 3)."""
  if unknown := set(settings) - set(SETTINGS):
    raise ValueError(f'Unknown sampling settings {sorted(unknown)}; known: {list(SETTINGS)}.')
  if calls < 1 or repeats < 1 or not rows or min(rows) < 1:
    raise ValueError(f'calls, repeats and rows must be >= 1, got {calls}, {repeats}, {rows}.')
  rng = np.random.default_rng(seed)
  found = []
  for R in rows:
    logits_RxV = jnp.asarray(rng.normal(size=(R, vocab)) * 3, jnp.float32)
    uniforms_CxR = jnp.asarray(rng.random((calls, R)), jnp.float32)
    runs = {s: (lambda p=_program(s, calls): p(logits_RxV, uniforms_CxR)) for s in settings}
    timing.warm(list(runs.values()), threads=_usable_cpus())
    seconds = timing.medians(runs, repeats=repeats)
    for s in settings:
      same = None
      if s == SEARCHED:
        by_search, by_top_k = (jax.jit(_probabilities(t))(logits_RxV) for t in (s, 'top-k 50'))
        same = bool(np.allclose(by_search, by_top_k, rtol=1e-6, atol=0))
      found.append(Cost(s, R, seconds[s] / calls, same))
  return found
