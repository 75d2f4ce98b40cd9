"""Logit processors: the one function that turns logits into the distribution actually sampled.

Every sampler (ArS, and both the draft and the target in SpS) calls `probabilities`, so a draft and a
target with the same `SamplingConfig` are processed identically. Order (transformers'):
the repetition penalty on the raw logits of the tokens already present (`present_xV`: the
prompt's and every generated one before the position), then temperature, then top-k, then top-p
on what top-k kept, then min-p, typical-p, the epsilon cutoff and the eta cutoff, each on what
the cuts before it kept, renormalised. Temperature 0 is greedy: a one-hot on the
argmax (of the penalised logits).
Output is float32 whatever the model dtype. `draw` / `sample` draw from such a distribution.

Cost matters here: SpS runs these on 2k + 1 vocabulary rows per loop. XLA's CPU sort and
cumulative sum of a vocabulary row take 100s of microseconds (the sort ~1 ms), and
`jax.random.categorical` makes V random numbers per draw. So nothing here sorts (but XLA:GPU's
`lax.top_k` sorts the row above k = 16: `_top_k_mask`), prefix sums on a CPU are two small
triangular matrix products (`_cumsum`), a draw uses one uniform number, and
what a GPU or TPU runs differs where it costs them less (`_cumsum`, `CutSearch`: chosen per
platform when the program is lowered, the same law).

`native=True` (a sampler on one CPU device) computes the same law with the native kernel
(`spsjax.native.distribution`, one pass instead of XLA's tens of vocabulary-wide ops), from the
same uniform number per draw, so both paths draw the same token but where float rounding puts a
boundary between two.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from spsjax import native
from spsjax.native import library


def _length_bans(name: str, pairs) -> tuple[tuple[tuple[int, ...], int], ...]:
  """`ban_before_new` or `ban_before_length` as tuples (lists, a config's, accepted: the
  settings are a static jit argument), validated: each pair some ids >= 0 and a count >= 0."""
  def count(n):
    if isinstance(n, (bool, str)) or int(n) != n:
      raise ValueError
    return int(n)
  try:
    bans = tuple((tuple(int(t) for t in tokens), count(n)) for tokens, n in pairs)
  except (TypeError, ValueError):
    bans = None
  if bans is None or any(not tokens or min(tokens) < 0 or n < 0 for tokens, n in bans):
    raise ValueError(f'{name} must be (token ids, n) pairs, each with at least one id >= 0 and '
                     f'an integer n >= 0, got {pairs!r}.')
  return bans


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """temperature 0: greedy; top_k 0: off; top_p 1.0: off; min_p 0.0: off. Hashable, so it is a
  static jit arg.

  min_p (Nguyen et al. 2024; transformers' `min_p`) keeps the tokens whose probability is at
  least min_p times the largest one's; as every cut here it never drops the most likely token.
  repetition_penalty (Keskar et al. 2019; transformers' `repetition_penalty`, 1.0: off) divides
  the logit of a token already present by it (multiplies a negative one): the law then depends
  on the tokens before the position, which every caller passes (`present_xV`).
  typical_p (Meister et al. 2023; transformers' `typical_p`, 1.0: off) keeps the tokens whose
  surprisal -log p is closest to the entropy H of the law: the fewest, by |-log p - H|, whose mass
  reaches typical_p, every token tied at the last one's distance included.
  epsilon_cutoff (Hewitt et al. 2022; 0.0: off) keeps the tokens of probability >= epsilon_cutoff,
  and eta_cutoff (the same paper; 0.0: off) those >= min(eta, sqrt(eta) exp(-H)); both keep the
  most likely token (and its ties) whatever its probability, as transformers' warpers do.
  no_repeat_ngram_size (transformers'; 0: off) bans the tokens that would repeat an n-gram of
  that size already in the row (prompt included), and sequence_bias ((token ids, bias) pairs,
  transformers' `sequence_bias`; -inf bans: banned words, suppressed tokens) adds a bias to the
  last token of a sequence whose other tokens end the row, both before everything else
  (`ngrams`): the law then depends on the tokens before the position, which every caller passes
  as `ngrams.History`, as it passes `present_xV` for a repetition penalty.
  ban_before_new ((token ids, n) pairs) bans the ids at a row's first n new tokens (transformers'
  `min_new_tokens` with the eos ids; `begin_suppress_tokens` with n = 1), and ban_before_length
  ((token ids, n) pairs) while the row holds fewer than n tokens, prompt included (`min_length`
  with the eos ids): both read the position, which `ngrams.History` knows, so they shift the
  logits with the n-gram ban.
  A positive temperature must be in [1.2e-38, 8.5e37], so that it and its reciprocal are float32
  normal numbers (XLA may divide by multiplying with the reciprocal; a denormal one is flushed to
  0).
  """
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  min_p: float = 0.0
  repetition_penalty: float = 1.0
  typical_p: float = 1.0
  epsilon_cutoff: float = 0.0
  eta_cutoff: float = 0.0
  no_repeat_ngram_size: int = 0
  sequence_bias: tuple[tuple[tuple[int, ...], float], ...] = ()
  ban_before_new: tuple[tuple[tuple[int, ...], int], ...] = ()
  ban_before_length: tuple[tuple[tuple[int, ...], int], ...] = ()

  def __post_init__(self):
    if not (self.temperature == 0 or
            _FLOAT32_TINY <= self.temperature <= 1 / _FLOAT32_TINY):  # Also rejects NaN.
      raise ValueError(f'temperature must be 0 (greedy) or in [{_FLOAT32_TINY:.3g}, '
                       f'{1 / _FLOAT32_TINY:.3g}], got {self.temperature}.')
    if int(self.top_k) != self.top_k or self.top_k < 0:
      raise ValueError(f'top_k must be an integer >= 0 (0 is off), got {self.top_k}.')
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f'top_p must be in (0, 1] (1 is off), got {self.top_p}.')
    if not 0.0 <= self.min_p <= 1.0:
      raise ValueError(f'min_p must be in [0, 1] (0 is off), got {self.min_p}.')
    if not 0.0 < self.typical_p <= 1.0:
      raise ValueError(f'typical_p must be in (0, 1] (1 is off), got {self.typical_p}.')
    try:  # Lists (a config's) become tuples: the settings are a static jit argument.
      bias = tuple((tuple(int(t) for t in tokens), float(b)) for tokens, b in self.sequence_bias)
    except (TypeError, ValueError):
      bias = None
    if bias is None or any(not tokens or min(tokens) < 0 or b != b for tokens, b in bias):
      raise ValueError('sequence_bias must be (token ids, bias) pairs, each with at least one id '
                       f'>= 0 and a bias that is not NaN, got {self.sequence_bias!r}.')
    object.__setattr__(self, 'sequence_bias', bias)
    for name in ('ban_before_new', 'ban_before_length'):
      object.__setattr__(self, name, _length_bans(name, getattr(self, name)))
    if int(self.no_repeat_ngram_size) != self.no_repeat_ngram_size or self.no_repeat_ngram_size < 0:
      raise ValueError(f'no_repeat_ngram_size must be an integer >= 0 (0 is off), got '
                       f'{self.no_repeat_ngram_size}.')
    for name in ('epsilon_cutoff', 'eta_cutoff'):
      if not 0.0 <= getattr(self, name) < 1.0:
        raise ValueError(f'{name} must be in [0, 1) (0 is off), got {getattr(self, name)}.')
    if not 0.0 < self.repetition_penalty < float('inf'):
      raise ValueError(f'repetition_penalty must be > 0 and finite (1 is off), got '
                       f'{self.repetition_penalty}.')

  def __repr__(self) -> str:
    """The settings that differ from the defaults (those that cut or change the law)."""
    changed = [f'{f.name}={getattr(self, f.name)!r}' for f in dataclasses.fields(self)
               if getattr(self, f.name) != f.default]
    return f'SamplingConfig({", ".join(changed)})'

  @property
  def greedy(self) -> bool:
    return self.temperature == 0

  @property
  def penalised(self) -> bool:
    """Whether the law depends on the tokens present (a repetition penalty other than 1)."""
    return self.repetition_penalty != 1.0

  @property
  def reads_context(self) -> bool:
    """Whether the logits are shifted by what the tokens before the position hold (an n-gram
    ban or sequence biases: `ngrams`)."""
    return bool(self.no_repeat_ngram_size or self.sequence_bias or self.ban_before_new or
                self.ban_before_length)

  def without_context(self) -> 'SamplingConfig':
    """These settings without the n-gram ban, the sequence biases and the bans by position: the
    law of logits already shifted by them (`ngrams.History`)."""
    return dataclasses.replace(self, no_repeat_ngram_size=0, sequence_bias=(), ban_before_new=(),
                               ban_before_length=())

  def without_penalty(self) -> 'SamplingConfig':
    return dataclasses.replace(self, repetition_penalty=1.0)

  @property
  def min_logit(self) -> float:
    """min-p's cut on the scaled logits (logit - max) / temperature, whose largest is 0: a token
    is kept iff its scaled logit is >= log(min_p), rounded to float32 once here (the same cut on
    XLA's path and the kernel's); -inf when off. p(x) >= min_p max p is exp(x - 0) >= min_p,
    whatever renormalisation top-k and top-p applied before."""
    return float(np.float32(np.log(self.min_p))) if self.min_p > 0 else -np.inf


_FLOAT32_TINY = float(np.finfo(np.float32).tiny)


def present_through(tokens_BxT: jax.Array, vocab_size: int) -> jax.Array:
  """bool[B, T, V]: the tokens present at each position of whole sequences, its own included
  (the `present_xV` of the law of the token after it; PAD_ID and other ids outside the
  vocabulary count as none)."""
  one_hot_BxTxV = jax.nn.one_hot(tokens_BxT, vocab_size, dtype=jnp.int32)
  return jax.lax.cummax(one_hot_BxTxV, axis=1) > 0


def present_along(present_BxV: jax.Array, tokens_BxN: jax.Array, on_path_xRxN) -> jax.Array:
  """bool[B, R, V]: for each of R paths through N tokens (on_path[r, m]: token m is on path r, a
  bool array shared by the rows or each row's [B, R, N], e.g. a token tree's ancestors),
  `present_BxV` with that path's tokens."""
  B = tokens_BxN.shape[0]
  on_path_BxRxN = jnp.asarray(on_path_xRxN, jnp.float32)
  on_path_BxRxN = jnp.broadcast_to(on_path_BxRxN, (B,) + on_path_BxRxN.shape[-2:])
  drafted_BxNxV = jax.nn.one_hot(tokens_BxN, present_BxV.shape[1], dtype=jnp.float32)
  return present_BxV[:, None] | (jnp.einsum('brn,bnv->brv', on_path_BxRxN, drafted_BxNxV) > 0)


def mark_present(present_BxV: jax.Array, tokens_BxN: jax.Array, counts_B: jax.Array | None = None
                 ) -> jax.Array:
  """`present_BxV` with each row's first counts[b] tokens (default all N; ids outside the
  vocabulary ignored) marked present."""
  B, N = tokens_BxN.shape
  V = present_BxV.shape[1]
  real_BxN = jnp.ones((B, N), bool) if counts_B is None else (
      jnp.arange(N)[None, :] < counts_B[:, None])
  ids_BxN = jnp.where(real_BxN & (tokens_BxN >= 0) & (tokens_BxN < V), tokens_BxN, V)
  rows_BxN = jnp.broadcast_to(jnp.arange(B)[:, None], (B, N))
  return present_BxV.at[rows_BxN, ids_BxN].set(True, mode='drop')


def penalise(logits_xV: jax.Array, sampling: SamplingConfig,
             present_xV: jax.Array | None) -> jax.Array:
  """The logits after `sampling`'s repetition penalty (themselves without one): a present
  token's logit x becomes x / penalty, or x * penalty where x < 0, as transformers'
  RepetitionPenaltyLogitsProcessor does. A penalty needs `present_xV` (bool, the logits' shape).
  Refuses an n-gram ban or sequence biases (`probabilities`)."""
  if sampling.reads_context:
    raise ValueError('no_repeat_ngram_size and sequence_bias read the tokens before each '
                     'position: shift the logits by `ngrams.History` (or `ngrams.offsets_through`)'
                     ' and pass sampling.without_context().')
  if not sampling.penalised:
    return logits_xV
  if present_xV is None:
    raise ValueError(f'repetition_penalty {sampling.repetition_penalty} needs the tokens present '
                     'before each position (present_xV): this caller does not track them.')
  logits_xV = logits_xV.astype(jnp.float32)
  penalty = sampling.repetition_penalty
  return jnp.where(present_xV, jnp.where(logits_xV < 0, logits_xV * penalty, logits_xV / penalty),
                   logits_xV)


def probabilities(logits_xV: jax.Array, sampling: SamplingConfig, *,
                  top_k_search: 'CutSearch | None' = None,
                  present_xV: jax.Array | None = None) -> jax.Array:
  """float32[..., V]: the distribution a sampler draws from under `sampling`, the tokens
  `present_xV` before the position (needed with a repetition penalty only; `penalise`).

  Logits are scaled as (logit - max) / temperature (at most 0: no overflow at any temperature).
  A -inf logit has probability exactly 0, and so has a logit whose scaled value is below
  log(float32 tiny) ~ -87.3 (its exp underflows). A row with no distribution (a NaN or +inf
  logit, or every logit -inf) comes out NaN everywhere, at every temperature; a draw from it gives
  token 0 (`draw`).

  `top_k_search`: top-k by that search, without `lax.top_k` (the same law; `_top_k_mask`).
  An n-gram ban or sequence biases (`SamplingConfig.reads_context`) are refused: they read the
  tokens before each position, so the caller shifts the logits by them (`ngrams.History`) and
  passes `sampling.without_context()`.
  """
  logits_xV = penalise(logits_xV, sampling, present_xV).astype(jnp.float32)
  V = logits_xV.shape[-1]
  # One reduction finds the max and the rows without a distribution: a NaN counts as +inf, so
  # the max of such a row is not finite (whatever XLA's max does with NaNs), and that of any
  # other row is its max.
  max_x1 = jnp.max(jnp.where(jnp.isnan(logits_xV), jnp.inf, logits_xV), axis=-1, keepdims=True)
  defined_x1 = jnp.isfinite(max_x1)
  if sampling.greedy:
    probs_xV = jax.nn.one_hot(jnp.argmax(logits_xV, axis=-1), V, dtype=jnp.float32)
    return jnp.where(defined_x1, probs_xV, jnp.nan)
  logits_xV = jnp.where(defined_x1, (logits_xV - max_x1) / sampling.temperature, 0.0)
  # Their max is exactly 0, so this is `jax.nn.softmax` bit for bit without its shift by the max:
  # a second reduction over the vocabulary each draw (a kernel on a GPU) for nothing.
  unnormalized_xV = jnp.exp(logits_xV)
  probs_xV = unnormalized_xV / jnp.sum(unnormalized_xV, axis=-1, keepdims=True)
  top_k = sampling.top_k if 0 < sampling.top_k < V else 0
  if top_k:
    probs_xV = _renormalise(
        jnp.where(_top_k_mask(logits_xV, top_k, top_k_search), probs_xV, 0.0))
  if sampling.top_p < 1.0:
    probs_xV = _renormalise(jnp.where(_top_p_mask(probs_xV, sampling.top_p), probs_xV, 0.0))
  if sampling.min_p > 0.0:
    probs_xV = _renormalise(jnp.where(logits_xV >= sampling.min_logit, probs_xV, 0.0))
  if sampling.typical_p < 1.0:
    probs_xV = _renormalise(jnp.where(
        _typical_mask(logits_xV, probs_xV, sampling.typical_p), probs_xV, 0.0))
  if sampling.epsilon_cutoff > 0.0:
    probs_xV = _renormalise(jnp.where(
        _at_least(logits_xV, probs_xV, sampling.epsilon_cutoff), probs_xV, 0.0))
  if sampling.eta_cutoff > 0.0:
    eta = sampling.eta_cutoff
    entropy_x1 = _entropy(logits_xV, probs_xV)
    cut_x1 = jnp.minimum(eta, np.float32(np.sqrt(eta)) * jnp.exp(-entropy_x1))
    probs_xV = _renormalise(jnp.where(_at_least(logits_xV, probs_xV, cut_x1), probs_xV, 0.0))
  return jnp.where(defined_x1, probs_xV, jnp.nan)


def _renormalise(probs_xV):
  return probs_xV / jnp.sum(probs_xV, axis=-1, keepdims=True)


def _kept_mean(scaled_xV, probs_xV):
  """float32[..., 1]: the law's mean scaled logit, sum p x over the tokens kept (p > 0).

  With Z the kept tokens' sum of exp x, log p = x - log Z, so the entropy is H = log Z - mean
  and a token's typical-p distance |-log p - H| is |x - mean|: no logarithm per token."""
  return jnp.sum(jnp.where(probs_xV > 0, probs_xV * scaled_xV, 0.0), axis=-1, keepdims=True)


def _entropy(scaled_xV, probs_xV):
  """float32[..., 1]: H = -sum p log p over the tokens kept (`_kept_mean`)."""
  kept_xV = probs_xV > 0
  log_total_x1 = jnp.log(jnp.sum(jnp.where(kept_xV, jnp.exp(scaled_xV), 0.0), -1, keepdims=True))
  return log_total_x1 - _kept_mean(scaled_xV, probs_xV)


def _at_least(scaled_xV, probs_xV, cut):
  """The kept tokens of probability >= cut, and the most likely kept one with its ties (by
  scaled logit, as transformers' epsilon and eta warpers keep their top token)."""
  kept_xV = probs_xV > 0
  top_x1 = jnp.max(jnp.where(kept_xV, scaled_xV, -jnp.inf), axis=-1, keepdims=True)
  return kept_xV & ((probs_xV >= cut) | (scaled_xV == top_x1))


def _typical_mask(scaled_xV, probs_xV, mass: float, search: 'CutSearch | None' = None):
  """Typical-p's set: the kept tokens whose distance |-log p - H| is at most d*, the smallest
  distance with mass(distance <= d*) >= mass (transformers' TypicalLogitsWarper: the first
  token, by distance, where the sorted mass reaches `mass`, and every token at its distance or
  nearer; all kept tokens if rounding leaves the mass below). Found by `_search_cut` over the
  distances' descending keys, without a sort."""
  distance_xV = jnp.where(probs_xV > 0, jnp.abs(scaled_xV - _kept_mean(scaled_xV, probs_xV)),
                          jnp.inf)
  keys_xV = _descending_keys(distance_xV)
  return keys_xV >= _platform_cut(probs_xV, keys_xV, mass, search)[..., None]


def _cumsum(x_xV: jax.Array) -> jax.Array:
  """Inclusive float32 prefix sums along the last axis. Exact for integer counts below 2^24; for
  probabilities, float32-accurate but not guaranteed monotone by an ulp where x is 0 (callers must
  not rely on equal neighbours being equal).

  On a CPU, two blocked triangular matmuls (`_blocked_cumsum`: XLA:CPU's cumulative sum of a
  vocabulary row takes 100s of microseconds); on a GPU or TPU `lax.cumsum`, which XLA computes as a
  scan in blocks, O(V), where the matmuls take O(V^1.5) multiply-adds: 21 GFLOP for SpS's accept
  at batch 32 and k = 4 over llama1b's 128k vocabulary (160 rows), 0.3-0.4 ms at an H100's float32
  peak (by its peak, not measured; XLA:GPU for an H100 makes it one 40160 x 512 x 512 GEMM,
  `lax.cumsum` six kernels; `experiments/compile_only.py`'s programs).
  """
  return jax.lax.platform_dependent(
      x_xV.astype(jnp.float32), cpu=_blocked_cumsum,
      default=lambda x: jax.lax.cumsum(x, axis=x.ndim - 1))


def _blocked_cumsum(x_xV: jax.Array) -> jax.Array:
  """`_cumsum` as two blocked triangular matmuls: the row is cut into blocks of b ~ sqrt(V), sums
  within each block (x_xNxb @ upper-triangular ones) plus the sum of the blocks before it."""
  V = x_xV.shape[-1]
  b = 1 << max(0, (V - 1).bit_length() + 1) // 2  # ~sqrt(V), a power of two.
  pad = (-V) % b
  x_xNxb = jnp.pad(x_xV.astype(jnp.float32), [(0, 0)] * (x_xV.ndim - 1) + [(0, pad)])
  x_xNxb = x_xNxb.reshape(x_xV.shape[:-1] + (-1, b))
  N = x_xNxb.shape[-2]
  within_xNxb = jnp.einsum('...nb,bc->...nc', x_xNxb, jnp.triu(jnp.ones((b, b), jnp.float32)),
                           precision=jax.lax.Precision.HIGHEST)
  before_xN = jnp.einsum('...n,nm->...m', within_xNxb[..., -1],
                         jnp.triu(jnp.ones((N, N), jnp.float32), 1),
                         precision=jax.lax.Precision.HIGHEST)
  total_xNxb = within_xNxb + before_xN[..., None]
  return total_xNxb.reshape(x_xV.shape[:-1] + (N * b,))[..., :V]


def _first_ties(tied_xV, room_x):
  """Among tied tokens, the first `room` by id (ties rank by id, as in a stable sort)."""
  rank_xV = _cumsum(tied_xV).astype(jnp.int32) - 1
  return tied_xV & (rank_xV < room_x[..., None])


def _top_k_mask(logits_xV, k: int, search: 'CutSearch | None' = None):
  """The k most likely tokens, ties by id: those above the k-th largest logit, then tied ones.
  (`lax.top_k`: XLA:CPU's TopK kernel, a TPU's TopK op; on a GPU XLA's TopK kernel up to
  k = 16, a sort of the row above, by compile-only H100 programs of JAX 0.11: CUB's radix sort
  where a GPU is present, else XLA's own sort, 21 kernels for 128k logits.)

  The k-th largest is the min of the k largest, not their last: XLA:CPU before JAX 0.12 rewrote
  a top-k whose only use is one element into a stable sort of the whole row (llama1b's 128,256
  logits: 26 ms a row, against 0.2 ms for its TopK kernel); the min keeps the TopK everywhere.
  With a `search`, no top-k: `_search_cut` counts the logits above its cuts (an alternative to
  a GPU's sort, timed beside it by `spsjax.bench.sampling_costs`). `logits_xV`: scaled, <= 0.
  """
  if search is None:
    kth_x = jnp.min(jax.lax.top_k(logits_xV, k)[0], axis=-1)
    above_xV, tied_xV = logits_xV > kth_x[..., None], logits_xV == kth_x[..., None]
  else:
    keys_xV = _descending_keys(logits_xV)
    kth_x = _search_cut(jnp.ones_like(logits_xV), keys_xV, float(k), search)
    above_xV, tied_xV = keys_xV > kth_x[..., None], keys_xV == kth_x[..., None]
  room_x = k - jnp.sum(above_xV, axis=-1)
  return above_xV | _first_ties(tied_xV, room_x)


def _descending_keys(x_xV):
  """int32 keys in [0, 0x7f800000] ordered as -|x| (scaled logits, all <= 0, as themselves;
  distances, all >= 0, reversed; infinities included): the bit patterns of the magnitudes,
  reversed (equal values, -0.0 and 0.0 too, give equal keys)."""
  return 0x7f800000 - jax.lax.bitcast_convert_type(jnp.abs(x_xV), jnp.int32)


@dataclasses.dataclass(frozen=True)
class CutSearch:
  """How `_search_cut` searches (top-p's cut, or top-k's without `lax.top_k`): each step splits
  the interval of bit patterns in `ways` (ways - 1 masses a step, from one read of the row),
  ceil(32 / log2(ways)) steps, as a loop or (`unrolled`) as straight-line code. Every plan finds
  the same cut, up to the rounding of the masses.

  A CPU runs `CPU_SEARCH` (the least arithmetic: 16 steps of 3 masses, one product of the row
  with the three masks each, in a loop). A GPU or TPU runs `ACCELERATOR_SEARCH`: half the reads
  of the row, in straight-line code. On a GPU a loop's every step is launched from the host and
  the loop splits the SpS loop's CUDA graph (an H100 trace idled 20-50 us at each such boundary,
  `Loop.drafts_unrolled`), and SpS searches k + 1 times a loop. XLA:GPU for an H100
  (`experiments/compile_only.py`, llama1b, top-p 0.95): `probabilities` of 5 rows 47 kernels
  unrolled against 149 launches (16 trips of a loop), and SpS's loop body (k = 4) 708 operations
  with no inner loop against 1189 with five. A step's new bounds come in closed form (no gather
  of the cuts): with JAX 0.11.2, `probabilities` of a row launches 42 kernels (three a step), SpS's
  loop body 655 operations (k = 4, padded), ArS's step 332.
  """
  ways: int
  unrolled: bool

  def __post_init__(self):
    if self.ways < 2 or self.ways & (self.ways - 1):
      raise ValueError(f'ways must be a power of two >= 2, got {self.ways}.')

  @property
  def steps(self) -> int:
    return -(-32 // (self.ways.bit_length() - 1))  # ways ** steps >= 2^32 > hi - lo.


CPU_SEARCH = CutSearch(ways=4, unrolled=False)
ACCELERATOR_SEARCH = CutSearch(ways=16, unrolled=True)


def _search_cut(weights_xV, bits_xV, threshold: float, search: CutSearch):
  """The largest v with mass(bits >= v) >= threshold, the mass of a set being the sum of its
  `weights` (>= 0, their total >= threshold), `bits` int32 >= 0: top-p's cut with probabilities
  and their bit patterns, top-k's with ones and the logits' keys (counts: exact below 2^24)."""
  ways = search.ways
  cuts_xW = jnp.arange(1, ways, dtype=jnp.int32).reshape((1,) * (bits_xV.ndim - 1) + (ways - 1,))

  def split(_, bounds):
    lo_x, hi_x = bounds  # mass(bits >= lo) >= threshold > mass(bits >= hi).
    width_x = (hi_x - lo_x + ways - 1) // ways
    t_xW = jnp.minimum(lo_x[..., None] + cuts_xW * width_x[..., None], hi_x[..., None])
    above_xWxV = bits_xV[..., None, :] >= t_xW[..., None]
    if search.unrolled:  # A reduction per step (XLA:GPU: two kernels, no [W, V] mask stored).
      mass_xW = jnp.sum(jnp.where(above_xWxV, weights_xV[..., None, :], 0.0), axis=-1)
    else:
      mass_xW = jnp.einsum('...V,...WV->...W', weights_xV, above_xWxV.astype(jnp.float32),
                           precision=jax.lax.Precision.HIGHEST)
    # The cuts that keep the invariant (the first n: masses fall as cuts rise). The new bounds
    # are cuts n and n + 1 (cut 0 is lo, cut `ways` hi), in closed form: no gather of them.
    n_x = jnp.sum(mass_xW >= threshold, axis=-1)
    return (jnp.minimum(lo_x + n_x * width_x, hi_x),
            jnp.minimum(lo_x + (n_x + 1) * width_x, hi_x))

  lo_x = jnp.zeros(bits_xV.shape[:-1], jnp.int32)
  hi_x = jnp.max(bits_xV, axis=-1) + 1
  return jax.lax.fori_loop(0, search.steps, split, (lo_x, hi_x), unroll=search.unrolled)[0]


def _platform_cut(weights_xV, bits_xV, threshold: float, search: CutSearch | None):
  """`_search_cut` by `search`, or (None) by the plan of the platform the program is lowered
  for."""
  if search is not None:
    return _search_cut(weights_xV, bits_xV, threshold, search)
  cut = lambda plan: lambda w, b: _search_cut(w, b, threshold, plan)
  return jax.lax.platform_dependent(weights_xV, bits_xV, cpu=cut(CPU_SEARCH),
                                    default=cut(ACCELERATOR_SEARCH))


def _top_p_mask(probs_xV, top_p: float, search: CutSearch | None = None):
  """The smallest set of most likely tokens (ties by id) whose mass reaches top_p, without a sort.

  A token is kept iff the mass ranked before it is < top_p. The last kept token's probability v*
  is the largest v with mass(p >= v) >= top_p: found by a search over the bit patterns of
  non-negative float32 (ordered like the values) that splits the interval in `search.ways` per
  step (`CutSearch`; None: the plan of the platform the program is lowered for). Tokens above v*
  are kept; tokens at v* are kept in id order while the mass before them stays < top_p.
  """
  bits_xV = jax.lax.bitcast_convert_type(probs_xV, jnp.int32)
  v_x = _platform_cut(probs_xV, bits_xV, top_p, search)
  above_xV = bits_xV > v_x[..., None]
  tied_xV = bits_xV == v_x[..., None]
  mass_above_x = jnp.sum(jnp.where(above_xV, probs_xV, 0.0), axis=-1)
  v_value_x = jax.lax.bitcast_convert_type(v_x, jnp.float32)
  # Tied tokens before this one hold v* each: keep while mass_above + v* * rank < top_p.
  rank_xV = _cumsum(tied_xV).astype(jnp.int32) - 1
  keep_tied_xV = tied_xV & (mass_above_x[..., None] + v_value_x[..., None] * rank_xV < top_p)
  return above_xV | keep_tied_xV


def draw(key: jax.Array, weights_V: jax.Array) -> jax.Array:
  """int32[]: a token drawn with probability proportional to `weights_V` (>= 0, not all 0).

  Inverse CDF with one uniform u in [0, 1): the first token whose prefix mass exceeds u * total.
  Only tokens of positive weight can be drawn, whatever the rounding (if rounding leaves no prefix
  above u * total, the last token of positive weight). Weights with no positive entry (a NaN row
  of `probabilities`) draw token 0.
  """
  return draw_with(jax.random.uniform(key, (), jnp.float32), weights_V)


def draw_with(u: jax.Array, weights_V: jax.Array) -> jax.Array:
  """`draw` with its uniform number u in [0, 1) given."""
  V = weights_V.shape[-1]
  weights_V = weights_V.astype(jnp.float32)
  cdf_V = _cumsum(weights_V)
  ids_V = jnp.arange(V, dtype=jnp.int32)
  positive_V = weights_V > 0
  # One reduction for both answers: a token past the threshold keys as its id (< V), any other
  # token of positive weight as 2V - 1 - id (in [V, 2V): the last one smallest), the rest 2V.
  # (Two reductions over the vocabulary are two kernels more on a GPU, a collective more where
  # the vocabulary is split over a mesh.)
  past_V = positive_V & (cdf_V > u * cdf_V[-1])
  key = jnp.min(jnp.where(past_V, ids_V, jnp.where(positive_V, 2 * V - 1 - ids_V, 2 * V)))
  return jnp.where(key < V, key, jnp.where(key < 2 * V, 2 * V - 1 - key, 0)).astype(jnp.int32)


def draw_in_blocks(u: jax.Array, weights_V: jax.Array, block: int = 128) -> jax.Array:
  """`draw_with`'s law (a token with probability proportional to `weights_V`, >= 0, by inverse
  CDF with u in [0, 1)) in O(V) on every platform: the first block of `block` tokens whose
  prefix mass exceeds u * total, then the first token in it whose prefix within the block
  exceeds the rest. Only tokens of positive weight are drawn, whatever the rounding (none past
  the threshold: the last block, or token in the block, of positive weight); no positive weight
  draws token 0. Its prefix sums differ from `draw_with`'s in rounding, so a draw at a boundary
  may differ: callers that must reproduce the native kernels' draws use `draw_with`."""
  V = weights_V.shape[-1]
  block = min(block, V)  # A small vocabulary is one block, not padded.
  P = -(-V // block)
  w_PxC = jnp.pad(weights_V.astype(jnp.float32), (0, P * block - V)).reshape(P, block)
  sums_P = jnp.sum(w_PxC, axis=1)
  cdf_P = jnp.cumsum(sums_P)
  threshold = u * cdf_P[-1]
  p = _first_past(cdf_P, sums_P > 0, threshold)
  in_block_C = w_PxC[p]
  c = _first_past(jnp.cumsum(in_block_C), in_block_C > 0, threshold - (cdf_P[p] - sums_P[p]))
  return (p * block + c).astype(jnp.int32)


def _first_past(cdf_N: jax.Array, positive_N: jax.Array, threshold: jax.Array) -> jax.Array:
  """The first index of positive weight whose prefix sum exceeds `threshold`; none: the last
  of positive weight; none of positive weight: 0 (one reduction, as `draw_with`)."""
  N = cdf_N.shape[-1]
  ids_N = jnp.arange(N, dtype=jnp.int32)
  key = jnp.min(jnp.where(positive_N & (cdf_N > threshold), ids_N,
                          jnp.where(positive_N, 2 * N - 1 - ids_N, 2 * N)))
  return jnp.where(key < N, key, jnp.where(key < 2 * N, 2 * N - 1 - key, 0)).astype(jnp.int32)


def typed_keys(keys) -> jax.Array:
  """Typed keys (`jax.random.key`) of any shape from typed keys or legacy raw ones (uint32 key
  data with the key's trailing dimension, as `jax.random.PRNGKey` and `split` of it make): the
  same keys, so the same random numbers, either way."""
  if isinstance(keys, jax.Array) and jax.dtypes.issubdtype(keys.dtype, jax.dtypes.prng_key):
    return keys
  keys = jnp.asarray(keys)
  if keys.dtype != jnp.uint32 or keys.ndim < 1:
    raise TypeError(f'Expected JAX random keys (jax.random.key(seed) or jax.random.PRNGKey(seed)),'
                    f' got an array of {keys.dtype}{keys.shape}.')
  return jax.random.wrap_key_data(keys)


def uniforms(keys: jax.Array) -> jax.Array:
  """The uniform number `draw` uses for each key (keys of any shape, typed or legacy; one
  threefry call for all: a sampler that knows its keys ahead draws them at once, not one small
  op per step)."""
  keys = typed_keys(keys)
  flat = jax.vmap(lambda key: jax.random.uniform(key, (), jnp.float32))(keys.reshape(-1))
  return flat.reshape(keys.shape)


def _native(logits_BxV, uniforms_B, sampling: SamplingConfig):
  """The kernel on the CPU; XLA's ops (the same law) on any other platform."""
  kernel = lambda ops: native.probabilities_and_draw(
      ops[0], ops[1], temperature=sampling.temperature, top_k=sampling.top_k,
      top_p=sampling.top_p, min_logit=sampling.min_logit, typical_p=sampling.typical_p,
      epsilon_cutoff=sampling.epsilon_cutoff, eta_cutoff=sampling.eta_cutoff)

  def xla(ops):
    probs_BxV = probabilities(ops[0], sampling)
    return probs_BxV, jax.vmap(draw_with)(ops[1], probs_BxV)

  return library.on_cpu((logits_BxV.astype(jnp.float32), uniforms_B), kernel, xla)


def probabilities_and_sample(keys_B: jax.Array, logits_BxV: jax.Array, sampling: SamplingConfig,
                             *, native_kernel: bool = False, present_BxV: jax.Array | None = None
                             ) -> tuple[jax.Array, jax.Array]:
  """(float32[B, V] `probabilities`, int32[B] one draw per row with its key), by the native
  kernel when `native_kernel` and it is built, else by XLA's ops."""
  return probabilities_and_sample_with(uniforms(keys_B), logits_BxV, sampling,
                                       native_kernel=native_kernel, present_BxV=present_BxV)


def probabilities_and_sample_with(uniforms_B: jax.Array, logits_BxV: jax.Array,
                                  sampling: SamplingConfig, *, native_kernel: bool = False,
                                  present_BxV: jax.Array | None = None
                                  ) -> tuple[jax.Array, jax.Array]:
  """`probabilities_and_sample` with each row's uniform number given (`uniforms` of its key):
  the same probabilities and the same draws."""
  logits_BxV = penalise(logits_BxV, sampling, present_BxV)
  sampling = sampling.without_penalty()
  if native_kernel and library.available():
    return _native(logits_BxV, uniforms_B, sampling)
  probs_BxV = probabilities(logits_BxV, sampling)
  return probs_BxV, _sample_with(uniforms_B, probs_BxV, sampling.greedy)


def native_probabilities(logits_xV: jax.Array, sampling: SamplingConfig,
                         present_xV: jax.Array | None = None) -> jax.Array:
  """`probabilities` by the native kernel where it is built (any leading shape)."""
  logits_xV = penalise(logits_xV, sampling, present_xV)
  sampling = sampling.without_penalty()
  if not library.available():
    return probabilities(logits_xV, sampling)
  lead, V = logits_xV.shape[:-1], logits_xV.shape[-1]
  logits_RxV = logits_xV.reshape(-1, V)
  probs_RxV, _ = _native(logits_RxV, jnp.zeros(logits_RxV.shape[:1], jnp.float32), sampling)
  return probs_RxV.reshape(lead + (V,))


def sample(keys_B: jax.Array, probs_BxV: jax.Array, *, greedy: bool = False) -> jax.Array:
  """int32[B]: one draw per row from its distribution, each row with its own key.

  `greedy`: the rows are one-hot (`probabilities` at temperature 0), so the draw is their argmax,
  found without the prefix sums of a draw.
  """
  return _sample_with(uniforms(keys_B), probs_BxV, greedy)


def _sample_with(uniforms_B, probs_BxV, greedy: bool):
  if greedy:  # XLA drops the unused uniforms.
    return jnp.argmax(probs_BxV, axis=-1).astype(jnp.int32)
  return jax.vmap(draw_with)(uniforms_B, probs_BxV)
