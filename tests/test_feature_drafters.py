"""Drafters that read the target's hidden states (`sampling.feature_drafters`, issue 43): the
heads' cached and uncached forwards agree, each loop's drafts are drawn from the laws the head
gives on the target's true features (with alternatives too: the features of the accepted path),
exact output law (G-tests against enumeration) and greedy parity with ArS, chains and trees of
drafts, and clear errors for heads that do not fit."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spsjax import models, native, sharding
from spsjax.models import feature_head
from spsjax.sampling import (SamplingConfig, autoregressive_sample, drafter_config, drafters,
                             probabilities, speculative, speculative_sample)
from spsjax.sampling.feature_drafters import (FalconDrafter, FeatureDrafter,
                                              FeatureDynamicDrafter, FeatureTreeDrafter,
                                              HeadsDrafter, HeadsTreeDrafter, MlpDrafter,
                                              MlpTreeDrafter)
from tests import forwards
from tests.stats import scaled_model
from tests.test_drafters import check_unrolled_drafts
from tests.test_speculative import check_interleaved_law, interleaved

GREEDY = SamplingConfig(temperature=0.0)
P_MIN = 1e-5  # Each G-test fails a correct sampler with this probability.
DRAFTERS = {'feature': FeatureDrafter(), 'heads': HeadsDrafter(), 'mlp': MlpDrafter(),
            'falcon': FalconDrafter()}


def _drafter(kind: str, variant, k: int):
  """The `kind` drafter as a chain (variant 0), with that many alternatives (an int), drafting
  a full tree of depth k ('tree': 2 children a node, then 1), or the EAGLE head growing each
  row's own tree ('dynamic': k + 2 nodes, width 2)."""
  if variant == 'dynamic':
    assert kind == 'feature'
    return FeatureDynamicDrafter(nodes=k + 2, width=2)
  if variant == 'tree':
    tree_drafter = {'feature': FeatureTreeDrafter, 'heads': HeadsTreeDrafter,
                    'mlp': MlpTreeDrafter}[kind]
    return tree_drafter(branching=(2,) * min(k, 2) + (1,) * (k - 2))
  return dataclasses.replace(DRAFTERS[kind], alternatives=variant)


TAPS = (0, 1, 2)  # An EAGLE-3 head's taps of the 2-layer targets: embedding, middle, last output.


def _head(target: models.Model, kind: str, layers: int, seed: int,
          scale: float = 1.0, taps: tuple[int, ...] = (), vocab: tuple[int, ...] = ()
          ) -> models.Model:
  """A random head for `target` (reading its residual stream at `taps`, EAGLE-3's; drafting
  the tokens `vocab` from its own output layer, EAGLE-3's draft vocabulary), its fused input
  scaled (an MLP speculator: each stage's output product; a Falcon head, of 2 drafts a pass:
  its first cell's product; sharper, less uniform drafts)."""
  config = feature_head.head_config(target.config, layers, taps, len(vocab),
                                    drafts_per_pass=2 if kind == 'falcon' else 1)
  params = feature_head.init_head(kind, config, jax.random.key(seed))
  if kind == 'mlp':
    params = {name: dict(p, out=p['out'] * scale) if name.startswith('stage_') else p
              for name, p in params.items()}
  elif kind == 'falcon':
    params = dict(params, cells=dict(params['cells'], cell_0=params['cells']['cell_0'] * scale))
  else:
    params = dict(params, fuse=dict(params['fuse'], fuse=params['fuse']['fuse'] * scale))
  head = models.Model(config, params)
  return feature_head.with_draft_vocab(head, vocab) if vocab else head


@pytest.fixture(scope='module')
def pair48():
  config = models.TransformerConfig(vocab_size=48, d_model=32, num_layers=2, num_heads=4,
                                    num_kv_heads=2, d_ff=64, max_seq_len=64)
  return models.Model(config, models.init_params(config, jax.random.key(0)))


def _ragged(seed, batch=5, width=7, vocab=48):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, width + 1, size=batch).astype(np.int32)
  prompts = rng.integers(0, vocab, size=(batch, width)).astype(np.int32)
  return prompts, lengths


@pytest.mark.parametrize('packed,taps', [(False, ()), ('float32', ()), ('int8', ()),
                                          (False, TAPS), ('float32', TAPS)])
def test_cached_head_equals_its_full_forward(pair48, packed, taps):
  """`extend_head` in two calls at ragged offsets == `feature_head_forward` over the whole
  sequence, with the target packed for the native kernels or not (the head reads its embedding
  and output layer either way). A head packed in int8 beside its target drafts through its own
  int8 copy of the target's output layer: the reference is the XLA head with its quantized
  weights over a target whose output layer is that copy. A head of `taps` reads the target's
  taps side by side, or its own predictions (a third call, against the full forward over its
  stream, `feature_head.stream`, then those)."""
  target = models.for_decoding(pair48) if packed else pair48
  head = _head(pair48, 'feature', 2, 1, taps=taps)
  head_run = models.for_decoding(head, packed, target) if packed else head
  assert models.is_packed(head_run) == bool(packed)
  assert ('output' in head_run.params) == (packed == 'int8')
  ref_head, ref_target = head, pair48
  if packed == 'int8':
    copy = head_run.params['output']
    assert copy.panels_PxIxC.dtype == jnp.int8 and copy.tied_to == 'target'
    assert models.num_params(head_run.params) == models.num_params(head.params)
    ref_head = models.unpack(head_run)
    assert 'output' not in ref_head.params
    ref_target = models.Model(dataclasses.replace(pair48.config, tie_embeddings=False),
                              dict(pair48.params, head=native.unpack(copy)))
    assert not np.allclose(native.unpack(copy), pair48.params['embedding'].T, atol=1e-4)
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, 48, size=(3, 9)), jnp.int32)
  features = jnp.asarray(rng.normal(size=(3, 9, 32 * max(len(taps), 1))), jnp.float32)
  want_logits, want_features = _head_forward(ref_head, ref_target, features, tokens)
  cache = models.init_cache(head.config, 3, 14)
  extend_head = jax.jit(feature_head.extend_head)
  _, got_a, cache = extend_head(head_run, target, cache, features[:, :4], tokens[:, :4])
  got_logits, got_b, cache = extend_head(
      head_run, target, cache, features[:, 4:], tokens[:, 4:],
      logits_at_BxL=jnp.array([[0, 4]] * 3, jnp.int32))
  np.testing.assert_allclose(np.concatenate([got_a, got_b], 1), want_features, rtol=2e-4,
                             atol=2e-4)
  np.testing.assert_allclose(got_logits, np.asarray(want_logits)[:, [4, 8]], rtol=2e-4,
                             atol=2e-4)
  if taps:  # Two more pairs, of its own predictions.
    stream = np.concatenate([feature_head.stream(ref_head, features), got_b[:, -2:]], axis=1)
    more = tokens[:, -2:]
    _, want_more = _head_forward(ref_head, ref_target, jnp.asarray(stream),
                                 jnp.concatenate([tokens, more], axis=1))
    _, got_c, _ = extend_head(head_run, target, cache, got_b[:, -2:], more)
    np.testing.assert_allclose(got_c, want_more[:, 9:], rtol=2e-4, atol=2e-4)


_head_forward = jax.jit(feature_head.feature_head_forward, static_argnames='in_draft_vocab')


@pytest.mark.parametrize('packed', [False, 'float32', 'bfloat16'])
def test_a_falcon_heads_blocks_see_ahead_and_its_cache_agrees(pair48, packed):
  """A Falcon head of 2 drafts a pass and 2 layers: over a whole sequence each pair sees its
  training block's pairs (pair 0 changes with pair 1's token, pair 1 not with pair 2's, pair 2
  with pair 3's), or with `block_ends`' `ahead` the next pair whatever its block (pairs 1 and 7
  then change with pairs 2 and 8); `extend_head` in two calls at ragged offsets, each pair
  told what it sees, gives the whole forward's features and logits (the target and head packed
  for the native kernels too, whose attention is then XLA's; the bfloat16 head against its
  rounded weights unpacked)."""
  target = models.for_decoding(pair48) if packed else pair48
  head = _head(pair48, 'falcon', 2, 1)
  head_run = models.for_decoding(head, packed) if packed else head
  ref_head = models.unpack(head_run) if packed else head
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, 48, size=(3, 9)), jnp.int32)
  features = jnp.asarray(rng.normal(size=(3, 9, 32)), jnp.float32)
  _, want = _head_forward(ref_head, pair48, features, tokens)
  for ahead in (False, True):
    sees = feature_head.block_ends(9, 2, ahead)
    _, base = _head_forward(ref_head, pair48, features, tokens, sees_T=sees)
    for t, moved in ((0, True), (1, ahead), (2, True), (6, True), (7, ahead)):
      other = tokens.at[:, t + 1].set((tokens[:, t + 1] + 1) % 48)
      _, changed = _head_forward(ref_head, pair48, features, other, sees_T=sees)
      assert np.allclose(changed[:, :t + 1], base[:, :t + 1], atol=1e-6) != moved, (t, ahead)
  sees_BxT = jnp.broadcast_to(feature_head.block_ends(9, 2), (3, 9))
  cache = models.init_cache(head.config, 3, 14)
  extend_head = jax.jit(feature_head.extend_head)
  _, got_a, cache = extend_head(head_run, target, cache, features[:, :4], tokens[:, :4],
                                sees_BxT=sees_BxT[:, :4])
  got_logits, got_b, cache = extend_head(
      head_run, target, cache, features[:, 4:], tokens[:, 4:],
      logits_at_BxL=jnp.array([[0, 4]] * 3, jnp.int32), sees_BxT=sees_BxT[:, 4:])
  np.testing.assert_allclose(np.concatenate([got_a, got_b], 1), want, rtol=2e-4, atol=2e-4)
  want_logits, _ = _head_forward(ref_head, pair48, features, tokens)
  np.testing.assert_allclose(got_logits, np.asarray(want_logits)[:, [4, 8]], rtol=2e-4,
                             atol=2e-4)


def test_an_mlp_speculator_stage_updates_its_state_as_ibms_does(pair48):
  """Stages by numpy: s_0 = the features RMS-normed; s_{i+1} = GELU(norm(a s_i P_i + b
  norm(e(x_i)))), a = 0.5^(0.5 / n), b = sqrt(1 - a^2) for n = 3 stages; stage i's features
  s_{i+1} O_i through the target's output layer; stage by stage as drafting runs them too."""
  head = _head(pair48, 'mlp', 3, 5, scale=2.0)
  rng = np.random.default_rng(3)
  f_2xD = rng.normal(size=(2, 32)).astype(np.float32)
  tokens_2x3 = rng.integers(0, 48, size=(2, 3)).astype(np.int32)
  rms = lambda x, g: x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6) * np.asarray(g)
  gelu = lambda x: np.asarray(jax.nn.gelu(jnp.asarray(x)))
  P = head.params
  a = 0.5**(0.5 / 3)
  state = rms(f_2xD.astype(np.float64), P['input_norm']['scale'])
  logits, _ = feature_head.mlp_speculator(head, pair48, jnp.asarray(f_2xD),
                                          jnp.asarray(tokens_2x3))
  state_run = feature_head.speculator_state(head, jnp.asarray(f_2xD))
  for i in range(3):
    stage = P[f'stage_{i}']
    e = np.asarray(pair48.params['embedding'])[tokens_2x3[:, i]]
    mixed = a * state @ np.asarray(stage['proj']) + np.sqrt(1 - a * a) * rms(
        e, stage['token_norm']['scale'])
    state = gelu(rms(mixed, stage['norm']['scale']))
    want = models.output_logits(pair48.config, pair48.params,
                                jnp.asarray((state @ np.asarray(stage['out']))[:, None],
                                            jnp.float32))[:, 0]
    np.testing.assert_allclose(logits[:, i], want, rtol=1e-4, atol=1e-4)
    got, state_run = feature_head.speculator_stage(head, pair48, i, state_run,
                                                   jnp.asarray(tokens_2x3[:, i]))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize('kind', ['feature', 'heads'])
def test_a_draft_vocabulary_is_drafted_from_the_heads_own_output_layer(pair48, kind):
  """A head with a draft vocabulary of 16 of the 48 tokens: its logits are its predicted
  features RMS-normed, through its own [D, 16] product (numpy, from the features it predicts),
  at those tokens, -inf at the others; packed (float32, int8) its cached calls give them (int8:
  its own output layer quantized, no copy of the target's); bad vocabularies are refused."""
  vocab = tuple(int(t) for t in np.sort(np.random.default_rng(1).choice(48, 16, replace=False)))
  head = _head(pair48, kind, 1 if kind in ('feature', 'falcon') else 2, 1, vocab=vocab)
  rng = np.random.default_rng(2)
  tokens = jnp.asarray(rng.integers(0, 48, size=(2, 5)), jnp.int32)
  features = jnp.asarray(rng.normal(size=(2, 5, 32)), jnp.float32)

  def want(predicted, own):
    x = np.asarray(predicted, np.float64)
    x = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6) * np.asarray(
        own['norm']['scale'])
    out = np.full(x.shape[:-1] + (48,), -np.inf)
    w_DxVd = own['output']
    if isinstance(w_DxVd, native.PackedWeight):
      w_DxVd = native.unpack(w_DxVd)
    out[..., vocab] = x @ np.asarray(w_DxVd, np.float64)
    return out

  def close(got, want_):
    assert np.array_equal(np.isinf(np.asarray(got)), np.isinf(want_))
    np.testing.assert_allclose(np.where(np.isinf(want_), 0, got), np.where(np.isinf(want_), 0,
                                                                           want_), atol=2e-4)
  if kind == 'heads':
    logits, predicted = feature_head.parallel_heads(head, pair48, features[:, 0], tokens[:, 0])
    close(logits, want(predicted, head.params['draft_vocab']))
    own, _ = feature_head.parallel_heads(head, pair48, features[:, 0], tokens[:, 0],
                                         in_draft_vocab=True)
    np.testing.assert_array_equal(own, np.asarray(logits)[..., vocab])
    return
  logits, predicted = _head_forward(head, pair48, features, tokens)
  close(logits, want(predicted, head.params['draft_vocab']))
  own, _ = _head_forward(head, pair48, features, tokens, in_draft_vocab=True)
  np.testing.assert_array_equal(own, np.asarray(logits)[..., vocab])
  for weights in ('float32', 'int8'):
    target = models.for_decoding(pair48)
    head_run = models.for_decoding(head, weights, target)
    assert 'output' not in head_run.params
    assert head_run.params['draft_vocab']['output'].panels_PxIxC.dtype == (
        jnp.int8 if weights == 'int8' else jnp.float32)
    assert models.num_params(head_run.params) == models.num_params(head.params)
    reference = models.unpack(head_run)  # Its weights as the packed products read them.
    _, predicted = _head_forward(reference, pair48, features, tokens)
    cache = models.init_cache(head.config, 2, 8)
    got, _, _ = jax.jit(feature_head.extend_head)(head_run, target, cache, features, tokens)
    close(got, want(predicted, head_run.params['draft_vocab']))
  for bad in (vocab[:-1], vocab[:-1] + (vocab[0],), vocab[:-1] + (48,)):
    with pytest.raises(ValueError, match='drafts as many distinct tokens in'):
      feature_head.with_draft_vocab(head, bad)
  with pytest.raises(ValueError, match='draft_vocab_size must be in'):
    feature_head.head_config(pair48.config, 1, (), 49)


def _padded(rows, width=forwards.WIDTH - 1) -> jax.Array:
  """`rows` (a sequence of tokens, or of feature vectors) as one batch row of `width` positions,
  zeros after them: the reference forwards are causal, so the positions of `rows` never see the
  padding, and one program serves every length."""
  rows = np.asarray(rows)
  out = np.zeros((1, width, *rows.shape[1:]), rows.dtype)
  out[0, :len(rows)] = rows
  return jnp.asarray(out)


def _reference_laws(target, head, kind, seq, k, sampling):
  """The laws a loop's k drafts come from after committed tokens `seq`, from uncached forwards
  over the target's true features: the EAGLE head's first two (the second after the first draft,
  with the head's own prediction at the last position as one more pair), or all k parallel
  heads'. Returns, for the EAGLE head, a function of the drafts before a slot (one or more) giving
  that slot's law (the head fed its own prediction and the draft at each). A repetition penalty
  reads `seq` (and, after drafts, them too)."""
  features_CxD = forwards.features(target, seq, feature_head.reads(head))
  c = len(seq)

  def law(logits_1xV, drafts=()):
    present_1xV = np.zeros(logits_1xV.shape, bool)
    present_1xV[0, list(seq) + list(drafts)] = True
    return np.asarray(probabilities(logits_1xV, sampling, present_xV=jnp.asarray(present_1xV)))[0]
  if kind == 'heads':
    logits, _ = feature_head.parallel_heads(head, target, jnp.asarray(features_CxD[None, c - 2]),
                                            jnp.asarray(seq[-1:], jnp.int32), num=k)
    return [law(logits[:, i]) for i in range(k)]
  if kind == 'mlp':  # Stage i after the last committed token and drafts 0 .. i - 1.
    def stage(*drafts):
      inputs = np.concatenate([seq[-1:], drafts]).astype(np.int32)
      logits, _ = feature_head.mlp_speculator(
          head, target, jnp.asarray(features_CxD[None, c - 2]), jnp.asarray(inputs[None]))
      return law(logits[:, len(drafts)], drafts)
    return stage(), stage
  if kind == 'falcon':  # Slots 0, 1: pairs c - 3, c - 2 (a block seeing c - 2); 2, 3: then
    # the block of their predictions with drafts 0, 1 at c - 1, c (seeing c).
    pairs, tokens = _padded(features_CxD[:c - 1]), _padded(seq[1:].astype(np.int32))
    sees = np.arange(pairs.shape[1], dtype=np.int32)
    block = [max(c - 3, 0), c - 2]  # One pending pair (a prompt of one token): it twice.
    sees[block] = c - 2
    logits, predicted = _head_forward(head, target, pairs, tokens, sees_T=jnp.asarray(sees))

    def falcon(*drafts):  # Slot 1 after no draft; slot 2 after drafts 0 and 1.
      if not drafts:
        return law(logits[:, block[1]])
      pairs_ = np.concatenate([features_CxD[:c - 1], np.asarray(predicted)[0, block]])
      tokens_ = np.concatenate([seq[1:], drafts]).astype(np.int32)
      sees_ = np.arange(pairs.shape[1], dtype=np.int32)
      sees_[block] = c - 2
      sees_[[c - 1, c]] = c
      logits_, _ = _head_forward(head, target, _padded(pairs_), _padded(tokens_),
                                 sees_T=jnp.asarray(sees_))
      return law(logits_[:, c - 1], drafts)
    return law(logits[:, block[0]]), falcon
  logits, predicted = _head_forward(head, target, _padded(features_CxD[:c - 1]),
                                    _padded(seq[1:].astype(np.int32)))

  def after(*drafts):  # The head's stream (a taps head's taps projected), then its own.
    pairs = np.asarray(feature_head.stream(head, jnp.asarray(features_CxD[None, :c - 1])))[0]
    tokens, predicted_ = seq[1:], np.asarray(predicted)[0]
    for i, draft in enumerate(drafts):  # Pair c - 2 + i + 1: the last prediction, the draft.
      pairs = np.concatenate([pairs, predicted_[c - 2 + i:c - 1 + i]])
      tokens = np.append(tokens, draft).astype(np.int32)
      logits_, predicted_ = _head_forward(head, target, _padded(pairs), _padded(tokens))
      predicted_ = np.asarray(predicted_)[0]
    return law(logits_[:, c - 2 + len(drafts)], drafts)

  return law(logits[:, c - 2]), after


@pytest.mark.parametrize('kind,packed,variant', [
    ('feature', False, 0), ('feature', True, 0), ('heads', True, 0), ('feature', True, 2),
    ('heads', False, 2), ('feature', True, 'tree'), ('heads', True, 'tree'),
    ('feature', True, 'penalty'), ('feature', False, 'taps'), ('feature', True, 'taps'),
    ('mlp', False, 2), ('mlp', True, 'tree'), ('falcon', False, 0), ('falcon', True, 0)])
def test_each_loops_drafts_come_from_the_head_on_the_targets_features(pair48, kind, packed,
                                                                      variant):
  """Stepping the loop (ragged prompts, 3 loops, k = 3): before each loop, the proposal's laws
  are the head's on the target's features of the committed tokens (full forwards, no cache):
  slot 0 (after the pairs the last loop verified) and slot 1 (after the head read its own
  prediction and draft 0) for the EAGLE head, every slot for the parallel heads. With
  alternatives the chain's slots are the tree's first nodes, and after a loop that accepted an
  alternative the head reads the features of the accepted path's nodes; the EAGLE head drafting
  a tree (2, 2, 1): node 1 from the root's law, node 3 from node 1's (read on the tree); the
  parallel heads drafting it: every node at depth d from head d's law. 'penalty': the chain
  after a repetition penalty of 1.8, each slot's law reading the committed tokens and the
  drafts before it as present. 'taps': the chain of an EAGLE-3 head reading the target's taps.
  An MLP speculator: slot i from stage i after the last committed token and drafts 0 .. i - 1
  (with alternatives too: the chain's slots); drafting the tree, a node at depth d from stage d
  - 1 after its path, as the EAGLE head's nodes. A Falcon head: slots 0 and 1 from the block of
  the last two true pairs, slot 2 from the block of their predictions and drafts 0 and 1."""
  target = models.for_decoding(pair48) if packed else pair48
  head = _head(pair48, kind, 1 if kind in ('feature', 'falcon') else 3, 2, scale=3.0,
               taps=TAPS if variant == 'taps' else ())
  head_run = models.for_decoding(head) if packed else head
  k, sampling = 3, SamplingConfig(temperature=0.8)
  if variant == 'penalty':
    sampling, variant = dataclasses.replace(sampling, repetition_penalty=1.8), 0
  variant = 0 if variant == 'taps' else variant
  drafter = _drafter(kind, variant, k)
  # Slot 1's law after draft 0; in the tree (2, 2, 1), node 3 (slot 2) after node 1 and nodes
  # 7 .. 10 (slots 6 .. 9) after their grandparent (1, 1, 2, 2) and parent (3, 4, 5, 6).
  paths = {1: (0,)} if variant != 'tree' else {2: (0,), 6: (0, 2), 7: (0, 3), 8: (1, 4),
                                                9: (1, 5)}
  if kind == 'mlp' and variant != 'tree':
    paths = {1: (0,), 2: (0, 1)}
  if kind == 'falcon':
    paths = {1: (), 2: (0, 1)}
  prompts, lengths = _ragged(3)
  loop, args = speculative.prepare(target, head_run, prompts, lengths, k=k, max_new_tokens=20,
                                   sampling=sampling, drafter=drafter)
  state, body = jax.jit(loop.init)(*args, jax.random.key(0)), jax.jit(loop.body)
  propose = jax.jit(lambda target, head, state, committed, keys: drafter.propose(
      loop, drafter.bind(target, head), state, committed, keys))
  for _ in range(3):
    committed = drafters.Committed(args[2], args[3], state.tokens_BxW, state.num_generated_B,
                                   48, ~state.done_B, state.present_BxV)
    keys = jax.random.split(jax.random.key(5), (len(lengths), k))
    proposal, _ = propose(target, head_run, state.draft_state, committed, keys)
    q = np.asarray(proposal.q_BxKxV)
    for b in range(len(lengths)):
      seq = np.concatenate([prompts[b, :lengths[b]],
                            np.asarray(state.tokens_BxW)[b, :state.num_generated_B[b]]])
      if kind == 'heads':  # Chain slot i, or in the tree the first children at depth i + 1.
        slots = [[0], [2, 4], [6, 7, 8, 9]] if variant == 'tree' else [[0], [1], [2]]
        wants = _reference_laws(pair48, head, kind, seq, k, sampling)
        for i, want in enumerate(wants):
          for slot in slots[i]:
            np.testing.assert_allclose(q[b, slot], want, rtol=1e-4, atol=1e-5)
        if variant == 'tree':  # Node 2: head 0's law without node 1's token.
          rest = np.where(np.arange(48) == int(proposal.tokens_BxK[b, 0]), 0.0, wants[0])
          np.testing.assert_allclose(q[b, 1], rest / rest.sum(), rtol=1e-4, atol=1e-5)
        continue
      want0, after = _reference_laws(pair48, head, kind, seq, k, sampling)
      np.testing.assert_allclose(q[b, 0], want0, rtol=1e-4, atol=1e-5)
      tokens = np.asarray(proposal.tokens_BxK)[b]
      for slot, path in paths.items():
        np.testing.assert_allclose(q[b, slot], after(*tokens[list(path)]), rtol=1e-4,
                                   atol=1e-5, err_msg=f'slot {slot}')
    state = body(*args, state)
  assert int(np.sum(state.num_accepted_B)) > 0  # Loops after accepted drafts were compared too.


@pytest.mark.parametrize('kind', ['feature', 'heads'])
def test_heads_draft_a_chain_under_the_context_rules(pair48, kind):
  """A head's chain is drafted after the draft sampling's n-gram ban and bans by position, as a
  model drafter's: q at a slot is the head's law without the tokens banned there (after the
  committed tokens and the drafts before it), renormalised, and no draft is banned. The
  parallel heads' laws come from one pass, so every slot is set against the same call without
  the rules; the EAGLE head's first slot (its later ones read drafts that differ)."""
  head = _head(pair48, kind, 1 if kind in ('feature', 'falcon') else 3, 2, scale=3.0)
  k, plain = 3, SamplingConfig(temperature=0.8)
  # Every token of the context banned (1-grams: the drafts before a slot too), and a third of
  # the vocabulary at the first three new tokens (the prefill gave the first: slots 0 and 1).
  ruled = dataclasses.replace(plain, no_repeat_ngram_size=1,
                              ban_before_new=((tuple(range(0, 48, 3)), 3),))
  prompts, lengths = _ragged(3)
  drafter = _drafter(kind, 0, k)
  got, state = {}, None
  for sampling in (plain, ruled):  # Both from the state after the same first token.
    loop, args = speculative.prepare(pair48, head, prompts, lengths, k=k, max_new_tokens=20,
                                     sampling=sampling, drafter=drafter)
    state = state or jax.jit(loop.init)(*args, jax.random.key(0))
    committed = drafters.Committed(args[2], args[3], state.tokens_BxW, state.num_generated_B,
                                   48, ~state.done_B)
    keys = jax.random.split(jax.random.key(5), (len(lengths), k))
    proposal, _ = drafter.propose(loop, drafter.bind(pair48, head), state.draft_state,
                                  committed, keys)
    got[sampling] = (np.asarray(proposal.q_BxKxV), np.asarray(proposal.tokens_BxK), committed)
  (q_plain, _, _), (q, tokens, committed) = got[plain], got[ruled]
  allowed = np.asarray(committed.history(ruled).along_chain(jnp.asarray(tokens), k)) == 0
  banned = (~allowed).sum(-1)
  assert banned[:, :2].min() > 16 and np.all(banned[:, 2] < banned[:, 1])
  for i in range(k if kind == 'heads' else 1):
    want = q_plain[:, i] * allowed[:, i]
    np.testing.assert_allclose(q[:, i], want / want.sum(-1, keepdims=True), rtol=1e-5,
                               atol=1e-6, err_msg=f'slot {i}')
  assert np.take_along_axis(allowed, tokens[..., None], -1).all()  # No draft is banned.
  assert np.all(np.take_along_axis(q, tokens[..., None], -1) > 0)


# --- Exactness ----------------------------------------------------------------------------------

V_SMALL, RAGGED_PROMPTS, NEW_LONG, ROWS = 7, ((1, 4, 2), (5,)), 5, 100_000


@pytest.fixture(scope='module')
def tiny_target():
  return scaled_model(models.TransformerConfig(
      vocab_size=V_SMALL, d_model=16, num_layers=2, num_heads=2, d_ff=32, max_seq_len=16,
      tie_embeddings=False), 0, 1.5)


@pytest.mark.parametrize('kind,setting,k,packed,variant', [
    ('feature', 'top_p_0.8', 2, True, 0), ('heads', 'top_p_0.8', 3, True, 0),
    ('feature', 'temperature_1', 2, True, 2), ('heads', 'top_p_0.8', 2, True, 1),
    ('feature', 'top_p_0.8', 2, True, 'tree'), ('heads', 'temperature_1', 2, True, 'tree'),
    ('feature', 'temperature_1', 2, True, 'dynamic'), ('feature', 'top_p_0.8', 3, False,
                                                       'dynamic'),
    ('feature', 'top_p_0.8', 2, True, 'taps'), ('feature', 'temperature_1', 3, True, 'vocab'),
    # (The EAGLE chain at temperature 1, k = 3: the 'vocab' row; the heads' there: the tree.)
    ('mlp', 'top_p_0.8', 3, True, 0), ('falcon', 'temperature_1', 3, True, 0)])
def test_output_law_is_target_law(tiny_target, kind, setting, k, packed, variant):
  """5 tokens per row after two prompts of different lengths interleaved in one batch (rows accept
  different numbers of drafts in the same loops; the law covers the bonus token and a second
  loop), against each prompt's enumerated joint law of the target; with alternatives, or the heads
  drafting a tree (2, 2), a tree of drafts; the EAGLE head growing each row's own tree (point
  masses); an EAGLE-3 head (reading the target's taps) drafting a chain; a head drafting 4 of
  the 7 tokens (its draft vocabulary: the others never proposed, drawn from the residual only);
  an MLP speculator's chain; a Falcon head's chain of two passes (2 drafts, then 1).
  Power: 50,000 rows per
  prompt detect at 80% any law within total variation 0.035 (temperature 1) or 0.028 (top-p
  0.8) of the target's (`stats.detectable_tv`)."""
  sampling = {'temperature_1': SamplingConfig(), 'top_p_0.8': SamplingConfig(top_p=0.8)}[setting]
  head = _head(tiny_target, kind, 1 if kind in ('feature', 'falcon') else 3, 4, scale=2.0,
               taps=TAPS if variant == 'taps' else (),
               vocab=(0, 2, 3, 5) if variant == 'vocab' else ())
  variant = 0 if variant in ('taps', 'vocab') else variant
  target, head = tiny_target, head
  if packed:  # The head in w8a8 (the drafts' default), through its own copy of the output layer.
    target = models.for_decoding(tiny_target)
    head = models.for_decoding(head, 'w8a8', target)
    assert ('output' in head.params) != bool(head.config.draft_vocab_size)
  assert models.is_packed(target) == packed == models.is_packed(head)
  prompts, lengths = interleaved(RAGGED_PROMPTS, ROWS)
  out = speculative_sample(target, head, prompts, lengths, jax.random.key(30 + k), k=k,
                           max_new_tokens=NEW_LONG, sampling=sampling,
                           drafter=_drafter(kind, variant, k))
  check_interleaved_law(out, tiny_target, k, sampling, f'{kind} {setting} k={k} {variant}',
                        RAGGED_PROMPTS, NEW_LONG)


@pytest.mark.parametrize('kind,k', [('feature', 1), ('feature', 4), ('heads', 4), ('mlp', 4),
                                    ('falcon', 1), ('falcon', 3)])
def test_greedy_sps_equals_greedy_ars(tiny_target, kind, k):
  """Ragged prompts, 8 tokens, an eos some rows emit: the same tokens as greedy ArS, with
  drafts accepted (the small vocabulary makes a random head's argmax often right); with 2
  alternatives beside each draft (the head's next best) too, and drafting a tree (the heads': the
  Cartesian tree of their top tokens; the MLP speculator's: each node's top tokens after its
  path), in fewer loops than the chain; and the EAGLE head growing
  each row's own tree; an EAGLE-3 head (the target's taps) too, its chain and its tree; and one
  drafting from its own output layer over 5 of the 7 tokens (a draft vocabulary); a Falcon
  head's chain (k = 3: two passes, the last of one draft), and one of 3 drafts a pass."""
  seed = 7 if kind == 'falcon' else 6  # A random Falcon head of seed 6 has no draft accepted.
  head = _head(tiny_target, kind, 1 if kind in ('feature', 'falcon') else 4, seed, scale=2.0)
  prompts, lengths = _ragged(k, batch=8, width=4, vocab=V_SMALL)
  ars = autoregressive_sample(tiny_target, prompts, lengths, jax.random.key(0),
                              max_new_tokens=8, sampling=GREEDY, eos_id=6)
  loops = {}
  dynamic = ('dynamic',) if kind == 'feature' else ()
  variants = (0, 2) + (('tree',) + dynamic if k > 1 else ())
  for variant in variants if kind != 'falcon' else (0,):  # A Falcon head drafts a chain.
    sps = speculative_sample(
        tiny_target, head, prompts, lengths, jax.random.key(1), k=k, max_new_tokens=8,
        sampling=GREEDY, eos_id=6, drafter=_drafter(kind, variant, k))
    np.testing.assert_array_equal(sps.tokens, ars.tokens, err_msg=str(variant))
    np.testing.assert_array_equal(sps.num_generated, ars.num_generated)
    assert int(np.sum(sps.num_accepted)) > 0
    loops[variant] = int(np.sum(sps.num_loops))
  assert all(loops[v] < loops[0] for v in loops if v not in (0, 'dynamic')), loops
  if kind == 'falcon':  # 3 drafts a pass: at k = 1 its first call reads 3 > k + 1 pairs.
    config = feature_head.head_config(tiny_target.config, 1, drafts_per_pass=3)
    head3 = models.Model(config, feature_head.init_head('falcon', config, jax.random.key(3)))
    sps = speculative_sample(tiny_target, head3, prompts, lengths, jax.random.key(1), k=k,
                             max_new_tokens=8, sampling=GREEDY, eos_id=6,
                             drafter=FalconDrafter(per_pass=3))
    np.testing.assert_array_equal(sps.tokens, ars.tokens)
  if kind == 'feature':
    # Its taps' product on the last output alone: the EAGLE head's drafts, which are accepted.
    head3 = _head(tiny_target, kind, 1, 6, scale=2.0, taps=TAPS)
    D = tiny_target.config.d_model
    last_only = jnp.zeros((len(TAPS), D, D)).at[-1].set(jnp.eye(D))
    head3 = models.Model(head3.config, dict(head3.params, taps=dict(head3.params['taps'],
                                                                     taps=last_only)))
    # A draft vocabulary of 5 of the 7 tokens (its own output layer): chain and dynamic tree.
    head_v = _head(tiny_target, kind, 1, 6, scale=2.0, vocab=(0, 1, 3, 4, 6))
    for name, head_, variants in (('taps', head3, (0, 'tree')), ('vocab', head_v, (0, 'dynamic'))):
      for variant in variants if k > 1 else (0,):
        sps = speculative_sample(
            tiny_target, head_, prompts, lengths, jax.random.key(1), k=k, max_new_tokens=8,
            sampling=GREEDY, eos_id=6, drafter=_drafter(kind, variant, k))
        np.testing.assert_array_equal(sps.tokens, ars.tokens, err_msg=f'{name} {variant}')
        assert int(np.sum(sps.num_accepted)) > 0


@pytest.mark.parametrize('kind', ['feature', 'heads'])
def test_greedy_sps_equals_greedy_ars_under_context_rules(tiny_target, kind):
  """No repeated 2-gram and no eos (6) in the first 3 new tokens: the head's chain drafts under
  the same rules, and SpS emits ArS's tokens, with drafts accepted; also with the EAGLE head
  growing each row's own tree (its values ignore the rules, the target's accept step reads them
  along each row's paths)."""
  head = _head(tiny_target, kind, 1 if kind in ('feature', 'falcon') else 4, 6, scale=2.0)
  prompts, lengths = _ragged(4, batch=8, width=4, vocab=V_SMALL)
  rules = SamplingConfig(temperature=0.0, no_repeat_ngram_size=2, ban_before_new=(((6,), 3),))
  ars = autoregressive_sample(tiny_target, prompts, lengths, jax.random.key(0),
                              max_new_tokens=8, sampling=rules, eos_id=6)
  plain = autoregressive_sample(tiny_target, prompts, lengths, jax.random.key(0),
                                max_new_tokens=8, sampling=GREEDY, eos_id=6)
  assert not np.array_equal(ars.tokens, plain.tokens)
  for variant in (0, 'dynamic') if kind == 'feature' else (0,):
    sps = speculative_sample(tiny_target, head, prompts, lengths, jax.random.key(1), k=3,
                             max_new_tokens=8, sampling=rules, eos_id=6,
                             drafter=_drafter(kind, variant, 3))
    np.testing.assert_array_equal(sps.tokens, ars.tokens, err_msg=str(variant))
    assert int(np.sum(sps.num_accepted)) > 0


def test_unrolled_head_steps_give_the_same_tokens(pair48):
  """The EAGLE head's k - 1 steps after the first, unrolled as on an accelerator."""
  check_unrolled_drafts(pair48, _head(pair48, 'feature', 1, 3, scale=3.0), FeatureDrafter(),
                        *_ragged(4, batch=4))


def test_heads_that_do_not_fit_are_refused(pair48):
  prompts, lengths = _ragged(0)
  run = lambda drafter, draft, k=2: speculative_sample(
      pair48, draft, prompts, lengths, jax.random.key(0), k=k, max_new_tokens=4, drafter=drafter)
  with pytest.raises(ValueError, match="drafts with a 'feature' head"):
    run(FeatureDrafter(), _head(pair48, 'heads', 2, 0))
  with pytest.raises(ValueError, match="drafts with a 'feature' head.*got a transformer"):
    run(FeatureDrafter(), pair48)  # A transformer, not a head.
  with pytest.raises(ValueError, match='needs a draft model'):
    run(HeadsDrafter(), None)
  narrow = dataclasses.replace(pair48.config, d_model=16, num_heads=2, num_kv_heads=1, d_ff=32)
  with pytest.raises(ValueError, match='does not fit the target'):
    run(FeatureDrafter(), _head(models.Model(narrow, {}), 'feature', 1, 0))
  with pytest.raises(ValueError, match='k = 3 drafts need k heads'):
    run(HeadsDrafter(), _head(pair48, 'heads', 2, 0), k=3)
  with pytest.raises(ValueError, match=r"k = 3 drafts need k heads \(an MLP speculator's stages"):
    run(MlpDrafter(), _head(pair48, 'mlp', 2, 0), k=3)
  with pytest.raises(ValueError, match="MlpDrafter drafts with a 'mlp' head.*got a 'heads' head"):
    run(MlpDrafter(), _head(pair48, 'heads', 2, 0))
  assert drafter_config.build('mlp', alternatives=1) == MlpDrafter(alternatives=1)
  with pytest.raises(ValueError, match='not the mlp drafter'):
    drafter_config.build('mlp', tree_nodes=4)
  assert drafter_config.build('mlp', branching='2+1') == MlpTreeDrafter(branching=(2, 1))
  with pytest.raises(ValueError, match=r"k = 3 drafts need k heads \(an MLP speculator's stages"):
    run(MlpTreeDrafter(branching=(2, 1, 1)), _head(pair48, 'mlp', 2, 0), k=3)
  with pytest.raises(ValueError, match='48 alternatives need a vocabulary'):
    run(HeadsDrafter(alternatives=48), _head(pair48, 'heads', 2, 0))
  with pytest.raises(ValueError, match='alternatives must be an integer'):
    FeatureDrafter(alternatives=-1)
  assert drafter_config.build('heads', alternatives=2) == HeadsDrafter(alternatives=2)
  with pytest.raises(ValueError, match='not by the lookup drafter'):
    drafter_config.build('lookup', alternatives=2)
  assert drafter_config.build('feature', branching='3+1') == FeatureTreeDrafter(branching=(3, 1))
  with pytest.raises(ValueError, match='drafts trees of depth 2'):
    run(FeatureTreeDrafter(branching=(2, 1)), _head(pair48, 'feature', 1, 0), k=3)
  with pytest.raises(ValueError, match='not alternatives'):
    FeatureTreeDrafter(alternatives=1)
  falcon = _head(pair48, 'falcon', 1, 0)
  with pytest.raises(ValueError, match="FalconDrafter drafts with a 'falcon' head.*'feature'"):
    run(FalconDrafter(), _head(pair48, 'feature', 1, 0))
  with pytest.raises(ValueError, match="FeatureDrafter drafts with a 'feature' head.*'falcon'"):
    run(FeatureDrafter(), falcon)
  with pytest.raises(ValueError, match='drafts 2 tokens a pass; .* per_pass=3'):
    run(FalconDrafter(per_pass=3), falcon)
  with pytest.raises(ValueError, match='takes no alternatives'):
    FalconDrafter(alternatives=1)
  with pytest.raises(ValueError, match='per_pass >= 2'):
    FalconDrafter(per_pass=1)
  assert drafter_config.build('falcon', per_pass=3) == FalconDrafter(per_pass=3)
  with pytest.raises(ValueError, match='drafts a chain'):
    drafter_config.build('falcon', branching='2+1')
  with pytest.raises(ValueError, match='not the model drafter'):
    drafter_config.build('model', per_pass=3)
  with pytest.raises(ValueError, match="got kind 'falcon' with drafts_per_pass 1"):
    feature_head.init_head('falcon', feature_head.head_config(pair48.config), jax.random.key(0))
  with pytest.raises(ValueError, match="got kind 'feature' with drafts_per_pass 2"):
    feature_head.init_head('feature', falcon.config, jax.random.key(0))
  with pytest.raises(ValueError, match='reads a sequence, not a tree'):
    feature_head.feature_head_forward(falcon, pair48, jnp.zeros((1, 3, 32)),
                                      jnp.zeros((1, 3), jnp.int32),
                                      models.TokenTree((0, 0)))
  with pytest.raises(ValueError, match='drafts_per_pass must be >= 1'):
    dataclasses.replace(pair48.config, drafts_per_pass=0)


def test_a_head_drafts_the_same_tokens_on_a_mesh(pair48):
  """Target and EAGLE head sharded on a 2 x 2 mesh (heads and MLP over `model`, rows over
  `data`): greedy SpS gives the tokens it gives on one device; an EAGLE-3 head (the target's
  taps, its own output layer over 24 tokens split over `model`) and a Falcon head too."""
  prompts, lengths = _ragged(8, batch=4)
  for kind, taps in (('feature', ()), ('feature', TAPS), ('falcon', ())):
    head = _head(pair48, kind, 1, 3, scale=3.0, taps=taps,
                 vocab=tuple(range(0, 48, 2)) if taps else ())
    run = lambda mesh, head=head, kind=kind: speculative_sample(
        pair48, head, prompts, lengths, jax.random.key(0), k=3, max_new_tokens=10,
        sampling=GREEDY, mesh=mesh, drafter=DRAFTERS[kind])
    one = run(None)
    sharded = run(sharding.make_mesh(2, 2, jax.devices()[:4]))
    np.testing.assert_array_equal(np.asarray(sharded.tokens), np.asarray(one.tokens))
    np.testing.assert_array_equal(np.asarray(sharded.num_loops), np.asarray(one.num_loops))
