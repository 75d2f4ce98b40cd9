"""Run untrusted HumanEval completions against the problems' tests in a sandboxed subprocess.

The program is `prompt + completion + '\\n' + test + '\\n' + f'check({entry_point})'`. It runs in a
fresh interpreter (`python -I`) whose bootstrap, before any of the program runs:
- sets rlimits: address space (memory), CPU seconds, file size, open files, no core dumps, and
  as `nobody` at most 64 processes;
- makes creating any non-Unix socket raise `NetworkBlockedError` (status 'blocked').
Around it the parent, with what `sandbox()` finds working on this host:
- starts it in new network and pid namespaces (`unshare --net --pid --fork`): the new network
  namespace's only interface is a downed loopback, so even code that gets past the socket guard
  (ctypes, a child interpreter) gets ENETUNREACH, and every process it starts dies with it; without
  `unshare` the socket guard is the only network barrier;
- runs it as `nobody` if we are root (`setpriv`), so it cannot write the repository or signal
  other jobs; where that does not work it keeps our uid;
- gives it a new temporary working directory that is removed afterwards, a scrubbed environment,
  stdin from /dev/null, and stdout+stderr in a file of which `Limits.output_chars` are kept;
- kills its whole process group at the wall-clock limit.

Invariants: `ExecResult.passed` iff `status == 'passed'`, and that status comes only from a record
the bootstrap writes on a private pipe after `check(...)` returned; a program that exits early, is
killed, or runs out of time never passes. `check_completions` returns results in input order.

Not a defence against code written to attack this harness (it could find the pipe and forge a
record, or fill the disk with many files under the size limit): it contains careless and rambling
model output. Statuses: see `STATUSES`.
"""

import ast
import dataclasses
import functools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Mapping, Sequence
from concurrent import futures

STATUSES = (
    'passed',  # check(...) returned.
    'failed',  # An AssertionError: a test failed.
    'error',  # Another exception (SyntaxError, NameError, ...), or it stopped without a record.
    'timeout',  # The wall-clock or the CPU-time limit.
    'memory',  # A MemoryError: the address-space limit.
    'blocked',  # The program tried to create a network socket.
)

# A generated completion ends where a line at column 0 starts a new top-level statement: the
# function body it completes is indented. These are the Codex paper's stop sequences ('\nclass',
# '\ndef', '\n#', '\nif', '\nprint') with the keywords' trailing space or paren, plus decorators,
# top-level asserts (models like to append their own tests) and the end of a markdown code fence.
STOP_SEQUENCES = ('\ndef ', '\nclass ', '\nif ', '\nprint(', '\n#', '\n@', '\nassert ', '\n```')

PROGRAM_FILE = 'program.py'
NOBODY = 65534
_MAX_PROCESSES = 64
_MAX_OPEN_FILES = 256
_MAX_RECORD_BYTES = 1 << 16


@dataclasses.dataclass(frozen=True)
class Limits:
  """Per-program limits. The CPU-time limit is `ceil(timeout_s) + 1` seconds."""

  timeout_s: float = 5.0  # Wall clock, from process start (interpreter start-up included).
  memory_mb: int = 1024  # Address space (RLIMIT_AS).
  file_mb: int = 16  # Largest file the program may write (RLIMIT_FSIZE).
  output_chars: int = 2000  # Captured stdout+stderr kept in `ExecResult.output`.

  def __post_init__(self):
    if min(self.timeout_s, self.memory_mb, self.file_mb, self.output_chars) <= 0:
      raise ValueError(f'Limits must be positive: {self}')


@dataclasses.dataclass(frozen=True)
class ExecResult:
  """The outcome of one program: `passed` iff `status == 'passed'`."""

  passed: bool
  status: str  # One of `STATUSES`.
  message: str  # One line: the exception, or why the program stopped.
  output: str = ''  # The head of stdout+stderr, at most `Limits.output_chars`.
  seconds: float = 0.0  # Wall time of the subprocess.

  def __post_init__(self):
    if self.status not in STATUSES:
      raise ValueError(f'Unknown status {self.status!r}; expected one of {STATUSES}')
    if self.passed != (self.status == 'passed'):
      raise ValueError(f'passed={self.passed} contradicts status={self.status!r}')


def truncate_completion(text: str) -> str:
  """`text` up to the first of `STOP_SEQUENCES`: the function body without what follows it."""
  cut = min((i for s in STOP_SEQUENCES if (i := text.find(s)) != -1), default=len(text))
  return text[:cut]


def parses(source: str) -> bool:
  """Whether `source` (e.g. prompt + completion) parses as Python (`ast.parse`). Runs nothing.

  Only the grammar: compiler checks such as `return` outside a function are not made.
  """
  try:
    with warnings.catch_warnings():
      warnings.simplefilter('ignore')  # SyntaxWarning for odd escapes and the like.
      ast.parse(source)
  except (SyntaxError, ValueError, RecursionError, MemoryError):  # ValueError: null bytes.
    return False
  return True


def build_program(problem: Mapping[str, str], completion: str) -> str:
  """The HumanEval check program for `completion` (a function body following the prompt)."""
  return (problem['prompt'] + completion + '\n' + problem['test'] + '\n'
          + f"check({problem['entry_point']})")


def check_completion(problem: Mapping[str, str], completion: str,
                     limits: Limits = Limits()) -> ExecResult:
  """Runs `completion` against `problem`'s tests in the sandbox."""
  return run_program(build_program(problem, completion), limits)


def check_completions(pairs: Sequence[tuple[Mapping[str, str], str]], limits: Limits = Limits(),
                      workers: int = 2) -> list[ExecResult]:
  """`check_completion` for each (problem, completion), `workers` at a time, in input order."""
  sandbox()  # Probe once, before the threads.
  with futures.ThreadPoolExecutor(max_workers=workers) as pool:
    return list(pool.map(lambda pair: check_completion(*pair, limits), pairs))


def pass_at_1(results: Sequence[ExecResult]) -> float:
  """The fraction of `results` that passed: pass@1 with one sample per problem."""
  if not results:
    raise ValueError('pass_at_1 needs at least one result')
  return sum(r.passed for r in results) / len(results)


# Runs first in the child. argv: result fd, CPU seconds, memory bytes, file bytes, whether to cap
# processes (only as `nobody`: the cap counts every process of the uid). Writes one JSON record
# {status, message} to the result fd, then exits at once, so that atexit hooks and threads the
# program left behind can neither change nor delay the outcome.
_BOOTSTRAP = r"""
import json, os, resource, signal, socket, sys, traceback
import _socket

_FD, _CPU, _MEMORY, _FILE, _CAP_PROCESSES = (int(a) for a in sys.argv[1:6])
_PROGRAM = %(file)r
sys.argv = [_PROGRAM]


def _report(status, message):
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except BaseException:
      pass
  os.write(_FD, json.dumps({'status': status, 'message': message[:300]}).encode())
  os._exit(0)


def _limit(name, soft, hard=None):
  resource.setrlimit(getattr(resource, name), (soft, soft if hard is None else hard))


_limit('RLIMIT_AS', _MEMORY)
_limit('RLIMIT_CPU', _CPU, _CPU + 1)
_limit('RLIMIT_FSIZE', _FILE)
_limit('RLIMIT_NOFILE', %(open_files)d)
_limit('RLIMIT_CORE', 0)
if _CAP_PROCESSES:
  _limit('RLIMIT_NPROC', %(processes)d)
# SIGXCPU at the soft CPU limit; SIGKILL a second later if this handler cannot run (a long C call).
signal.signal(signal.SIGXCPU, lambda *_: _report('timeout', 'CPU-time limit reached'))


class NetworkBlockedError(PermissionError):
  pass


def _guard(base):
  class Guarded(base):
    def __init__(self, family=-1, type=-1, proto=-1, fileno=None):
      if fileno is None and family != socket.AF_UNIX:
        raise NetworkBlockedError('network access is disabled in the sandbox')
      super().__init__(family, type, proto, fileno)
  Guarded.__name__ = Guarded.__qualname__ = base.__name__
  return Guarded


socket.socket = _guard(socket.socket)
_socket.socket = _guard(_socket.socket)


def _where(error):
  lines = [f.lineno for f in traceback.extract_tb(error.__traceback__) if f.filename == _PROGRAM]
  return f' ({_PROGRAM} line {lines[-1]})' if lines else ''


try:
  with open(_PROGRAM, encoding='utf-8') as f:
    _code = compile(f.read(), _PROGRAM, 'exec')
  exec(_code, {'__name__': '__sandbox__', '__builtins__': __builtins__})
except BaseException as e:
  traceback.print_exc()
  status = ('blocked' if isinstance(e, NetworkBlockedError) else
            'memory' if isinstance(e, MemoryError) else
            'failed' if isinstance(e, AssertionError) else 'error')
  _report(status, traceback.format_exception_only(type(e), e)[-1].strip() + _where(e))
_report('passed', '')
""" % {'file': PROGRAM_FILE, 'open_files': _MAX_OPEN_FILES, 'processes': _MAX_PROCESSES}

# Namespace flags in order of preference; `sandbox()` takes the first that runs here. The `--user`
# forms are for non-root hosts that allow unprivileged user namespaces.
_PID_NS = ('--pid', '--fork', '--kill-child')
_UNSHARE_CANDIDATES = (
    ('netns+pidns', ('--net',) + _PID_NS),
    ('userns+netns+pidns', ('--user', '--map-root-user', '--net') + _PID_NS),
    ('netns', ('--net',)),
    ('userns+netns', ('--user', '--map-root-user', '--net')),
)
# Root becomes `nobody`, keeping only CAP_DAC_READ_SEARCH (read any file, write none it does not
# own) so that an interpreter installed under /root (pyenv, 0700) can still load its stdlib;
# no-new-privs stops setuid binaries from giving privileges back.
_SETPRIV_FLAGS = (f'--reuid={NOBODY}', f'--regid={NOBODY}', '--clear-groups',
                  '--inh-caps=-all,+dac_read_search', '--ambient-caps=+dac_read_search',
                  '--bounding-set=-all,+dac_read_search', '--no-new-privs')
_PROBE_TIMEOUT_S = 10.0


@dataclasses.dataclass(frozen=True)
class Sandbox:
  """How this host isolates programs, as found by `sandbox()`."""

  network: str  # One of `_UNSHARE_CANDIDATES`' names, or 'socket-guard' (in Python only).
  user: str  # 'nobody', or 'unchanged' where setpriv is missing or we are not root.
  prefix: tuple[str, ...]  # The unshare and setpriv commands that run the interpreter.


def _runs(prefix: tuple[str, ...], code: str) -> bool:
  try:
    probe = subprocess.run((*prefix, sys.executable, '-I', '-c', code), capture_output=True,
                           stdin=subprocess.DEVNULL, timeout=_PROBE_TIMEOUT_S, check=False)
  except (OSError, subprocess.SubprocessError):
    return False
  return probe.returncode == 0


@functools.cache
def sandbox() -> Sandbox:
  """The strongest isolation that works here, probed once (a few short subprocesses)."""
  network, prefix = 'socket-guard', ()
  if unshare := shutil.which('unshare'):
    for name, flags in _UNSHARE_CANDIDATES:
      if _runs((unshare, *flags, '--'), 'pass'):
        network, prefix = name, (unshare, *flags, '--')
        break
  setpriv = shutil.which('setpriv')
  if os.geteuid() == 0 and setpriv:
    dropped = (*prefix, setpriv, *_SETPRIV_FLAGS, '--')
    if _runs(dropped, f'import fractions, os; assert os.getuid() == {NOBODY}'):
      return Sandbox(network, 'nobody', dropped)
  return Sandbox(network, 'unchanged', prefix)


def _environment(workdir: str) -> dict[str, str]:
  return {'PATH': '/usr/local/bin:/usr/bin:/bin', 'HOME': workdir, 'TMPDIR': workdir,
          'LANG': 'C.UTF-8', 'LC_ALL': 'C.UTF-8'}


def _kill_group(pid: int) -> None:
  try:
    os.killpg(pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass


def _read_record(fd: int) -> dict | None:
  os.set_blocking(fd, False)
  chunks = []
  try:
    while chunk := os.read(fd, _MAX_RECORD_BYTES):
      chunks.append(chunk)
  except BlockingIOError:  # A stray process still holds the write end; the record is complete.
    pass
  try:
    record = json.loads(b''.join(chunks))
  except ValueError:
    return None
  if not isinstance(record, dict) or record.get('status') not in STATUSES:
    return None
  return record


def _without_record(returncode: int) -> tuple[str, str]:
  """Status and message for a program that stopped without writing its record."""
  # A signal shows as -N; through `unshare --fork` (util-linux 2.38) it shows as exit code 1.
  if returncode >= 0:
    return 'error', f'exited with code {returncode} before check() returned'
  try:
    name = signal.Signals(-returncode).name
  except ValueError:
    name = f'signal {-returncode}'
  if -returncode in (signal.SIGXCPU, signal.SIGKILL):
    return 'timeout', f'killed by {name} (the CPU-time limit, or the kernel out of memory)'
  return 'error', f'killed by {name}'


def run_program(program: str, limits: Limits = Limits()) -> ExecResult:
  """Runs the Python source `program` in the sandbox; passes iff it runs to the end."""
  box = sandbox()
  workdir = tempfile.mkdtemp(prefix='spsjax-exec-')
  path = os.path.join(workdir, PROGRAM_FILE)
  read_fd, write_fd = os.pipe()
  try:
    with open(path, 'w', encoding='utf-8') as f:
      f.write(program)
    if box.user == 'nobody':
      os.chown(workdir, NOBODY, NOBODY)
      os.chown(path, NOBODY, NOBODY)
    args = (write_fd, math.ceil(limits.timeout_s) + 1, limits.memory_mb << 20,
            limits.file_mb << 20, int(box.user == 'nobody'))
    command = (*box.prefix, sys.executable, '-I', '-c', _BOOTSTRAP, *map(str, args))
    with tempfile.TemporaryFile() as out:
      start = time.monotonic()
      proc = subprocess.Popen(
          command, cwd=workdir, env=_environment(workdir), stdin=subprocess.DEVNULL, stdout=out,
          stderr=subprocess.STDOUT, pass_fds=(write_fd,), start_new_session=True)
      os.close(write_fd)
      write_fd = -1
      timed_out = False
      try:
        proc.wait(timeout=limits.timeout_s)
      except subprocess.TimeoutExpired:
        timed_out = True
      finally:
        _kill_group(proc.pid)  # Also whatever the program started and left running.
        proc.wait()
      seconds = time.monotonic() - start
      record = _read_record(read_fd)
      out.seek(0)
      output = out.read(4 * limits.output_chars).decode('utf-8', 'replace')[:limits.output_chars]
  finally:
    os.close(read_fd)
    if write_fd >= 0:
      os.close(write_fd)
    shutil.rmtree(workdir, ignore_errors=True)

  if timed_out:
    status, message = 'timeout', f'wall-clock limit of {limits.timeout_s:g} s'
  elif record is not None:
    status, message = record['status'], str(record.get('message', ''))
  else:
    status, message = _without_record(proc.returncode)
  return ExecResult(passed=status == 'passed', status=status, message=message, output=output,
                    seconds=seconds)
