"""The single accept/resample step against its exact law, and its numerics on hostile inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spsjax.sampling.rejection import accept_and_resample_rows, check_lenience, lenient_law
from tests.stats import g_test_pvalue

V, K = 6, 3
# Each G-test fails a correct step with probability 1e-5 (its p-value threshold).
P_MIN = 1e-5


def _laws():
  p_Kp1xV = np.array([[0.5, 0.2, 0.0, 0.1, 0.2, 0.0],
                      [0.0, 0.1, 0.6, 0.1, 0.1, 0.1],
                      [0.3, 0.3, 0.0, 0.0, 0.2, 0.2],
                      [0.1, 0.1, 0.1, 0.1, 0.1, 0.5]], np.float32)
  q_KxV = np.array([[0.1, 0.5, 0.3, 0.0, 0.1, 0.0],
                    [0.2, 0.2, 0.2, 0.2, 0.2, 0.0],
                    [0.3, 0.3, 0.0, 0.0, 0.2, 0.2]], np.float32)  # q_3 == p_3.
  return p_Kp1xV, q_KxV


def test_accept_resample_law_exact():
  """With position-independent laws the emitted tokens are p_1, p_2, ... and n is exact. Power
  (`stats.detectable_tv`, 80%): total variation 0.003 for the first token and for n, 0.005 for
  the second token, 0.007 for the bonus token."""
  p, q = _laws()
  n_draws = 1_000_000
  key_d, key_a = jax.random.split(jax.random.key(0))
  drafts = jax.random.categorical(key_d, jnp.log(jnp.asarray(q)), shape=(n_draws, K)).astype(
      jnp.int32)
  keys = jax.random.split(key_a, n_draws)
  n, token = accept_and_resample_rows(keys, jnp.broadcast_to(p, (n_draws, K + 1, V)),
                                      jnp.broadcast_to(q, (n_draws, K, V)), drafts)
  n, token, drafts = np.asarray(n), np.asarray(token), np.asarray(drafts)

  first = np.where(n >= 1, drafts[:, 0], token)
  assert g_test_pvalue(np.bincount(first, minlength=V), p[0]) > P_MIN
  second = np.where(n >= 2, drafts[:, 1], token)[n >= 1]
  assert g_test_pvalue(np.bincount(second, minlength=V), p[1]) > P_MIN
  # Position 4 only ever comes from the bonus draw.
  assert g_test_pvalue(np.bincount(token[n == K], minlength=V), p[K]) > P_MIN

  beta = np.minimum(p[:K], q).sum(axis=1)
  law_n = [np.prod(beta[:j]) * (1 - beta[j]) for j in range(K)] + [np.prod(beta)]
  assert g_test_pvalue(np.bincount(n, minlength=K + 1), law_n) > P_MIN
  assert (n[n >= 2] == K).all()  # q_3 == p_3: once at position 3, always accepted.


def test_no_nan_or_out_of_range_on_hostile_laws():
  """10^5 random (p, q) pairs with zeros, p == q and disjoint supports."""
  rows, k = 100_000, 2
  rows_i = np.arange(rows)
  rng = np.random.default_rng(0)
  p = rng.exponential(size=(rows, k + 1, V)).astype(np.float32)
  q = rng.exponential(size=(rows, k, V)).astype(np.float32)
  p[rng.random(p.shape) < 0.4] = 0
  q[rng.random(q.shape) < 0.4] = 0
  p[:, :, 0] += 1e-3  # Every law keeps some mass.
  q[:, :, 1] += 1e-3
  kind = np.arange(rows) % 4
  q[kind == 1] = p[kind == 1, :k]  # Identical laws.
  p[kind == 2, :, :3] = 0  # Disjoint supports: p on {3, 4, 5}, q on {0, 1, 2}.
  p[kind == 2, :, 3] += 1e-3
  q[kind == 2, :, 3:] = 0
  one_hot = np.eye(V, dtype=np.float32)  # Greedy-like laws.
  p[kind == 3] = one_hot[rng.integers(0, V, size=(int((kind == 3).sum()), k + 1))]
  p /= p.sum(-1, keepdims=True)
  q /= q.sum(-1, keepdims=True)
  # Each draft from its own q, by inverse CDF (200,000 calls of rng.choice took ~5 s): the token
  # whose cumulative mass interval holds u * total, never one of mass 0.
  cdf = np.cumsum(q.astype(np.float64), axis=-1)
  drafts = np.minimum((cdf <= rng.random((rows, k, 1)) * cdf[..., -1:]).sum(-1), V - 1)
  assert (q[rows_i[:, None], np.arange(k), drafts] > 0).all()
  keys = jax.random.split(jax.random.key(1), rows)
  n, token = jax.jit(accept_and_resample_rows)(keys, jnp.asarray(p), jnp.asarray(q),
                                               jnp.asarray(drafts, jnp.int32))
  n, token = np.asarray(n), np.asarray(token)
  assert ((0 <= n) & (n <= k)).all()
  assert ((0 <= token) & (token < V)).all()
  # Every emitted token has target mass at its position: accepted drafts and the final draw.
  assert (p[rows_i, n, token] > 0).all()
  for i in range(k):
    accepted = n > i
    assert (p[rows_i[accepted], i, drafts[accepted, i]] > 0).all()
  assert (n[kind == 1] == k).all()  # p == q accepts everything.
  assert (n[kind == 2] == 0).all()  # Disjoint supports accept nothing.


def test_edge_uniforms_never_accept_zero_target_mass():
  """u in [0, 1): whatever u is, a draft with p(x) = 0 is rejected and one with p = q accepted."""
  p = jnp.asarray([[[0.0, 1.0], [0.5, 0.5]]] * 1000, jnp.float32)
  q = jnp.asarray([[[1.0, 0.0]]] * 1000, jnp.float32)
  drafts = jnp.zeros((1000, 1), jnp.int32)
  n, token = accept_and_resample_rows(jax.random.split(jax.random.key(2), 1000), p, q, drafts)
  assert (np.asarray(n) == 0).all() and (np.asarray(token) == 1).all()


def _first_token(p, q, n_draws, lenience, num=None):
  key_d, key_a = jax.random.split(jax.random.key(2))
  drafts = jax.random.categorical(key_d, jnp.log(jnp.asarray(q)), shape=(n_draws, K)).astype(
      jnp.int32)
  num_B = None if num is None else jnp.full((n_draws,), num, jnp.int32)
  n, token = jax.jit(accept_and_resample_rows, static_argnums=5)(
      jax.random.split(key_a, n_draws), jnp.broadcast_to(p, (n_draws, K + 1, V)),
      jnp.broadcast_to(q, (n_draws, K, V)), drafts, num_B, lenience)
  n, token, drafts = np.asarray(n), np.asarray(token), np.asarray(drafts)
  return n, np.where(n >= 1, drafts[:, 0], token), token


def test_lenience_follows_its_own_law():
  """l = 0.5: the first position follows `lenient_law` (not p), and a draft is accepted with
  probability sum min(q, p / l); the law sums to 1 and is p at l = 1. Power: total variation
  0.005 at 80% (`stats.detectable_tv`)."""
  p, q = _laws()
  law = np.asarray(lenient_law(jnp.asarray(p[0]), jnp.asarray(q[0]), 0.5), np.float64)
  assert law.sum() == pytest.approx(1.0, abs=1e-6) and np.abs(law - p[0]).sum() > 0.1
  np.testing.assert_allclose(lenient_law(jnp.asarray(p[:K]), jnp.asarray(q), 1.0), p[:K],
                             atol=1e-6)
  n, first, _ = _first_token(p, q, 400_000, 0.5)
  assert g_test_pvalue(np.bincount(first, minlength=V), law) > P_MIN
  assert g_test_pvalue(np.bincount(first, minlength=V), p[0]) < 1e-20  # Lossy, detectably.
  alpha = np.minimum(q[0], p[0] / 0.5).sum()
  assert np.mean(n >= 1) == pytest.approx(alpha, abs=5e-3)


def test_fewer_proposals_than_k():
  """num = 1 of k = 3 drafts proposed: n <= 1, and the token after an accepted draft is drawn
  from p_2 itself (no residual against the unproposed q_2). Power: total variation 0.006 (the
  first token) and 0.01 (the token after an accepted draft) at 80% (`stats.detectable_tv`)."""
  p, q = _laws()
  n, first, token = _first_token(p, q, 200_000, 1.0, num=1)
  assert n.max() == 1 and g_test_pvalue(np.bincount(first, minlength=V), p[0]) > P_MIN
  assert g_test_pvalue(np.bincount(token[n == 1], minlength=V), p[1]) > P_MIN
  with pytest.raises(ValueError, match='lenience must be in'):
    check_lenience(0.0)
