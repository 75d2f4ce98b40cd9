"""`docstrings`: write a function's one-line summary from its decorators and signature.

Examples come from the functions and methods (any nesting) of the `python_code` TEST split that have
a `\"\"\"` docstring (an `r` or `u` prefix is allowed). For each:
- `input`: the source text exactly as written, from the start of the line of the first decorator
  (or of the `def`) through the docstring's opening quotes: decorators, signature line(s), the
  newline and indentation, then `\"\"\"`;
- `reference`: the first non-blank line of the docstring, stripped (empty docstrings are skipped);
- `path`: the file, relative to the stdlib root; `name`: the qualified name (`Class.method`,
  `outer.<locals>.inner`).
Invariant: `input` occurs verbatim in the file and ends with `\"\"\"`. Files that do not parse
(the stdlib's deliberate syntax-error tests) are skipped. The config selects the same files as
`python_code` (`PythonCodeConfig`), and the test split is the one `python_code.split_of` gives.
"""

import ast
import re
from collections.abc import Iterator

import tensorflow_datasets as tfds

from spsjax.data import functions, local_builder, python_code

_OPENING = re.compile(r'[rRuU]?"""')


def extract(source: str, path: str) -> list[dict[str, str]]:
  """The examples of one file, in source order ([] if it does not parse)."""
  return [example for _, example in _examples(source, path)]


def _examples(source: str, path: str) -> Iterator[tuple[int, dict[str, str]]]:
  """(first line, example) pairs; the first line (1-based) makes a unique key within the file."""
  tree = functions.parse(source)
  if tree is None:
    return
  lines = functions.lines(source)
  for name, node in functions.walk(tree):
    docstring = (ast.get_docstring(node, clean=True) or '').strip()
    if not docstring:
      continue
    literal = node.body[0].value
    line_bytes = lines[literal.lineno - 1].encode('utf-8')
    opening = _OPENING.match(line_bytes[literal.col_offset:].decode('utf-8'))
    if opening is None:
      continue  # A '...', '''...''' or "..." docstring.
    start = functions.start_line(node)
    end = line_bytes[:literal.col_offset].decode('utf-8') + opening.group()
    yield start, {
        'input': ''.join(lines[start - 1:literal.lineno - 1]) + end,
        'reference': docstring.splitlines()[0].strip(),
        'path': path,
        'name': name,
    }


class Docstrings(local_builder.LocalBuilder):
  """Docstring summaries of the `python_code` test split; see the module docstring."""

  name = 'docstrings'
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
        }),
        disable_shuffling=True,
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # Reads the interpreter's own files.
    examples = [(f'{path}:{line}', example)
                for path, source in python_code.test_sources(self.builder_config.prefixes)
                for line, example in _examples(source, path)]
    return {'test': self._generate_examples(examples)} if examples else {}  # TFDS needs examples.

  def _generate_examples(self, examples: list[tuple[str, dict]]) -> Iterator[tuple[str, dict]]:
    yield from examples
