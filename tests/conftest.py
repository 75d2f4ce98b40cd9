"""Test-wide JAX setup: 8 fake CPU devices and strict rank promotion.

The device count must be in XLA_FLAGS before JAX initialises its backends, so this runs at import,
before any test module imports jax.
"""

import os

_DEVICES_FLAG = '--xla_force_host_platform_device_count=8'
if _DEVICES_FLAG not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICES_FLAG}".strip()

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position

jax.config.update('jax_numpy_rank_promotion', 'raise')
