"""The peer benchmark's report: spsjax's ArS and SpS beside transformers' ArS and assisted
generation on the same weights and prompts (experiments/peer_benchmark.py runs them).

Every method generates exactly max_new_tokens per prompt (no eos), batch 1, the four taking turns
prompt by prompt (`timing.time_interleaved`). A method's tokens/s is its generated tokens over its
summed wall time; its speedup is over its own framework's ArS; `SpS / assisted` is spsjax SpS's
tokens/s over transformers' assisted generation's. Greedy rows also count the prompts whose four
outputs are identical (same weights, same argmax), a check that both run the same model.
"""

import dataclasses
from collections.abc import Mapping, Sequence

from spsjax.bench import timing

METHODS = ('hf_ars', 'hf_assisted', 'ars', 'sps')
LABELS = {'hf_ars': 'transformers ArS', 'hf_assisted': 'transformers assisted',
          'ars': 'spsjax ArS', 'sps': 'spsjax SpS'}


@dataclasses.dataclass(frozen=True)
class Row:
  decoding: str
  timings: Mapping[str, timing.Timing]  # By METHODS.
  identical: int | None = None  # Greedy: prompts whose four outputs agree.
  prompts: int = 0

  def tokens_per_second(self, method: str) -> float:
    t = self.timings[method]
    return t.total_tokens / sum(c.seconds for c in t.calls)

  def speedup(self, method: str) -> float:
    """Over the same framework's ArS."""
    base = 'hf_ars' if method.startswith('hf_') else 'ars'
    return self.tokens_per_second(method) / self.tokens_per_second(base)

  @property
  def sps_over_assisted(self) -> float:
    return self.tokens_per_second('sps') / self.tokens_per_second('hf_assisted')


def markdown(rows: Sequence[Row]) -> str:
  lines = ['| decoding | method | tokens/s | speedup over own ArS | tokens per loop | '
           'outputs identical |', '|---|---|---|---|---|---|']
  for row in rows:
    for method in METHODS:
      t = row.timings[method]
      per_loop = f'{t.tokens_per_loop:.2f}' if method == 'sps' else ''
      same = (f'{row.identical} of {row.prompts}' if row.identical is not None and
              method == 'hf_ars' else '')
      lines.append(f'| {row.decoding} | {LABELS[method]} | {row.tokens_per_second(method):.1f} | '
                   f'{row.speedup(method):.2f}x | {per_loop} | {same} |')
  lines += ['', '| decoding | spsjax SpS / transformers assisted (tokens/s) |', '|---|---|']
  lines += [f'| {row.decoding} | {row.sps_over_assisted:.2f}x |' for row in rows]
  return '\n'.join(lines)
