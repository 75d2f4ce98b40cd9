"""XLA flags of the test process and of the processes tests start (binaries, workers).

Compiling is most of the suite's time (63% of tests/test_speculative.py, by JAX's own compile-time
events): it compiles over a thousand small programs. XLA:CPU's legacy fusion emitters compile them
a quarter faster than its MLIR fusion emitters (test_speculative's greedy and law tests: compile
88.6 -> 66.3 s); both are XLA's own code generation of the same HLO, and the binaries keep XLA's
default. Processes a test starts get the same flags, so that what they compute is bit-identical
to the test process (a killed and resumed training run is compared bit for bit).
"""

import os

QUICK_COMPILE = '--xla_cpu_use_fusion_emitters=false'


def flags(devices: int | None = None) -> str:
  """XLA_FLAGS for a test process: the quick compiler path, and `devices` fake CPU devices."""
  parts = [QUICK_COMPILE]
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
