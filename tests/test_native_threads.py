"""The native kernels' threads: as many as the process has usable CPUs, asleep when idle.

The thread count is read once per process, so each setting runs in a process of its own: `CHILD`
makes one threaded product and one threaded attention call on fixed inputs, saves their outputs,
then idles and reports its CPU time. A cgroup quota cannot be set from a test; its files are
parsed from a fake hierarchy instead.
"""

import json
import math
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from spsjax.native import library
from tests import xla_env

REPO = pathlib.Path(__file__).resolve().parent.parent

# Prints {"threads", "helpers", "idle_cpu_s"} as JSON and saves the outputs to argv[1] (.npz).
# Both calls are large enough to be split over the threads (packed_matmul.cc,
# decode_attention.cc); idle_cpu_s is the process's CPU time over 1 s of sleep begun 50 ms after.
CHILD = '''
import json, resource, sys, time
import jax, jax.numpy as jnp, numpy as np
from spsjax import native
from spsjax.native import attention, library

rng = np.random.default_rng(0)
w = jnp.asarray(rng.standard_normal((1024, 1024), np.float32))
x = jnp.asarray(rng.standard_normal((5, 1024), np.float32))
y = jax.jit(lambda x, p: native.matmul(x, p, use_kernel=True))(x, native.pack(w))
B, S, T, K, G, H = 2, 256, 5, 2, 3, 64
qkv = jnp.asarray(rng.standard_normal((B, T, K * G + 2 * K, H), np.float32))
keys = jnp.asarray(rng.standard_normal((B, S, K, H), np.float32))
values = jnp.asarray(rng.standard_normal((B, S, K, H), np.float32))
out = jax.jit(lambda *a: attention.cached_attention(
    *a, rope_freqs=attention.rope_frequencies(H, 1e4)))(
    qkv, keys, values, jnp.array([3, 200], jnp.int32))
np.savez(sys.argv[1], y=y, out=out[0], keys=out[1], values=out[2])

def cpu():
  usage = resource.getrusage(resource.RUSAGE_SELF)
  return usage.ru_utime + usage.ru_stime

time.sleep(0.05)
before = cpu()
time.sleep(1.0)
print(json.dumps(dict(threads=library.threads(), helpers=library.helpers_started(),
                      idle_cpu_s=cpu() - before)))
'''


def _env(**extra):
  env = xla_env.subprocess_env(**extra)
  if 'SPSJAX_NATIVE_THREADS' not in extra:
    env.pop('SPSJAX_NATIVE_THREADS', None)
  return env


def _run_child(path, prefix=(), **env):
  result = subprocess.run([*prefix, sys.executable, '-c', CHILD, str(path)], cwd=REPO,
                          env=_env(**env), capture_output=True, text=True, timeout=300,
                          check=False)
  assert result.returncode == 0, result.stderr
  return json.loads(result.stdout.strip().splitlines()[-1]), np.load(path)


@pytest.fixture(scope='module')
def unrestricted(tmp_path_factory):
  """The child's report and outputs with every usable CPU and no SPSJAX_NATIVE_THREADS."""
  return _run_child(tmp_path_factory.mktemp('threads') / 'all.npz')


def _lib():
  lib = library.load()
  assert lib is not None, 'spsjax/native was not built: reinstall with pip install -e .'
  return lib


def _quota(root, proc_cgroup: str) -> int:
  return _lib().spsjax_cgroup_cpu_limit(str(root).encode(), proc_cgroup.encode())


def test_threads_are_the_usable_cpus_and_helpers_the_rest(unrestricted):
  report, _ = unrestricted
  quota = _quota('/sys/fs/cgroup', pathlib.Path('/proc/self/cgroup').read_text())
  want = min(len(os.sched_getaffinity(0)), quota or math.inf)
  assert report['threads'] == want
  assert report['helpers'] == want - 1


def test_an_idle_process_takes_no_cpu(unrestricted):
  """After a threaded call the helpers look for the next job for a fraction of a millisecond,
  then sleep: over the next second the process runs for a few milliseconds at most."""
  report, _ = unrestricted
  if report['helpers'] == 0:
    pytest.skip('one usable CPU: no helper threads to put to sleep')
  assert report['idle_cpu_s'] < 0.05


@pytest.mark.skipif(shutil.which('taskset') is None, reason='needs taskset (util-linux)')
def test_one_cpu_starts_no_helper_and_gives_the_same_outputs(unrestricted, tmp_path):
  cpu = str(min(os.sched_getaffinity(0)))
  report, got = _run_child(tmp_path / 'one.npz', prefix=('taskset', '-c', cpu))
  assert (report['threads'], report['helpers']) == (1, 0)
  _, want = unrestricted
  for name in want.files:
    np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_native_threads_variable_caps_the_threads_and_bad_values_are_ignored(unrestricted,
                                                                             tmp_path):
  report, _ = _run_child(tmp_path / 'capped.npz', SPSJAX_NATIVE_THREADS='1')
  assert (report['threads'], report['helpers']) == (1, 0)
  show = 'from spsjax.native import library; print(library.threads())'
  bad = ['', '0', '-2', 'two', '1.5']
  children = [subprocess.Popen([sys.executable, '-c', show], cwd=REPO,
                               env=_env(SPSJAX_NATIVE_THREADS=value), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for value in bad]
  for value, child in zip(bad, children, strict=True):
    stdout, stderr = child.communicate(timeout=120)
    assert child.returncode == 0, stderr
    assert int(stdout) == unrestricted[0]['threads'], value
    if value:  # Set to something that is not a positive integer: the loader says so.
      assert 'is not a positive integer' in stderr, value


def _write(root, files):
  for name, text in files.items():
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_quota_is_the_smallest_on_the_way_up(tmp_path):
  _write(tmp_path, {'cpu.max': 'max 100000\n', 'a/cpu.max': '250000 100000\n',
                    'a/b/cpu.max': 'max 100000\n', 'c/cpu.max': '50000 100000\n',
                    'c/d/cpu.max': '400000 100000\n'})
  assert _quota(tmp_path, '0::/a/b\n') == 3  # 2.5 CPUs, from the parent.
  assert _quota(tmp_path, '0::/c/d\n') == 1  # Half a CPU: still one thread.
  assert _quota(tmp_path, '0::/\n') == 0  # No quota.
  assert _quota(tmp_path, '0::/elsewhere/x\n') == 0  # No files on the way but the root's.
  # A container's mount shows its own cgroup at the top, named by the host's path.
  _write(tmp_path / 'box', {'cpu.max': '150000 100000\n'})
  assert _quota(tmp_path / 'box', '0::/docker/0123abc\n') == 2


def test_cgroup_v1_quota_and_malformed_files(tmp_path):
  _write(tmp_path, {'cpu,cpuacct/cpu.cfs_quota_us': '-1\n',
                    'cpu,cpuacct/cpu.cfs_period_us': '100000\n',
                    'cpu,cpuacct/job/cpu.cfs_quota_us': '200000\n',
                    'cpu,cpuacct/job/cpu.cfs_period_us': '100000\n',
                    'cpuset/job/cpu.cfs_quota_us': '100000\n',
                    'cpuset/job/cpu.cfs_period_us': '100000\n',
                    'bad/cpu.max': 'lots 100000\n', 'zero/cpu.max': '100000 0\n'})
  v1 = '12:memory:/job\n4:cpu,cpuacct:/job\n3:cpuset:/job\n1:name=systemd:/\n0::/\n'
  assert _quota(tmp_path, v1) == 2  # The cpuset hierarchy is not the cpu one.
  assert _quota(tmp_path, '4:cpu,cpuacct:/\n') == 0  # -1: no quota.
  assert _quota(tmp_path, '0::/bad\n0::/zero\n') == 0
  assert _quota(tmp_path, 'not a cgroup line\n::\n0::\n') == 0
