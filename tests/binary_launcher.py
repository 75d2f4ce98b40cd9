"""Starts binaries from one warm interpreter, for the tests of their one-line errors.

  python tests/binary_launcher.py BINARY...

Imports what each BINARY imports (its module-level `import` statements; no JAX backend starts),
then reads requests on stdin, one JSON object per line: {"argv": [binary, args...], "stdout":
path, "stderr": path}. For each it forks a child that sends its stdout and stderr to those files
and runs the binary as `__main__` (`runpy`), as `python binary args...` would: sys.argv, sys.path[0]
the binary's directory, an uncaught exception printed with its traceback and status 1, SystemExit's
code as the status. The parent answers each request with {"returncode": status} on stdout.

Starting an interpreter and importing JAX, flax, TFDS and spsjax took ~3 s of CPU per binary; a
fork of this process takes a fraction of a second. The binaries' own code (their module bodies,
flag definitions, config parsing, `main`) runs in each child as in a fresh process; only the
modules they import are shared, imported once with the same environment. Used by
tests/test_experiments.py and tests/test_accelerator_check.py (through `started`) for runs that
must end in an error before any model runs; the runs that sample, train or write start fresh
interpreters.
"""

import ast
import contextlib
import json
import os
import runpy
import select
import subprocess
import sys
import traceback


def preload(binary: str) -> None:
  """Runs the module-level imports of `binary` (as its own process would find them)."""
  with open(binary, encoding='utf-8') as f:
    tree = ast.parse(f.read(), binary)
  imports = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
  sys.path.insert(0, os.path.dirname(os.path.abspath(binary)))
  try:
    exec(compile(ast.Module(body=imports, type_ignores=[]), binary, 'exec'), {})  # pylint: disable=exec-used
  finally:
    sys.path.pop(0)


def _child(argv: list[str], stdout: str, stderr: str) -> None:
  """In the forked child: runs the binary and exits with its status; never returns."""
  code = 1
  try:
    for fd, path in ((1, stdout), (2, stderr)):
      target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
      os.dup2(target, fd)
      os.close(target)
    sys.stdin = open(os.devnull, encoding='utf-8')  # pylint: disable=consider-using-with
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    try:
      runpy.run_path(os.path.abspath(argv[0]), run_name='__main__')
      code = 0
    except SystemExit as e:  # As the interpreter treats it.
      if e.code is None:
        code = 0
      elif isinstance(e.code, int):
        code = e.code
      else:
        print(e.code, file=sys.stderr)
        code = 1
    except BaseException:  # pylint: disable=broad-except
      traceback.print_exc()
      code = 1
  finally:
    for stream in (sys.stdout, sys.stderr):
      try:
        stream.flush()
      except Exception:  # pylint: disable=broad-except
        pass
    os._exit(code)  # pylint: disable=protected-access


def main(binaries: list[str]) -> None:
  for binary in binaries:
    preload(binary)
  print(json.dumps({'ready': True}), flush=True)
  for line in sys.stdin:
    request = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
      _child(request['argv'], request['stdout'], request['stderr'])
    _, status = os.waitpid(pid, 0)
    print(json.dumps({'returncode': os.waitstatus_to_exitcode(status)}), flush=True)


@contextlib.contextmanager
def started(binaries, out_dir, *, cwd: str, env: dict[str, str], timeout_s: float = 300):
  """Starts a launcher for `binaries` (paths relative to `cwd`); yields `run(binary, *args)`,
  which runs one in a forked child and returns its `subprocess.CompletedProcess` (stdout and
  stderr through files in `out_dir`). A run past `timeout_s` kills the launcher and raises
  TimeoutError."""
  launcher = subprocess.Popen(  # pylint: disable=consider-using-with
      [sys.executable, os.path.abspath(__file__), *binaries], cwd=cwd, env=env,
      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
  count = 0

  def run(*args):
    nonlocal count
    count += 1
    paths = [os.path.join(out_dir, f'{count}.{stream}') for stream in ('stdout', 'stderr')]
    launcher.stdin.write(json.dumps(dict(argv=list(args), stdout=paths[0], stderr=paths[1]))
                         + '\n')
    launcher.stdin.flush()
    if not select.select([launcher.stdout], [], [], timeout_s)[0]:
      launcher.kill()
      raise TimeoutError(f'{args}: no end after {timeout_s} s')
    returncode = json.loads(launcher.stdout.readline())['returncode']
    stdout, stderr = (open(path, encoding='utf-8').read() for path in paths)  # pylint: disable=consider-using-with
    return subprocess.CompletedProcess(args, returncode, stdout, stderr)

  try:
    if json.loads(launcher.stdout.readline() or 'null') != {'ready': True}:
      raise RuntimeError(f'the launcher of {binaries} did not start')
    yield run
  finally:
    launcher.stdin.close()
    try:
      launcher.wait(timeout=60)
    except subprocess.TimeoutExpired:
      launcher.kill()
      launcher.wait()


if __name__ == '__main__':
  main(sys.argv[1:])
