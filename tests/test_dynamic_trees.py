"""Dynamic trees (`sampling.dynamic_trees`): the grown tree against a numpy enumeration of
EAGLE-2's rule, the drafter's own tree it reads on, sampled children's laws, and the sizes it
refuses."""

import itertools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spsjax.sampling import SamplingConfig, dynamic_trees, ngrams
from spsjax.sampling.processors import mark_present
from spsjax.sharding import DEFAULT_RULES

V, R = 11, 97  # Vocabulary; rows of the draft's table of laws.


def _table(seed):
  return np.asarray(jax.nn.log_softmax(jax.random.normal(jax.random.key(seed), (R, V)) * 2.0))


def _key(path) -> int:
  """A path's (its tokens after the root's, in depth order) row of the table."""
  return sum((t + 1) * (V + 1) ** i for i, t in enumerate(path)) % R


def _reference(root_logp, table, nodes, width, k):
  """numpy, EAGLE-2's rule: the set of chosen paths (token tuples) of one row."""
  top = lambda logp: np.argsort(-logp, kind='stable')[:width]
  level = [((int(t),), float(root_logp[t])) for t in top(root_logp)]
  everything = list(level)
  for _ in range(1, k):
    expanded = sorted(level, key=lambda c: -c[1])[:width]
    level = [(path + (int(t),), value + float(table[_key(path)][t]))
             for path, value in expanded for t in top(table[_key(path)])]
    everything += level
  return {path for path, _ in sorted(everything, key=lambda c: -c[1])[:nodes]}


def _path_reader(table, B: int, width: int):
  """(read, read_tokens) for `dynamic_trees.grow`: each expanded node's draft logits are the
  table's row of its path, its path looked up from the drafter's own tree `read` is given;
  read_tokens collects the expanded nodes' tokens, level by level."""
  read_tokens = []

  def read(d, tokens_BxW, parents_BxW, tree):
    del parents_BxW
    read_tokens.append(tokens_BxW)
    tokens_BxE = jnp.concatenate([jnp.zeros((B, 1), jnp.int32)] + read_tokens, axis=1)
    first = 1 + (d - 1) * width
    on_path_BxWxE = tree.ancestors[:, first:first + width, :tokens_BxE.shape[1]]
    depths_BxE = tree.depths[:, :tokens_BxE.shape[1]]
    # Node n's key: sum over its path's nodes m > 0 of (token + 1) (V + 1)^(depth(m) - 1).
    weights_BxE = jnp.where(jnp.arange(tokens_BxE.shape[1])[None] > 0,
                            (tokens_BxE + 1) * (V + 1) ** jnp.maximum(depths_BxE - 1, 0), 0)
    keys_BxW = jnp.einsum('bwe,be->bw', on_path_BxWxE.astype(jnp.int32), weights_BxE) % R
    return jnp.asarray(table)[keys_BxW]

  return read, read_tokens


@pytest.mark.parametrize('nodes,width,k', [(7, 3, 3), (4, 2, 4), (1, 2, 2), (3, 3, 1)])
def test_the_tree_holds_the_best_paths_and_reads_its_own_tree(nodes, width, k):
  """Each row's chosen tree against the numpy enumeration (the draft's law a function of the
  path, looked up from the drafter's own tree as `read` is given it): the same paths, parents
  before children, every node's parent chosen; each node the drafter read maps to its node in
  the drafter's tree (every node with children among them)."""
  B = 4
  table = _table(0)
  root_logp_BxV = np.asarray(jax.nn.log_softmax(jax.random.normal(jax.random.key(1), (B, V))))
  read, read_tokens = _path_reader(table, B, width)

  tokens_BxN, valid_BxN, trees, expanded_BxNp1, _ = dynamic_trees.grow(
      nodes, width, k, jnp.asarray(root_logp_BxV), read)
  parents_BxN = np.asarray(trees.parents_BxN)
  assert np.all(np.asarray(valid_BxN)) and trees.depth == k and trees.width == width
  for b in range(B):
    paths = {0: ()}
    for i, parent in enumerate(parents_BxN[b], start=1):
      assert 0 <= parent < i
      paths[i] = paths[int(parent)] + (int(tokens_BxN[b, i - 1]),)
    assert set(list(paths.values())[1:]) == _reference(root_logp_BxV[b], table, nodes, width, k)
    assert len(set(paths.values())) == nodes + 1  # No path twice.
    for i, e in enumerate(np.asarray(expanded_BxNp1[b])):  # Read nodes: the drafter's node.
      if i and e:
        level, j = (e - 1) // width + 1, (e - 1) % width
        assert len(paths[i]) == level and int(read_tokens[level - 1][b, j]) == paths[i][-1]
      if i and i in parents_BxN[b]:
        assert e > 0, (b, i)
  children = np.asarray(trees.children)
  assert children.shape == (B, nodes + 1, width)


def test_the_expansion_tree_and_the_envelope():
  parents = [jnp.zeros((1, 2), jnp.int32), jnp.asarray([[1, 1]]), jnp.asarray([[0, 1]])]
  tree = dynamic_trees.expansion_tree(parents, 5, 2)
  np.testing.assert_array_equal(tree.parents_BxN, [[0, 0, 2, 2, 3, 4, 0, 0]])
  envelope = dynamic_trees.envelope(6, 3)
  assert envelope.num_nodes == 6 and envelope.depth == 3
  assert dynamic_trees.envelope(2, 3).parents == (0, 1)
  assert dynamic_trees.num_candidates(3, 2) == 10


def test_sizes_are_checked():
  for nodes, width in itertools.product((0, 2), (0, 2)):
    if nodes and width:
      continue
    with pytest.raises(ValueError, match='nodes >= 1 and width >= 1'):
      dynamic_trees.check_sizes(nodes, width)
  with pytest.raises(ValueError, match='values 6 candidates'):
    dynamic_trees.check_sizes(7, 2, 2)


@pytest.mark.parametrize('in_context', [False, True])
def test_sampled_children_keep_a_prefix_of_each_nodes_draws_with_their_laws(in_context):
  """A sampled draft (`sampled_children`, temperature 1): each chosen node's law is its parent's
  draft law (looked up by the parent's path, so every chosen node's parent is chosen) without
  the tokens of its chosen earlier siblings, renormalised: each node's chosen children are the
  first of its draws, in order, and distinct. `in_context`: the parent's law read after the
  committed tokens and its path (`Context`): every token biased after its predecessor, a token
  banned, then a repetition penalty on the tokens present."""
  B, width, k, nodes = 4, 3, 3, 7
  table = _table(2)
  sampling = SamplingConfig()
  committed_BxS = np.asarray([[1, 2, 3], [4, 4, 0], [7, 8, 9], [10, 2, 6]], np.int32)
  context = None
  if in_context:
    sampling = SamplingConfig(repetition_penalty=1.7, sequence_bias=tuple(
        ((a, (a + 1) % V), 2.0) for a in range(V)) + (((5,), float('-inf')),))
    lengths_B = jnp.full((B,), committed_BxS.shape[1], jnp.int32)
    history = ngrams.History.of(sampling, jnp.asarray(committed_BxS), lengths_B, lengths_B, V)
    present_BxV = mark_present(jnp.zeros((B, V), bool), jnp.asarray(committed_BxS))
    context = dynamic_trees.Context(sampling, history, present_BxV)
  loop = types.SimpleNamespace(draft_sampling=sampling, mesh=None, rules=DEFAULT_RULES,
                               native_kernel=False)
  keys_BxK = jax.random.split(jax.random.key(5), (B, k))
  root_logits_BxV = jnp.asarray(table[:B])  # Row b's root law: table row b.
  read, _ = _path_reader(table, B, width)

  grown = dynamic_trees.grow(nodes, width, k, root_logits_BxV, read,
                             dynamic_trees.sampled_children(loop, keys_BxK, width, context))
  parents_BxN, tokens_BxN = np.asarray(grown.trees.parents_BxN), np.asarray(grown.tokens_BxN)
  q_BxNxV = np.asarray(grown.q_BxNxV)
  assert np.all(np.asarray(grown.valid_BxN))

  def law(b, path):  # The draft's law after row b's committed tokens and `path`.
    logits = np.array(table[_key(path)] if path else table[b], np.float64)
    if in_context:
      sequence = list(committed_BxS[b]) + list(path)
      logits[(sequence[-1] + 1) % V] += 2.0
      logits[5] = -np.inf
      for t in set(sequence):
        logits[t] = logits[t] * 1.7 if logits[t] < 0 else logits[t] / 1.7
    return np.exp(logits - logits.max())

  for b in range(B):
    paths, earlier = {0: ()}, {}
    for i, parent in enumerate(parents_BxN[b], start=1):
      parent = int(parent)
      paths[i] = paths[parent] + (int(tokens_BxN[b, i - 1]),)
      q = law(b, paths[parent])
      q[earlier.setdefault(parent, [])] = 0.0
      np.testing.assert_allclose(q_BxNxV[b, i - 1], q / q.sum(), rtol=1e-5, atol=1e-7,
                                 err_msg=f'row {b}, node {i}')
      assert paths[i][-1] not in earlier[parent]
      earlier[parent].append(paths[i][-1])
