"""Modified rejection sampling: the accept/resample step of speculative sampling, in float32.

Given the target laws p_1..p_{k+1} and the draft laws q_1..q_k of the k draft tokens, accept draft i
with probability min(1, p_i(d_i) / q_i(d_i)), left to right; at the first rejection draw from
norm(max(0, p - q)) at that position; if all k are accepted draw a bonus token from p_{k+1}. A
drafter may propose fewer than k (per row): the first `num` drafts are then the only ones tried.
Lenience l < 1 (Leviathan et al.; opt-in, LOSSY) accepts more drafts than exactness allows. The
emitted tokens are then distributed exactly as sampling from p one token at a time. A tree of
drafts (`accept_tree`) tries a node's children one after another against what is left of p.

Numerics: acceptance compares u * q < p (no division, so no NaN for q = 0 or p = 0; u in [0, 1)
never accepts a token with p = 0); a residual with zero mass (p equal to q up to rounding) falls back
to p; draws use `processors.draw`, which only returns ids of positive weight.

`native_kernel` (a sampler on one CPU device) runs the batched step as one native call
(`spsjax.native.accept`) from the same uniform numbers: the same accepted counts, and the same
tokens but where float rounding of the prefix sums puts a boundary between two.
"""

import functools

import jax
import jax.numpy as jnp

from spsjax import native
from spsjax.native import library
from spsjax.sampling.processors import draw_with, uniforms


def acceptance_probability(p_xV: jax.Array, q_xV: jax.Array) -> jax.Array:
  """beta = sum_x min(p(x), q(x)): the probability that a draft drawn from q is accepted against p
  (Leviathan et al.); its mean over positions is the alpha of the formulas."""
  return jnp.sum(jnp.minimum(p_xV.astype(jnp.float32), q_xV.astype(jnp.float32)), axis=-1)


def check_lenience(lenience: float) -> None:
  if not 0.0 < lenience <= 1.0:
    raise ValueError(f'lenience must be in (0, 1] (1: exact), got {lenience}.')


def lenient_law(p_xV: jax.Array, q_xV: jax.Array, lenience: float) -> jax.Array:
  """The law of a draft position's token under lenience l (Leviathan et al.): a draft x ~ q is
  accepted with probability min(1, p(x) / (l q(x))), else the token comes from the residual
  norm(max(0, p - q)); so P = min(q, p / l) + (1 - sum min(q, p / l)) norm(max(0, p - q)).
  l = 1 gives p."""
  p_xV, q_xV = p_xV.astype(jnp.float32), q_xV.astype(jnp.float32)
  accepted_xV = jnp.minimum(q_xV, p_xV / lenience)
  residual_xV = jnp.maximum(p_xV - q_xV, 0.0)
  mass_x1 = jnp.sum(residual_xV, axis=-1, keepdims=True)
  residual_xV = jnp.where(mass_x1 > 0, residual_xV / jnp.where(mass_x1 > 0, mass_x1, 1.0), p_xV)
  return accepted_xV + (1.0 - jnp.sum(accepted_xV, axis=-1, keepdims=True)) * residual_xV


def accept_and_resample(key: jax.Array, p_Kp1xV: jax.Array, q_KxV: jax.Array,
                        drafts_K: jax.Array, num: jax.Array | int | None = None,
                        lenience: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """One row: (n accepted drafts in [0, num], the token drawn after them).

  Only the first `num` drafts (default: all k) were proposed: the others are never accepted, and
  after all `num` the token is drawn from p_{num+1} itself. `lenience` l < 1 accepts a draft with
  probability min(1, p / (l q)): LOSSY, the drafts' positions then follow `lenient_law`, not p.
  """
  u_K, token_key = _split(key, drafts_K.shape[0])
  return accept_with(u_K, uniforms(token_key), p_Kp1xV, q_KxV, drafts_K, num, lenience)


def accept_with(u_K: jax.Array, u_token: jax.Array, p_Kp1xV: jax.Array, q_KxV: jax.Array,
                drafts_K: jax.Array, num: jax.Array | int | None = None,
                lenience: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """`accept_and_resample` with its uniform numbers given: draft i's test u_K[i] in [0, 1), and
  the token's draw `u_token` (`processors.draw`'s)."""
  k = drafts_K.shape[0]
  num = k if num is None else num
  p_Kp1xV, q_KxV = p_Kp1xV.astype(jnp.float32), q_KxV.astype(jnp.float32)
  p_at_K = jnp.take_along_axis(p_Kp1xV[:k], drafts_K[:, None], axis=1)[:, 0]
  q_at_K = jnp.take_along_axis(q_KxV, drafts_K[:, None], axis=1)[:, 0]
  accepted_K = (u_K * (lenience * q_at_K) < p_at_K) & (jnp.arange(k) < num)
  n = jnp.sum(jnp.cumprod(accepted_K.astype(jnp.int32)))
  # Position n: residual of p_{n+1} against q_{n+1}, or p_{n+1} itself after all proposed drafts.
  p_V = p_Kp1xV[n]
  q_V = jnp.where(n < num, q_KxV[jnp.minimum(n, k - 1)], 0.0)
  residual_V = jnp.maximum(p_V - q_V, 0.0)
  residual_V = jnp.where(jnp.sum(residual_V) > 0, residual_V, p_V)
  token = draw_with(u_token, residual_V)
  return n.astype(jnp.int32), token.astype(jnp.int32)


def _residual(r_V: jax.Array, q_V: jax.Array) -> jax.Array:
  """norm(max(0, r - q)); r itself where that has no mass (r equal to q up to rounding)."""
  residual_V = jnp.maximum(r_V - q_V, 0.0)
  mass = jnp.sum(residual_V)
  return jnp.where(mass > 0, residual_V / jnp.where(mass > 0, mass, 1.0), r_V)


def accept_tree(key: jax.Array, p_Np1xV: jax.Array, q_NxV: jax.Array, tokens_N: jax.Array,
                valid_N: jax.Array, children_Np1xC, depth: int
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """One row of a token tree (`models.TokenTree`, or a row of `models.RowTrees`: its `children`,
  static or traced, and its depth bound): (path int32[depth + 1]: the node accepted at each
  depth, the root first and -1 past the last; n, the drafts accepted; the token after them).

  Recursive rejection sampling (SpecInfer's, Miao et al. 2024): at the node reached, its children
  are tried in order against r, starting from p at that node; child c (token t_c, drawn from q_c
  given its earlier siblings) is accepted with probability min(1, r(t_c) / q_c(t_c)), else r
  becomes norm(max(0, r - q_c)) and the next child is tried. An accepted child is the next node;
  when none is (or the node has no valid child) the token is drawn from r. Each step is a
  rejection step of r against the law its candidate was drawn from given the earlier ones, so the
  path and the token follow p exactly, whatever the tree. `p_Np1xV[i]` is the target's law after
  node i (0: the root); `q_NxV[i - 1]`, `tokens_N[i - 1]` and `valid_N[i - 1]` are node i's law,
  token and whether it was proposed (a node not proposed is never tried).
  """
  N = tokens_N.shape[0]
  u_N, token_key = _split(key, N)
  return accept_tree_with(u_N, uniforms(token_key), p_Np1xV, q_NxV, tokens_N, valid_N,
                          children_Np1xC, depth)


def accept_tree_with(u_N, u_token, p_Np1xV, q_NxV, tokens_N, valid_N, children_Np1xC,
                     depth: int):
  """`accept_tree` with its uniform numbers given: node i's test u_N[i - 1], the token's draw
  `u_token`.

  Every node's children are tried at once, all nodes together (C steps over [N + 1, V], C the
  most children a node has): for each node, the child accepted (or none) and r after the
  children tried. The walk down from the root then only looks these up, and the token comes
  from r where it stopped (p at a leaf). The same tests with the same numbers as a walk trying
  the children of the nodes it reaches, in a few wide ops rather than depth * C narrow ones."""
  children_Np1xC = jnp.asarray(children_Np1xC)
  p_Np1xV, q_NxV = p_Np1xV.astype(jnp.float32), q_NxV.astype(jnp.float32)
  M = p_Np1xV.shape[0]
  r_MxV = p_Np1xV
  chosen_M = jnp.full((M,), -1, jnp.int32)
  for j in range(children_Np1xC.shape[1]):  # The j-th child of every node.
    child_M = children_Np1xC[:, j]
    i_M = jnp.maximum(child_M, 1) - 1
    token_M = tokens_N[i_M]
    q_MxV = q_NxV[i_M]
    tried_M = (child_M > 0) & valid_N[i_M] & (chosen_M < 0)
    ok_M = (u_N[i_M] * jnp.take_along_axis(q_MxV, token_M[:, None], axis=1)[:, 0]
            < jnp.take_along_axis(r_MxV, token_M[:, None], axis=1)[:, 0])
    chosen_M = jnp.where(tried_M & ok_M, child_M, chosen_M)
    r_MxV = jnp.where((tried_M & ~ok_M)[:, None], jax.vmap(_residual)(r_MxV, q_MxV), r_MxV)
  node, path = jnp.int32(0), [jnp.int32(0)]
  for _ in range(depth):  # Down the accepted children: -1 once one is missing.
    step = (node >= 0) & (chosen_M[jnp.maximum(node, 0)] > 0)
    last = jnp.maximum(node, 0)
    node = jnp.where(step, chosen_M[last], -1)
    path.append(node)
  path_D = jnp.stack(path)
  stop = jnp.max(jnp.where(path_D >= 0, path_D, 0))  # Node ids grow down a path.
  n = jnp.sum(path_D[1:] >= 0).astype(jnp.int32)
  return path_D, n, draw_with(u_token, r_MxV[stop]).astype(jnp.int32)


def _split(key: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """A row's k accept uniforms, in [0, 1), and the key of its token's draw."""
  accept_key, token_key = jax.random.split(key)
  return jax.random.uniform(accept_key, (k,), jnp.float32), token_key


def accept_and_resample_rows(keys_B, p_BxKp1xV, q_BxKxV, drafts_BxK, num_B=None,
                             lenience: float = 1.0, *, native_kernel: bool = False):
  """Batched `accept_and_resample`: each row with its own key (and number of proposed drafts);
  with `native_kernel` by one native call where the library is built (module docstring)."""
  if num_B is None:
    num_B = jnp.full(drafts_BxK.shape[:1], drafts_BxK.shape[1], jnp.int32)
  row = functools.partial(accept_and_resample, lenience=lenience)
  xla = lambda ops: jax.vmap(row)(*ops)
  operands = (keys_B, p_BxKp1xV, q_BxKxV, drafts_BxK, num_B)
  if not (native_kernel and library.available()):
    return xla(operands)

  def kernel(ops):
    keys_B, p_BxKp1xV, q_BxKxV, drafts_BxK, num_B = ops
    u_BxK, token_keys_B = jax.vmap(lambda key: _split(key, drafts_BxK.shape[1]))(keys_B)
    return native.accept(p_BxKp1xV, q_BxKxV, drafts_BxK, num_B, u_BxK, uniforms(token_keys_B),
                         lenience=lenience)

  return library.on_cpu(operands, kernel, xla)
