"""Context parallelism: SWA (halo ppermute), block attention and GDPA with the sequence sharded,
against unsharded references (numpy loops and ``pallas_kernels.reference``)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import reference as kref
from sharding import checks, partition
from sharding import context as CP
from sharding import mesh as M
from sharding import rules as R
from tests.pallas_kernels.np_ref import gdpa_loop

B, T, H, D = 4, 32, 2, 8
RNG = np.random.default_rng(0)
Q, K, V = (RNG.normal(size=(B, T, H, D)).astype(np.float32) for _ in range(3))
LENGTHS = np.array([32, 17, 5, 0], np.int32)


def np_swa(q, k, v, lengths, window, activation="softmax", out_scale=1.0, score_clip=None):
  """Dense loop reference: bidirectional |i-j| <= window over valid keys; invalid rows zero."""
  out = np.zeros_like(q, dtype=np.float64)
  for b in range(B):
    L = lengths[b]
    for i in range(L):
      js = [j for j in range(max(0, i - window), min(L, i + window + 1))]
      for h in range(H):
        s = np.array([q[b, i, h] @ k[b, j, h] for j in js]) / np.sqrt(D)
        if activation == "softmax":
          p = np.exp(s - s.max())
          p /= p.sum()
        else:                                            # relu for the GDPA case
          if score_clip:
            s = np.clip(s, -score_clip, score_clip)
          p = np.maximum(s, 0) * out_scale
        out[b, i, h] = sum(pj * v[b, j, h] for pj, j in zip(p, js, strict=True))
  return out


@functools.cache
def setup():
  mesh = M.make_mesh({"fsdp": 2, "context": 4})
  rules = R.get_rules("fsdp_cp")
  seq = partition.logical_sharding(mesh, rules, CP.SEQ_AXES)
  q, k, v = (jax.device_put(x, seq) for x in (Q, K, V))
  return mesh, rules, q, k, v


def _run(fn, *args):
  mesh, rules, *_ = setup()
  with partition.activate(mesh, rules):
    jitted = jax.jit(fn)
    return jitted(*args), checks.collectives(jitted.lower(*args).compile().as_text())


@pytest.mark.parametrize("window, activation", [(4, "softmax"), (8, "relu"), (0, "softmax")])
def test_swa_matches_dense_reference(window, activation):
  _, _, q, k, v = setup()
  want = np_swa(Q, K, V, LENGTHS, window, activation, out_scale=0.25)
  out, ops = _run(lambda q, k, v: CP.swa_attention(q, k, v, LENGTHS, window, activation=activation,
                                                   out_scale=0.25), q, k, v)
  np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)
  # unsharded path gives the same result
  plain = jax.jit(lambda q, k, v: CP.swa_attention(q, k, v, LENGTHS, window, activation=activation,
                                                   out_scale=0.25))(Q, K, V)
  np.testing.assert_allclose(np.asarray(plain), want, rtol=1e-5, atol=1e-5)
  kinds = {c["op"] for c in ops}
  if window:
    # only halos move: window rows of k and v to each neighbour (4 permutes), nothing gathered
    perms = [c for c in ops if c["op"] == "collective-permute"]
    assert len(perms) == 4 and kinds == {"collective-permute"}, kinds
    assert all(s == (B // 2, window, H, D) for c in perms for s in c["shapes"]), perms
  else:
    assert not kinds


def test_swa_gradient_matches_reference():
  _, _, q, k, v = setup()
  w = RNG.normal(size=Q.shape).astype(np.float32)

  def ref(q, k, v):   # dense masked softmax in jnp (independent of the banded/halo code)
    mask = kref.gdpa_mask(B, T, T, LENGTHS, LENGTHS, window=4)[:, None]
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D)
    s = jnp.where(mask, s, -1e30)
    p = jnp.where(mask, jax.nn.softmax(s, -1), 0)
    return jnp.sum(jnp.einsum("bhqk,bkhd->bqhd", p, v) * w)

  want = jax.jit(jax.grad(ref, argnums=(0, 1, 2)))(Q, K, V)
  got, _ = _run(jax.grad(lambda q, k, v: jnp.sum(CP.swa_attention(q, k, v, LENGTHS, 4) * w),
                         argnums=(0, 1, 2)), q, k, v)
  for g, r in zip(got, want, strict=True):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-5)


def test_block_attention_no_cross_shard_traffic():
  _, _, q, k, v = setup()
  cos, sin = (RNG.uniform(-1, 1, (B, T, H, D // 2)).astype(np.float32) for _ in range(2))
  want = jax.jit(lambda q, k, v, rot: kref.block_attention_reference(
      q, k, v, block_size=8, lengths=LENGTHS, rotary=rot))(Q, K, V, (cos, sin))
  mesh, rules, *_ = setup()
  rot = tuple(jax.device_put(x, partition.logical_sharding(mesh, rules, CP.SEQ_AXES))
              for x in (cos, sin))
  out, ops = _run(lambda q, k, v, rot: CP.block_attention(q, k, v, LENGTHS, block_size=8,
                                                           rotary=rot), q, k, v, rot)
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-5)
  assert not ops, ops
  with pytest.raises(ValueError, match="multiple of 4 x block_size=16"):
    with partition.activate(mesh, rules):
      CP.block_attention(q, k, v, LENGTHS, block_size=16)


def test_gdpa_query_sharded_is_local():
  """PFFN layout: sequence queries against per-example K/V rows."""
  _, _, q, _, _ = setup()
  kv = RNG.normal(size=(2, B, 6, H, D)).astype(np.float32)
  want = jax.jit(lambda q, k, v: kref.gdpa_reference(q, k, v, activation="fast_gelu",
                                                     q_lengths=LENGTHS))(Q, kv[0], kv[1])
  out, ops = _run(lambda q: CP.context_parallel_gdpa(q, kv[0], kv[1], shard="q", q_lengths=LENGTHS), q)
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-6)
  assert not ops, ops


def test_gdpa_key_sharded_psum():
  """HSP layout: shared seed queries over the sharded sequence keys, partial sums psum'd."""
  _, _, _, k, v = setup()
  seeds = RNG.normal(size=(1, 3, H, D)).astype(np.float32)
  want = jax.jit(lambda q, k, v: kref.gdpa_reference(q, k, v, activation="silu", out_scale=1 / T,
                                                     kv_lengths=LENGTHS, broadcast_q=True))(
      seeds, K, V)
  out, ops = _run(lambda k, v: CP.context_parallel_gdpa(seeds, k, v, shard="kv", activation="silu",
                                       out_scale=1 / T, kv_lengths=LENGTHS, broadcast_q=True),
                  k, v)
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-6)
  assert {(c["op"], c["group"]) for c in ops} == {("all-reduce", 4)}, ops


def test_score_clip_passes_through_sharded_paths():
  """score_clip (spec h-13) on the halo SWA and on the psum'd key-sharded GDPA, against numpy
  loops; clip 0.5 clamps about 60% of the scores (q.k / sqrt(D) ~ N(0, 1))."""
  _, _, q, k, v = setup()
  want = np_swa(Q, K, V, LENGTHS, 8, "relu", out_scale=0.25, score_clip=0.5)
  assert np.abs(want - np_swa(Q, K, V, LENGTHS, 8, "relu", out_scale=0.25)).max() > 0.05
  out, _ = _run(lambda q, k, v: CP.swa_attention(q, k, v, LENGTHS, 8, activation="relu",
                                                 out_scale=0.25, score_clip=0.5), q, k, v)
  np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)
  seeds = RNG.normal(size=(1, 3, H, D)).astype(np.float32)
  kw = dict(activation=("silu", "gelu"), out_scale=1 / T, kv_lengths=LENGTHS, broadcast_q=True,
            score_clip=0.5)
  out, _ = _run(lambda k, v: CP.context_parallel_gdpa(seeds, k, v, shard="kv", **kw), k, v)
  np.testing.assert_allclose(np.asarray(out), gdpa_loop(seeds, K, V, **kw), rtol=1e-5, atol=1e-6)
