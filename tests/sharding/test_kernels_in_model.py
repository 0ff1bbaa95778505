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


@pytest.mark.parametrize("name", ["attention", "hsp", "pffn"])
def test_packed_fused_projections_per_device_equal_xla_unsharded(name):
  """A packed tower in 4 blocks split over the mesh's batch devices (``5d`` rules): the fused
  norm -> projection kernels (``pallas_kernels.norm_qkv``), HSP's seed side
  (``pallas_kernels.seed_kron``) and the PFFN's tail (``pallas_kernels.norm_residual``),
  interpret mode, run per device inside a shard_map and equal the unsharded XLA modules,
  forward and gradient."""
  from data.jagged import pack_blocks
  from kunlun.nn import packed
  from pallas_kernels.jagged import sharded
  rng = np.random.default_rng(3)
  s = rng.normal(size=(8, 24, 64)).astype(np.float32)
  age = rng.exponential(3600.0, (8, 24)).astype(np.float32)
  lengths = np.array([24, 0, 7, 13, 1, 24, 0, 5], np.int32)
  toks, offsets, seg, pos, _ = pack_blocks({"s": s, "age": age}, lengths, 128, shards=4)
  jag = sharded(*(jnp.asarray(a) for a in (offsets, seg, pos)), 8)
  x, a = jnp.asarray(toks["s"]), jnp.asarray(toks["age"])
  if name == "attention":
    make = lambda be: SeqAttention(2, kind="swa", window=4, backend=be)
    call = lambda m, p, x: m.apply(p, packed.Packed(x, jag), None, a).value
  elif name == "hsp":
    make = lambda be: HSP(16, 8, 2, rank=2, backend=be, t_max=24)   # seed side: seed_kron
    call = lambda m, p, x: m.apply(p, packed.Packed(x, jag), None)
  else:
    kv = [jnp.asarray(rng.normal(size=(8, 3, 2, 32)), jnp.float32) for _ in range(2)]
    make = lambda be: PFFN(2, backend=be)
    call = lambda m, p, x: m.apply(p, packed.Packed(x, jag), None, *kv).value
  ref_mod, ker_mod = make("xla"), make("pallas")
  extra = {"attention": (None, a), "hsp": (None,)}.get(name) or (None, *kv)
  params = nn.meta.unbox(jax.jit(lambda: ref_mod.init(jax.random.key(1), packed.Packed(x, jag),
                                                       *extra))())
  loss = lambda m: (lambda p, x: jnp.sum(jnp.sin(call(m, p, x))))
  want = np.asarray(jax.jit(lambda p, x: call(ref_mod, p, x))(params, x))
  want_g = jax.jit(jax.grad(loss(ref_mod), argnums=(0, 1)))(params, x)
  with partition.activate(_mesh(), R.get_rules("5d")):
    got = np.asarray(jax.jit(lambda p, x: call(ker_mod, p, x))(params, x))
    got_g = jax.jit(jax.grad(loss(ker_mod), argnums=(0, 1)))(params, x)
    jaxpr = str(jax.make_jaxpr(lambda p, x: call(ker_mod, p, x))(params, x))
  assert "shard_map" in jaxpr and "norm_" in jaxpr
  assert name != "hsp" or "seed_kron" in jaxpr
  np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
  for u, w in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g), strict=True):
    np.testing.assert_allclose(np.asarray(u), np.asarray(w), rtol=2e-3, atol=2e-3)


def test_mowe_token_side_per_device_equals_xla_unsharded():
  """MoWE on the Wukong token-side kernels (``pallas_kernels.wukong_fm``, interpret mode) under
  the ``5d`` mesh: the kernels run per device on its examples inside a shard_map, their weight
  gradients summed over the devices, and equal the unsharded XLA module, forward and gradient
  (parameters and tokens)."""
  from kunlun.nn.mowe import MoWE
  x = np.random.default_rng(4).normal(size=(8, 12, 16)).astype(np.float32)
  make = lambda be: MoWE(2, 2, 6, 16, 32, cross_layer=True, backend=be)
  ref_mod, ker_mod = make("xla"), make("pallas")
  params = nn.meta.unbox(jax.jit(ref_mod.init)(jax.random.key(2), x))
  loss = lambda m: (lambda p, x: jnp.sum(jnp.sin(m.apply(p, x))))
  want = np.asarray(jax.jit(ref_mod.apply)(params, x))
  want_g = jax.jit(jax.grad(loss(ref_mod), argnums=(0, 1)))(params, x)
  with partition.activate(_mesh(), R.get_rules("5d")):
    got = np.asarray(jax.jit(ker_mod.apply)(params, x))
    got_g = jax.jit(jax.grad(loss(ker_mod), argnums=(0, 1)))(params, x)
    jaxpr = str(jax.make_jaxpr(ker_mod.apply)(params, x))
  assert "shard_map" in jaxpr and "wukong_fm" in jaxpr
  np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
  for u, w in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g), strict=True):
    np.testing.assert_allclose(np.asarray(u), np.asarray(w), rtol=2e-3, atol=2e-3)


def test_weightgen_per_device_equals_xla_unsharded():
  """WeightGen on its kernels (``pallas_kernels.weightgen``, interpret mode) under the ``5d``
  mesh: per device on its examples inside a shard_map, the weight gradients summed over the
  devices, equal to the unsharded XLA module, forward and gradient (parameters and tokens)."""
  from kunlun.nn.weightgen import WeightGen
  x = np.random.default_rng(5).normal(size=(8, 16, 32)).astype(np.float32)
  make = lambda be: WeightGen(16, 2, 32, backend=be)
  ref_mod, ker_mod = make("xla"), make("pallas")
  params = nn.meta.unbox(jax.jit(ref_mod.init)(jax.random.key(3), x))
  loss = lambda m: (lambda p, x: sum(jnp.sum(jnp.sin(t)) for t in m.apply(p, x)))
  want = jax.jit(ref_mod.apply)(params, x)
  want_g = jax.jit(jax.grad(loss(ref_mod), argnums=(0, 1)))(params, x)
  with partition.activate(_mesh(), R.get_rules("5d")):
    got = jax.jit(ker_mod.apply)(params, x)
    got_g = jax.jit(jax.grad(loss(ker_mod), argnums=(0, 1)))(params, x)
    jaxpr = str(jax.make_jaxpr(ker_mod.apply)(params, x))
  assert "shard_map" in jaxpr and "weightgen_fwd" in jaxpr
  for u, w in zip(got, want, strict=True):
    np.testing.assert_allclose(np.asarray(u), np.asarray(w), rtol=2e-4, atol=2e-4)
  for u, w in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g), strict=True):
    np.testing.assert_allclose(np.asarray(u), np.asarray(w), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("item_vocab", [32, 200])
def test_event_mlp_takes_a_pair_where_the_item_table_sums_densely(item_vocab, monkeypatch):
  """An item table of no more rows than the step's ids (32 of 64; unsharded: no mesh) is summed
  inside the optimizer's cond, so EventEmbed hands the kernels its columns and the side tables'
  as a pair (200 rows: one x); forward and parameter gradients equal the XLA module's."""
  import dataclasses

  from data.fake import random_batch, tiny_schema
  from kunlun.nn.inputs import EventEmbed
  from pallas_kernels import event_mlp
  seen, orig = [], event_mlp.event_mlp_pallas
  monkeypatch.setattr(event_mlp, "event_mlp_pallas",
                      lambda x, *a, **k: seen.append(isinstance(x, tuple)) or orig(x, *a, **k))
  st = dataclasses.replace(tiny_schema().streams[0], item_vocab=item_vocab)
  ev = random_batch(tiny_schema(), 4, {st.name: 16}, seed=3)["events"][st.name]
  ev = dict(ev, length=np.array([16, 0, 9, 3], np.int32))
  make = lambda be: EventEmbed(st, 3, 16, axes=EventEmbed.PACKED_AXES, backend=be)
  ref_mod, ker_mod = make("xla"), make("pallas")
  params = nn.meta.unbox(jax.jit(ref_mod.init)(jax.random.key(5), ev))
  loss = lambda m: (lambda p: jnp.sum(jnp.sin(m.apply(p, ev))))
  got_g = jax.jit(jax.grad(loss(ker_mod)))(params)
  assert seen and all(seen) == (item_vocab == 32), seen
  np.testing.assert_allclose(np.asarray(jax.jit(ker_mod.apply)(params, ev)),
                             np.asarray(jax.jit(ref_mod.apply)(params, ev)), rtol=2e-4, atol=2e-4)
  for u, w in zip(jax.tree.leaves(got_g), jax.tree.leaves(jax.jit(jax.grad(loss(ref_mod)))(params)),
                  strict=True):
    np.testing.assert_allclose(np.asarray(u), np.asarray(w), rtol=2e-3, atol=2e-3)


# the click stream's concatenation is 48 wide (16 and four side fields of 8: chunks of 32 and
# 16), the impression stream's 40 (three side fields), padded to 48 with zero columns
@pytest.mark.parametrize("stream", [0, 1])
def test_event_mlp_per_device_equals_xla_unsharded(stream):
  """A packed stream's EventEmbed (``[S, Ns]`` blocks, ``PACKED_AXES``) on the event-MLP kernels
  (``pallas_kernels.event_mlp``, interpret mode) under the ``5d`` mesh: per device on its blocks
  inside a shard_map, the weight gradients summed over the devices, equal to the unsharded XLA
  module, forward and parameter gradients; the parameter trees are the same."""
  from data.fake import random_batch, tiny_schema
  from kunlun.nn.inputs import EventEmbed
  sch = tiny_schema()
  st = sch.streams[stream]
  ev = random_batch(sch, 4, {st.name: 16}, seed=2)["events"][st.name]
  ev = dict(ev, length=np.array([16, 0, 9, 3], np.int32))
  make = lambda be: EventEmbed(st, 3, 16, axes=EventEmbed.PACKED_AXES, backend=be)
  ref_mod, ker_mod = make("xla"), make("pallas")
  params = nn.meta.unbox(jax.jit(ref_mod.init)(jax.random.key(4), ev))
  assert (jax.tree.structure(params) == jax.tree.structure(
      nn.meta.unbox(jax.jit(ker_mod.init)(jax.random.key(4), ev))))
  loss = lambda m: (lambda p: jnp.sum(jnp.sin(m.apply(p, ev))))
  want = jax.jit(ref_mod.apply)(params, ev)
  want_g = jax.jit(jax.grad(loss(ref_mod)))(params)
  with partition.activate(_mesh(), R.get_rules("5d")):
    got = jax.jit(ker_mod.apply)(params, ev)
    got_g = jax.jit(jax.grad(loss(ker_mod)))(params)
    jaxpr = str(jax.make_jaxpr(ker_mod.apply)(params, ev))
  assert "shard_map" in jaxpr and "event_mlp_fwd" in jaxpr
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=2e-4)
  assert not np.any(np.asarray(got)[1]) and not np.any(np.asarray(got)[2, 9:])
  for u, w in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g), strict=True):
    np.testing.assert_allclose(np.asarray(u), np.asarray(w), rtol=2e-3, atol=2e-3)


def test_seed_queries_take_their_kernel_on_one_device_only():
  """HSP's seed queries run on ``pallas_kernels.seed_query`` where the step is on one device
  (``sharding.packed.one_device``) and as XLA's einsum under a mesh of several (its operands are
  parameters, which the mesh may split): the same summaries and gradients either way."""
  from sharding.packed import one_device
  s = RNG.normal(size=(B, T, 64)).astype(np.float32)
  mods = {b: HSP(16, 4, 2, rank=2, backend=b, t_max=T) for b in ("xla", "pallas")}
  params = nn.meta.unbox(jax.jit(lambda: mods["xla"].init(jax.random.key(2), s, LENGTHS))())
  call = lambda m: (lambda p, s: m.apply(p, s, LENGTHS))
  loss = lambda m: (lambda p, s: jnp.sum(jnp.sin(call(m)(p, s))))
  jaxpr = lambda: str(jax.make_jaxpr(call(mods["pallas"]))(params, s))
  assert one_device() and "seed_query_fwd" in jaxpr()
  want = np.asarray(jax.jit(call(mods["xla"]))(params, s))
  want_g = jax.jit(jax.grad(loss(mods["xla"])))(params, s)
  got_one = np.asarray(jax.jit(call(mods["pallas"]))(params, s))
  with partition.activate(_mesh(), R.get_rules("5d")):
    assert not one_device() and "seed_query" not in jaxpr()
    got = np.asarray(jax.jit(call(mods["pallas"]))(params, s))
    got_g = jax.jit(jax.grad(loss(mods["pallas"])))(params, s)
  for g in (got_one, got):
    np.testing.assert_allclose(g, want, rtol=2e-4, atol=2e-4)
  for a, b in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-3, atol=2e-3)
