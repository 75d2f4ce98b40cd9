"""The tasks of Table 1: prompts, references, and how a row's completions are scored.

- `humaneval`: pass@1, each completion cut by the standard stop rule and run against the problem's
  tests in the sandbox of `spsjax.eval.execution`, and the rate of completions that parse;
- `docstrings`: ROUGE-2 of the generated first line against the reference docstring line;
- `code_completion` (`spsjax.data.code_completion`, held-out functions cut in half): chrF of the
  completion's first lines (as many as the reference has) against the reference lines, and exact
  match of the next line (the completion's first line against the reference's, trailing
  whitespace ignored, indentation kept).

`score` gives one value per example for each metric (the first is the task's headline), so that
every metric can be compared prompt by prompt between two samplers (`metrics.parity`).
"""

from collections.abc import Sequence
import dataclasses

import numpy as np

from absl import logging

from spsjax.data import datasets, humaneval
from spsjax.data import prompts as prompts_lib
from spsjax.data.tokenizer import Tokenizer
from spsjax.eval import execution, metrics

TASKS = ('humaneval', 'docstrings', 'code_completion')
# The paper's sampling per task (Chen et al., 2023, Table 1) and our generation lengths: HumanEval
# at temperature 0.8, top_p 0.95; summarisation (docstrings here, XSum there) at top_p 0.8.
PAPER_SETTINGS = dict(
    humaneval=dict(max_new_tokens=128, nucleus=dict(temperature=0.8, top_k=0, top_p=0.95)),
    docstrings=dict(max_new_tokens=24, nucleus=dict(temperature=1.0, top_k=0, top_p=0.8)),
    code_completion=dict(max_new_tokens=64,
                         nucleus=dict(temperature=0.8, top_k=0, top_p=0.95)),  # As HumanEval.
)
GREEDY = dict(temperature=0.0, top_k=0, top_p=1.0)


@dataclasses.dataclass(frozen=True)
class Task:
  """Prompts, what scores them, and the generation length."""
  name: str
  prompts: tuple[str, ...]
  references: tuple  # HumanEval problem dicts, reference docstring lines or code lines.
  max_new_tokens: int


def load_task(name: str, num: int, max_new_tokens: int, data_dir: str | None = None,
              config: str | None = None) -> Task:
  """The first `num` examples of `name` (all if num <= 0)."""
  if name == 'humaneval':
    problems = humaneval.read_problems()
    problems = problems[:num] if num > 0 else problems
    return Task(name, tuple(p['prompt'] for p in problems), tuple(problems), max_new_tokens)
  if name in ('docstrings', 'code_completion'):  # Records in the builder's documented order.
    records = datasets.load_records(name, 'test', data_dir, config)
    count = min(num, len(records)) if num > 0 else len(records)
    rows = [records[i] for i in range(count)]
    return Task(name, tuple(r['input'] for r in rows), tuple(r['reference'] for r in rows),
                max_new_tokens)
  raise ValueError(f'Unknown task {name!r}; known: {TASKS}.')


def encode(task: Task, tok: Tokenizer, max_seq_lens: Sequence[tuple[str, int]],
           headroom: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """(prompts int32[N, P], lengths int32[N]) of every prompt of `task`, each cut to the room left
  by max_new_tokens (and `headroom`, e.g. SpS's k - 1) in every named model's max_seq_len
  (`prompts.prompt_room`); prompts that were cut are logged."""
  room = prompts_lib.prompt_room(max_seq_lens, task.max_new_tokens, headroom)
  note = prompts_lib.cut_note(tok, task.prompts, room)
  if note:
    logging.warning('%s: %s', task.name, note)
  return prompts_lib.encode_prompts(tok, list(task.prompts), max_len=room.positions)


@dataclasses.dataclass(frozen=True)
class Scores:
  """A row's scores: per-example values of each metric (headline first), and whole-row extras."""
  values: dict[str, list[float]]
  extra: dict

  @property
  def headline(self) -> str:
    return next(iter(self.values))


def score(task: Task, completions: Sequence[str]) -> Scores:
  """The scores of one row's completions, one per prompt of `task`."""
  if len(completions) != len(task.prompts):
    raise ValueError(f'{len(completions)} completions for {len(task.prompts)} prompts')
  if task.name == 'humaneval':
    cut = [execution.truncate_completion(c) for c in completions]
    results = execution.check_completions(list(zip(task.references, cut)))
    parse_rate = float(np.mean([execution.parses(p['prompt'] + c)
                                for p, c in zip(task.references, cut)]))
    return Scores({'pass@1': [float(r.passed) for r in results]}, dict(parse_rate=parse_rate))
  if task.name == 'code_completion':
    return Scores(code_scores(completions, task.references), {})
  first_lines = [c.strip().split('\n')[0].strip().rstrip('"').strip() for c in completions]
  return Scores({'rouge2': metrics.rouge2_scores(first_lines, list(task.references))}, {})


def code_scores(completions: Sequence[str], references: Sequence[str]) -> dict[str, list[float]]:
  """`code_completion`'s metrics (see the module docstring): {'chrF': ..., 'next-line EM': ...}."""
  predictions, next_line = [], []
  for completion, reference in zip(completions, references, strict=True):
    want = reference.splitlines()
    got = completion.splitlines()
    predictions.append('\n'.join(got[:len(want)]))
    next_line.append(float(bool(got) and got[0].rstrip() == want[0].rstrip()))
  return {'chrF': metrics.chrf_scores(predictions, list(references)), 'next-line EM': next_line}
