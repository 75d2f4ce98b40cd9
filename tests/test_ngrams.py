"""No repeated n-grams: the tokens banned after a context are transformers' (fairseq's) set."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spsjax import models
from spsjax.models import TokenTree
from spsjax.sampling import SamplingConfig, ngrams


def reference_banned(context, n, vocab_size):
  """transformers' `_calc_banned_ngram_tokens` for one context, as a [V] mask: every n-gram of
  the context keyed by its first n - 1 tokens; the tokens after the context's last n - 1."""
  banned = np.zeros(vocab_size, bool)
  if len(context) + 1 < n:
    return banned
  following = {}
  for gram in zip(*[context[i:] for i in range(n)]):
    following.setdefault(tuple(gram[:-1]), []).append(gram[-1])
  banned[following.get(tuple(context[len(context) + 1 - n:]), [])] = True
  return banned


@pytest.mark.parametrize('n', [1, 2, 3, 4])
def test_banned_after_is_transformers_set(n):
  """Random sequences over 5 tokens (3 for n >= 3: many repeats), contexts of every length
  0..20, PAD_ID past some ends (never banned, never matched)."""
  rng = np.random.default_rng(n)
  V, B, R, S = 5 if n < 3 else 3, 6, 9, 20
  seqs = rng.integers(0, V, (B, S)).astype(np.int32)
  ends = rng.integers(0, S + 1, (B, R)).astype(np.int32)
  ends[:, 0], ends[:, 1] = 0, S
  seqs[0, 15:] = -1
  ends[0] = np.minimum(ends[0], 15)
  got = np.asarray(jax.jit(ngrams.banned_after, static_argnums=(2, 3))(
      jnp.asarray(seqs)[:, None], jnp.asarray(ends), n, V))
  banned_somewhere = 0
  for b in range(B):
    for r in range(R):
      want = reference_banned(list(seqs[b, :ends[b, r]]), n, V)
      np.testing.assert_array_equal(got[b, r], want, err_msg=f'row {b}, end {ends[b, r]}')
      banned_somewhere += want.any()
  assert banned_somewhere >= B * R // 5


def test_offsets_through_each_prefix():
  tokens = np.array([[1, 2, 1, 2, 3, 1], [0, 0, 0, 4, 0, 0]], np.int32)
  got = _banned(ngrams.offsets_through(jnp.asarray(tokens), SamplingConfig(
      no_repeat_ngram_size=2), 5))
  for b in range(2):
    for t in range(6):
      np.testing.assert_array_equal(got[b, t], reference_banned(list(tokens[b, :t + 1]), 2, 5))
  assert got[0, 3, 1] and got[0, 0].sum() == 0  # After 1 2 1 2: 2 was followed by 1.


def _history(n):
  prompts = jnp.array([[1, 2, 3, 1, -1, -1], [4, 4, 1, 2, 4, 3]], jnp.int32)
  return ngrams.History.of_prompts(SamplingConfig(no_repeat_ngram_size=n), prompts,
                                   jnp.array([4, 6], jnp.int32), 8, 6)


def _banned(offsets):
  """The tokens at -inf; every other offset 0 (an n-gram ban alone)."""
  offsets = np.asarray(offsets)
  assert np.all((offsets == 0) | (offsets == -np.inf))
  return offsets == -np.inf


def test_history_appends_and_bans_along_a_chain():
  """`append` commits counts[b] tokens per row; a chain's slot j reads the committed tokens and
  the drafts before it (`banned_along_chain`, `banned_at` with a traced slot)."""
  assert ngrams.History.of_prompts(SamplingConfig(), jnp.zeros((1, 2), jnp.int32), jnp.ones(1),
                                   3, 5) is None
  history = _history(2).append(jnp.array([[2, 5, 0], [1, 1, 1]]), jnp.array([2, 0]))
  np.testing.assert_array_equal(history.lengths_B, [6, 6])
  np.testing.assert_array_equal(history.tokens_BxS[:, :7], [[1, 2, 3, 1, 2, 5, -1],
                                                            [4, 4, 1, 2, 4, 3, -1]])
  committed = [[1, 2, 3, 1, 2, 5], [4, 4, 1, 2, 4, 3]]
  np.testing.assert_array_equal(_banned(history.after()),
                                [reference_banned(c, 2, 6) for c in committed])
  drafts = jnp.array([[3, 1, 2], [4, 1, 0]], jnp.int32)
  chain = _banned(history.along_chain(drafts, 4))
  for j in range(4):
    want = [reference_banned(c + list(np.asarray(drafts[b, :j])), 2, 6)
            for b, c in enumerate(committed)]
    np.testing.assert_array_equal(chain[:, j], want, err_msg=f'slot {j}')
    np.testing.assert_array_equal(_banned(jax.jit(history.at)(drafts, jnp.int32(j))), want)
  assert chain.any(axis=-1).sum() >= 5


@pytest.mark.parametrize('per_row', [False, True])
def test_history_bans_along_a_tree(per_row):
  """Node i reads the committed tokens, then its ancestors' tokens and its own in depth order;
  the root the committed tokens alone. `per_row`: each row its own tree (`models.RowTrees`)."""
  trees = [TokenTree((0, 0, 1, 1, 2, 3))] * 2  # Depths 1, 1, 2, 2, 2, 3.
  if per_row:
    trees[1] = TokenTree((0, 1, 2, 0, 4, 4))  # Depths 1, 2, 3, 1, 2, 2.
  history = _history(3)
  tokens = jnp.array([[1, 4, 2, 3, 1, 1], [2, 4, 3, 2, 4, 1]], jnp.int32)  # Nodes 1 .. 6.
  tree = models.RowTrees.of(jnp.asarray([t.parents for t in trees]), 3, 2) if per_row else trees[0]
  got = _banned(history.along_tree(tokens, tree))
  committed = [[1, 2, 3, 1], [4, 4, 1, 2, 4, 3]]
  for node in range(7):
    for b in range(2):
      path = [a for a in np.flatnonzero(trees[b].ancestors[node]) if a > 0]
      context = committed[b] + [int(tokens[b, a - 1]) for a in path]
      np.testing.assert_array_equal(got[b, node], reference_banned(context, 3, 6),
                                    err_msg=f'row {b}, node {node}, context {context}')
  assert got.any(axis=-1).sum() >= 2


def test_shift_adds_the_offsets():
  logits = jnp.array([[0.5, 1.0, -2.0]])
  np.testing.assert_array_equal(ngrams.shift(logits, jnp.array([[0.0, -np.inf, 1.5]])),
                                [[0.5, -np.inf, -0.5]])
  assert ngrams.shift(logits, None) is logits


def reference_biases(context, sequence_bias, vocab_size):
  """transformers' SequenceBiasLogitsProcessor for one context: single tokens always; a longer
  sequence's bias on its last token when the context holds at least as many tokens and ends
  with the others."""
  out = np.zeros(vocab_size)
  for tokens, bias in sequence_bias:
    ends_with = list(context[len(context) - len(tokens) + 1:]) == list(tokens[:-1])
    if len(tokens) == 1 or (len(tokens) <= len(context) and ends_with):
      out[tokens[-1]] += bias
  return out


def test_sequence_biases_and_bans_after_each_context():
  """Biases of sequences of 1-3 tokens (finite and -inf, two on one token), with a 2-gram ban
  beside them (-inf wins), against transformers' rules, at every context length."""
  bias = (((3,), 1.5), ((1, 2), -2.0), ((2, 1, 0), -np.inf), ((0, 2), 0.75), ((4, 2), 0.5))
  sampling = SamplingConfig(sequence_bias=bias, no_repeat_ngram_size=2)
  rng = np.random.default_rng(0)
  V, B, S = 5, 4, 16
  seqs = rng.integers(0, V, (B, S)).astype(np.int32)
  ends = np.tile(np.arange(1, S + 1, dtype=np.int32), (B, 1))
  got = np.asarray(ngrams.offsets_after(jnp.asarray(seqs)[:, None], jnp.asarray(ends), sampling,
                                        V))
  applied = 0
  for b in range(B):
    for r, end in enumerate(ends[b]):
      context = list(seqs[b, :end])
      want = np.where(reference_banned(context, 2, V), -np.inf,
                      reference_biases(context, bias, V))
      np.testing.assert_array_equal(got[b, r], want, err_msg=f'row {b}, context {context}')
      applied += np.sum(np.isfinite(want) & (want != 0) & (want != 1.5))
  assert applied >= 10


def test_sequence_bias_settings():
  s = SamplingConfig(sequence_bias=[[[1, 2], -1.0], [[7], float('-inf')]])
  assert s.sequence_bias == (((1, 2), -1.0), ((7,), float('-inf'))) and s.reads_context
  assert hash(s) == hash(SamplingConfig(sequence_bias=(((1, 2), -1.0), ((7,), -np.inf))))
  for bad in ([[[], 1.0]], [[[-1], 1.0]], [[[1], float('nan')]], [[1, 2]], 'x'):
    with pytest.raises(ValueError, match='sequence_bias'):
      SamplingConfig(sequence_bias=bad)
  with pytest.raises(ValueError, match='outside the vocabulary of 5'):
    ngrams.History.of(SamplingConfig(sequence_bias=[[[5], 1.0]]), jnp.zeros((1, 3), jnp.int32),
                      jnp.ones(1, jnp.int32), jnp.ones(1, jnp.int32), 5)


def reference_position_bans(context_length, prompt_length, sampling, vocab_size):
  """transformers' MinNewTokensLengthLogitsProcessor and SuppressTokensAtBeginLogitsProcessor
  (`ban_before_new`: new tokens so far below n) and MinLengthLogitsProcessor
  (`ban_before_length`: tokens so far below n) for one unpadded row, as a [V] mask."""
  banned = np.zeros(vocab_size, bool)
  for ids, n in sampling.ban_before_new:
    if context_length - prompt_length < n:
      banned[list(ids)] = True
  for ids, n in sampling.ban_before_length:
    if context_length < n:
      banned[list(ids)] = True
  return banned


POSITION_BANS = SamplingConfig(ban_before_new=(((2, 5), 3), ((1,), 1)),
                               ban_before_length=(((4,), 7), ((5,), 2)))


def test_bans_by_position_along_chains_and_trees():
  """Each context's new tokens count from its row's prompt (ragged: 4 and 6 tokens), at every
  slot of a chain and node of a tree, after commits; `ban_before_new` needs the prompt's
  length."""
  prompts = jnp.array([[1, 2, 3, 1, -1, -1], [4, 4, 1, 2, 4, 3]], jnp.int32)
  prompt_lengths = np.array([4, 6])
  history = ngrams.History.of_prompts(POSITION_BANS, prompts, jnp.asarray(prompt_lengths), 8, 6)
  drafts = jnp.array([[3, 1, 2, 0], [4, 1, 0, 2]], jnp.int32)
  tree = TokenTree((0, 0, 1, 1, 2, 3))  # Depths 1, 1, 2, 2, 2, 3.
  seen = set()
  for committed in (0, 1, 2, 3):
    if committed:
      history = history.append(jnp.array([[0], [0]]), jnp.array([1, 1]))
    lengths = prompt_lengths + committed
    chain = _banned(history.along_chain(drafts, 5))
    nodes = _banned(history.along_tree(drafts[:, :3].repeat(2, axis=1), tree))
    for b in range(2):
      for j in range(5):
        want = reference_position_bans(lengths[b] + j, prompt_lengths[b], POSITION_BANS, 6)
        np.testing.assert_array_equal(chain[b, j], want, err_msg=f'{committed}, row {b}, {j}')
        seen.add(tuple(want))
      for node, depth in enumerate(tree.depths):
        np.testing.assert_array_equal(nodes[b, node], reference_position_bans(
            lengths[b] + depth, prompt_lengths[b], POSITION_BANS, 6))
      np.testing.assert_array_equal(_banned(history.after())[b], reference_position_bans(
          lengths[b], prompt_lengths[b], POSITION_BANS, 6))
  assert len(seen) >= 4  # Several different sets: the rules switch off at different slots.
  through = _banned(ngrams.offsets_through(prompts, POSITION_BANS, 6, jnp.array([2, 3])))
  for b, p in enumerate((2, 3)):
    for t in range(6):
      np.testing.assert_array_equal(through[b, t], reference_position_bans(t + 1, p,
                                                                            POSITION_BANS, 6))
  with pytest.raises(ValueError, match="pass the prompts' lengths"):
    ngrams.offsets_through(prompts, POSITION_BANS, 6)
  for name in ('ban_before_new', 'ban_before_length'):
    with pytest.raises(ValueError, match=f'{name} names'):
      ngrams.check_vocabulary(SamplingConfig(**{name: (((4,), 7),)}), 4)


def test_position_ban_settings():
  s = SamplingConfig(ban_before_new=[[[1, 2], 3]], ban_before_length=[[[7], 0]])
  assert s.ban_before_new == (((1, 2), 3),) and s.ban_before_length == (((7,), 0),)
  assert s.reads_context and not s.without_context().reads_context
  assert hash(s) == hash(SamplingConfig(ban_before_new=(((1, 2), 3),),
                                        ban_before_length=(((7,), 0),)))
  for bad in ([[[], 1]], [[[-1], 1]], [[[1], -1]], [[[1], 1.5]], [[[1], True]], [[1, 2]], 'x'):
    with pytest.raises(ValueError, match='ban_before_new'):
      SamplingConfig(ban_before_new=bad)
