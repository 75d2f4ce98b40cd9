"""Log-probabilities of generated text under a model: Table 1's model-based parity columns.

Exact SpS samples the target's law, so any statistic of its outputs has the same distribution under
ArS and SpS: equal within noise, on any task, whether or not the task's metric scores the models
above zero. Table 1 uses two, per prompt:
- log p: the target's mean log-probability per generated token;
- log p/q: the mean of log p - log q (target minus draft) per generated token. Where SpS leaks the
  draft's law into its outputs (a lossy lenience, a bug in the acceptance rule) this moves first:
  it is the log-likelihood ratio of the two laws, the most powerful statistic for telling samples
  of one from samples of the other (Neyman-Pearson), with mean KL(p || q) on the target's samples
  and -KL(q || p) on the draft's.
Both use the raw models (log-softmax of the logits: temperature 1, no top-k or top-p), so that every
generated token has a finite value whatever the decoding that produced it.

Invariant: a row's value averages over exactly the positions that produced its generated tokens
(`acceptance.generated_positions`: eos included, prompt never).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from spsjax import models, sampling
from spsjax.eval import acceptance


@functools.partial(jax.jit, static_argnums=0)
def _row_sums(config, params, tokens_BxL, mask_BxL):
  """(sum over each row's masked positions of log p(next token), count per row)."""
  logp_BxLxV = jax.nn.log_softmax(models.logits(config, params, tokens_BxL).astype(jnp.float32))
  next_BxL1 = tokens_BxL[:, 1:]
  picked_BxL1 = jnp.take_along_axis(logp_BxLxV[:, :-1], next_BxL1[..., None], axis=-1)[..., 0]
  mask_BxL1 = mask_BxL[:, :-1]
  return jnp.sum(jnp.where(mask_BxL1, picked_BxL1, 0.0), axis=1), jnp.sum(mask_BxL1, axis=1)


def mean_logprobs(target: models.Model, prompts_BxP, lengths_B, out: sampling.SampleOutput,
                  mesh: Mesh | None = None) -> list[float]:
  """The target's mean log-probability per generated token of each row of `out` (nats)."""
  tokens, mask = acceptance.generated_positions(prompts_BxP, lengths_B, out, mesh)
  sums_B, counts_B = _row_sums(target.config, target.params, tokens, mask)
  sums_B, counts_B = np.asarray(sums_B), np.asarray(counts_B)
  if (counts_B == 0).any():
    raise ValueError('A row generated no tokens: its mean log-probability is undefined.')
  return [float(x) for x in sums_B / counts_B]
