"""What XLA:GPU launches, from its thunk sequence: kernels and CUDA graphs a loop iteration.

The optimized HLO counts a fusion once, but some launch many kernels (a sort XLA emits itself:
21 for a row of 128k logits) and CUDA graphs decide what the host launches one by one. XLA:GPU
writes the sequence it runs, after its passes (command buffers included), as
`*.thunk_sequence_after_thunk_passes.txt` into `--xla_dump_to` (with `--xla_dump_hlo_as_text`;
the flags must be XLA_FLAGS, before JAX starts: a compile's own options do not write it). Each
line is a thunk, nested by indentation: a command buffer (one CUDA graph) holds the thunks it
launches; a while loop's `condition:` and `body:` hold theirs.

`main_loop` reads one iteration (condition and body) of the loop that launches the most: its
launches (kernels, copies, library calls: the leaves), the command buffers among them and the
leaves outside any (each launched from the host alone: the condition's, where XLA leaves the
loop on the host), an inner loop counted once (its trips are not in the text).
"""

import dataclasses
import re

_LINE = re.compile(r'^( *)\d+: (k\w+)')
_LABEL = re.compile(r'^ *(condition|body):')
CONTAINERS = frozenset({'kCommandBuffer', 'kWhile', 'kConditional', 'kSequential'})
_LOOPS = frozenset({'kWhile', 'kConditional'})


@dataclasses.dataclass
class _Node:
  kind: str
  indent: int
  children: list['_Node'] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Loop:
  launches: int  # Leaf thunks one iteration runs (inner loops' bodies once).
  graphs: int  # Command buffers among them.
  outside: int  # Leaves outside any command buffer.
  inner_loops: int


def parse(text: str) -> _Node:
  """The thunk tree of a `thunk_sequence_after_thunk_passes.txt`."""
  root = _Node('root', -1)
  stack = [root]
  for line in text.splitlines():
    label = _LABEL.match(line)
    if label:  # Belongs to the latest loop, whatever its indentation.
      while stack[-1].kind not in _LOOPS:
        if len(stack) == 1:
          raise ValueError(f'"{label.group(1)}:" outside a loop: {line!r}')
        stack.pop()
      node = _Node(label.group(1), stack[-1].indent + 1)
      stack[-1].children.append(node)
      stack.append(node)
      continue
    thunk = _LINE.match(line)
    if not thunk:
      continue
    indent = len(thunk.group(1))
    while len(stack) > 1 and stack[-1].indent >= indent:
      stack.pop()
    node = _Node(thunk.group(2), indent)
    stack[-1].children.append(node)
    stack.append(node)
  return root


def _count(node: _Node, in_graph: bool) -> tuple[int, int, int, int]:
  """(leaves, command buffers, leaves outside one, inner loops) below `node`."""
  leaves = graphs = outside = loops = 0
  for child in node.children:
    if child.kind in CONTAINERS or child.kind in ('condition', 'body'):
      graphs += child.kind == 'kCommandBuffer'
      loops += child.kind in _LOOPS
      sub = _count(child, in_graph or child.kind == 'kCommandBuffer')
    else:
      sub = (1, 0, 0 if in_graph else 1, 0)
    leaves, graphs, outside, loops = (leaves + sub[0], graphs + sub[1], outside + sub[2],
                                      loops + sub[3])
  return leaves, graphs, outside, loops


def _loops(node: _Node):
  for child in node.children:
    if child.kind == 'kWhile':
      yield child
    yield from _loops(child)


def main_loop(text: str) -> Loop | None:
  """One iteration (its condition and body) of the while loop that launches the most."""
  found = None
  for loop in _loops(parse(text)):
    count = Loop(*_count(loop, False))
    if found is None or count.launches > found.launches:
      found = count
  return found
