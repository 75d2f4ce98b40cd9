"""What a draft head over a frozen target's features (`models.feature_head`) is trained on.

The target's forward on the batch gives, at every position t, its features f_t and its law p_t
of token t + 1 (no gradient: the target is frozen). A head reads pairs (f_t, x_{t+1}):
- the EAGLE head's prediction at pair t is f^_{t+1}: its loss is KL(p_{t+1} || q_t), q_t its law
  of x_{t+2} through the target's output layer, plus `feature_weight` times the smooth-L1
  distance of f^_{t+1} to f_{t+1} per dimension, in units of f_{t+1}'s root mean square (EAGLE's
  feature regression);
- with `own_steps` > 0 (HASS; EAGLE-3's training-time test), the head is run again
  `own_steps` times, as drafting runs it: run j's pair at position s reads the features run
  j - 1 predicted at s - 1 and attends to the target's features up to s - j and to the pairs
  of runs 1 .. j - 1 on its diagonal (`own_steps_tree`), with the targets at s + 1; the losses
  are averaged over the runs, run j weighted by `own_step_decay`^j (EAGLE-3: 0.8). A head of
  several taps (EAGLE-3's features, `feature_head`) reads
  the target's taps in run 0 and its own predictions after;
- a Falcon head (`drafts_per_pass` m) reads the pairs in blocks of m aligned at 0, each pair
  seeing its block's pairs (`feature_head.block_ends`), and its prediction at pair t is
  f^_{t+m}: the same KL and regression m positions on, KL(p_{t+m} || q_t) (offset j of a
  block is the j-th draft of a pass; its drafting passes after the first read its own
  predictions, which it is not trained on: Falcon's glancing is not built);
- parallel head i at pair t predicts the law of x_{t+2+i}: KL(p_{t+1+i} || q_{t,i}) and the
  regression to f_{t+1+i}, over the pairs where t + 1 + i is in the batch, averaged over heads;
  an MLP speculator's stage i likewise, reading the corpus tokens x_{t+1} .. x_{t+1+i} (teacher
  forcing, as IBM trains it; drafting feeds it its drafts).
A head with a draft vocabulary (`feature_head.DraftVocab`, EAGLE-3) is trained in it: its
logits over those tokens against the target's law restricted to them, renormalized (the law q
on the draft vocabulary that accepts most: every min(p, q) is p there).
Metrics: `lm_loss` is the cross-entropy of the first draft's law on the corpus token it drafts
(x_{t+2}; a Falcon head's, of each pair's law on its token x_{t+m+1}; with a draft vocabulary,
over the tokens in it, and `coverage` the fraction that are), `distill` the KL, `feature` the
regression.
"""

import functools

import jax
import jax.numpy as jnp

from spsjax import models
from spsjax.models import TokenTree, feature_head, output_logits
from spsjax.train import losses


def _smooth_l1(x, y):
  """Smooth L1 per dimension between predicted features x and the target's y, both divided by
  y's root mean square at that position: the output layer's norm makes the features' scale
  irrelevant to the laws, and deep features are large."""
  y = y.astype(jnp.float32)
  scale = jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + 1e-6)
  d = jnp.abs(x.astype(jnp.float32) - y) * scale
  return jnp.mean(jnp.where(d < 1.0, 0.5 * d * d, d - 0.5))


def _kl(q_BxTxV, p_BxTxV):
  return jnp.mean(losses.divergence_per_position(q_BxTxV, p_BxTxV, 'forward_kl'))


def _first_draft_ce(q_BxTxV, tokens_BxT, vocab_Vd, vocab_size: int) -> dict:
  """{'lm_loss'} of the first draft's law on the corpus tokens; with a draft vocabulary (its
  tokens `vocab_Vd`), on the tokens in it, and their fraction ('coverage')."""
  if vocab_Vd is None:
    return dict(lm_loss=losses.cross_entropy(q_BxTxV, tokens_BxT,
                                             jnp.ones(tokens_BxT.shape, bool)))
  index_V = jnp.full((vocab_size,), -1, jnp.int32).at[vocab_Vd].set(
      jnp.arange(vocab_Vd.shape[0], dtype=jnp.int32))
  index_BxT = index_V[tokens_BxT]
  inside_BxT = index_BxT >= 0
  return dict(lm_loss=losses.cross_entropy(q_BxTxV, jnp.maximum(index_BxT, 0), inside_BxT),
              coverage=jnp.mean(inside_BxT.astype(jnp.float32)))


def _weighted(values: list, decay: float):
  """The runs' mean, run j weighted by decay^j."""
  weights = [decay**j for j in range(len(values))]
  return sum(w * v for w, v in zip(weights, values)) / sum(weights)


@functools.lru_cache(maxsize=16)
def own_steps_tree(T: int, runs: int) -> tuple[TokenTree, tuple[int, ...]]:
  """The pairs of `runs` runs over T positions as one token tree, and each run's first node:
  run 0 is the sequence (its pair at s is node s, the root pair 0); run j >= 1 has a pair at each
  s = j .. T - 1, the child of run j - 1's pair at s - 1. So run j's pair at s sees run 0's pairs
  up to s - j and, of each run i = 1 .. j, the pair at s - j + i: what the head sees j steps
  into drafting after position s - j (the target's features up to there, then its own
  predictions), at position s (its depth)."""
  if not 1 <= runs <= T:
    raise ValueError(f'{runs} runs over {T} positions: want 1 .. {T}.')
  parents, firsts = list(range(T - 1)), [0]
  for run in range(1, runs):
    firsts.append(len(parents) + 1)  # The nodes so far, the root included.
    parents += [firsts[run - 1] + (s - 1) - (run - 1) for s in range(run, T)]
  return TokenTree(tuple(parents)), tuple(firsts)


def _target_features(head: models.Model, target: models.Model, inputs_BxL):
  """(what the head reads of the target at each position, [B, L, F]; the target's last output,
  [B, L, D]), from one forward with no gradient (the target is frozen)."""
  taps = feature_head.reads(head)
  if taps is True:
    f_BxLxD = models.features(target.config, target.params, inputs_BxL)
    return jax.lax.stop_gradient(f_BxLxD), jax.lax.stop_gradient(f_BxLxD)
  last = target.config.num_layers
  both = tuple(sorted(set(taps) | {last}))
  all_BxLxF = jax.lax.stop_gradient(models.features(target.config, target.params, inputs_BxL,
                                                    both))
  D = target.config.d_model
  read = [all_BxLxF[..., both.index(t) * D:(both.index(t) + 1) * D] for t in taps]
  return jnp.concatenate(read, axis=-1), all_BxLxF[..., -D:]


def head_loss(kind: str, head: models.Model, target: models.Model, batch_BxL1: jax.Array, *,
              feature_weight: float, own_steps: int = 0, own_step_decay: float = 1.0
              ) -> tuple[jax.Array, dict]:
  """(loss, metrics) of a head of `kind` on a batch of int32[B, L + 1] (module docstring)."""
  inputs_BxL = batch_BxL1[:, :-1]
  read_BxLxF, f_BxLxD = _target_features(head, target, inputs_BxL)
  p_BxLxV = jax.lax.stop_gradient(output_logits(target.config, target.params, f_BxLxD))
  vocab_Vd = feature_head.draft_vocab(head)
  own = vocab_Vd is not None  # Laws in the draft vocabulary ([.., Vd]).
  if own:
    p_BxLxV = p_BxLxV[..., vocab_Vd]
  pairs_f, pairs_x = read_BxLxF[:, :-1], inputs_BxL[:, 1:]  # Pair t = (f_t, x_{t+1}), t < L - 1.
  if kind == 'feature':
    T = pairs_x.shape[1]
    kls, regressions = [], []
    streams, tokens = [feature_head.stream(head, pairs_f)], [pairs_x]  # Run 0's pairs.
    q_BxTxV, predicted_BxTxD = feature_head.feature_head_forward(head, target, streams[0],
                                                                 pairs_x, in_draft_vocab=own)
    ce = _first_draft_ce(q_BxTxV, batch_BxL1[:, 2:], vocab_Vd, head.config.vocab_size)
    for run in range(1 + own_steps):
      if run:  # Run `run`'s pairs (positions run .. T - 1) on the tree of runs 0 .. run.
        tree, firsts = own_steps_tree(T, run + 1)
        q_BxNxV, predicted_BxNxD = feature_head.feature_head_forward(
            head, target, jnp.concatenate(streams, axis=1), jnp.concatenate(tokens, axis=1),
            tree, in_draft_vocab=own)
        q_BxTxV, predicted_BxTxD = q_BxNxV[:, firsts[run]:], predicted_BxNxD[:, firsts[run]:]
      # Pair s predicts the features at s + 1 and the law of the token after them.
      kls.append(_kl(q_BxTxV, p_BxLxV[:, 1 + run:]))
      regressions.append(_smooth_l1(predicted_BxTxD, f_BxLxD[:, 1 + run:]))
      # The next run's pair at s reads this run's prediction made at s - 1.
      streams.append(jax.lax.stop_gradient(predicted_BxTxD[:, :T - run - 1]))
      tokens.append(pairs_x[:, run + 1:])
    kl, regression = _weighted(kls, own_step_decay), _weighted(regressions, own_step_decay)
  elif kind == 'falcon':
    m = head.config.drafts_per_pass
    valid = pairs_x.shape[1] - m + 1  # Pairs t with t + m <= L - 1.
    q_BxTxV, predicted_BxTxD = feature_head.feature_head_forward(head, target, pairs_f, pairs_x,
                                                                 in_draft_vocab=own)
    kl = _kl(q_BxTxV[:, :valid], p_BxLxV[:, m:])
    regression = _smooth_l1(predicted_BxTxD[:, :valid], f_BxLxD[:, m:])
    ce = _first_draft_ce(q_BxTxV[:, :valid], batch_BxL1[:, m + 1:], vocab_Vd,
                         head.config.vocab_size)
  elif kind in ('heads', 'mlp'):
    B, T = pairs_x.shape
    D = f_BxLxD.shape[-1]
    n = head.config.num_layers
    if kind == 'heads':
      q_BTxNxV, predicted_BTxNxD = feature_head.parallel_heads(
          head, target, pairs_f.reshape(B * T, D), pairs_x.reshape(B * T), in_draft_vocab=own)
    else:  # Stage i at pair t reads the corpus token x_{t+1+i} (teacher forcing).
      padded_BxLn = jnp.pad(inputs_BxL, ((0, 0), (0, n)))
      tokens_BxTxN = jnp.stack([padded_BxLn[:, 1 + i:1 + i + T] for i in range(n)], axis=2)
      q_BTxNxV, predicted_BTxNxD = feature_head.mlp_speculator(
          head, target, pairs_f.reshape(B * T, D), tokens_BxTxN.reshape(B * T, n),
          in_draft_vocab=own)
    q_BxTxNxV = q_BTxNxV.reshape(B, T, n, -1)
    predicted_BxTxNxD = predicted_BTxNxD.reshape(B, T, n, D)
    kls, regressions = [], []
    for i in range(n):
      valid = T - i  # Pairs t with t + 1 + i <= L - 1.
      kls.append(_kl(q_BxTxNxV[:, :valid, i], p_BxLxV[:, 1 + i:]))
      regressions.append(_smooth_l1(predicted_BxTxNxD[:, :valid, i], f_BxLxD[:, 1 + i:]))
    kl, regression = sum(kls) / n, sum(regressions) / n
    ce = _first_draft_ce(q_BxTxNxV[:, :, 0], batch_BxL1[:, 2:], vocab_Vd, head.config.vocab_size)
  else:
    raise ValueError(f'Unknown head kind {kind!r}; known: {list(feature_head.KINDS)}.')
  loss = kl + feature_weight * regression
  return loss, dict(loss=loss, distill=kl, feature=regression, **ce)
