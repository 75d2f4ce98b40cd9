"""The functions of a Python source file, for the builders that make tasks from held-out code.

`lines(source)` splits a file as `ast` numbers its lines (only \\n, \\r\\n and \\r end one, each line
keeps its ending), so `lines(source)[node.lineno - 1]` is a node's first line. `walk(tree)` yields
(qualified name, node) for every function and method at any depth, outermost first, with the names
`pickle` uses (`Class.method`, `outer.<locals>.inner`). `start_line(node)` is the first line of a
function's text: its first decorator's, else the `def`'s.
"""

import ast
import io
from collections.abc import Iterator

_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def lines(source: str) -> list[str]:
  """The source's lines as `ast` counts them, each with its line ending."""
  return io.StringIO(source, newline='').readlines()


def parse(source: str) -> ast.Module | None:
  """The module's tree, or None for a file that does not parse (the stdlib's deliberate syntax
  errors, null bytes)."""
  try:
    return ast.parse(source)
  except (SyntaxError, ValueError):
    return None


def walk(node: ast.AST, prefix: str = '') -> Iterator[tuple[str, ast.FunctionDef]]:
  """(qualified name, node) for every function below `node`, outermost first."""
  for child in ast.iter_child_nodes(node):
    if isinstance(child, _SCOPES):
      name = prefix + child.name
      is_class = isinstance(child, ast.ClassDef)
      if not is_class:
        yield name, child
      yield from walk(child, f'{name}.' if is_class else f'{name}.<locals>.')
    else:
      yield from walk(child, prefix)


def start_line(node: ast.FunctionDef) -> int:
  """The first line (1-based) of a function's text, decorators included."""
  return min([node.lineno] + [d.lineno for d in node.decorator_list])


def docstring_node(node: ast.FunctionDef) -> ast.Expr | None:
  """The statement holding the function's docstring, if its body opens with a string literal."""
  first = node.body[0]
  if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
      and isinstance(first.value.value, str)):
    return first
  return None
