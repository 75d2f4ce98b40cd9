"""Sharded models and samplers equal single-device ones, and decode never all-gathers a weight.

Runs on the 8 fake CPU devices of `tests/conftest.py`. Meshes (data, model) = (1, 8), (2, 4), (8, 1)
for a GQA model whose 4 kv heads split over a 4-way but not an 8-way `model` axis, plus MHA and MQA
on (2, 4).
"""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from spsjax import models, sharding
from spsjax.bench import deviceless, hlo as hlo_lib
from spsjax.models import kv_cache
from spsjax.sampling import (SamplingConfig, autoregressive, autoregressive_sample, common,
                             drafters, speculative, speculative_sample)

GREEDY = SamplingConfig(temperature=0.0)
RULES = sharding.DEFAULT_RULES
# Prompts long enough that prefill activations outweigh a weight: a bad layout then shows up as the
# partitioner gathering weights rather than moving activations.
BATCH, WIDTH, MAX_NEW = 8, 24, 6
KV_IDS = {None: 'mha', 4: 'gqa', 1: 'mqa'}
# (data, model) mesh and num_kv_heads: every mesh for GQA, MHA and MQA on (2, 4) only.
CASES = [((1, 8), 4), ((2, 4), 4), ((8, 1), 4), ((2, 4), None), ((2, 4), 1)]
CASE_IDS = [f'{d}x{m}-{KV_IDS[kv]}' for (d, m), kv in CASES]


def _config(num_kv_heads, **kw):
  # Weight sizes (8192, 4096, 512 * K, 5120 elements) match no activation the sampler moves
  # (those have a factor 3 from WIDTH or are smaller), so an all-gather that size is a weight.
  return models.TransformerConfig(vocab_size=128, d_model=64, num_layers=2, num_heads=8,
                                  num_kv_heads=num_kv_heads, d_ff=80, max_seq_len=32, **kw)


@functools.cache
def _reference(num_kv_heads):
  """Single-device (config, params, prompts, lengths, logits, greedy sample) for one model."""
  config = _config(num_kv_heads)
  params = models.init_params(config, jax.random.key(0))
  rng = jax.random.key(1)
  lengths = np.array(jax.random.randint(rng, (BATCH,), 1, WIDTH + 1), np.int32)
  lengths[:2] = 1, WIDTH  # The shortest and the longest row.
  prompts = np.array(jax.random.randint(jax.random.fold_in(rng, 1), (BATCH, WIDTH), 0,
                                        config.vocab_size), np.int32)
  prompts[np.arange(WIDTH)[None, :] >= lengths[:, None]] = 7  # Padding holds junk ids.
  logits_BxTxV = jax.jit(models.logits, static_argnums=0)(config, params, jnp.asarray(prompts))
  out = autoregressive_sample(models.Model(config, params), prompts, lengths, jax.random.key(2),
                              max_new_tokens=MAX_NEW, sampling=GREEDY)
  return config, params, prompts, lengths, np.asarray(logits_BxTxV), jax.device_get(out)


def _leaves(tree):
  return {jax.tree_util.keystr(path): x for path, x in jax.tree_util.tree_leaves_with_path(tree)}


def _expected_spec(name, config, mesh):
  """The layout the default rules give each parameter (a dimension the axis divides is split)."""
  model_axis = mesh.shape['model']
  kv = 'model' if config.kv_heads % model_axis == 0 else None
  if name == "['embedding']":
    return P('model', None)  # Vocabulary split: a Megatron vocab-parallel lookup and head.
  if name == "['head']":
    return P(None, 'model')
  for suffix, spec in (("['wq']", P(None, 'model', None)), ("['wk']", P(None, kv, None)),
                       ("['wv']", P(None, kv, None)), ("['wo']", P('model', None, None)),
                       ("['w_in']", P(None, 'model')), ("['w_gate']", P(None, 'model')),
                       ("['w_out']", P('model', None)), ("['scale']", P(None))):
    if name.endswith(suffix):
      return spec
  raise AssertionError(f'No expected sharding for parameter {name}.')


def test_a_mesh_that_cannot_split_a_dimension_names_it(caplog):
  """A `model` axis that does not divide the heads, kv heads, d_ff or vocabulary replicates them:
  `unsharded_dims` names them, and placing parameters says so in one log line."""
  config = models.TransformerConfig(vocab_size=100, d_model=32, num_layers=1, num_heads=8,
                                    num_kv_heads=2, d_ff=48, max_seq_len=16)
  assert models.unsharded_dims(config, sharding.make_mesh(4, 2)) == {}
  assert models.unsharded_dims(config, sharding.make_mesh(2, 4)) == {
      'kv_heads': (2, 'model', 4)}
  assert models.unsharded_dims(config, sharding.make_mesh(1, 8)) == {
      'kv_heads': (2, 'model', 8), 'vocab': (100, 'model', 8)}
  with caplog.at_level('WARNING'):
    models.param_shardings(config, sharding.make_mesh(1, 8))
  lines = [r.getMessage() for r in caplog.records if 'does not divide' in r.getMessage()]
  assert lines == ['The mesh does not divide kv_heads (2, model=8), vocab (100, model=8): '
                   'replicated on that axis (their work is repeated on every shard of it).']


@pytest.mark.parametrize('mesh_shape,num_kv_heads', CASES, ids=CASE_IDS)
def test_params_logits_and_greedy_sampling_match_single_device(mesh_shape, num_kv_heads):
  config, params, prompts, lengths, logits_BxTxV, expected = _reference(num_kv_heads)
  mesh = sharding.make_mesh(*mesh_shape)
  sharded = models.init_params(config, jax.random.key(0), mesh=mesh)

  # Created sharded, equal to the unsharded init, laid out by the rules.
  for name, x in _leaves(sharded).items():
    np.testing.assert_array_equal(np.asarray(x), np.asarray(_leaves(params)[name]), err_msg=name)
    assert x.sharding.is_equivalent_to(NamedSharding(mesh, _expected_spec(name, config, mesh)),
                                       x.ndim), (name, x.sharding)

  tokens = jax.device_put(jnp.asarray(prompts), sharding.named(('batch', 'length'), prompts.shape,
                                                                mesh))
  sharded_logits = jax.jit(models.logits, static_argnums=0)(config, sharded, tokens)
  np.testing.assert_allclose(np.asarray(sharded_logits), logits_BxTxV, rtol=1e-5, atol=1e-5)

  out = autoregressive_sample(models.Model(config, sharded), prompts, lengths, jax.random.key(2),
                              max_new_tokens=MAX_NEW, sampling=GREEDY, mesh=mesh)
  np.testing.assert_array_equal(np.asarray(out.tokens), expected.tokens)
  np.testing.assert_array_equal(np.asarray(out.num_generated), expected.num_generated)


@pytest.mark.parametrize('tie_embeddings', [True, False], ids=['tied', 'untied'])
@pytest.mark.parametrize('mesh_shape,num_kv_heads', CASES, ids=CASE_IDS)
def test_param_shardings_follow_rules(mesh_shape, num_kv_heads, tie_embeddings):
  config = _config(num_kv_heads, tie_embeddings=tie_embeddings)
  mesh = sharding.make_mesh(*mesh_shape)
  shardings = _leaves(models.param_shardings(config, mesh))
  assert ("['head']" in shardings) != tie_embeddings
  for name, s in shardings.items():
    assert s.spec == _expected_spec(name, config, mesh), (name, s.spec)


@pytest.mark.parametrize('mesh_shape,num_kv_heads,heads_split', [
    ((2, 4), 4, True), ((2, 4), None, True), ((1, 8), None, True),
    ((1, 8), 4, False), ((2, 4), 2, False), ((2, 4), 1, False), ((1, 8), 1, False),
], ids=['2x4-kv4', '2x4-kv8', '1x8-kv8', '1x8-kv4', '2x4-kv2', '2x4-kv1', '1x8-kv1'])
def test_kv_cache_sharded_by_kv_heads_when_they_divide(mesh_shape, num_kv_heads, heads_split):
  config = _config(num_kv_heads)
  mesh = sharding.make_mesh(*mesh_shape)
  cache = jax.eval_shape(functools.partial(kv_cache.init_cache, config, BATCH, 16))
  shardings = kv_cache.shardings(cache, mesh)
  kv_spec = P('data', None, 'model' if heads_split else None, None)
  assert len(shardings.k) == len(shardings.v) == config.num_layers
  for s in shardings.k + shardings.v:
    assert s.spec == kv_spec and s.mesh == mesh
  assert shardings.lengths.spec == P('data')

  # A cache built inside a jitted program and pinned with `constrain` really has that layout.
  built = jax.jit(lambda: kv_cache.constrain(kv_cache.init_cache(config, BATCH, 16), mesh))()
  for x in built.k + built.v:
    assert x.sharding.is_equivalent_to(NamedSharding(mesh, kv_spec), x.ndim)


# One HLO instruction's result type(s) and opcode, e.g.
# `%all-gather.3 = (f32[4,4]{0,1}, s32[4]{0}) all-gather(%a, %b), channel_id=...`.
_INSTRUCTION = re.compile(r'^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<type>.+?)\s+(?P<op>[\w\-]+)\(')
_ARRAY = re.compile(r'\b(?P<dtype>pred|bf16|[fsuc]\d+)\[(?P<dims>[\d,]*)\]')
_GATHER_OPS = ('all-gather', 'all-gather-start')


def _all_gather_results(hlo_text):
  """(dtype, element count, line) of every array an all-gather instruction produces."""
  results = []
  for line in hlo_text.splitlines():
    match = _INSTRUCTION.match(line)
    if match and match['op'] in _GATHER_OPS:
      for array in _ARRAY.finditer(match['type']):
        dims = [int(d) for d in array['dims'].split(',') if d]
        results.append((array['dtype'], math.prod(dims), line.strip()))
  return results


def _gathered_weights(hlo_text, params):
  """All-gathers whose result is as large as a sharded weight (a weight gathered to full size).

  Only weights split over some mesh axis count: a replicated weight is never all-gathered.
  """
  hlo_dtypes = {jnp.dtype(jnp.float32): 'f32', jnp.dtype(jnp.bfloat16): 'bf16'}
  weights = {}  # (dtype, size) -> names of the sharded weights that large.
  for name, x in _leaves(params).items():
    if x.ndim >= 2 and not x.sharding.is_fully_replicated:
      weights.setdefault((hlo_dtypes[x.dtype], x.size), []).append(name)
  return [(' or '.join(weights[dtype, size]), line)
          for dtype, size, line in _all_gather_results(hlo_text) if (dtype, size) in weights]


def test_all_gather_parser():
  hlo = """
  %all-gather.8 = f32[4,4]{0,1} all-gather(%bitcast.101), channel_id=30, dimensions={1}
  %ags = (f32[2,64]{1,0}, f32[8,64]{1,0}) all-gather-start(%p), dimensions={0}
  ROOT %t = (f32[3]{0}, s32[5,2]{1,0}) all-gather(%a, %b), dimensions={0}
  %all-reduce.1 = f32[64,64]{1,0} all-reduce(%x), to_apply=%add
  %f = f32[64,64]{1,0} fusion(%all-gather.8), kind=kLoop, calls=%all-gather-like
  """
  assert [(d, n) for d, n, _ in _all_gather_results(hlo)] == [
      ('f32', 16), ('f32', 128), ('f32', 512), ('f32', 3), ('s32', 10)]


def test_gather_detector_catches_a_gathered_weight():
  """Guards the decode check against going vacuous: a forced weight all-gather is reported."""
  config, params = _reference(4)[:2]
  mesh = sharding.make_mesh(2, 4)
  params = jax.device_put(params, models.param_shardings(config, mesh))
  replicated = NamedSharding(mesh, P())

  def embed_with_full_table(params, tokens_BxT):
    table_VxD = jax.lax.with_sharding_constraint(params['embedding'], replicated)
    return jnp.take(table_VxD, tokens_BxT, axis=0) * 2.0

  tokens = jnp.zeros((BATCH, 1), jnp.int32)
  hlo = jax.jit(embed_with_full_table).lower(params, tokens).compile().as_text()
  gathered = _gathered_weights(hlo, params)
  assert [name for name, _ in gathered] == ["['embedding']"], gathered


@pytest.mark.parametrize('mesh_shape,num_kv_heads', [c for c in CASES if c[0][1] > 1],
                         ids=[i for i, c in zip(CASE_IDS, CASES) if c[0][1] > 1])
def test_decode_program_never_all_gathers_a_weight(mesh_shape, num_kv_heads):
  config, params, prompts, lengths, _, _ = _reference(num_kv_heads)
  mesh = sharding.make_mesh(*mesh_shape)
  loop, args = autoregressive.prepare(models.Model(config, params), prompts, lengths,
                                      max_new_tokens=MAX_NEW, sampling=GREEDY, mesh=mesh,
                                      rules=RULES)
  model = args[0]
  hlo = autoregressive.Loop.run.lower(loop, *args, jax.random.key(2)).compile().as_text()
  sharded = [x for x in jax.tree.leaves(model.params)
             if x.ndim >= 2 and not x.sharding.is_fully_replicated]
  assert len(sharded) >= 5 * config.num_layers  # The check is not vacuous.
  gathered = _gathered_weights(hlo, model.params)
  assert not gathered, gathered


def test_a_fused_model_shards_by_the_same_rules_and_decodes_the_same():
  """A model fused for XLA's decoding (`models.fuse`) on a (2, 4) mesh: each kv head's queries,
  key and value on one device, greedy ArS equal to the plain model's on one device, and a decode
  program that gathers no weight."""
  config, params, prompts, lengths, _, expected = _reference(4)
  fused = models.fuse(models.Model(config, params))
  mesh = sharding.make_mesh(2, 4)
  loop, args = autoregressive.prepare(fused, prompts, lengths, max_new_tokens=MAX_NEW,
                                      sampling=GREEDY, mesh=mesh, rules=RULES)
  specs = {name: x.sharding.spec for name, x in _leaves(args[0].params).items()}
  assert specs["['layer_0']['attn']['wqkv']"] == P(None, 'model', None, None), specs
  assert specs["['layer_0']['mlp']['w_gate_in']"] == P(None, None, 'model'), specs
  hlo = autoregressive.Loop.run.lower(loop, *args, jax.random.key(2)).compile().as_text()
  assert not _gathered_weights(hlo, args[0].params)
  out = autoregressive_sample(fused, prompts, lengths, jax.random.key(2),
                              max_new_tokens=MAX_NEW, sampling=GREEDY, mesh=mesh)
  np.testing.assert_array_equal(np.asarray(out.tokens), expected.tokens)
  np.testing.assert_array_equal(np.asarray(out.num_generated), expected.num_generated)


@functools.cache
def _draft(num_kv_heads):
  """A wide-shallow draft for the `_reference` target: one layer, 4 heads (2 kv heads)."""
  config = models.TransformerConfig(vocab_size=128, d_model=48, num_layers=1, num_heads=4,
                                    num_kv_heads=2, d_ff=64, max_seq_len=32)
  del num_kv_heads  # One draft for every target.
  return config, models.init_params(config, jax.random.key(3))


@pytest.mark.parametrize('mesh_shape', [(1, 8), (2, 4)], ids=['1x8', '2x4'])
def test_sharded_greedy_sps_equals_single_device_and_gathers_no_weight(mesh_shape):
  config, params, prompts, lengths, _, expected_ars = _reference(4)
  draft_config, draft_params = _draft(4)
  target, draft = models.Model(config, params), models.Model(draft_config, draft_params)
  kw = dict(k=3, max_new_tokens=MAX_NEW, sampling=GREEDY)
  single = speculative_sample(target, draft, prompts, lengths, jax.random.key(2), **kw)
  np.testing.assert_array_equal(np.asarray(single.tokens), expected_ars.tokens)  # Greedy parity.

  mesh = sharding.make_mesh(*mesh_shape)
  out = speculative_sample(target, draft, prompts, lengths, jax.random.key(2), mesh=mesh, **kw)
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(single.tokens))
  np.testing.assert_array_equal(np.asarray(out.num_loops), np.asarray(single.num_loops))

  placed_target, prompts_BxP, lengths_B = common.place(target, prompts, lengths, mesh, RULES)
  placed_draft = common.place(draft, prompts, lengths, mesh, RULES)[0]
  loop = speculative.Loop(k=3, max_new_tokens=MAX_NEW, sampling=GREEDY, draft_sampling=GREEDY,
                          mesh=mesh, rules=RULES)
  hlo = speculative.Loop.run.lower(loop, placed_target, placed_draft, prompts_BxP, lengths_B,
                                   jax.random.key(2)).compile().as_text()
  weights = {'target': placed_target.params, 'draft': placed_draft.params}
  assert len([x for x in jax.tree.leaves(weights)
              if x.ndim >= 2 and not x.sharding.is_fully_replicated]) >= 5 * config.num_layers
  gathered = _gathered_weights(hlo, weights)
  assert not gathered, gathered


def test_sharded_sampling_at_temperature_above_0_draws_the_unsharded_tokens():
  """A row's draws depend on its key and its laws only, so on a (2, 4) mesh ArS and SpS draw the
  tokens of the single-device run with the same key.

  Not guaranteed bit for bit: the sharded logits differ from the single-device ones by rounding
  (probabilities by ~2e-7 here), so a draw whose uniform number falls that close to the boundary
  between two tokens may go either way. Over the ~300 draws below that is a chance of order 1e-4
  for a key picked at random; the fixed keys here agree (as did keys 0 to 4 on meshes (2, 4),
  (8, 1) and (1, 8) when this was written).
  """
  config, params, prompts, lengths, _, greedy = _reference(4)
  target = models.Model(config, params)
  sampling = SamplingConfig(temperature=0.8, top_k=20, top_p=0.9)
  # The target drafts for itself a little hotter: some drafts accepted, some not.
  draft_sampling = SamplingConfig(temperature=1.2, top_k=20, top_p=0.9)
  mesh = sharding.make_mesh(2, 4)
  ars = lambda mesh: autoregressive_sample(target, prompts, lengths, jax.random.key(5),
                                           max_new_tokens=MAX_NEW, sampling=sampling, mesh=mesh)
  sps = lambda mesh: speculative_sample(target, target, prompts, lengths, jax.random.key(6), k=3,
                                        max_new_tokens=MAX_NEW, sampling=sampling,
                                        draft_sampling=draft_sampling, mesh=mesh)
  for name, run in (('ArS', ars), ('SpS', sps)):
    single, sharded = jax.device_get(run(None)), jax.device_get(run(mesh))
    assert (single.tokens != greedy.tokens).any(), name  # Really sampled.
    for field in ('tokens', 'num_generated', 'num_loops', 'num_accepted'):
      np.testing.assert_array_equal(getattr(sharded, field), getattr(single, field),
                                    err_msg=f'{name} {field}')
  assert 0 < int(np.sum(single.num_accepted)) < 3 * int(np.sum(single.num_loops))


@pytest.mark.parametrize('drafter,trim_score', [
    (drafters.PromptLookup(), True), (drafters.Hybrid(stop_below=0.3), False)], ids=str)
def test_sharded_sps_with_other_drafters_equals_single_device(drafter, trim_score):
  """Greedy SpS with prompt lookup (scoring trimmed) and hybrid with dynamic k on a 2 x 4 mesh:
  the tokens and counts of one device."""
  config, params, prompts, lengths, _, expected_ars = _reference(4)
  draft_config, draft_params = _draft(4)
  target = models.Model(config, params)
  draft = models.Model(draft_config, draft_params) if drafter.needs_model else None
  kw = dict(k=3, max_new_tokens=MAX_NEW, sampling=GREEDY, drafter=drafter, trim_score=trim_score)
  single = jax.device_get(speculative_sample(target, draft, prompts, lengths, jax.random.key(2),
                                             **kw))
  np.testing.assert_array_equal(single.tokens, expected_ars.tokens)  # Greedy parity.
  sharded = jax.device_get(speculative_sample(target, draft, prompts, lengths, jax.random.key(2),
                                              mesh=sharding.make_mesh(2, 4), **kw))
  for field in ('tokens', 'num_loops', 'num_accepted', 'num_drafted'):
    np.testing.assert_array_equal(getattr(sharded, field), getattr(single, field), err_msg=field)


def _phase_collectives(compiled, phase):
  parsed = hlo_lib.parse_hlo(compiled.as_text())
  return hlo_lib.launches_by_phase(parsed, parsed.main_loop().body, trips=True,
                                   opcodes=hlo_lib.COLLECTIVES).get(phase, 0)


def test_a_draw_gathers_the_vocabulary_once_not_once_per_reduction(monkeypatch):
  """On a mesh that splits the vocabulary, the logits a draw reads are made whole first
  (`common.whole_vocabulary`): each draft step then adds one collective to its layers' and its
  embedding lookup's, where a draw over the split vocabulary adds one per reduction (max, sum,
  total, first token) besides the gather its prefix sums make. Compiled only, at nucleus."""
  mesh = sharding.make_mesh(1, 4, jax.devices()[:4])
  target = deviceless.abstract_model(_config(4), mesh)
  draft = deviceless.abstract_model(_draft(4)[0], mesh)
  nucleus = SamplingConfig(temperature=0.8, top_p=0.9)
  drafting = {}
  for whole, k in ((True, 3), (True, 2), (False, 4)):  # Another k: another trace, not a cached one.
    if not whole:
      monkeypatch.setattr(common, 'whole_vocabulary', lambda logits_BxV, mesh, rules: logits_BxV)
    compiled = deviceless.compile_sps(target, draft, mesh, k=k, batch=BATCH, prompt_len=WIDTH,
                                      max_new_tokens=MAX_NEW, sampling=nucleus)
    drafting[whole, k] = _phase_collectives(compiled, 'draft')
  # A step's own: one step more, less what the phase has once whatever k (JAX 0.12's partitioner
  # adds some there).
  per_step = {True: drafting[True, 3] - drafting[True, 2], False: drafting[False, 4] / 4}
  draft_layers = _draft(4)[0].num_layers
  assert per_step[True] <= 2 * draft_layers + 2 < per_step[False], (per_step, drafting)
