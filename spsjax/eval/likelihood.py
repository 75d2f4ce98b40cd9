"""Log-probabilities of generated text under a model: Table 1's model-based parity columns.

Exact SpS samples the target's law, so any statistic of its outputs has the same distribution under
ArS and SpS: equal within noise, on any task, whether or not the task's metric scores the models
above zero. Table 1 uses two, per prompt:
- log p: the target's mean log-probability per generated token;
- log p/q: the mean of log p - log q (target minus draft) per generated token the draft can
  propose (q > 0: every token, but a head with a draft vocabulary gives the others q = 0, an
  infinite ratio; a row with none counts 0). Where SpS leaks the
  draft's law into its outputs (a lossy lenience, a bug in the acceptance rule) this moves first:
  it is the log-likelihood ratio of the two laws, the most powerful statistic for telling samples
  of one from samples of the other (Neyman-Pearson), with mean KL(p || q) on the target's samples
  and -KL(q || p) on the draft's.
Both use the raw models (log-softmax of the logits: temperature 1, no top-k or top-p), so that every
generated token has a finite value whatever the decoding that produced it.

Invariant: a row's value averages over exactly the positions that produced its generated tokens
(`generated_positions`: eos included, prompt never). `acceptance.pair_statistics` computes the
draft's column with beta from the same forward passes.
"""


import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from spsjax import distributed, models, sampling, sharding
from spsjax.models import feature_head


def generated_positions(prompts_BxP, lengths_B, out: sampling.SampleOutput,
                        mesh: Mesh | None = None):
  """(tokens int32[B, L], mask bool[B, L]): each row's prompt then its generated tokens (zeros
  after), and True at the positions whose next-token law produced a generated token (position t
  predicts token t + 1). `out` is gathered here if it is a global array; on `mesh` both are
  replicated to the models' devices."""
  out = distributed.gather(out)
  tokens = np.asarray(out.tokens)
  n_B = np.asarray(out.num_generated)
  B, P = prompts_BxP.shape
  seq = np.zeros((B, P + tokens.shape[1]), np.int32)
  mask = np.zeros(seq.shape, bool)
  for b in range(B):
    L = int(lengths_B[b])
    seq[b, :L] = prompts_BxP[b, :L]
    seq[b, L:L + n_B[b]] = tokens[b, :n_B[b]]
    mask[b, L - 1:L - 1 + n_B[b]] = True
  if mesh is not None:
    replicated = NamedSharding(mesh, PartitionSpec())
    seq, mask = sharding.put((seq, mask), (replicated, replicated))
  return seq, mask


def _next_logprobs(logits_BxLxV, tokens_BxL):
  """float32[B, L - 1]: at each position t < L - 1, the log-softmax of token t + 1."""
  logp_BxLxV = jax.nn.log_softmax(logits_BxLxV.astype(jnp.float32))
  return jnp.take_along_axis(logp_BxLxV[:, :-1], tokens_BxL[:, 1:, None], axis=-1)[..., 0]


def row_sums(logits_BxLxV, tokens_BxL, mask_BxL):
  """(sum over each row's masked positions of the log-softmax of the next token, count per row):
  traceable, for callers that already hold a model's logits."""
  picked_BxL1, mask_BxL1 = _next_logprobs(logits_BxLxV, tokens_BxL), mask_BxL[:, :-1]
  return jnp.sum(jnp.where(mask_BxL1, picked_BxL1, 0.0), axis=1), jnp.sum(mask_BxL1, axis=1)


def row_ratio_sums(target_BxLxV, draft_BxLxV, tokens_BxL, mask_BxL):
  """(sum over each row's masked positions of log p - log q of the next token, count per row),
  over the positions whose token the draft can propose (q > 0): traceable."""
  logq_BxL1 = _next_logprobs(draft_BxLxV, tokens_BxL)
  mask_BxL1 = mask_BxL[:, :-1] & jnp.isfinite(logq_BxL1)
  ratio_BxL1 = _next_logprobs(target_BxLxV, tokens_BxL) - logq_BxL1
  return jnp.sum(jnp.where(mask_BxL1, ratio_BxL1, 0.0), axis=1), jnp.sum(mask_BxL1, axis=1)


def row_means(sums_B, counts_B) -> list[float]:
  """Per-row mean log-probability from `row_sums`; a row without generated tokens is an error."""
  sums_B, counts_B = np.asarray(sums_B), np.asarray(counts_B)
  if (counts_B == 0).any():
    raise ValueError('A row generated no tokens: its mean log-probability is undefined.')
  return [float(x) for x in sums_B / counts_B]


def ratio_means(sums_B, counts_B) -> list[float]:
  """Per-row mean log p/q from `row_ratio_sums`; 0 for a row none of whose tokens the draft
  can propose."""
  sums_B, counts_B = np.asarray(sums_B), np.asarray(counts_B)
  return [float(s / c) if c else 0.0 for s, c in zip(sums_B, counts_B)]


@jax.jit
def _model_row_sums(model, target, tokens_BxL, mask_BxL):
  return row_sums(feature_head.next_token_logits(model, target, tokens_BxL), tokens_BxL, mask_BxL)


@jax.jit
def _pair_sums(target, draft, tokens_BxL, mask_BxL):
  target_BxLxV = models.logits(target.config, target.params, tokens_BxL)
  draft_BxLxV = feature_head.next_token_logits(draft, target, tokens_BxL)
  return (row_sums(target_BxLxV, tokens_BxL, mask_BxL),
          row_ratio_sums(target_BxLxV, draft_BxLxV, tokens_BxL, mask_BxL))


def log_columns(target: models.Model, draft: models.Model, prompts_BxP, lengths_B,
                out: sampling.SampleOutput, mesh: Mesh | None = None
                ) -> tuple[list[float], list[float]]:
  """Both columns of each row from one forward pass of each model: the target's mean
  log-probability per generated token (`row_means`) and the mean log p - log q per generated
  token the draft can propose (`ratio_means`; a head over `target`'s features with its first
  draft's law)."""
  tokens, mask = generated_positions(prompts_BxP, lengths_B, out, mesh)
  logp_sums, ratio_sums = _pair_sums(target, draft, tokens, mask)
  return row_means(*logp_sums), ratio_means(*ratio_sums)


def mean_log_ratios(target: models.Model, draft: models.Model, prompts_BxP, lengths_B,
                    out: sampling.SampleOutput, mesh: Mesh | None = None) -> list[float]:
  """`log_columns`' log p/q alone."""
  return log_columns(target, draft, prompts_BxP, lengths_B, out, mesh)[1]


def mean_logprobs(model: models.Model, prompts_BxP, lengths_B, out: sampling.SampleOutput,
                  mesh: Mesh | None = None, target: models.Model | None = None) -> list[float]:
  """The model's mean log-probability per generated token of each row of `out` (nats); a head
  over `target`'s features scores with its first draft's law (`feature_head.next_token_logits`)."""
  tokens, mask = generated_positions(prompts_BxP, lengths_B, out, mesh)
  return row_means(*_model_row_sums(model, target, tokens, mask))
