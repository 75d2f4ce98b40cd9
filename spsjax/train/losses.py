"""Training losses in float32: next-token cross-entropy and distillation from a teacher.

Distillation (in the spirit of DistillSpec): KL(teacher || student) between the next-token laws at
every position of the same batch, both at `temperature`. It is zero exactly when the student's law
equals the teacher's, which is what speculative sampling's acceptance rewards.
"""

import jax
import jax.numpy as jnp


def cross_entropy(logits_BxTxV: jax.Array, targets_BxT: jax.Array,
                  mask_BxT: jax.Array) -> jax.Array:
  """Mean next-token cross-entropy over positions where mask is true."""
  log_probs = jax.nn.log_softmax(logits_BxTxV.astype(jnp.float32), axis=-1)
  nll_BxT = -jnp.take_along_axis(log_probs, targets_BxT[..., None], axis=-1)[..., 0]
  mask = mask_BxT.astype(jnp.float32)
  return jnp.sum(nll_BxT * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def distillation(student_BxTxV: jax.Array, teacher_BxTxV: jax.Array, mask_BxT: jax.Array,
                 temperature: float = 1.0) -> jax.Array:
  """Mean KL(teacher || student) per position; no gradient flows into the teacher."""
  teacher = jax.lax.stop_gradient(teacher_BxTxV.astype(jnp.float32)) / temperature
  student = student_BxTxV.astype(jnp.float32) / temperature
  teacher_log_p = jax.nn.log_softmax(teacher, axis=-1)
  kl_BxT = jnp.sum(jnp.exp(teacher_log_p) * (teacher_log_p - jax.nn.log_softmax(student, axis=-1)),
                   axis=-1)
  mask = mask_BxT.astype(jnp.float32)
  return jnp.sum(kl_BxT * mask) / jnp.maximum(jnp.sum(mask), 1.0)
