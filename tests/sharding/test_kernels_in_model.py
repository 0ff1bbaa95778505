"""Kernel backends inside the model's modules run per shard under sharded meshes.

PFFN (sequence as GDPA query), HSP (sequence as GDPA keys, partial sums + psum), block
attention and softmax attention (banded with a halo exchange; full with k/v all-gathered) with
``backend="pallas"`` (interpret mode on CPU) under a mesh that splits batch, heads
and the sequence (``5d`` rules: fsdp x tensor x context) must equal the unsharded XLA reference
modules, forward and gradient.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kunlun.nn.attention import SeqAttention
from kunlun.nn.hsp import HSP
from kunlun.nn.pffn import PFFN
from sharding import mesh as M
from sharding import partition
from sharding import rules as R

B, T, d, H, NKV = 4, 32, 16, 2, 8
RNG = np.random.default_rng(0)
S = RNG.normal(size=(B, T, d)).astype(np.float32)
LENGTHS = np.array([32, 19, 5, 0], np.int32)
AGE = np.sort(RNG.exponential(3600.0, (B, T)), axis=1)[:, ::-1].astype(np.float32)
KV = RNG.normal(size=(2, B, NKV, H, d // H)).astype(np.float32)


def _mesh():
  return M.make_mesh({"fsdp": 2, "tensor": 2, "context": 2})


CASES = {
    "pffn": (lambda be: PFFN(H, backend=be), lambda m, p, s: m.apply(p, s, LENGTHS, KV[0], KV[1])),
    "hsp": (lambda be: HSP(8, 4, H, rank=2, backend=be, t_max=T),
            lambda m, p, s: m.apply(p, s, LENGTHS)),
    "block": (lambda be: SeqAttention(H, kind="block", block_size=8, backend=be),
              lambda m, p, s: m.apply(p, s, LENGTHS, AGE)),
    # softmax kernel: banded (halo exchange, q_offset / kv_start) and full (k, v all-gathered)
    "swa": (lambda be: SeqAttention(H, kind="swa", window=4, backend=be),
            lambda m, p, s: m.apply(p, s, LENGTHS, AGE)),
    "full": (lambda be: SeqAttention(H, kind="full", backend=be),
             lambda m, p, s: m.apply(p, s, LENGTHS, AGE)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_pallas_module_under_5d_mesh_equals_xla_unsharded(name):
  make, call = CASES[name]
  ref_mod, ker_mod = make("xla"), make("pallas")
  params = nn.meta.unbox(jax.jit(lambda: ref_mod.init(jax.random.key(1), S, *(
      (LENGTHS, KV[0], KV[1]) if name == "pffn" else (LENGTHS,) if name == "hsp"
      else (LENGTHS, AGE))))())
  loss = lambda m: (lambda p, s: jnp.sum(jnp.sin(call(m, p, s))))
  want = np.asarray(jax.jit(lambda p, s: call(ref_mod, p, s))(params, S))
  want_g = jax.jit(jax.grad(loss(ref_mod), argnums=1))(params, S)
  with partition.activate(_mesh(), R.get_rules("5d")):
    fwd = jax.jit(lambda p, s: call(ker_mod, p, s))
    got = np.asarray(fwd(params, S))
    got_g = jax.jit(jax.grad(loss(ker_mod), argnums=1))(params, S)
    hlo = fwd.lower(params, S).compile().as_text()
    jaxpr = str(jax.make_jaxpr(lambda p, s: call(ker_mod, p, s))(params, S))
  # the kernel sits inside a shard_map (XLA cannot partition a GPU custom call by itself)
  assert "shard_map" in jaxpr and "pallas_call" in jaxpr
  np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
  np.testing.assert_allclose(np.asarray(got_g), np.asarray(want_g), rtol=2e-3, atol=2e-3)
  if name == "hsp":                     # keys split over context: partial sums are all-reduced
    assert "all-reduce" in hlo
  if name == "swa":                     # halo rows from the neighbouring context shard
    assert "collective-permute" in hlo
  if name == "full":
    assert "all-gather" in hlo
