"""Training losses in float32: next-token cross-entropy and distillation from a teacher.

Distillation (DistillSpec, Zhou et al. 2023): a divergence D(p_teacher, q_student) between the
next-token laws at every position of a batch, both at `temperature`, one of `DIVERGENCES`:
- `forward_kl`: KL(p || q) = sum p (log p - log q), mass-covering (the student spreads over all
  the teacher's likely tokens);
- `reverse_kl`: KL(q || p) = sum q (log q - log p), mode-seeking;
- `tv`: total variation 1/2 sum |p - q| = 1 - sum min(p, q) = 1 - beta: exactly the probability
  that speculative sampling rejects a draft token drawn from q, so minimising it maximises the
  acceptance rate alpha directly.
Each is zero exactly when the student's law equals the teacher's; no gradient flows into the
teacher.
"""

import math

import jax
import jax.numpy as jnp


def cross_entropy(logits_BxTxV: jax.Array, targets_BxT: jax.Array,
                  mask_BxT: jax.Array) -> jax.Array:
  """Mean next-token cross-entropy over positions where mask is true."""
  log_probs = jax.nn.log_softmax(logits_BxTxV.astype(jnp.float32), axis=-1)
  nll_BxT = -jnp.take_along_axis(log_probs, targets_BxT[..., None], axis=-1)[..., 0]
  mask = mask_BxT.astype(jnp.float32)
  return jnp.sum(nll_BxT * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def next_token(logits_fn, batch_BxL1: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(logits [B, L, V], mean cross-entropy) of predicting each token of `batch` from the ones
  before it: `logits_fn` maps inputs [B, L] to logits (the training loss and held-out loss)."""
  inputs_BxL, targets_BxL = batch_BxL1[:, :-1], batch_BxL1[:, 1:]
  logits_BxLxV = logits_fn(inputs_BxL)
  return logits_BxLxV, cross_entropy(logits_BxLxV, targets_BxL,
                                     jnp.ones(targets_BxL.shape, bool))


def perplexity(mean_loss: float) -> float:
  """exp(loss), capped at exp(50) so that a diverged run reports a number, not inf."""
  return math.exp(min(float(mean_loss), 50.0))


DIVERGENCES = ('forward_kl', 'reverse_kl', 'tv')


def divergence_per_position(student_BxTxV: jax.Array, teacher_BxTxV: jax.Array, kind: str,
                            temperature: float = 1.0) -> jax.Array:
  """float32[B, T]: D(teacher, student) at each position (module docstring)."""
  if kind not in DIVERGENCES:
    raise ValueError(f'Unknown divergence {kind!r}; known: {DIVERGENCES}.')
  log_p = jax.nn.log_softmax(
      jax.lax.stop_gradient(teacher_BxTxV.astype(jnp.float32)) / temperature, axis=-1)
  log_q = jax.nn.log_softmax(student_BxTxV.astype(jnp.float32) / temperature, axis=-1)
  def kl(log_a, log_b):  # sum a (log a - log b), with 0 log 0 = 0 (a teacher's -inf logits).
    a = jnp.exp(log_a)
    return jnp.sum(jnp.where(a > 0, a * (log_a - log_b), 0.0), axis=-1)

  if kind == 'forward_kl':
    return kl(log_p, log_q)
  if kind == 'reverse_kl':
    return kl(log_q, log_p)
  return 0.5 * jnp.sum(jnp.abs(jnp.exp(log_p) - jnp.exp(log_q)), axis=-1)


def distillation(student_BxTxV: jax.Array, teacher_BxTxV: jax.Array, mask_BxT: jax.Array,
                 temperature: float = 1.0, kind: str = 'forward_kl') -> jax.Array:
  """Mean divergence `kind` per position where mask is true; no gradient flows into the teacher."""
  per_position_BxT = divergence_per_position(student_BxTxV, teacher_BxTxV, kind, temperature)
  mask = mask_BxT.astype(jnp.float32)
  return jnp.sum(per_position_BxT * mask) / jnp.maximum(jnp.sum(mask), 1.0)
