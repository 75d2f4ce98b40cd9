"""The phases of a compiled program's HLO: which named scope (`draft`, `score`, `accept`, else
`other`) each instruction belongs to, parsed from `compiled.as_text()`.

Phases. An instruction's phase is, first found: (0) for an instruction that calls code holding
matrix products (`dot`, `convolution`; a fusion's `calls=`, recursively), the majority phase of
those products: they dominate its time, and XLA fuses a phase's last product with the next
phase's first elementwise ops (on CPU, YNNPACK fuses the target's output layer from `score` with
the softmax of `accept`, which would otherwise charge a whole matrix product to `accept`); (1) the
innermost phase name that is a `/`-separated component of its own `op_name`
(`jit(run)/while/body/draft/...`); (2) the majority
over its own and its fused or called instructions' metadata (a fusion's `calls=`, a `call`'s
`to_apply=`, recursively; unscoped code votes `other`; ties go to the earlier of `phases`, then
`other`), so a fusion rooted outside the scopes but made mostly of `score` code is `score`; (3) for
an instruction with no metadata at all (XLA's loop-carried `copy`s, and products XLA rewrote, such
as the attention's batched dots), the phase of its operands if they have exactly one, else (none)
that of its users likewise (through chains of such instructions; code that feeds or reads two
phases is not guessed at), else the phase of the instruction running its computation (copies in
the body of the draft's `fori_loop` are `draft`, those at the top of the main loop's body
`other`); (4) `other`. A `while` or `conditional` takes no votes from
its body or branches: their ops are charged by themselves. Reducers and comparators (a reduce's or
sort's `to_apply=`) neither vote nor count: XLA shares identical ones between scopes. Ops whose own
and fused metadata name two or more phases are counted as mixed (XLA fuses or CSEs across scopes);
each still goes to exactly one phase.

Invariant: every instruction of the module gets exactly one phase; those whose own and fused
metadata name several are also listed in `Hlo.mixed`.

Kernels. XLA:GPU compiles fusions whose fused code, shapes, layouts, kind and backend config are
equal into one kernel, named after the first of them with `.` as `_` (`loop_add_fusion.14` ->
`loop_add_fusion_14`; every layer's copy of a fusion launches the first layer's kernel). A trace's
kernels inside CUDA graphs name only that kernel, so `Hlo.kernel_owners` gives, per kernel name,
the fusions that may have launched it: the named fusion's class of equal fusions
(`Hlo.kernel_class`); another instruction a kernel is named after owns it alone. On the H200's
llama1b step programs each class's kernels ran exactly as often as its fusions
(`tests/test_bench_profile.py`). XLA's own `deduplicated_name` metadata does not say this: it
misses fusions that share kernels and names other ones.
"""

import collections
import dataclasses
import hashlib
import re
from collections.abc import Callable, Iterator, Mapping, Sequence

PHASES = ('draft', 'score', 'accept')
OTHER = 'other'


_MODULE = re.compile(r'^HloModule\s+([^\s,]+)')
_COMPUTATION = re.compile(r'^(ENTRY\s+)?%(\S+)\s.*\{$')
_INSTRUCTION = re.compile(r'^\s+(?:ROOT\s+)?%(\S+)\s+=\s(.*)$')
_OPCODE = re.compile(r'(?:^|\s)([a-z][\w\-]*)\(')  # The first `word(` after the shape.
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_CALLED = re.compile(r'\b(calls|to_apply|called_computations|body|condition|true_computation|'
                     r'false_computation|branch_computations)=(\{[^}]*\}|%[^\s,}]+)')
_CONTROL = ('body', 'condition', 'true_computation', 'false_computation', 'branch_computations')
_LENDS = ('calls', 'called_computations')  # And `to_apply` of a `call`, not of a reducer.
_PRODUCTS = ('dot', 'convolution')
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_PLUMBING = ('parameter', 'get-tuple-element', 'tuple', 'constant')  # Pass values, run nothing.
# What does not change a kernel: source locations, scheduling names, the stream a fusion runs on.
_NOT_CODE = re.compile(r',\s*(?:metadata|frontend_attributes|statistics)='
                       r'\{(?:[^{}"]|"(?:[^"\\]|\\.)*")*\}|"operation_queue_id":"[^"]*",?')


@dataclasses.dataclass(frozen=True)
class Instruction:
  name: str
  opcode: str
  op_name: str | None  # From `metadata={op_name=...}`; None if XLA gave it no metadata.
  called: tuple[str, ...]  # Code that lends its phase: `calls=`, a `call`'s `to_apply=`.
  applied: tuple[str, ...]  # Reducers and comparators (`to_apply=` of reduce, scatter, sort, ...).
  control: tuple[str, ...]  # Control flow: `body=`, `condition=`, branches.
  body: str | None  # For a `while`: its body computation.
  operands: tuple[str, ...] = ()
  trip_count: int | None = None  # For a `while` whose trip count XLA knows (`known_trip_count`).


@dataclasses.dataclass(frozen=True)
class Hlo:
  """A compiled module's instructions with their phases (see the module docstring)."""
  module: str
  phases: tuple[str, ...]
  instructions: Mapping[str, Instruction]
  computations: Mapping[str, tuple[str, ...]]  # Computation -> its instructions.
  phase: Mapping[str, str]  # Instruction -> phase, for every instruction.
  mixed: frozenset[str]  # Instructions whose own and fused metadata name several phases.
  # Fusion -> a key shared by the fusions XLA:GPU compiles to one kernel (module docstring).
  kernel_class: Mapping[str, str] = dataclasses.field(default_factory=dict)

  def kernel_owners(self) -> dict[str, tuple[str, ...]]:
    """{GPU kernel name: the instructions that may have launched it}: the instruction whose name
    with `.` as `_` is the kernel's and, for a fusion, every fusion of its class. Names two
    instructions would share are left out (no kernel can be told by them)."""
    classes, named = collections.defaultdict(list), collections.defaultdict(list)
    for name, key in self.kernel_class.items():
      classes[key].append(name)
    for name in self.instructions:
      named[name.replace('.', '_')].append(name)
    return {kernel: tuple(classes[self.kernel_class[n]]) if n in self.kernel_class else (n,)
            for kernel, (n, *others) in named.items() if not others}

  def subtree(self, computations: Sequence[str]) -> set[str]:
    """Instructions in `computations` and, recursively, in everything they call."""
    return set(self.walk(computations, lambda i: i.called + i.applied + i.control))

  def walk(self, computations: Sequence[str],
           follow: Callable[[Instruction], Sequence[str]]) -> Iterator[str]:
    """The instructions of `computations` and, recursively, of the computations `follow` names
    for each instruction; every computation once."""
    seen, todo = set(), list(computations)
    while todo:
      c = todo.pop()
      if c in seen:
        continue
      seen.add(c)
      for name in self.computations.get(c, ()):
        yield name
        todo.extend(follow(self.instructions[name]))

  def main_loop(self) -> Instruction | None:
    """The outermost `while` holding phased instructions; with none, the largest `while`."""
    def key(w):
      names = self.subtree([w.body])
      return any(self.phase[n] != OTHER for n in names), len(names)
    whiles = [i for i in self.instructions.values() if i.body is not None]
    return max(whiles, key=key, default=None)


def _operands(rest: str) -> tuple[str, ...]:
  """The `%names` between the parentheses that follow the opcode of an instruction's text."""
  opcode = _OPCODE.search(rest)
  if opcode is None:
    return ()
  depth, end = 1, opcode.end()
  while end < len(rest) and depth:
    depth += {'(': 1, ')': -1}.get(rest[end], 0)
    end += 1
  return tuple(re.findall(r'%([^\s,()]+)', rest[opcode.end():end - 1]))


def parse_hlo(text: str, phases: Sequence[str] = PHASES) -> Hlo:
  """Parses `compiled.as_text()`: instructions, what they call, and their phases."""
  module = _MODULE.match(text)
  if module is None:
    raise ValueError('Not HLO text: no `HloModule` header (pass `compiled.as_text()`).')
  instructions, computations, texts, current = {}, {}, {}, None
  for line in text.splitlines():
    if (header := _COMPUTATION.match(line)) is not None:
      current = header.group(2)
      computations[current], texts[current] = [], []
    elif current is not None and (m := _INSTRUCTION.match(line)) is not None:
      op_name, opcode = _OP_NAME.search(line), _OPCODE.search(m.group(2))
      opcode = opcode.group(1) if opcode else ''
      called, applied, control, body = [], [], [], None
      for kind, target in _CALLED.findall(line):
        names = re.findall(r'%([^\s,}]+)', target)
        lends = kind in _LENDS or (kind == 'to_apply' and opcode == 'call')
        (control if kind in _CONTROL else called if lends else applied).extend(names)
        body = names[0] if kind == 'body' else body
      trips = _TRIP_COUNT.search(line) if body is not None else None
      instructions[m.group(1)] = Instruction(m.group(1), opcode, op_name and op_name.group(1),
                                             tuple(called), tuple(applied), tuple(control), body,
                                             _operands(m.group(2)),
                                             trips and int(trips.group(1)))
      computations[current].append(m.group(1))
      texts[current].append(m.group(2))
  computations = {c: tuple(names) for c, names in computations.items()}

  def scope(op_name):
    found = [c for c in op_name.split('/') if c in phases]
    return found[-1] if found else OTHER

  def tally(counts_of):
    """Computation -> Counter of `counts_of(instruction)` over it and, recursively, what it calls."""
    memo = {}

    def count(computation):
      if computation not in memo:
        memo[computation] = collections.Counter()  # Guards against recursion.
        total = collections.Counter()
        for name in computations.get(computation, ()):
          i = instructions[name]
          total.update(counts_of(i))
          for c in i.called:
            total.update(count(c))
        memo[computation] = total
      return memo[computation]

    return count

  # The phases named by code's metadata, and by its matrix products only.
  votes = tally(lambda i: [scope(i.op_name)] if i.op_name is not None else [])
  products = tally(lambda i: [scope(i.op_name)] if i.op_name is not None and
                   i.opcode in _PRODUCTS else [])

  phase, mixed, order, silent = {}, set(), tuple(phases) + (OTHER,), []
  majority = lambda count: max(order, key=lambda p: (count[p], -order.index(p)))
  for name, i in instructions.items():
    count = collections.Counter([scope(i.op_name)] if i.op_name is not None else [])
    fused_products = collections.Counter()
    for c in i.called:
      count.update(votes(c))
      fused_products.update(products(c))
    own = scope(i.op_name) if i.op_name is not None else OTHER
    best = majority(count)
    phase[name] = (majority(fused_products) if fused_products else
                   own if own != OTHER else best if count[best] else OTHER)
    if sum(count[p] > 0 for p in phases) > 1:
      mixed.add(name)
    if not count:
      silent.append(name)

  # No metadata at all (copies and rewritten products XLA adds): the one phase of the operands,
  # else of the users, passed along chains of such instructions (never through tuple plumbing);
  # else the phase of the instruction that runs the computation.
  users = collections.defaultdict(list)
  for name, i in instructions.items():
    for o in i.operands:
      users[o].append(name)
  pending = dict.fromkeys(n for n in silent if instructions[n].opcode not in _PLUMBING)
  while True:
    found = {}
    for name in pending:
      for neighbours in (instructions[name].operands, users[name]):
        named = {phase[n] for n in neighbours
                 if n in phase and n not in pending and phase[n] != OTHER and
                 instructions[n].opcode not in _PLUMBING}
        if len(named) == 1:
          found[name] = named.pop()
        if named:
          break
    if not found:
      break
    for name, p in found.items():
      phase[name] = p
      del pending[name]
  home = {n: c for c, names in computations.items() for n in names}
  caller = {c: n for n, i in instructions.items() for c in i.called + i.control}

  def context(computation, depth=0):
    n = caller.get(computation)
    if n is None or depth > len(computations):
      return OTHER
    return phase[n] if phase[n] != OTHER else context(home[n], depth + 1)

  for name in silent:
    if name in pending or instructions[name].opcode in _PLUMBING:
      phase[name] = context(home[name])
  return Hlo(module.group(1), tuple(phases), instructions, computations, phase,
             frozenset(mixed), _kernel_classes(instructions, computations, texts))


def _kernel_classes(instructions: Mapping[str, Instruction],
                    computations: Mapping[str, tuple[str, ...]],
                    texts: Mapping[str, Sequence[str]]) -> dict[str, str]:
  """{fusion: key}, equal for fusions of equal code (see the module docstring): the fusion's
  own text but for its operands' names, with its computation's text in place of its name, in
  which values are numbered in order and called computations replaced likewise, recursively;
  metadata and scheduling left out."""
  memo = {}

  def code(computation):
    if computation not in memo:
      memo[computation] = '(recursion)'
      local = {n: f'%{i}' for i, n in enumerate(computations.get(computation, ()))}
      body = '\n'.join(_canonical(t, local, code) for t in texts.get(computation, ()))
      memo[computation] = hashlib.sha1(body.encode()).hexdigest()
    return memo[computation]

  own = {n: t for c, names in computations.items() for n, t in zip(names, texts[c])}
  return {name: hashlib.sha1(_canonical(own[name], dict.fromkeys(i.operands, '%'),
                                        code).encode()).hexdigest()
          for name, i in instructions.items() if i.opcode == 'fusion'}


def _canonical(text: str, local: Mapping[str, str], code: Callable[[str], str]) -> str:
  """An instruction's text with metadata left out, local values renamed by `local` and called
  computations by `code`."""
  def rename(m):
    name = m.group(1)
    return local[name] if name in local else '%{' + code(name) + '}'
  return re.sub(r'%([^\s,(){}]+)', rename, _NOT_CODE.sub('', text))


# Instructions that run no work of their own: plumbing, views, and control flow (whose bodies'
# instructions count instead).
_NO_WORK = _PLUMBING + ('bitcast', 'while', 'conditional', 'call')


def launches_by_phase(hlo: Hlo, computation: str, *, trips: bool = False,
                      opcodes: Sequence[str] | None = None) -> dict[str, int]:
  """{phase: the instructions of that phase that run work in `computation` and in the
  computations its control flow runs (loop bodies and conditions, branches, `call`s)}: a fusion
  counts as one (its fused code not at all), reducers and comparators not at all; plumbing,
  bitcasts and the control-flow instructions themselves run no work. On a GPU each is about one
  kernel launch. Each instruction is counted once, or with `trips` as often as one run of
  `computation` runs it: a nested loop's body and condition times the loop's trip count where
  XLA knows it (`known_trip_count`), else once. With `opcodes`, only instructions of those
  opcodes count. Phases with none are left out."""
  counts, seen = collections.Counter(), set()

  def count(c, times, path):
    if c in (path if trips else seen):
      return
    seen.add(c)
    for name in hlo.computations.get(c, ()):
      i = hlo.instructions[name]
      if i.opcode not in _NO_WORK and (opcodes is None or i.opcode in opcodes):
        counts[hlo.phase[name]] += times
      inner = times * (i.trip_count or 1) if trips and i.body is not None else times
      for callee in i.control + (i.called if i.opcode == 'call' else ()):
        count(callee, inner, path | {c})

  count(computation, 1, frozenset())
  return dict(counts)


def launches(hlo: Hlo, computation: str) -> int:
  """All `launches_by_phase` of `computation`."""
  return sum(launches_by_phase(hlo, computation).values())


def hlo_phases(text: str, phases: Sequence[str] = PHASES) -> dict[str, str]:
  """{HLO instruction name: phase} for every instruction of `compiled.as_text()`."""
  return dict(parse_hlo(text, phases).phase)


def loop_launches_by_phase(text: str, *, trips: bool = False) -> dict[str, int] | None:
  """`launches_by_phase` of the main loop's body of a compiled program (`compiled.as_text()`):
  the operations one iteration runs (nested loops by their trip counts with `trips`, else each
  once); None if XLA left no loop (unrolled it)."""
  parsed = parse_hlo(text)
  loop = parsed.main_loop()
  return None if loop is None else launches_by_phase(parsed, loop.body, trips=trips)


# Cross-device communication: each one a wait on the interconnect on a mesh of chips.
COLLECTIVES = ('all-reduce', 'all-reduce-start', 'all-gather', 'all-gather-start',
               'reduce-scatter', 'collective-permute', 'collective-permute-start', 'all-to-all',
               'ragged-all-to-all', 'collective-broadcast')


def loop_collectives(text: str) -> int | None:
  """The collectives (`COLLECTIVES`; an asynchronous one by its start) one iteration of the
  main loop of a compiled program runs, nested loops by their trip counts; None if XLA left no
  loop."""
  parsed = parse_hlo(text)
  loop = parsed.main_loop()
  if loop is None:
    return None
  return sum(launches_by_phase(parsed, loop.body, trips=True, opcodes=COLLECTIVES).values())


def loop_launches(text: str) -> int | None:
  """All `loop_launches_by_phase`, each instruction once (a `layer_scan` program's layer too)."""
  by_phase = loop_launches_by_phase(text)
  return None if by_phase is None else sum(by_phase.values())
