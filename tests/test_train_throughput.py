"""Training throughput: the flop count, the meter, the measured peak, the training XLA flags, and a
run's metrics carrying tokens/s and MFU."""

import os
import subprocess
import sys

import pytest

from spsjax import models
from spsjax.train import throughput, xla_flags

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize('tied', [True, False])
def test_flops_per_token_counts_products_by_hand(tied):
  c = models.TransformerConfig(vocab_size=100, d_model=16, num_layers=2, num_heads=4,
                               num_kv_heads=2, d_ff=24, tie_embeddings=tied)
  # Per layer: q 16x16, k and v 16x8 each, out 16x16, gate/in/out 16x24 x 3; the head 16x100
  # (the tied table counts as the head; the lookup is not a product).
  per_layer = 16 * 16 + 2 * 16 * 8 + 16 * 16 + 3 * 16 * 24
  products = 2 * per_layer + 16 * 100
  attention = 12 * 2 * 32 * 4 * 4  # 12 L T (heads x head_dim) at T = 32.
  assert throughput.flops_per_token(c, 32) == 6 * products + attention
  assert throughput.teacher_flops_per_token(c, 32) == pytest.approx((6 * products + attention) / 3)


def test_head_flops_count_its_products_and_the_output_layer_it_reads_by_hand():
  """A head's count: its own products 6 N, the target's output layer 4 V D a law (frozen), or
  its own over a draft vocabulary 6 V' D; an EAGLE head's attention; own-step runs again but
  the taps' product."""
  target = models.TransformerConfig(vocab_size=100, d_model=16, num_layers=2, num_heads=4,
                                    num_kv_heads=2, d_ff=24)
  layer = 16 * 16 + 2 * 16 * 8 + 16 * 16 + 3 * 16 * 24
  fuse, taps, attention = 2 * 16 * 16, 3 * 16 * 16, 12 * 1 * 32 * 4 * 4
  eagle = models.feature_head.head_config(target, 1)
  assert throughput.head_flops_per_token('feature', eagle, 32) == (
      6 * (fuse + layer) + 4 * 100 * 16 + attention)
  eagle3 = models.feature_head.head_config(target, 1, (0, 1, 2), 40)
  run = 6 * (fuse + layer) + 6 * 40 * 16 + attention
  assert throughput.head_flops_per_token('feature', eagle3, 32, own_steps=2) == (
      6 * taps + 3 * run)
  mlp = 3 * 16 * 24  # A parallel head: a gated MLP (its norm is no product), 3 laws a pair.
  heads = models.feature_head.head_config(target, 3)
  assert throughput.head_flops_per_token('heads', heads, 32) == 6 * (fuse + 3 * mlp) + 3 * (
      4 * 100 * 16)


def test_meter_counts_steps_between_ticks(monkeypatch):
  clock = iter([10.0, 12.0, 12.0, 16.0])
  monkeypatch.setattr(throughput.time, 'perf_counter', lambda: next(clock))
  meter = throughput.Meter(tokens_per_step=100, flops_per_token=1e6, peak_flops=1e9)
  assert meter.tick(1) == {}  # The clock starts: nothing measured yet.
  assert meter.tick(5) == pytest.approx(dict(tokens_per_second=200.0, mfu=0.2))  # 4 steps in 2 s.
  assert meter.tick(5) == {}  # No new step.
  assert meter.tick(9) == pytest.approx(dict(tokens_per_second=100.0, mfu=0.1))


def test_matmul_peak_is_a_rate():
  peak = throughput.matmul_peak(size=256, repeats=2)
  assert 1e8 < peak < 1e14


def test_training_flags_are_added_unless_set(monkeypatch):
  env = {'XLA_FLAGS': '--xla_force_host_platform_device_count=2'}
  monkeypatch.setattr(xla_flags.xla_bridge, 'backends_are_initialized', lambda: False)
  assert xla_flags.use_for_training(env) == list(xla_flags.TRAINING)
  assert env['XLA_FLAGS'].split() == ['--xla_force_host_platform_device_count=2',
                                      *xla_flags.TRAINING]
  assert xla_flags.use_for_training(env) == []  # Idempotent.
  mine = {'XLA_FLAGS': '--xla_cpu_experimental_ynn_fusion_type=individual_dot'}
  assert xla_flags.use_for_training(mine) == []  # The user's value wins.
  assert mine['XLA_FLAGS'] == '--xla_cpu_experimental_ynn_fusion_type=individual_dot'


def test_training_flags_refuse_a_started_backend():
  import jax  # pylint: disable=import-outside-toplevel
  jax.devices()
  with pytest.raises(RuntimeError, match='before JAX starts'):
    xla_flags.use_for_training({})


def test_training_flags_take_effect_in_a_fresh_process():
  """Set before the backend starts, the flag reaches XLA: a weight gradient's product takes its
  transposed operand inside the dot's fusion, where without it XLA copies it first (one loop
  fusion more: the transposes a training step spent a fifth of its time in)."""
  code = '''
import os, re, sys
from spsjax.train import xla_flags
if sys.argv[1] == 'flags':
  xla_flags.use_for_training()
import jax, jax.numpy as jnp
f = jax.jit(lambda x, g: jnp.einsum('BTD,BTF->DF', x * 2.0, jax.nn.silu(g)))
text = f.lower(jnp.ones((4, 64, 32)), jnp.ones((4, 64, 48))).compile().as_text()
entry = text[text.index('ENTRY'):]
print(os.environ.get('XLA_FLAGS', ''))
print(len(re.findall(r'kind=kLoop', entry)), len(re.findall(r'__ynn_fusion', entry)))
'''
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
  outs = {}
  for mode in ('flags', 'default'):
    outs[mode] = subprocess.run([sys.executable, '-c', code, mode], cwd=_REPO, env=env,
                                capture_output=True, text=True, timeout=300,
                                check=True).stdout.rstrip('\n').split('\n')
  assert outs['flags'][0] == xla_flags.TRAINING[0] and outs['default'][0] == ''
  loops_with, dots_with = map(int, outs['flags'][1].split())
  loops_without, dots_without = map(int, outs['default'][1].split())
  assert dots_with == dots_without == 1
  assert loops_with < loops_without, outs
