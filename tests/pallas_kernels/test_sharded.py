"""Kernels under shard_map on a 2 x 2 CPU mesh (batch over "data", heads over "tensor")."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from pallas_kernels import reference, sharded
from tests.pallas_kernels.deviceless import twin_jit
from tests.pallas_kernels.np_ref import gdpa_loop

B, T, H, D = 4, 20, 4, 8


@pytest.fixture(scope="module")
def mesh():
  return Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "tensor"))


def _qkv(t=T, seed=0):
  ks = jax.random.split(jax.random.key(seed), 3)
  return tuple(jax.random.normal(k, (B, t, H, D)) for k in ks)


def test_sharded_gdpa_matches_unsharded_reference(mesh):
  q, k, v = _qkv()
  # Per-head activations that differ between the two head shards (exercises the switch).
  kw = dict(activation=("silu", "silu", "relu", "gelu"), q_lengths=jnp.array([20, 3, 0, 17]),
            kv_lengths=jnp.array([20, 11, 5, 0]), window=7, out_scale=0.5)
  kern = lambda q, k, v: sharded.sharded_gdpa(q, k, v, mesh=mesh, batch_axes="data",
                                              head_axes="tensor", interpret=True, **kw)
  ref = lambda q, k, v: reference.gdpa_reference(q, k, v, **kw)
  both = lambda f: lambda q, k, v: (f(q, k, v), jax.grad(lambda v: jnp.sum(f(q, k, v) ** 2))(v))
  out, g = jax.jit(both(kern))(q, k, v)
  want, g_ref = twin_jit(both(ref), q.dtype)(q, k, v)
  np.testing.assert_allclose(out, want, atol=2e-5)
  np.testing.assert_allclose(g, g_ref, atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("score_clip", [None, 0.5])
def test_sharded_gdpa_broadcast_q(mesh, score_clip):
  q, k, v = _qkv()
  kw = dict(activation="fast_gelu", broadcast_q=True, kv_lengths=jnp.array([20, 9, 1, 14]),
            score_clip=score_clip)
  out = jax.jit(lambda q, k, v: sharded.sharded_gdpa(q, k, v, mesh=mesh, batch_axes="data",
                                                     head_axes="tensor", interpret=True, **kw))(
      q[:1], k, v)
  np.testing.assert_allclose(out, gdpa_loop(q[:1], k, v, **kw), atol=2e-5)


def test_sharded_block_attention_with_rotary(mesh):
  q, k, v = _qkv(t=32, seed=1)
  ang = jax.random.uniform(jax.random.key(2), (B, 32, H, D // 2), maxval=5.0)
  kw = dict(block_size=16, lengths=jnp.array([32, 7, 0, 20]), rotary=(jnp.cos(ang), jnp.sin(ang)))
  out = jax.jit(lambda q, k, v: sharded.sharded_block_attention(
      q, k, v, mesh=mesh, batch_axes="data", head_axes="tensor", interpret=True, **kw))(q, k, v)
  want = twin_jit(lambda q, k, v: reference.block_attention_reference(q, k, v, **kw), q.dtype)(
      q, k, v)
  np.testing.assert_allclose(out, want, atol=2e-5)


def test_bad_mesh_axis(mesh):
  q, k, v = _qkv()
  with pytest.raises(ValueError, match="not in the mesh"):
    sharded.sharded_gdpa(q, k, v, mesh=mesh, batch_axes="fsdp", head_axes=None)
  with pytest.raises(ValueError, match="divisible"):
    sharded.sharded_gdpa(q[:, :, :3], k[:, :, :3], v[:, :, :3], mesh=mesh, batch_axes="data",
                         head_axes="tensor")
