"""`code_completion`: continue a held-out function from its opening lines.

A task small models score on (Table 1's third task): the prompt is the first half of a function of
the `python_code` TEST split, the reference the lines that follow it. Examples come from every
function and method (any nesting) of the test split's files that parse, with at least
`MIN_CODE_LINES` lines after its header and docstring ("code lines"). For each:
- the cut: the first line at or past the middle of the code lines that starts a statement (at any
  depth), and not the first code line, so the prompt holds at least one line of code and the
  reference opens with a whole statement's first line, never a blank or a continuation line;
- `input`: the source exactly as written, whole lines, from the first decorator's line (or the
  `def`'s) up to the cut, ending with that line's newline; functions whose input would exceed
  `MAX_PROMPT_LINES` lines are skipped (prompts stay short enough for every model's context);
- `reference`: the next `REFERENCE_LINES` lines from the cut (fewer where the function ends first),
  verbatim, without the last line's ending. Its first line is the "next line" of exact match;
- `path` (relative to the stdlib root), `name` (qualified, `Class.method`), `line` (the cut, 1-based).

Order (deterministic, documented for the tasks that take "the first n"): examples are sorted by
sha256 of `path:line:name` (a unique key: a nested function can share its outer one's cut), a fixed
pseudo-random order, so any prefix spreads over the split's files
instead of taking the alphabetically first ones. Invariant: `input + reference` occurs verbatim in
the file. The config selects the same files as `python_code` (`PythonCodeConfig`) and the test split
is the one `python_code.split_of` gives.
"""

import ast
import hashlib
from collections.abc import Iterator

import numpy as np
import tensorflow_datasets as tfds

from spsjax.data import functions, local_builder, python_code

MIN_CODE_LINES = 4
MAX_PROMPT_LINES = 30
REFERENCE_LINES = 4


def _cut(node: ast.FunctionDef) -> int | None:
  """The cut line of a function (see the module docstring), or None if it has none."""
  doc = functions.docstring_node(node)
  body = node.body[1:] if doc is not None else node.body
  if not body:
    return None
  first, end = body[0].lineno, node.end_lineno
  if end - first + 1 < MIN_CODE_LINES:
    return None
  middle = first + (end - first + 1) // 2
  starts = {s.lineno for statement in body for s in ast.walk(statement)
            if isinstance(s, ast.stmt)}
  after = [line for line in starts if line >= middle and line > first]
  return min(after) if after else None


def extract(source: str, path: str) -> list[dict[str, str | int]]:
  """The examples of one file, in source order ([] if it does not parse)."""
  tree = functions.parse(source)
  if tree is None:
    return []
  lines = functions.lines(source)
  examples = []
  for name, node in functions.walk(tree):
    cut = _cut(node)
    start = functions.start_line(node)
    if cut is None or cut - start > MAX_PROMPT_LINES:
      continue
    reference = ''.join(lines[cut - 1:min(cut - 1 + REFERENCE_LINES, node.end_lineno)])
    examples.append({
        'input': ''.join(lines[start - 1:cut - 1]),
        'reference': reference.rstrip('\r\n'),
        'path': path,
        'name': name,
        'line': cut,
    })
  return examples


def key(example: dict) -> str:
  """The example's unique key, whose sha256 orders the dataset."""
  return f'{example["path"]}:{example["line"]}:{example["name"]}'


def _order(example: dict) -> bytes:
  return hashlib.sha256(key(example).encode('utf-8')).digest()


class CodeCompletion(local_builder.LocalBuilder):
  """Held-out functions cut in half; see the module docstring."""

  name = 'code_completion'
  SOURCE = 'the functions of the python_code test split (this interpreter\'s standard library)'
  VERSION = tfds.core.Version('1.0.0')
  RELEASE_NOTES = {'1.0.0': 'Initial release.'}
  BUILDER_CONFIGS = [python_code.STDLIB, python_code.SMALL]

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self,
        description=__doc__,
        features=tfds.features.FeaturesDict({
            'input': tfds.features.Text(),
            'reference': tfds.features.Text(),
            'path': tfds.features.Text(),
            'name': tfds.features.Text(),
            'line': tfds.features.Scalar(dtype=np.int32),
        }),
        disable_shuffling=True,  # Records stay in the sha256 order of the module docstring.
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # Reads the interpreter's own files.
    examples = sorted((e for path, source in python_code.test_sources(self.builder_config.prefixes)
                       for e in extract(source, path)), key=_order)
    return {'test': self._generate_examples(examples)} if examples else {}  # TFDS needs examples.

  def _generate_examples(self, examples: list[dict]) -> Iterator[tuple[str, dict]]:
    for example in examples:
      yield key(example), example
