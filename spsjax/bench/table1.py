"""Table 1 as Markdown, from `comparison.Comparison`s: text only, every figure computed there.

Three tables, each a function of the comparisons alone: the measurement (`measured_table`, a line
per ArS and SpS row), the theory from the same run (`theory_table`, a line per pair, with the
result parity of `PARITY_NOTE`) and, for pairs with a loop profile, the loop's times and the
speedups it bounds (`profile_table`).
"""

from collections.abc import Sequence

import numpy as np

from spsjax.bench.comparison import PARITY_LEVEL, PARITY_POWER, Comparison
from spsjax.bench.speedup import Row
from spsjax.eval import metrics
from spsjax.sampling import drafters

PARITY_NOTE = (
    f'log p: the target\'s mean log-probability per generated token; log p/q: the mean of log p - '
    f'log q (target minus draft, the log-likelihood ratio that moves first when SpS leaks the '
    f'draft\'s law); raw logits, nats. Results differ beyond noise: for each column (the task\'s '
    f'metrics, log p and log p/q), Student\'s paired t-test of SpS - ArS over the same prompts, '
    f'which the two sample with independent keys; two-sided at '
    f'{PARITY_LEVEL} / m for a row of m columns (Bonferroni), so a row is flagged with probability '
    f'at most {PARITY_LEVEL} when the laws are equal. In brackets the test\'s power: the smallest '
    f'true difference it detects with probability {PARITY_POWER} at the row\'s number of prompts '
    f'(0 when all differences are equal, as greedy decoding gives: then any difference counts). '
    f'ms/token: the mean over calls of each call\'s seconds per token; speedup per call is its '
    f'ratio, pooled the ratio of total time over total tokens, in which a call that stops after '
    f'a token or two weighs by its tokens (at nucleus ArS and SpS draw different lengths).')


def _mean_se(values: Sequence[float]) -> str:
  mean, stderr = metrics.mean_and_stderr(values)
  return f'{mean:.3f} ± {stderr:.3f}'


def _differences(parity: dict[str, metrics.Parity]) -> str:
  """'chrF +0.004 (0.021), log p -0.010 (0.030)': each column's mean difference and MDE."""
  return ', '.join(f'{name} {p.difference:+.3f} ({p.mde:.3f}){" *" if p.differs else ""}'
                   for name, p in parity.items())


def _line(*cells) -> str:
  return '| ' + ' | '.join(str(cell) for cell in cells) + ' |'


def _table(columns: Sequence[str], lines: list[str]) -> list[str]:
  """A Markdown table: the header line, the separator, then `lines`."""
  return [_line(*columns), '|' + '---|' * len(columns)] + lines


def _key(row: Row) -> tuple[str, str, int]:
  """The cells that name a row's pair (the first three columns of every table)."""
  return row.task, row.decoding, row.batch


def measured_table(comparisons: Sequence[Comparison]) -> list[str]:
  """A line per row: results, parity columns, times, speedup, acceptance and tokens per loop."""
  lines = []
  for cmp in comparisons:
    for row in (cmp.ars, cmp.sps):
      t = row.timing
      sps = row.method == 'SpS'
      method = row.method + (f' (LOSSY: lenience {row.lenience}, TV {row.tv:.3f})'
                             if row.lenience < 1 else '')
      lines.append(_line(
          *_key(row), method,
          ', '.join(f'{name} {_mean_se(values)}' for name, values in row.scores.items()),
          f'{row.extra["parse_rate"]:.0%}' if 'parse_rate' in row.extra else '',
          _mean_se(row.logprobs), '-' if row.log_ratios is None else _mean_se(row.log_ratios),
          f'{t["mean_ms_per_token"]:.3f} ({t["std_ms_per_token"]:.3f})', f'{t["p90_ms"]:.3f}',
          f'{cmp.speedup:.2f}x / {cmp.pooled_speedup:.2f}x' if sps else '1x',
          f'{t["acceptance_rate"]:.3f}' if sps else '',
          f'{t["tokens_per_loop"]:.2f}' if sps else ''))
  return _table(('task', 'decoding', 'batch', 'method', 'result', 'parses', 'log p / token',
                 'log p/q / token', 'ms/token (std)', 'p90 ms', 'speedup (per call / pooled)',
                 'acceptance', 'tokens/loop'), lines)


def theory_table(comparisons: Sequence[Comparison]) -> list[str]:
  """A line per pair: alpha, c, s, tokens per loop and speedup against the theory's, and
  whether the results differ beyond noise."""
  lines = []
  for cmp in comparisons:
    p, t = cmp.prediction, cmp.sps.timing
    # Prompt lookup has no model alpha; hybrid's is its draft model's, not its proposals'.
    model_alpha = ('-' if np.isnan(cmp.sps.alpha_model) else f'{cmp.sps.alpha_model:.3f}'
                   + (' (draft model)' if isinstance(cmp.drafter, drafters.Hybrid) else ''))
    lines.append(_line(
        *_key(cmp.sps), f'{p.alpha:.3f} / {model_alpha}', f'{p.c:.3f}', f'{p.s:.2f}',
        f'{t["uncut_tokens_per_loop"]:.2f} / {p.tokens_per_loop:.2f}',
        f'{cmp.speedup:.2f}x / {p.speedup:.2f}x / {p.speedup_free_scoring:.2f}x',
        f'{cmp.speedup / p.speedup:.2f}', f'{p.operations:.2f}x', _differences(cmp.parity),
        'yes' if cmp.metrics_differ else 'no'))
  return _table(('task', 'decoding', 'batch', 'alpha (measured / model)', 'c', 's',
                 'tokens/loop (measured / predicted)',
                 'speedup (measured / predicted / with s = 1)', 'measured / predicted',
                 'operations', 'SpS - ArS, paired (MDE)', 'results differ beyond noise'), lines)


def profile_table(comparisons: Sequence[Comparison]) -> list[str]:
  """A line per pair with a loop profile: the loop's times by phase, the call's time outside the
  loop, and the speedups with every draft accepted and with a free draft."""
  ms = lambda x: f'{x * 1e3:.3f}'
  lines = []
  for cmp in comparisons:
    lp = cmp.loop_profile
    lines.append(_line(
        *_key(cmp.sps), lp.loops, ms(lp.loop), ms(lp.draft), ms(lp.score), ms(lp.accept),
        f'{lp.outside_forward_passes:.1%}', f'{lp.outside_forward_ops:.1%}', ms(lp.call),
        f'{ms(lp.outside_loop)} ({lp.outside_loop / lp.call:.0%})',
        f'{cmp.perfect_draft_speedup:.2f}x ({lp.perfect_loops} loops)',
        f'{cmp.free_draft_speedup:.2f}x ({cmp.free_perfect_draft_speedup:.2f}x)'))
  return _table(('task', 'decoding', 'batch', 'loops traced', 'ms per loop', 'draft', 'score',
                 'accept', 'outside draft and score', 'not running draft or score ops',
                 'ms per call', 'outside the loop (prefills)',
                 'speedup with every draft accepted',
                 'with a free draft (and every draft accepted)'), lines)


def markdown(comparisons: Sequence[Comparison]) -> str:
  """Table 1: the measurement, then the theory from the same run with the parity note, then the
  loop profiles of the pairs that have one."""
  lines = measured_table(comparisons) + [''] + theory_table(comparisons)
  if comparisons:
    lines += ['', PARITY_NOTE]
  profiled = [cmp for cmp in comparisons if cmp.loop_profile is not None]
  if profiled:
    lines += [''] + profile_table(profiled)
  return '\n'.join(lines)
