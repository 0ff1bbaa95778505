"""kunlun.nn.gdpa.gdpa_op against a dense numpy loop."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kunlun.nn.gdpa import gdpa_op

_ERF = np.vectorize(math.erf)
NP_ACTS = {
    "identity": lambda x: x,
    "gelu": lambda x: 0.5 * x * (1.0 + _ERF(x / math.sqrt(2.0))),
    "fast_gelu": lambda x: 0.5 * x * (1.0 + np.tanh(0.7978845608 * (x + 0.044715 * x ** 3))),
    "silu": lambda x: x / (1.0 + np.exp(-x)),
    "relu": lambda x: np.maximum(x, 0.0),
    "relu2": lambda x: np.maximum(x, 0.0) ** 2,
}


def np_gdpa(q, k, v, acts, scale, out_scale, q_len, kv_len, window, score_clip=None):
  """Loop over (b, h, i, j): o_i = out_scale * sum_j act(clip(scale q_i.k_j)) v_j."""
  c = score_clip or np.inf
  B, Tk, H, D = k.shape
  Tq = q.shape[1]
  o = np.zeros((B, Tq, H, D))
  for b in range(B):
    qb = q[0] if q.shape[0] == 1 else q[b]
    for h in range(H):
      for i in range(min(Tq, q_len[b])):
        for j in range(min(Tk, kv_len[b])):
          if window is not None and abs(i - j) > window:
            continue
          sc = min(max(scale * qb[i, h] @ k[b, j, h], -c), c)
          o[b, i, h] += NP_ACTS[acts[h]](sc) * v[b, j, h]
  return o * out_scale


@pytest.mark.parametrize("act", ["identity", "gelu", "fast_gelu", "silu", "relu", "relu2",
                                 ("silu", "relu2", "fast_gelu")])
def test_gdpa_matches_loop(act):
  rng = np.random.default_rng(0)
  B, Tq, Tk, H, D = 2, 7, 9, 3, 4
  q, k, v = (rng.normal(size=s).astype(np.float32) for s in [(B, Tq, H, D), (B, Tk, H, D),
                                                               (B, Tk, H, D)])
  ql, kl = np.array([7, 4]), np.array([5, 9])
  out = gdpa_op(jnp.array(q), jnp.array(k), jnp.array(v), activation=act, out_scale=0.3,
             q_lengths=ql, kv_lengths=kl, window=2)
  acts = (act,) * H if isinstance(act, str) else act
  ref = np_gdpa(q, k, v, acts, D ** -0.5, 0.3, ql, kl, 2)
  np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-4, atol=1e-5)


def test_gdpa_broadcast_q_and_scale():
  rng = np.random.default_rng(1)
  B, Tq, Tk, H, D = 3, 4, 6, 2, 4
  q = rng.normal(size=(1, Tq, H, D)).astype(np.float32)
  k, v = (rng.normal(size=(B, Tk, H, D)).astype(np.float32) for _ in range(2))
  kl = np.array([6, 0, 3])
  out = gdpa_op(jnp.array(q), jnp.array(k), jnp.array(v), activation="fast_gelu", scale=0.7,
             kv_lengths=kl, broadcast_q=True)
  ref = np_gdpa(q, k, v, ("fast_gelu",) * H, 0.7, 1.0, [Tq] * B, kl, None)
  np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-4, atol=1e-5)
  assert np.all(np.asarray(out)[1] == 0)          # empty key set -> zero output


def test_gdpa_score_clip():
  """score_clip (spec h-13): scores ~ N(0, 4) at scale 1, clipped to [-1, 1] before the
  activation; the clipped result differs from the unclipped one."""
  rng = np.random.default_rng(2)
  B, T, H, D = 2, 6, 2, 4
  q, k, v = (rng.normal(size=(B, T, H, D)).astype(np.float32) for _ in range(3))
  kw = dict(activation=("relu2", "gelu"), scale=1.0, q_lengths=np.array([6, 3]),
            kv_lengths=np.array([4, 6]))
  out = np.asarray(gdpa_op(jnp.array(q), jnp.array(k), jnp.array(v), score_clip=1.0, **kw))
  ref = np_gdpa(q, k, v, kw["activation"], 1.0, 1.0, kw["q_lengths"], kw["kv_lengths"], None,
                score_clip=1.0)
  np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)
  assert np.abs(out - np.asarray(gdpa_op(jnp.array(q), jnp.array(k), jnp.array(v), **kw))).max() > 0.1


def test_gdpa_named_scope_and_errors():
  q = jnp.ones((1, 3, 2, 4))
  text = jax.jit(lambda q: gdpa_op(q, q, q)).lower(q).as_text(debug_info=True)
  assert "GDPA" in text
  with pytest.raises(ValueError, match="unknown activation"):
    gdpa_op(q, q, q, activation="softmaxx")
  with pytest.raises(ValueError, match="backend"):
    gdpa_op(q, q, q, backend="cuda")
