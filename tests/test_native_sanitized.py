"""The native kernels under AddressSanitizer and UndefinedBehaviorSanitizer, at odd shapes.

Compiles spsjax/native's kernels (and the deliberate errors of `native_sanitizer_probe.cc`) with
`g++ -fsanitize=address,undefined` into a temporary directory, never next to the normal library,
then runs `native_sanitized_worker.py` in processes that load that build
(`SPSJAX_NATIVE_LIBRARY`) with the sanitizer runtime preloaded. The workers drive every FFI
target through its Python wrapper, in every instruction set this CPU runs, at odd shapes, on the
kernels' threads and on the packed matmul's wide path (at its default threshold of rows, from 1
row, and off: then AVX-512's passes of 9-16 rows read them transposed, up to 67 rows), and
compare every output with a float64 reference. A test fails on any sanitizer
report, on a mismatch and on a worker that does not finish. The negative controls prove the
sanitizers live in this very setup: a write one float past an FFI result buffer and a signed
overflow must each abort their process with the sanitizer's report.

A missing g++ or sanitizer runtime fails the test (with what is missing), never skips it.

The build is -O0: the sanitizers then check every load and store (-O1 optimizes some away), and
it compiles in a third of the time (the kernels' templates, three instruction sets each, took
~80 s of CPU at -O1, ~28 s at -O0); the four sources compile in parallel.
"""

import os
import shutil
import subprocess
import sys
import time

import jaxlib
import pytest

from tests import xla_env

_HERE = os.path.dirname(os.path.abspath(__file__))
_NATIVE = os.path.join(os.path.dirname(_HERE), 'spsjax', 'native')
_WORKER = os.path.join(_HERE, 'native_sanitized_worker.py')
SOURCES = [os.path.join(_NATIVE, name) for name in (
    'packed_matmul.cc', 'decode_attention.cc', 'sampling.cc', 'lookup.cc')]
SOURCES.append(os.path.join(_HERE, 'native_sanitizer_probe.cc'))
SANITIZE = ['-fsanitize=address,undefined,float-cast-overflow', '-fno-sanitize-recover=all',
            '-fno-omit-frame-pointer']
CXXFLAGS = SANITIZE + ['-O0', '-g', '-std=c++17', '-fPIC', '-Wno-attributes', '-Wno-return-type',
                       '-Wno-psabi']
# Worker processes, started together: name -> (worker arguments, SPSJAX_NATIVE_WIDE_ROWS).
# The wide path's threshold is read once per process, so each threshold has its own process;
# the second and third drive AVX-512's products only (no other instruction set has a wide path).
# The third runs them last: the second has compiled the same programs by then, into the run's
# compilation cache (the threshold is read at run time, not compiled in).
DRIVERS = {
    'matmul_and_lookup': (['matmul', 'lookup'], None),
    'matmul_wide_from_1_row_and_attention': (['matmul_rows:avx512', 'attention'], '1'),
    'matmul_wide_off_and_sampling': (['sampling', 'matmul_rows:avx512'], '0'),
}
PROBES = ('overflow_probe', 'ub_probe')
TIMEOUT_S = 600
SANITIZER_REPORTS = ('ERROR: AddressSanitizer', 'runtime error:', 'ERROR: LeakSanitizer',
                     'AddressSanitizer: CHECK failed')


def _runtime(compiler, name):
  """The path of the sanitizer runtime `name` that `compiler` links, or a failure."""
  path = subprocess.run([compiler, f'-print-file-name={name}'], capture_output=True, text=True,
                        check=True).stdout.strip()
  if not os.path.isabs(path) or not os.path.exists(path):
    pytest.fail(f'{compiler} finds no {name} (the sanitizer runtimes are Debian\'s libasan8 and '
                f'libubsan1): the sanitizer test cannot run.')
  return path


def build(out_dir: str, compiler: str = 'g++') -> str:
  """Compiles SOURCES with the sanitizers (one compiler per source, in parallel; XLA's FFI
  headers from jaxlib as system headers, as setup.py has them) and links them into
  out_dir/_kernels_sanitized.so; returns its path."""
  include = os.path.join(os.path.dirname(jaxlib.__file__), 'include')
  objects, procs = [], []
  for source in SOURCES:
    obj = os.path.join(out_dir, os.path.basename(source) + '.o')
    log = open(obj + '.log', 'w')  # pylint: disable=consider-using-with
    procs.append((source, log, subprocess.Popen(
        [compiler, *CXXFLAGS, '-isystem', include, f'-I{_NATIVE}', '-c', source, '-o', obj],
        stdout=log, stderr=subprocess.STDOUT)))
    objects.append(obj)
  for source, log, proc in procs:
    rc = proc.wait()
    log.close()
    if rc:
      with open(log.name) as f:
        pytest.fail(f'compiling {source} with the sanitizers failed:\n{f.read()[-4000:]}')
  path = os.path.join(out_dir, '_kernels_sanitized.so')
  link = subprocess.run([compiler, *SANITIZE, '-shared', *objects, '-o', path],
                        capture_output=True, text=True)
  if link.returncode:
    pytest.fail(f'linking the sanitized kernels failed:\n{link.stdout}{link.stderr}')
  return path


class Run:
  """A worker process whose output goes to files (a pipe it filled would stop it)."""

  def __init__(self, name, args, env, out_dir):
    self.name = name
    self.stdout_path = os.path.join(out_dir, f'{name}.stdout')
    self.stderr_path = os.path.join(out_dir, f'{name}.stderr')
    with open(self.stdout_path, 'w') as out, open(self.stderr_path, 'w') as err:
      self.proc = subprocess.Popen([sys.executable, _WORKER, *args], env=env, stdout=out,
                                   stderr=err, stdin=subprocess.DEVNULL, cwd=os.path.dirname(_HERE))
    self.start = time.time()

  def finish(self) -> tuple[int, str, str]:
    """(return code, stdout, stderr) once the process ends."""
    try:
      rc = self.proc.wait(timeout=max(1.0, TIMEOUT_S - (time.time() - self.start)))
    except subprocess.TimeoutExpired:
      self.proc.kill()
      self.proc.wait()
      rc = None
    with open(self.stdout_path) as out, open(self.stderr_path) as err:
      stdout, stderr = out.read(), err.read()
    if rc is None:
      pytest.fail(f'{self.name}: no end after {TIMEOUT_S} s\n{stdout[-3000:]}{stderr[-3000:]}')
    return rc, stdout, stderr


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  """Builds the sanitized library, then starts every worker at once (they share the cores):
  name -> Run."""
  compiler = shutil.which('g++')
  if compiler is None:
    pytest.fail('g++ is not installed: the sanitizer test needs it (and libasan, libubsan).')
  preload = ':'.join(_runtime(compiler, name) for name in ('libasan.so', 'libstdc++.so'))
  out_dir = str(tmp_path_factory.mktemp('sanitized'))
  start = time.time()
  path = build(out_dir, compiler)
  print(f'sanitized build: {time.time() - start:.1f} s')
  # libstdc++ preloaded after the runtime: ASan's interceptor of C++ throws needs it loaded at
  # start (jaxlib throws and catches while it loads its plugins).
  # One BLAS thread for the references: OpenBLAS's threads spin between the small products and
  # took the cores from the kernels (a 67 x 979 x 67 product 10x slower on 2 busy cores).
  env = dict(LD_PRELOAD=preload, SPSJAX_NATIVE_LIBRARY=path, JAX_PLATFORMS='cpu',
             ASAN_OPTIONS='detect_leaks=0', UBSAN_OPTIONS='print_stacktrace=1',
             OPENBLAS_NUM_THREADS='1')
  started = {}
  for name, (args, wide_rows) in DRIVERS.items():
    extra = dict(env) if wide_rows is None else dict(env, SPSJAX_NATIVE_WIDE_ROWS=wide_rows)
    started[name] = Run(name, args, xla_env.subprocess_env(**extra), out_dir)
  for name in PROBES:
    started[name] = Run(name, [name], xla_env.subprocess_env(**env), out_dir)
  yield started
  for run in started.values():
    if run.proc.poll() is None:
      run.proc.kill()
      run.proc.wait()


def _excerpt(stderr: str) -> str:
  """The first sanitizer report on stderr and what follows it, else stderr's end."""
  starts = [i for i in (stderr.find(r) for r in SANITIZER_REPORTS) if i >= 0]
  return stderr[max(0, min(starts) - 300):][:12000] if starts else stderr[-12000:]


@pytest.mark.parametrize('name', list(DRIVERS))
def test_kernels_run_clean_under_sanitizers(runs, name):
  rc, stdout, stderr = runs[name].finish()
  reports = [r for r in SANITIZER_REPORTS if r in stderr]
  assert not reports and rc == 0 and 'worker done' in stdout, (
      f'{name}: exit {rc}, sanitizer reports {reports}\n--- stdout\n{stdout[-3000:]}\n'
      f'--- stderr\n{_excerpt(stderr)}')


def test_sanitizer_reports_a_write_past_an_ffi_buffer(runs):
  """The negative control of AddressSanitizer: the probe writes one float past its result."""
  rc, stdout, stderr = runs['overflow_probe'].finish()
  assert rc != 0 and 'the sanitizer missed it' not in stdout, (rc, stdout, stderr[-3000:])
  assert 'ERROR: AddressSanitizer: heap-buffer-overflow' in stderr, stderr[-3000:]
  assert 'WRITE of size 4' in stderr and 'OverflowImpl' in stderr, stderr[-3000:]


def test_sanitizer_reports_undefined_behaviour(runs):
  """The negative control of UndefinedBehaviorSanitizer: the probe's int32 sum overflows."""
  rc, stdout, stderr = runs['ub_probe'].finish()
  assert rc != 0 and 'the sanitizer missed it' not in stdout, (rc, stdout, stderr[-3000:])
  assert 'runtime error: signed integer overflow' in stderr, stderr[-3000:]
  assert 'native_sanitizer_probe.cc' in stderr, stderr[-3000:]
