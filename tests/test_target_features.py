"""The target's hidden states (the input of its final norm) handed to a drafter that reads them
(issue 43, item 1): from the scoring forward itself, equal to a full forward's, packed or not,
and absent from the program of every drafter that does not read them."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spsjax import models
from spsjax.models import transformer
from spsjax.sampling import SamplingConfig, drafters, speculative
from tests import forwards

_CONFIG = models.TransformerConfig(vocab_size=48, d_model=32, num_layers=2, num_heads=4,
                                   num_kv_heads=2, d_ff=64, max_seq_len=64)
_DRAFT = models.TransformerConfig(vocab_size=48, d_model=24, num_layers=1, num_heads=2, d_ff=48,
                                  max_seq_len=64)


@pytest.fixture(scope='module')
def pair():
  return (models.Model(_CONFIG, models.init_params(_CONFIG, jax.random.key(0))),
          models.Model(_DRAFT, models.init_params(_DRAFT, jax.random.key(1))))


def _ragged(seed, batch=5, width=7):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, width + 1, size=batch).astype(np.int32)
  prompts = rng.integers(0, 48, size=(batch, width)).astype(np.int32)
  return prompts, lengths


@pytest.mark.parametrize('packed', [False, True])
def test_extend_with_features_is_extend_plus_the_full_forwards_hidden_states(pair, packed):
  target = models.for_decoding(pair[0]) if packed else pair[0]
  c, p = target.config, target.params
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 48, size=(3, 9)), jnp.int32)
  want = np.asarray(models.features(pair[0].config, pair[0].params, tokens))
  assert want.shape == (3, 9, 32)
  _, cache = models.prefill(c, p, tokens[:, :4], jnp.full((3,), 4, jnp.int32), 16)
  logits, features, cache_f = models.extend_with_features(c, p, cache, tokens[:, 4:])
  plain_logits, plain_cache = models.extend(c, p, cache, tokens[:, 4:])
  np.testing.assert_array_equal(np.asarray(logits), np.asarray(plain_logits))
  np.testing.assert_array_equal(np.asarray(cache_f.k), np.asarray(plain_cache.k))
  np.testing.assert_allclose(np.asarray(features), want[:, 4:], rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize('packed', [False, True])
def test_taps_are_the_residual_stream_at_those_depths(pair, packed):
  """Taps (0, 1, 2) of a 2-layer target, side by side: its embedding, the first layer's output
  (a 1-layer copy's last output) and its last output, from an uncached forward and from a
  cached call after a prefill (packed or not); a tap past the last layer is refused."""
  target, config = pair[0], pair[0].config
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 48, size=(3, 9)), jnp.int32)
  one = dataclasses.replace(config, num_layers=1)
  want = np.concatenate([
      np.asarray(transformer.embed(config, target.params['embedding'], tokens)),
      np.asarray(models.features(one, models.truncated_params(config, target.params, one),
                                 tokens)),
      np.asarray(models.features(config, target.params, tokens))], axis=-1)
  np.testing.assert_allclose(models.features(config, target.params, tokens, (0, 1, 2)), want,
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(models.features(config, target.params, tokens, (1,)),
                             want[..., 32:64], rtol=1e-5, atol=1e-5)
  run = models.for_decoding(target) if packed else target
  _, features_BxPxF, cache = models.prefill(run.config, run.params, tokens[:, :4],
                                            jnp.full((3,), 4, jnp.int32), 16,
                                            with_features=(0, 1, 2))
  _, features_BxTxF, _ = models.extend_with_features(run.config, run.params, cache,
                                                     tokens[:, 4:], taps=(0, 1, 2))
  np.testing.assert_allclose(np.concatenate([features_BxPxF, features_BxTxF], axis=1), want,
                             rtol=2e-4, atol=2e-4)
  with pytest.raises(ValueError, match='Feature taps'):
    models.features(config, target.params, tokens, (1, 3))


@dataclasses.dataclass(frozen=True)
class _Spy(drafters.ModelDrafter):
  """The default drafter, keeping the last Verdict's features beside its cache."""
  width: int = 32

  @property
  def reads_features(self) -> bool:
    return True

  def init(self, loop, draft, prompts_BxP, prompt_lengths_B, capacity, features_BxPxD=None):
    cache = super().init(loop, draft, prompts_BxP, prompt_lengths_B, capacity)
    return cache, jnp.zeros((prompts_BxP.shape[0], loop.k + 1, self.width), jnp.float32)

  def propose(self, loop, draft, state, committed, keys_BxK):
    proposal, cache = super().propose(loop, draft, state[0], committed, keys_BxK)
    return proposal, (cache, state[1])

  def rollback(self, loop, state, verdict):
    return (super().rollback(loop, state[0], verdict),
            verdict.features_BxKp1xD.astype(jnp.float32))


@pytest.mark.parametrize('packed,trim_score', [(True, False), (False, True)])  # Plain: extend's test.
def test_the_loop_hands_the_scored_positions_features_to_the_drafter(pair, packed, trim_score):
  """After a loop, row b's features at the scored positions base .. base + n (its last committed
  token and its n accepted drafts) are the full forward's over its committed tokens."""
  target, draft = (models.for_decoding(m) for m in pair) if packed else pair
  prompts, lengths = _ragged(3)
  loop, args = speculative.prepare(target, draft, prompts, lengths, k=4, max_new_tokens=30,
                                   sampling=SamplingConfig(temperature=0.7), drafter=_Spy(),
                                   trim_score=trim_score)
  state, body = jax.jit(loop.init)(*args, jax.random.key(0)), jax.jit(loop.body)
  accepted = []
  for _ in range(3):
    before = np.asarray(state.num_generated_B)
    state = body(*args, state)
    n_B = np.asarray(state.num_generated_B) - before - 1  # Accepted drafts (no eos, no limit).
    got = np.asarray(state.draft_state[1])
    tokens_BxW, num_generated_B = np.asarray(state.tokens_BxW), np.asarray(state.num_generated_B)
    for b in range(len(lengths)):
      want = forwards.features(pair[0], np.concatenate([prompts[b, :lengths[b]],
                                                        tokens_BxW[b, :num_generated_B[b]]]))
      base = lengths[b] + before[b] - 1
      np.testing.assert_allclose(got[b, :n_B[b] + 1], want[base:base + n_B[b] + 1],
                                 rtol=2e-4, atol=2e-4)
    accepted.append(n_B)
  assert np.sum(accepted) > 0  # Some drafts were accepted: positions past the first compared.


@pytest.mark.parametrize('trim_score', [False, True])
def test_a_drafter_that_does_not_read_features_never_traces_them(pair, monkeypatch, trim_score):
  """Reading features is opt-in: with `extend_with_features` broken, the default drafter's loop
  still compiles (its program is the one it was before features existed), the spy's does not."""
  target, draft = pair
  prompts, lengths = _ragged(4)

  def broken(*args, **kwargs):
    raise AssertionError('features traced')

  monkeypatch.setattr(speculative, 'extend_with_features', broken)
  for drafter, reads in ((drafters.ModelDrafter(), False), (drafters.Hybrid(), False),
                         (_Spy(), True)):
    loop, args = speculative.prepare(target, draft, prompts, lengths, k=3, max_new_tokens=8,
                                     drafter=drafter, trim_score=trim_score)
    lower = lambda: type(loop).run.lower(loop, *args, jax.random.key(0))
    if reads:
      with pytest.raises(AssertionError, match='features traced'):
        lower()
    else:
      lower()
