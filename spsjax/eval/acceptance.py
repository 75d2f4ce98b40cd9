"""Alpha along generated text: the acceptance a target/draft pair has where SpS actually runs.

Held-out alpha (`train.evaluation.evaluate_pair`) averages beta = sum_x min(p(x), q(x)) over the
positions of corpus text. SpS meets other text: the continuations of a task's prompts, sampled
under the task's settings. Here beta (p and q after the sampling processors) is averaged over the
positions that produced generated tokens: of SpS's own outputs in Table 1 (`model_alpha`), or of
the target's ArS samples from a task's prompts (`sample_task`, then `samples_alpha` for each draft:
the same law as SpS's output, sampled once for every draft). It is what Table 1's loop counts estimate (`theory.alpha_from_counts`), so
the two can be checked against each other.

Invariants: a position counts when it produced a generated token (eos included; prompt positions
never); every prompt counts once (a last partial call's padding rows are not counted).
"""

from collections.abc import Sequence
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from spsjax import distributed, models, sampling, sharding
from spsjax.models import feature_head
from spsjax.data import prompts as prompts_lib
from spsjax.data.tokenizer import Tokenizer
from spsjax.eval import likelihood, tasks
from spsjax.sampling import ngrams, processors, rejection


@functools.partial(jax.jit, static_argnums=(0, 1))
def _sums(sampling_config, lenience, target: models.Model, draft: models.Model, tokens_BxL,
          mask_BxL, prompt_lengths_B):
  """From one forward pass of each model, over masked positions (next-token laws): sum of beta =
  sum_x min(q(x), p(x) / lenience) (the probability a draft is accepted; sum min(p, q) when
  exact), count, sum of the total variation between a draft slot's law under `lenience` and p,
  and per row the raw target's log-probability sums of the next tokens (`likelihood.row_sums`)
  and the sums of log p - log q where q > 0 (`likelihood.row_ratio_sums`) with their counts.
  A head over the target's features counts with its first draft's law
  (`feature_head.next_token_logits`)."""
  target_BxLxV = models.logits(target.config, target.params, tokens_BxL)
  draft_BxLxV = feature_head.next_token_logits(draft, target, tokens_BxL)
  present_BxLxV = (processors.present_through(tokens_BxL, target.config.vocab_size)
                   if sampling_config.penalised else None)
  shifted = lambda x_BxLxV: x_BxLxV
  if sampling_config.reads_context:  # The n-gram ban, sequence biases and bans by position
    # shift both (as every drafter with a model drafts).
    offsets_BxLxV = ngrams.offsets_through(tokens_BxL, sampling_config, target.config.vocab_size,
                                           prompt_lengths_B)
    shifted = lambda x_BxLxV: ngrams.shift(x_BxLxV, offsets_BxLxV)
  p = sampling.probabilities(shifted(target_BxLxV), sampling_config.without_context(),
                             present_xV=present_BxLxV)
  q = sampling.probabilities(shifted(draft_BxLxV),  # As SpS drafts.
                             sampling_config.without_context().without_penalty())
  beta_BxL = rejection.acceptance_probability(p / lenience, q)
  tv_BxL = 0.5 * jnp.sum(jnp.abs(rejection.lenient_law(p, q, lenience) - p), axis=-1)
  total = lambda x_BxL: jnp.sum(jnp.where(mask_BxL, x_BxL, 0.0))
  logp_B, counts_B = likelihood.row_sums(target_BxLxV, tokens_BxL, mask_BxL)
  ratios_B, ratio_counts_B = likelihood.row_ratio_sums(target_BxLxV, draft_BxLxV, tokens_BxL,
                                                       mask_BxL)
  return (total(beta_BxL), jnp.sum(mask_BxL), total(tv_BxL), logp_B, counts_B, ratios_B,
          ratio_counts_B)


@dataclasses.dataclass(frozen=True)
class PairStatistics:
  """A target/draft pair along the generated tokens of one sampler call (real rows only)."""
  beta: float  # Sum of beta over the positions.
  count: int  # Positions.
  tv: float  # Sum of the lenient draft slot's total variation from p (0 when exact).
  logp_sums: np.ndarray  # [B]: the raw target's log-probability sums of each row's tokens.
  counts: np.ndarray  # [B]: each row's generated tokens.
  ratio_sums: np.ndarray  # [B]: sums of log p - log q (raw models) over the tokens with q > 0.
  ratio_counts: np.ndarray  # [B]: those tokens.

  @property
  def logp(self) -> list[float]:
    """Per row: the target's mean log-probability per generated token (a row without generated
    tokens is an error here, and only here: beta's sums just skip it)."""
    return likelihood.row_means(self.logp_sums, self.counts)

  @property
  def log_ratios(self) -> list[float]:
    """Per row: the mean log p - log q per generated token the draft can propose
    (`likelihood.ratio_means`)."""
    return likelihood.ratio_means(self.ratio_sums, self.ratio_counts)


def pair_statistics(target: models.Model, draft: models.Model, sampling_config, prompts_BxP,
                    lengths_B, out: sampling.SampleOutput, mesh: Mesh | None = None,
                    lenience: float = 1.0) -> PairStatistics:
  """Everything Table 1 asks of the pair about `out`, from one forward pass of each model: beta
  and total variation under `sampling_config` and `lenience`, and both log-probability columns.
  `out` is gathered here if it is a global array; on `mesh` the sequences are replicated."""
  seq, mask = likelihood.generated_positions(prompts_BxP, lengths_B, out, mesh)
  beta, count, tv, *rows = _sums(sampling_config, float(lenience), target, draft, seq, mask,
                                 np.asarray(lengths_B, np.int32))
  logp_B, counts_B, ratios_B, ratio_counts_B = (np.asarray(x) for x in rows)
  return PairStatistics(beta=float(beta), count=int(count), tv=float(tv), logp_sums=logp_B,
                        counts=counts_B, ratio_sums=ratios_B, ratio_counts=ratio_counts_B)


def lenient_tv(target: models.Model, draft: models.Model, sampling_config, lenience: float,
               prompts_BxP, lengths_B, out: sampling.SampleOutput, mesh: Mesh | None = None
               ) -> tuple[float, int]:
  """(sum, positions) of the total variation between the law of a draft slot under `lenience`
  (`rejection.lenient_law`) and the target's, over the positions of `out` as for `model_alpha`:
  its mean bounds what lenience costs per token (bonus tokens are exact)."""
  stats = pair_statistics(target, draft, sampling_config, prompts_BxP, lengths_B, out, mesh,
                          lenience)
  return stats.tv, stats.count


def model_alpha(target: models.Model, draft: models.Model, sampling_config, prompts_BxP,
                lengths_B, out: sampling.SampleOutput, mesh: Mesh | None = None,
                lenience: float = 1.0) -> tuple[float, int]:
  """(sum of beta, positions) over the positions that produced the generated tokens of `out`
  (host arrays, or gathered here); on `mesh` the sequences are replicated to the models' devices.
  With lenience < 1, beta is the lenient acceptance sum_x min(q(x), p(x) / lenience)."""
  stats = pair_statistics(target, draft, sampling_config, prompts_BxP, lengths_B, out, mesh,
                          lenience)
  return stats.beta, stats.count


@dataclasses.dataclass(frozen=True)
class Samples:
  """The target's ArS samples from every prompt of a task, call by call (real rows only)."""
  task: str
  sampling: sampling.SamplingConfig
  calls: tuple[tuple[np.ndarray, np.ndarray, sampling.SampleOutput], ...]  # (prompts, lengths, out)


def sample_task(target: models.Model, tok: Tokenizer, task: tasks.Task,
                sampling_config: sampling.SamplingConfig, *, batch: int, seed: int = 0,
                max_seq_lens: Sequence[tuple[str, int]] = (), headroom: int = 0,
                mesh: Mesh | None = None) -> Samples:
  """The target's samples from every prompt of `task`, in calls of `batch` rows (keys
  fold_in(key(seed), call)). Prompts are cut to fit the target and the models named in
  `max_seq_lens`, with `headroom` (SpS's k - 1) as Table 1 cuts them (`tasks.encode`)."""
  sharding.check_batch(batch, mesh)
  prompts_NxP, lengths_N = tasks.encode(
      task, tok, [('target', target.config.max_seq_len), *max_seq_lens], headroom)
  num = len(task.prompts)
  calls = []
  for i in range(-(-num // batch)):
    real = list(range(i * batch, min((i + 1) * batch, num)))
    rows = real + [real[-1]] * (batch - len(real))  # A last partial call repeats its last row.
    prompts_BxP, lengths_B = prompts_lib.for_call(prompts_NxP, lengths_N, rows)
    out = distributed.gather(sampling.autoregressive_sample(
        target, prompts_BxP, lengths_B, jax.random.fold_in(jax.random.key(seed), i),
        max_new_tokens=task.max_new_tokens, sampling=sampling_config, eos_id=tok.eos_ids,
        mesh=mesh))
    n = len(real)
    calls.append((prompts_BxP[:n], lengths_B[:n], sampling.SampleOutput(
        tokens=np.asarray(out.tokens)[:n], num_generated=np.asarray(out.num_generated)[:n])))
  return Samples(task.name, sampling_config, tuple(calls))


def samples_alpha(target: models.Model, draft: models.Model, samples: Samples,
                  mesh: Mesh | None = None) -> tuple[float, int]:
  """(alpha, positions): mean beta over every generated position of `samples`."""
  total, count = 0.0, 0
  for prompts_BxP, lengths_B, out in samples.calls:
    t, c = model_alpha(target, draft, samples.sampling, prompts_BxP, lengths_B, out, mesh)
    total, count = total + t, count + c
  if not count:
    raise ValueError(f'{samples.task}: the target generated no tokens to measure alpha on.')
  return total / count, count
