"""XLA flags of the test process and of the processes tests start (binaries, workers).

Compiling is most of the suite's time (63% of tests/test_speculative.py, by JAX's own compile-time
events): it compiles over a thousand small programs. These flags make XLA:CPU compile them faster,
each a change of how XLA compiles the same HLO:
- its legacy fusion emitters instead of the MLIR ones: a quarter faster (test_speculative's greedy
  and law tests: compile 88.6 -> 66.3 s);
- LLVM at optimisation level 0 for the generated code (`--xla_backend_optimization_level=0`): a
  sampler program of the law tests compiles in 1.2-1.4 s instead of 3.9-4.4 s and runs its 100k
  rows in ~4.3 s instead of ~1.9 s; over the suite (2 workers, 2 cores, 2026-11-26) pytest took
  11:39 instead of 18:39, every test file faster (the training tests 218 -> 72 s). The law tests'
  programs stay at level 0 too: at level 3 their SpS program (temperature 1, k = 4) compiled in
  8.4 s instead of 1.9 s to run in 4.5 s instead of 8.4 s, and the law tests of test_speculative,
  test_drafters, test_feature_drafters and test_autoregressive took 258 s instead of 212 s
  (2 workers, 2-core AMD EPYC, AVX2, 2026-11-29);
- no HLO verifier between XLA's passes (it checks XLA's own rewrites, not our programs) and LLVM's
  code generated as one module instead of split for parallel threads: 7% less CPU for
  tests/test_autoregressive.py and test_bench_decode.py (126 s against 133 s, median of 3 pairs,
  2-core AMD EPYC, AVX2; 11 sampler programs gave the same tokens). A single process's wall time
  grows a little (the split kept a second core busy), but the suite's two workers keep both cores
  busy: CPU is its cost.
The binaries, benchmarks and the library keep XLA's defaults: only test processes and the
processes they start use these. Processes a test starts get the same flags, so that what they
compute is bit-identical to the test process (a killed and resumed training run is compared bit
for bit).
"""

import os
import re
import subprocess
import sys

QUICK_COMPILE = ('--xla_cpu_use_fusion_emitters=false --xla_backend_optimization_level=0 '
                 '--xla_disable_hlo_passes=hlo-verifier --xla_cpu_parallel_codegen_split_count=1')

# The QUICK_COMPILE flags this run's XLA knows, found once per run and passed on to the workers and
# the processes they start through the environment.
_KNOWN_ENV = 'SPSJAX_TEST_QUICK_COMPILE'


def known_quick_compile() -> str:
  """QUICK_COMPILE without the flags the installed XLA does not know.

  XLA aborts a process whose XLA_FLAGS name an unknown flag, and its releases remove flags
  (jaxlib 0.11 dropped `--xla_cpu_use_fusion_emitters`, with the legacy emitters). These flags
  only make compiling quicker, so one that is gone is left out: a child Python starts JAX's CPU
  backend with them and names the one it rejects, until it starts (about a second, once per run).
  """
  if _KNOWN_ENV in os.environ:
    return os.environ[_KNOWN_ENV]
  kept = QUICK_COMPILE.split()
  for _ in range(len(kept) + 1):
    env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
    env.update(XLA_FLAGS=' '.join(kept), JAX_PLATFORMS='cpu')
    try:
      probe = subprocess.run([sys.executable, '-c', 'import jax; jax.devices()'], env=env,
                             capture_output=True, text=True, timeout=300, check=False)
    except subprocess.TimeoutExpired:
      break
    unknown = re.search(r'Unknown flags? in XLA_FLAGS: (--[a-z0-9_]+)', probe.stderr)
    if probe.returncode == 0 or not unknown:
      break  # Started, or failed for another reason: the test process will say which.
    kept = [f for f in kept if f.split('=')[0] != unknown.group(1)]
  os.environ[_KNOWN_ENV] = ' '.join(kept)
  return os.environ[_KNOWN_ENV]


def flags(devices: int | None = None) -> str:
  """XLA_FLAGS for a test process: the quick compiler path (the flags of it that this XLA
  knows), and `devices` fake CPU devices."""
  parts = [known_quick_compile()]
  if devices is not None:
    parts.append(f'--xla_force_host_platform_device_count={devices}')
  return ' '.join(parts)


def subprocess_env(devices: int | None = None, **extra: str) -> dict[str, str]:
  """This process's environment for a child process, its XLA_FLAGS replaced by `flags(devices)`
  (default: one CPU device), plus `extra`."""
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
  env['XLA_FLAGS'] = flags(devices)
  env.update(extra)
  return env

