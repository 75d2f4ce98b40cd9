"""Threefry random bits on XLA:CPU without a loop: the lowering JAX uses on TPU, for the CPU too.

JAX lowers its threefry hash on the CPU as a `while` loop of 5 trips (its "rolled" lowering,
chosen to keep compile times down), where TPUs get the 20 rounds as straight-line code. XLA's CPU
runtime executes each trip as ~17 tiny thunks (copies, slices, a fusion or three), so one
`jax.random.fold_in`, `split` or `uniform` costs ~90 thunk launches. A decoding program draws in
every step: an ArS step 2 hashes (a fold-in, a uniform), an SpS loop 7 (`speculative._loop_keys`
and the accept step), ~600 thunk launches, 0.1 ms of a 2.3 ms `reference_target` loop spent
between ops (profiled with `bench.profile`, 2026-11-25). Unrolled, a hash is one fusion.

`unroll_on_cpu()` registers JAX's straight-line lowering of `threefry2x32` for the CPU platform.
It changes no random number (the same hash, the same rounds; `tests/test_native.py` checks the
bits against a program compiled before the switch) and is global to the process: every program
lowered after it hashes without a loop (longer to compile when a program draws many times, not
the case for ours). It uses JAX internals (the primitive and its lowering rule); where a JAX
version lacks them it does nothing and says so once in the log.

Only up to jaxlib 0.10: from jaxlib 0.11 on, XLA:CPU's LLVM takes minutes to compile the
straight-line hash at its default optimisation level (the loop vectorizer's VPlan analysis; a toy
model's ArS program: over 300 s, 2.4 s with the loop, jaxlib 0.12.0.1), so there the hash keeps
JAX's loop, and the log says so once.
"""

import functools
import logging


# The newest jaxlib (major, minor) whose XLA:CPU compiles the unrolled hash quickly.
LAST_JAXLIB = (0, 10)


@functools.cache
def unroll_on_cpu() -> bool:
  """Registers the straight-line threefry lowering for the CPU; whether it could (once)."""
  try:
    from jax._src.lib import version as jaxlib_version  # pylint: disable=g-import-not-at-top
  except ImportError:
    jaxlib_version = None
  if jaxlib_version is None or tuple(jaxlib_version[:2]) > LAST_JAXLIB:
    logging.info('spsjax.native.threefry: random bits on the CPU keep their loop under jaxlib %s '
                 '(unrolled up to %d.%d, whose XLA compiles it quickly).',
                 '.'.join(map(str, jaxlib_version or ('?',))), *LAST_JAXLIB)
    return False
  try:
    from jax._src.interpreters import mlir  # pylint: disable=g-import-not-at-top
    from jax._src.random import threefry2x32  # pylint: disable=g-import-not-at-top
    rule = threefry2x32._threefry2x32_lowering_rule  # The default (TPU) rule: unrolled.
    primitive = threefry2x32.threefry2x32_p
  except (ImportError, AttributeError) as e:
    logging.warning('spsjax.native.threefry: this JAX has no threefry lowering to unroll (%s); '
                    'random bits on the CPU keep their loop.', e)
    return False
  mlir.register_lowering(primitive, rule, platform='cpu')
  return True
