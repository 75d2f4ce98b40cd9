"""Trees of drafts: the tree's structure, a model's call on a tree against the reference forward,
keeping a path in the cache, the tree's accept step against its exact law, and SpS with
alternatives and with a tree drafter (exact, greedy parity with ArS, caches after every loop)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spsjax import models
from spsjax.sharding import mesh_from_axes
from spsjax.models import TokenTree, kv_cache
from spsjax.sampling import (SamplingConfig, autoregressive_sample, drafter_config, drafters,
                             speculative, speculative_sample)
from spsjax.sampling.rejection import accept_tree, accept_tree_with
from spsjax.sampling.tree_drafters import DynamicTreeDrafter, TreeDrafter
from tests.forwards import full_logits
from tests.stats import exact_sequence_law, g_test_pvalue, sequence_counts
from tests.test_drafters import NEW, PROMPT, V_SMALL, tiny_pair  # pylint: disable=unused-import
from tests.test_speculative import (  # pylint: disable=unused-import
    _ragged, _run_checking_caches, pair, penalised_greedy_ars)

P_MIN = 1e-5  # Each G-test fails a correct sampler with this probability.
GREEDY = SamplingConfig(temperature=0.0)


def test_tree_structure():
  tree = TokenTree((0, 0, 1, 1, 2, 4, 4, 3))
  np.testing.assert_array_equal(tree.depths, [0, 1, 1, 2, 2, 2, 3, 3, 3])
  assert tree.depth == 3 and tree.num_nodes == 8
  np.testing.assert_array_equal(np.flatnonzero(tree.ancestors[6]), [0, 1, 4, 6])
  np.testing.assert_array_equal(tree.children[1], [3, 4])
  np.testing.assert_array_equal(tree.children[6], [-1, -1])
  chain = TokenTree.chain_with_alternatives(3, 2)
  assert chain.parents == (0, 1, 2, 0, 0, 1, 1, 2, 2)
  np.testing.assert_array_equal(chain.children[0], [1, 4, 5])
  assert TokenTree.chain_with_alternatives(2, 0) == TokenTree((0, 1))
  for parents in [(), (1,), (0, 2), (0, -1)]:
    with pytest.raises(ValueError):
      TokenTree(parents)
  full = TokenTree.full((2, 3, 1))
  assert full.parents == (0, 0, 1, 1, 1, 2, 2, 2) + tuple(range(3, 9))
  assert full.levels == ((0, 1), (1, 2), (3, 6), (9, 6))
  with pytest.raises(ValueError, match='breadth-first'):
    _ = chain.levels  # The chain's nodes come before the alternatives of depth 1.
  with pytest.raises(ValueError):
    TokenTree.full((2, 0))


def test_row_trees_are_each_rows_token_tree():
  """`RowTrees`' views (ancestors by repeated squaring, depths, children) equal each row's
  `TokenTree`'s, for trees of depth 1 to 8; `TokenTree.for_rows` the tree in every row."""
  rng = np.random.default_rng(0)
  for N in (1, 3, 8):
    trees = [TokenTree(tuple(int(rng.integers(0, i)) for i in range(1, N + 1)))
             for _ in range(6)] + [TokenTree(tuple(range(N)))]  # And a chain: depth N.
    width = max(t.children.shape[1] for t in trees)
    rows = models.RowTrees.of(jnp.asarray([t.parents for t in trees]),
                              max(t.depth for t in trees), width)
    for b, tree in enumerate(trees):
      np.testing.assert_array_equal(rows.ancestors[b], tree.ancestors)
      np.testing.assert_array_equal(rows.depths[b], tree.depths)
      np.testing.assert_array_equal(
          rows.children[b], np.pad(tree.children, ((0, 0), (0, width - tree.children.shape[1])),
                                   constant_values=-1))
  shared = TREE.for_rows(3)
  np.testing.assert_array_equal(shared.ancestors, np.broadcast_to(TREE.ancestors, (3, 9, 9)))
  assert shared.num_nodes == 8 and shared.depth == 3 and shared.width == 2
  np.testing.assert_array_equal(TREE.mask(4).ancestors_xTxM, shared.mask(4).ancestors_xTxM[1])


# --- The target's call on a tree -------------------------------------------------------------

VOCAB = 61
TREE = TokenTree((0, 0, 1, 1, 2, 4, 4, 3))
OTHER_TREE = TokenTree((0, 1, 2, 0, 4, 1, 6, 6))  # As many nodes, deeper: a second row's own.
N_TREE = TREE.num_nodes
_extend = jax.jit(models.extend, static_argnums=0, static_argnames='tree')
_extend_rows = jax.jit(models.extend, static_argnums=0)  # A `RowTrees` tree is traced.
_tree_logits = jax.jit(models.tree_logits, static_argnums=(0, 3))


def _path_logits(config, params, prefixes, tokens_BxT, tree) -> np.ndarray:
  """float32[B, N + 1, V]: for each row and node, the uncached forward's logits at the end of the
  row's prefix followed by the node's root-to-node tokens (one padded batch, one program). `tree`:
  a `TokenTree`, or one per row."""
  width = 48
  rows = []
  trees = tree if isinstance(tree, (list, tuple)) else [tree] * len(prefixes)
  for prefix, tokens_T, tree in zip(prefixes, tokens_BxT, trees, strict=True):
    for node in range(tree.num_nodes + 1):
      seq = np.concatenate([prefix, tokens_T[tree.ancestors[node]]])
      rows.append((np.pad(seq, (0, width - len(seq))), len(seq) - 1))
  out = np.asarray(full_logits(config, params, jnp.asarray(np.stack([r[0] for r in rows]))))
  last = out[np.arange(len(rows)), [r[1] for r in rows]]
  return last.reshape(len(prefixes), tree.num_nodes + 1, -1)


def test_tree_logits_are_each_paths_forward():
  config = models.TransformerConfig(vocab_size=VOCAB, d_model=32, num_layers=2, num_heads=4,
                                    num_kv_heads=2, d_ff=64, max_seq_len=64)
  params = models.init_params(config, jax.random.key(0))
  tokens_BxT = np.asarray(jax.random.randint(jax.random.key(1), (2, N_TREE + 1), 0, VOCAB))
  expected = _path_logits(config, params, [np.zeros((0,), np.int32)] * 2, tokens_BxT, TREE)
  np.testing.assert_allclose(_tree_logits(config, params, jnp.asarray(tokens_BxT), TREE),
                             expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize('layout,window,per_row', [
    ('xla', None, False), ('fused', None, False), ('xla', 3, False), ('packed', None, False),
    ('packed', 3, False), ('xla', None, True), ('packed', None, True), ('xla', 3, True)])
def test_a_tree_call_and_its_kept_path_decode_the_reference(layout, window, per_row):
  """Rows at ragged lengths, each loop: a tree call whose root is the row's next token, one
  random path carrying the sequence's true tokens and other tokens elsewhere. Every node's
  logits are the uncached forward's on the row's tokens and the node's root-to-node tokens; the
  path is then kept (`kv_cache.keep_path`) and decoding goes on from it. With a sliding window
  (Gemma 2's layers) the rings hold window - 1 + N slots (a packed model's cache holds every
  position; its products are the kernels', its attention on the tree XLA's). `per_row`: each
  row its own tree (`models.RowTrees`). Without keeping the path the next loops' logits are
  wrong (so the check can fail)."""
  extra = dict(sliding_window=window, global_layers=(1,)) if window else {}
  config = models.TransformerConfig(vocab_size=VOCAB, d_model=32, num_layers=2, num_heads=4,
                                    num_kv_heads=2, d_ff=64, max_seq_len=64, **extra)
  params = models.init_params(config, jax.random.key(0))
  model = models.Model(config, params)
  model = {'xla': lambda m: m, 'fused': models.fuse, 'packed': models.pack}[layout](model)
  sequence_BxL = np.asarray(jax.random.randint(jax.random.key(1), (2, 40), 0, VOCAB))
  rng = np.random.default_rng(0)
  N = TREE.num_nodes
  trees = [TREE, OTHER_TREE] if per_row else [TREE, TREE]
  depth = max(t.depth for t in trees)
  if per_row:
    call = lambda cache, tokens: _extend_rows(model.config, model.params, cache, tokens,
                                              tree=models.RowTrees.of(jnp.asarray(
                                                  [t.parents for t in trees]), depth, 2))
  else:
    call = lambda cache, tokens: _extend(model.config, model.params, cache, tokens, tree=TREE)

  def run(keep):
    lengths = np.array([3, 6])
    _, cache = models.prefill(model.config, model.params, jnp.asarray(sequence_BxL[:, :6]),
                              jnp.asarray(lengths), 48, rollback=N)
    worst = 0.0
    for _ in range(8):
      if lengths.max() + depth + 1 >= 40:
        break
      ends = rng.integers(1, N + 1, size=2)  # Each row's path: the ancestors of one node.
      tokens_BxT = rng.integers(0, VOCAB, size=(2, N + 1))
      path_BxD = np.full((2, depth + 1), -1)
      for b, (l, end) in enumerate(zip(lengths, ends)):
        path = np.flatnonzero(trees[b].ancestors[end])
        path_BxD[b, :len(path)] = path
        tokens_BxT[b, path] = sequence_BxL[b, l:l + len(path)]
      out_BxTxV, cache = call(cache.with_lengths(jnp.asarray(lengths)), jnp.asarray(tokens_BxT))
      expected = _path_logits(config, params, [sequence_BxL[b, :l] for b, l in enumerate(lengths)],
                              tokens_BxT, trees)
      worst = max(worst, float(np.abs(np.asarray(out_BxTxV) - expected).max()))
      if keep:
        cache = kv_cache.keep_path(cache, jnp.asarray(lengths), jnp.asarray(path_BxD))
      lengths = lengths + (path_BxD >= 0).sum(1)
    return worst

  assert run(keep=True) < 1e-4
  assert run(keep=False) > 1e-3


# --- The accept step against its exact law ---------------------------------------------------

def _walk(u, u_token, p, q, tokens, valid, tree: TokenTree):
  """numpy: the recursive rejection walk, trying the children of each node it reaches in order;
  (path, n, token) as `accept_tree`."""
  node, path, r = 0, [0], p[0]
  while True:
    r, chosen = p[node].astype(np.float64), None
    for child in tree.children[node]:
      if child <= 0 or not valid[child - 1]:
        continue
      t = tokens[child - 1]
      if u[child - 1] * q[child - 1, t] < r[t]:
        chosen = child
        break
      rest = np.maximum(r - q[child - 1], 0.0)
      r = rest / rest.sum() if rest.sum() > 0 else r
    if chosen is None:
      break
    node = chosen
    path.append(node)
  cdf = np.cumsum(r)
  token = int(np.argmax((cdf > u_token * cdf[-1]) & (r > 0)))
  return path + [-1] * (tree.depth + 1 - len(path)), len(path) - 1, token


def test_tree_accept_tries_every_nodes_children_as_the_walk_does():
  """`accept_tree_with` (every node's children tried at once, then the walk looks them up)
  against the walk trying the children of the nodes it reaches: random trees, laws (some
  children point masses, some not proposed) and uniforms give the same path, count and token."""
  rng = np.random.default_rng(0)
  V = 6
  for trial in range(60):
    N = int(rng.integers(1, 9))
    tree = TokenTree(tuple(int(rng.integers(0, i)) for i in range(1, N + 1)))
    p = rng.dirichlet(np.full(V, 0.5), size=N + 1).astype(np.float32)
    tokens = rng.integers(0, V, size=N)
    q = rng.dirichlet(np.full(V, 0.5), size=N).astype(np.float32)
    points = rng.random(N) < 0.4
    q[points] = np.eye(V, dtype=np.float32)[tokens[points]]
    valid = rng.random(N) < 0.85
    u, u_token = rng.random(N).astype(np.float32), np.float32(rng.random())
    got = accept_tree_with(jnp.asarray(u), u_token, jnp.asarray(p), jnp.asarray(q),
                           jnp.asarray(tokens), jnp.asarray(valid), tree.children, tree.depth)
    want = _walk(u, u_token, p, q, tokens, valid, tree)
    assert [np.asarray(got[0]).tolist(), int(got[1])] == [want[0], want[1]], (trial, tree)
    assert int(got[2]) == want[2], (trial, tree)


def _bigram_tree_draws(P, Q, tree: TokenTree, n: int, point_alternatives: bool, seed: int):
  """n rows of a tree drafted from bigram laws Q (row V: after the root), children of a node
  without replacement (the first drawn from Q, the others by Gumbel top-k of Q without the
  earlier ones, or as point masses on Q's next best); the target's laws P likewise. Returns
  the accept step's (path, n, token) and the node tokens."""
  V = P.shape[1]
  children = tree.children

  def one(key):
    draw_keys, gumbel_keys, accept_key = jnp.split(
        jax.random.split(key, 2 * tree.num_nodes + 3), [tree.num_nodes + 1,
                                                        2 * tree.num_nodes + 2])
    tokens = [jnp.int32(V)] + [None] * tree.num_nodes  # The root's bigram row is V.
    q = [None] * tree.num_nodes
    valid = [None] * tree.num_nodes
    for node in range(tree.num_nodes + 1):
      kids = [c for c in children[node] if c > 0]
      if not kids:
        continue
      law = Q[tokens[node]]
      first = jax.random.categorical(draw_keys[node], jnp.log(law)).astype(jnp.int32)
      rest = law.at[first].set(0.0)
      if point_alternatives:
        others = jnp.argsort(-rest)
      else:
        others = jnp.argsort(-(jnp.log(rest) + jax.random.gumbel(gumbel_keys[node], (V,))))
      for j, c in enumerate(kids):
        if j == 0:
          tokens[c], q[c - 1], valid[c - 1] = first, law, jnp.bool_(True)
          continue
        t = others[j - 1].astype(jnp.int32)
        tokens[c], valid[c - 1] = t, rest[t] > 0
        q[c - 1] = (jax.nn.one_hot(t, V) if point_alternatives
                    else rest / jnp.maximum(rest.sum(), 1e-30))
        rest = rest.at[t].set(0.0)
    p = jnp.stack([P[t] for t in tokens])
    nodes = jnp.stack(tokens[1:])
    return accept_tree(accept_key[0], p, jnp.stack(q), nodes, jnp.stack(valid), tree.children,
                       tree.depth) + (nodes,)

  return jax.jit(jax.vmap(one))(jax.random.split(jax.random.key(seed), n))


@pytest.mark.parametrize('point_alternatives', [False, True])
def test_tree_accept_law_exact(point_alternatives):
  """Bigram target and draft laws (V = 5) on a chain of 2 with 2 alternatives per slot: the
  first 3 emitted tokens (the path's, the token after it, then drawn from P to complete rows that
  emitted fewer) follow the target's joint law, the alternatives drawn without replacement or
  as point masses; alternatives are accepted in a fifth of the rows or more. Skipping the
  residual update after a rejected child fails this (p-value 0 in a trial)."""
  V = 5
  rng = np.random.default_rng(0)
  P = rng.dirichlet(np.full(V, 0.7), size=V + 1).astype(np.float32)
  Q = rng.dirichlet(np.full(V, 0.7), size=V + 1).astype(np.float32)
  tree = TokenTree.chain_with_alternatives(2, 2)
  n_rows = 100_000
  path, n, token, nodes = map(np.asarray, _bigram_tree_draws(
      jnp.asarray(P), jnp.asarray(Q), tree, n_rows, point_alternatives, seed=1))
  all_tokens = np.concatenate([np.full((n_rows, 1), -1), nodes], axis=1)
  # Each row's accepted path, then its sampled token, then draws from P until it has 3.
  emitted = np.zeros((n_rows, 3), np.int64)
  rows = np.arange(n_rows)
  conditional = np.cumsum(P[:V] / P[:V].sum(1, keepdims=True), axis=1)
  for j in range(3):
    on_path = j < n
    accepted = all_tokens[rows, path[:, np.minimum(j + 1, path.shape[1] - 1)]]
    drawn = np.minimum((rng.random(n_rows)[:, None] > conditional[emitted[:, j - 1]]).sum(1),
                       V - 1) if j else 0
    emitted[:, j] = np.where(on_path, accepted, np.where(j == n, token, drawn))
  counts = np.zeros((V, V, V))
  np.add.at(counts, tuple(emitted.T), 1)
  law = np.einsum('a,ab,bc->abc', P[V], P[:V], P[:V])
  assert g_test_pvalue(counts, law) > P_MIN
  assert np.mean((path > tree.depth).any(axis=1)) > 0.1  # Alternatives were accepted.


# --- SpS with alternatives --------------------------------------------------------------------

ROWS = 50_000


@pytest.mark.parametrize('sampling,draft_sampling,k', [
    (SamplingConfig(), None, 3),
    (SamplingConfig(temperature=0.9, top_p=0.8), GREEDY, 2),
    (SamplingConfig(top_p=0.9, repetition_penalty=1.5), None, 2)])
def test_sps_with_alternatives_samples_the_target_law(tiny_pair, sampling, draft_sampling, k):
  """50,000 rows, 3 tokens each, 2 alternatives per slot (sampled without replacement, or the
  greedy draft's next best as point masses; with a repetition penalty, each node's law reading
  its path), against the enumerated law; the tree accepts more drafts a loop than the chain.
  Power: detects at 80% any law within total variation 0.024 (temperature 1), 0.017 (top-p 0.8)
  or 0.020 (top-p 0.9 after the penalty) of it (`stats.detectable_tv`)."""
  target, draft = tiny_pair
  prompts = np.tile(np.array(PROMPT, np.int32), (ROWS, 1))
  lengths = np.full((ROWS,), len(PROMPT), np.int32)
  run = lambda drafter, rows=ROWS: speculative_sample(
      target, draft, prompts[:rows], lengths[:rows], jax.random.key(k), k=k, max_new_tokens=NEW,
      sampling=sampling, draft_sampling=draft_sampling, drafter=drafter)
  out = run(drafters.ModelDrafter(alternatives=2))
  pvalue = g_test_pvalue(sequence_counts(np.asarray(out.tokens), V_SMALL),
                         exact_sequence_law(target, PROMPT, NEW, sampling))
  assert pvalue > P_MIN, f'G-test p-value {pvalue:.2e}'
  chain = run(drafters.ModelDrafter(), ROWS // 10)
  per_loop = lambda o: float(np.sum(o.num_accepted)) / float(np.sum(o.num_loops))
  assert per_loop(out) > 1.3 * per_loop(chain)


def test_greedy_sps_with_trees_is_greedy_ars(tiny_pair):
  """Ragged prompts, an eos: greedy SpS gives ArS's tokens with 3 alternatives a slot (k = 1 and
  4; `Hybrid`'s lookup drafts at k = 3), with tree drafters of three shapes and with dynamic
  trees, one of each on a 4 x 2 mesh and one of each with both models packed for the native CPU
  kernels."""
  target, draft = tiny_pair
  packed = (models.pack(target), models.pack(draft))
  rng = np.random.default_rng(0)
  prompts = rng.integers(0, V_SMALL, (8, 4)).astype(np.int32)
  lengths = np.array([4, 3, 1, 4, 2, 4, 3, 1], np.int32)
  ars = autoregressive_sample(target, prompts, lengths, jax.random.key(0), max_new_tokens=9,
                              sampling=GREEDY, eos_id=5)
  mesh = mesh_from_axes(4, 2)
  for k, drafter, on in [(1, drafters.ModelDrafter(alternatives=3), None),
                         (4, drafters.ModelDrafter(alternatives=3), None),
                         (3, drafters.Hybrid(alternatives=3), None),
                         (2, drafters.ModelDrafter(alternatives=3), mesh),
                         (3, drafters.ModelDrafter(alternatives=2), packed),
                         (1, TreeDrafter((3,)), None), (4, TreeDrafter((1, 2, 2, 1)), None),
                         (2, TreeDrafter((2, 2)), mesh), (3, TreeDrafter((2, 2, 1)), packed),
                         (3, DynamicTreeDrafter(5, 2), None), (2, DynamicTreeDrafter(4, 2), mesh),
                         (4, DynamicTreeDrafter(6, 3), packed)]:
    models_on, mesh_on = (on, None) if isinstance(on, tuple) else ((target, draft), on)
    out = speculative_sample(*models_on, prompts, lengths, jax.random.key(0), k=k,
                             max_new_tokens=9, sampling=GREEDY, eos_id=5, drafter=drafter,
                             mesh=mesh_on)
    np.testing.assert_array_equal(out.tokens, ars.tokens, err_msg=f'k={k}, {drafter}, {on}')
    np.testing.assert_array_equal(out.num_generated, ars.num_generated)


def test_greedy_sps_with_trees_and_a_repetition_penalty_is_greedy_ars(pair):
  """Greedy after a penalty of 3 (which changes the tokens, so the check can fail): alternatives,
  a tree drafter and a dynamic tree give ArS's tokens, unpacked and with both models packed for the native CPU
  kernels; with draft == target the tree drafter's first child is accepted at every depth (its
  laws read each node's path as the target's do)."""
  target, draft = pair
  prompts, lengths = _ragged(3)
  penalised, ars = penalised_greedy_ars(target, prompts, lengths, 12)
  packed = lambda m: models.for_decoding(m)
  for t, d, drafter in ((target, draft, drafters.ModelDrafter(alternatives=2)),
                        (packed(target), packed(draft), drafters.ModelDrafter(alternatives=2)),
                        (target, draft, TreeDrafter((2, 2, 1))),
                        (packed(target), packed(draft), TreeDrafter((2, 1, 1))),
                        (packed(target), packed(draft), DynamicTreeDrafter(5, 2)),
                        (target, target, TreeDrafter((2, 2, 1)))):
    sps = speculative_sample(t, d, prompts, lengths, jax.random.key(1), k=3, max_new_tokens=12,
                             sampling=penalised, drafter=drafter)
    np.testing.assert_array_equal(sps.tokens, ars.tokens, err_msg=f'{drafter}')
    if d is target:
      np.testing.assert_array_equal(sps.num_accepted, 3 * np.asarray(sps.num_loops))


@pytest.mark.parametrize('context', ['penalty', 'ngrams_and_bias'])
def test_dynamic_trees_read_each_nodes_context_as_the_target(pair, context):
  """A dynamic tree drafted by the target itself under a greedy draft, after a repetition penalty
  of 3, or under no repeated 2-grams and a sequence bias (each changes ArS's tokens, so the check
  can fail): each node's law reads the committed tokens and its path as the target's does, so
  a chain (width 1) proposes the target's choices and every loop accepts k drafts; SpS gives
  ArS's tokens, also with every candidate of width 2 scored (which need not hold the greedy
  path: its second level's best two may both lie under the root's second child)."""
  target, _ = pair
  prompts, lengths = _ragged(3)
  if context == 'penalty':
    sampling, ars = penalised_greedy_ars(target, prompts, lengths, 12)
  else:
    sampling = SamplingConfig(temperature=0.0, no_repeat_ngram_size=2,
                              sequence_bias=(((7,), 2.5), ((3, 9), -4.0)))
    run = lambda s: autoregressive_sample(target, prompts, lengths, jax.random.key(0),
                                          max_new_tokens=12, sampling=s)
    ars = run(sampling)
    assert not np.array_equal(ars.tokens, run(GREEDY).tokens)
  k = 3
  for drafter in (DynamicTreeDrafter(k, 1), DynamicTreeDrafter(2 + (k - 1) * 4, 2)):
    sps = speculative_sample(target, target, prompts, lengths, jax.random.key(1), k=k,
                             max_new_tokens=12, sampling=sampling, drafter=drafter)
    np.testing.assert_array_equal(sps.tokens, ars.tokens, err_msg=f'{drafter}')
    if drafter.width == 1:
      np.testing.assert_array_equal(sps.num_accepted, k * np.asarray(sps.num_loops))


def test_alternatives_refuse_what_they_do_not_run_with(tiny_pair):
  target, draft = tiny_pair
  call = lambda t=target, **kw: speculative_sample(
      t, draft, np.zeros((1, 2), np.int32), np.array([2], np.int32), jax.random.key(0), k=2,
      max_new_tokens=4, drafter=kw.pop('drafter', drafters.ModelDrafter(alternatives=1)), **kw)
  with pytest.raises(ValueError, match='lenience'):
    call(lenience=0.5)
  with pytest.raises(ValueError, match='vocabulary'):
    call(drafter=drafters.ModelDrafter(alternatives=V_SMALL))
  with pytest.raises(ValueError, match='stop_below'):
    drafters.ModelDrafter(alternatives=1, stop_below=0.5)
  with pytest.raises(ValueError, match='alternatives'):
    drafters.ModelDrafter(alternatives=-1)


# --- A draft model drafting a full tree -------------------------------------------------------

@pytest.mark.parametrize('sampling,dynamic', [
    (SamplingConfig(), ''), (SamplingConfig(temperature=0.8, repetition_penalty=1.8), ''),
    (SamplingConfig(), 'sampled'),
    (SamplingConfig(temperature=0.8, repetition_penalty=1.8), 'sampled'),
    (SamplingConfig(), 'points')],
                         ids=['temperature_1', 'repetition_penalty', 'dynamic_temperature_1',
                              'dynamic_repetition_penalty', 'dynamic_greedy_draft'])
def test_sps_with_a_tree_drafter_samples_the_target_law(tiny_pair, sampling, dynamic):
  """50,000 rows, 3 tokens each, a draft drafting a tree of branching (2, 2) at temperature 1
  (or 0.8 after a repetition penalty of 1.8, which every node's law, the draft's and the
  target's, reads along its path), against the enumerated law (power: total variation 0.024 at
  80%, `stats.detectable_tv`); it accepts more drafts a loop than the chain of 2. `dynamic`: each row's own tree of 4
  nodes (`DynamicTreeDrafter`, width 2), its children drawn ('sampled'; the target's penalty
  along each row's paths) or, under a greedy draft, its top tokens as point masses ('points')."""
  target, draft = tiny_pair
  prompts = np.tile(np.array(PROMPT, np.int32), (ROWS, 1))
  lengths = np.full((ROWS,), len(PROMPT), np.int32)
  draft_sampling = GREEDY if dynamic == 'points' else None
  run = lambda drafter, rows=ROWS: speculative_sample(
      target, draft, prompts[:rows], lengths[:rows], jax.random.key(3), k=2, max_new_tokens=NEW,
      drafter=drafter, sampling=sampling, draft_sampling=draft_sampling)
  out = run(DynamicTreeDrafter(4, 2) if dynamic else TreeDrafter((2, 2)))
  pvalue = g_test_pvalue(sequence_counts(np.asarray(out.tokens), V_SMALL),
                         exact_sequence_law(target, PROMPT, NEW, sampling))
  assert pvalue > P_MIN, f'G-test p-value {pvalue:.2e}'
  if not dynamic:
    chain = run(drafters.ModelDrafter(), ROWS // 10)
    per_loop = lambda o: float(np.sum(o.num_accepted)) / float(np.sum(o.num_loops))
    assert per_loop(out) > 1.3 * per_loop(chain)


@pytest.mark.parametrize('drafter,packed', [(TreeDrafter((2, 2, 1)), False),
                                            (TreeDrafter((2, 2, 1)), True),
                                            (drafters.ModelDrafter(alternatives=2), False),
                                            (DynamicTreeDrafter(5, 2), False),
                                            (DynamicTreeDrafter(6, 2), True)],
                         ids=str)
def test_tree_caches_equal_fresh_prefill_after_every_loop(pair, drafter, packed):
  """Stepping the loop: after every loop the target cache holds exactly the committed tokens but
  the last and the draft cache at least all but the last two, slot for slot as a fresh prefill
  (the accepted path moved to its positions' slots), with every outcome of the tree seen; also
  with both models packed for the native CPU kernels."""
  target, draft = (models.pack(m) for m in pair) if packed else pair
  sampling = draft_sampling = SamplingConfig(temperature=1.5)
  if isinstance(drafter, DynamicTreeDrafter):  # Deep only where the draft is sure: the target
    draft, sampling = target, SamplingConfig(temperature=0.6)  # drafting sharper than it samples.
    draft_sampling = SamplingConfig(temperature=0.3)
  prompts, lengths = _ragged(5, batch=6)
  loop = speculative.Loop(k=3, max_new_tokens=14, sampling=sampling,
                          draft_sampling=draft_sampling, drafter=drafter)
  accepted = _run_checking_caches(target, draft, loop, prompts, lengths, jax.random.key(4))
  assert set(np.concatenate(accepted).tolist()) - {-1} == {0, 1, 2, 3}


def test_the_tree_drafter_refuses_what_it_does_not_run_with(tiny_pair):
  target, draft = tiny_pair
  call = lambda d=draft, k=2, drafter=TreeDrafter((2, 1)): speculative_sample(
      target, d, np.zeros((1, 2), np.int32), np.array([2], np.int32), jax.random.key(0), k=k,
      max_new_tokens=4, drafter=drafter)
  with pytest.raises(ValueError, match='k=2'):
    call(k=3)
  windowed = models.Model(dataclasses.replace(draft.config, sliding_window=2), draft.params)
  with pytest.raises(ValueError, match='sliding-window'):
    call(d=windowed)
  with pytest.raises(ValueError, match='more children'):
    call(drafter=TreeDrafter((V_SMALL + 1, 1)))
  with pytest.raises(ValueError, match='sliding-window'):
    call(d=windowed, drafter=DynamicTreeDrafter(4, 2))
  with pytest.raises(ValueError, match='more children'):
    call(drafter=DynamicTreeDrafter(4, V_SMALL + 1))
  with pytest.raises(ValueError, match='values 6 candidates: nodes=7'):
    call(drafter=DynamicTreeDrafter(7, 2))
  with pytest.raises(ValueError, match='lenience'):
    speculative_sample(target, draft, np.zeros((1, 2), np.int32), np.array([2], np.int32),
                       jax.random.key(0), k=2, max_new_tokens=4, lenience=0.5,
                       drafter=DynamicTreeDrafter(4, 2))
  assert drafter_config.build('tree', tree_nodes=5, tree_width=2) == DynamicTreeDrafter(5, 2)
  assert drafter_config.build('tree', branching='3+2') == TreeDrafter((3, 2))
  assert drafter_config.build('tree') == TreeDrafter()
  for kw in [dict(kind='model', branching='2'),
             dict(kind='tree', branching='2+x'), dict(kind='lookup', alternatives=1),
             dict(kind='model', tree_nodes=4), dict(kind='tree', tree_nodes=4, branching='2'),
             dict(kind='tree', tree_nodes=4, tree_width=0)]:
    with pytest.raises(ValueError):
      drafter_config.build(**kw)
