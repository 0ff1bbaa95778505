"""Packed (jagged) towers on a sharded mesh: a batch packed per batch shard (data / fsdp) or per
batch x context shard (context parallelism), S blocks, trains like the padded batch on one device,
with no all-gather of the token buffers; under context parallelism only the per-example rows cross
the context devices."""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from data.fake import random_batch
from data.jagged import pack_blocks
from data.pipeline import pack_batch
from kunlun.configs.types import seq_lens
from kunlun.models.build import build_model
from kunlun.nn import packed as packed_ops
from kunlun.nn.losses import masked_bce
from kunlun.train import optim
from kunlun.train import step as step_lib
from kunlun.train.sparse_update import make_sparse_update
from pallas_kernels import jagged
from sharding import mesh as M
from sharding import partition
from sharding import rules as R
from tests.kunlun.models.test_kunlun_jagged import one_line_error
from tests.sharding import tiny_kunlun

B, S, NS = 8, 4, 192          # 4 blocks of 2 examples, 192 tokens each (token dims stand out)


def _loss_and_grad(model):
  def f(p, b):
    return masked_bce(model.apply({"params": p}, b, True), b["labels"], b["label_mask"])[0]
  return jax.value_and_grad(f)


@functools.cache
def _case():
  """The small tiny Kunlun (swa attention) with Computation Skip off (its one layer then runs
  attention as well as PFFN and HSP) and time / position buckets (each token's example and
  position in its block matter); 8 examples, empty histories in two blocks; host params."""
  cfg, schema, _ = tiny_kunlun.small()
  cfg.model.comp_skip = False
  cfg.model.time_buckets.enabled = True
  model = build_model(cfg, schema)
  batch = random_batch(schema, B, seq_lens(cfg), seed=3)
  for ev in batch["events"].values():             # empty histories, in two different blocks
    ev["length"][[1, 6]] = 0
    for k, v in ev.items():
      if k != "length":
        v[[1, 6]] = 0
  return model, batch, tiny_kunlun.host_params(model, batch)


@functools.cache
def _reference():
  """The padded batch's loss and gradients on one device (host arrays)."""
  model, batch, params = _case()
  return jax.tree.map(np.asarray, jax.jit(_loss_and_grad(model))(params, batch))


def _token_gathers(hlo: str):
  """op_names of the all-gathers whose result holds the tokens of more than one block."""
  out = []
  for line in hlo.splitlines():
    m = re.search(r"= \(?\w+\[([\d,]*)\][^=]*? all-gather(?:-start)?\(", line)
    if not m:
      continue
    dims = [int(d) for d in m.group(1).split(",") if d]
    pairs = zip(dims, dims[1:], strict=False)
    if any(d in (k * NS for k in range(2, S + 1)) for d in dims) or any(
        a > 1 and b == NS for a, b in pairs):
      name = re.search(r'op_name="([^"]*)"', line)
      out.append(name.group(1) if name else line.strip()[:200])
  return out


def _sharded_step(sizes, preset):
  """The packed batch in S blocks, its loss and gradients on a ``sizes`` mesh under ``preset``
  checked against the padded single-device step's; returns the compiled program's text and its
  mesh."""
  model, batch, params = _case()
  loss_ref, g_ref = _reference()
  packed, dropped = pack_batch(batch, {s: S * NS for s in batch["events"]}, S)
  assert not any(dropped.values())
  mesh = M.make_mesh(sizes, devices=jax.devices()[:4])
  rules = R.get_rules(preset)
  shardings = partition.param_shardings(model, jax.random.key(0), packed, mesh, rules)
  with partition.activate(mesh, rules):
    p = jax.device_put(params, shardings)
    b = jax.device_put(packed, partition.batch_sharding(mesh, rules))
    compiled = jax.jit(_loss_and_grad(model)).lower(p, b).compile()
    loss, grads = compiled(p, b)
  np.testing.assert_allclose(float(loss), float(loss_ref), rtol=1e-5)
  # float32; the sharded sums (batch-mean gradient, table rows) add in another order: measured
  # max |diff| / max |ref| 4.5e-6 over the leaves
  for (k, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(g_ref),
                       strict=True):
    r = np.asarray(r)
    np.testing.assert_allclose(np.asarray(g), r, rtol=1e-5, atol=1e-5 * np.abs(r).max(),
                               err_msg=jax.tree_util.keystr(k))
  return compiled.as_text(), mesh


@pytest.mark.parametrize("sparse", [False, True])
def test_microbatches_of_a_packed_batch_equal_the_padded_whole_batch(sparse):
  """train.microbatches = 2 on a 2-way fsdp mesh: the batch packed in 2 x 2 blocks (the pipeline
  packs a block per batch shard and microbatch), each microbatch one block of each device's two.
  The update and statistics equal the padded whole batch's on one device: SGD at lr 1 (params
  minus the gradient) on the dense path; the sparse embedding update (the default: AdamW and
  row-wise Adagrad on the looked-up rows) on both sides."""
  model, batch, params = _case()
  cfg = tiny_kunlun.small()[0].train
  cfg.warmup_steps = 0                                # the first step moves every parameter
  txs = (lambda: optim.make_optimizer(cfg, 10)) if sparse else lambda: optax.sgd(1.0)
  su = (lambda: make_sparse_update(cfg, 10)) if sparse else lambda: None
  fresh = lambda: jax.tree.map(jnp.asarray, params)
  tx = txs()
  p_ref, _, s_ref = step_lib.make_train_step(model, tx, sparse_update=su())(
      fresh(), tx.init(fresh()), batch, jax.random.key(1), 0)
  packed, dropped = pack_batch(batch, {s: S * NS for s in batch["events"]}, S)
  assert not any(dropped.values())
  mesh = M.make_mesh({"fsdp": 2}, devices=jax.devices()[:2])
  rules = R.get_rules("fsdp")
  shardings = partition.param_shardings(model, jax.random.key(0), packed, mesh, rules)
  with partition.activate(mesh, rules):
    p = jax.device_put(fresh(), shardings)
    bs, tx = partition.batch_sharding(mesh, rules), txs()
    f = step_lib.make_train_step(model, tx, sparse_update=su(), param_shardings=shardings,
                                 microbatches=2)
    args = (p, tx.init(p), jax.device_put(packed, bs), jax.random.key(1), 0)
    compiled = f.lower(*args).compile()
    p_got, _, s_got = compiled(*args)
  # the split is a reshape of each device's own blocks: no token buffer is gathered outside the
  # row-sharded tables' overflow fallbacks (the lookup's, and the sparse update's row ids), which
  # the whole-batch step has as well
  gathers = _token_gathers(compiled.as_text())
  assert all("shard_map/cond" in g for g in gathers), gathers
  assert all("EventEmbed" in g or "optimizer" in g for g in gathers), gathers
  for k in ("loss", "per_task", "loss_sum", "count"):
    np.testing.assert_allclose(np.asarray(s_got[k]), np.asarray(s_ref[k]), rtol=1e-5)
  moved = 0
  for (k, g), r, p0 in zip(jax.tree_util.tree_leaves_with_path(p_got), jax.tree.leaves(p_ref),
                           jax.tree.leaves(params), strict=True):
    r = np.asarray(r)
    # AdamW's first step is lr g / (|g| + eps): where |g| ~ eps the reassociated gradient sums
    # move it by up to 1% of lr (measured 0.8%); a misplaced example moves it by about 2 lr
    atol = 0.02 * cfg.lr if sparse else 1e-5 * np.abs(r).max()
    np.testing.assert_allclose(np.asarray(g), r, rtol=1e-5, atol=atol,
                               err_msg=jax.tree_util.keystr(k))
    moved += not np.array_equal(r, p0)
  assert moved > len(jax.tree.leaves(params)) // 2            # the step did update
  with pytest.raises(ValueError, match="packed in 4 blocks does not split into 3 microbatches"):
    step_lib.split_microbatches(packed, 3, step_lib.packed_blocks(packed))


def test_bad_shard_counts_are_one_line_errors():
  model, batch, params = _case()
  apply = lambda b: jax.eval_shape(lambda p: model.apply({"params": p}, b), params)
  packed, _ = pack_batch(batch, {s: 2 * 64 for s in batch["events"]}, 2)
  bad = dict(packed, events={s: dict(ev, offsets=np.zeros(B + 3, np.int32))  # 3 blocks: 8 % 3
                             for s, ev in packed["events"].items()})
  one_line_error(lambda: apply(bad), "offsets [11]", "S dividing B=8")
  mesh = M.make_mesh({"data": 4}, devices=jax.devices()[:4])
  with partition.activate(mesh, R.get_rules("dp")):   # 2 blocks on a 4-way batch
    one_line_error(lambda: apply(packed), "split over 4 devices", "[2] blocks")
  mesh = M.make_mesh({"data": 2, "context": 2}, devices=jax.devices()[:4])
  cp = R.get_rules("fsdp_cp")
  with partition.activate(mesh, cp):                  # 2 blocks on 2 batch x 2 context shards
    one_line_error(lambda: apply(packed), "split over 4 devices", "(batch x context shards)",
                   "[2] blocks")
  no_blocks = tuple(r for r in cp if r[0] != "blocks") + (("blocks", ("data", "fsdp")),)
  packed4, _ = pack_batch(batch, {s: 4 * 64 for s in batch["events"]}, 4)
  with partition.activate(mesh, no_blocks):
    one_line_error(lambda: apply(packed4), "sequence axis over 2 devices", "not the packed blocks")


def test_oneseq_under_context_parallelism_equals_padded_single_device():
  """OneSeq on packed streams on 2 fsdp x 2 context devices (4 blocks, one a device): each device
  unpacks, merges and packs its own examples (the merged rows on ``blocks``), and the logits equal
  the padded batch's on one device; no token buffer crosses the context devices outside the
  embedding tables' lookup."""
  cfg, schema, _ = tiny_kunlun.small()
  cfg.model.update(seq_mode="oneseq")
  cfg.model.oneseq.update(depth=1, kept_len=16)
  model = build_model(cfg, schema)
  _, batch, _ = _case()
  params = tiny_kunlun.host_params(model, batch)
  ref = np.asarray(jax.jit(model.apply)({"params": params}, batch))
  packed, _ = pack_batch(batch, {s: S * NS for s in batch["events"]}, S)
  mesh = M.make_mesh({"fsdp": 2, "context": 2}, devices=jax.devices()[:4])
  rules = R.get_rules("fsdp_cp")
  shardings = partition.param_shardings(model, jax.random.key(0), packed, mesh, rules)
  with partition.activate(mesh, rules):
    p = jax.device_put(params, shardings)
    b = jax.device_put(packed, partition.batch_sharding(mesh, rules))
    compiled = jax.jit(model.apply).lower({"params": p}, b).compile()
    got = compiled({"params": p}, b)
  np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5)
  coll = _context_collectives(compiled.as_text(), mesh)
  token = [c for c in coll if "EventEmbed/shard_map" not in c[2] and any(
      int(d) % NS == 0 for d in re.findall(r"\[([\d,]+)\]", c[1])[0].split(",") if d)]
  assert not token, token
  # the merge and the per-block unpack / pack stay on each device: no collective of rows or
  # tokens (rank >= 2; the stream-type table's gather is rank 1). With the merged rows split over
  # the sequence axis instead, such collectives cross context here (checked).
  merge = [c for c in coll if ("OneSeq" in c[2] or "oneseq_merge" in c[2] or "vmap()" in c[2])
           and re.search(r"\[\d+,\d+", c[1])]
  assert not merge, merge


def test_jagged_kernels_take_one_block():
  jag = jagged.Jagged(jnp.zeros(6, jnp.int32), jnp.zeros(128, jnp.int32),
                      jnp.zeros(128, jnp.int32), 2)
  q = jnp.zeros((128, 2, 8))
  one_line_error(lambda: jagged.jagged_softmax_attention(q, q, q, jag), "2 shards")


@pytest.mark.parametrize("sizes,preset", [({"data": 2}, "dp"), ({"fsdp": 2, "context": 2}, "fsdp_cp")])
def test_pallas_blocks_per_device_equal_the_xla_twin(sizes, preset):
  """backend "pallas" (interpret mode) on 4 blocks over a 2-way batch (``shard_map`` per device,
  its 2 local blocks vmapped) or over 2 batch x 2 context shards (one block a device); values
  and gradients equal the XLA twin's."""
  lengths = np.array([5, 0, 20, 9, 31, 1, 0, 12])
  _, off, seg, pos, _ = pack_blocks({"x": np.zeros((B, 32))}, lengths, S * 64, S)
  jag = jagged.sharded(*(jnp.asarray(a) for a in (off, seg, pos)), B)
  q, k, v = jnp.asarray(np.random.default_rng(0).standard_normal((3, S * 64, 2, 8)), jnp.float32)

  def loss(backend):
    return lambda q, k, v: jnp.sum(packed_ops.block_attention(q, k, v, jag, backend=backend,
                                                              block_size=8) ** 2)

  ref = jax.jit(jax.value_and_grad(loss("xla"), argnums=(0, 1, 2)))(q, k, v)
  mesh = M.make_mesh(sizes, devices=jax.devices()[:math.prod(sizes.values())])
  with partition.activate(mesh, R.get_rules(preset)):
    assert "shard_map" in str(jax.make_jaxpr(loss("pallas"))(q, k, v))
    got = jax.jit(jax.value_and_grad(loss("pallas"), argnums=(0, 1, 2)))(q, k, v)
  for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-5)


def _replica_groups(line: str):
  """The device groups of one collective of the compiled text (logical ids: positions in the
  mesh's device array), from its explicit, iota or mesh-axes replica groups or its permute
  pairs; None when it names none."""
  m = re.search(r"replica_groups=\{(\{[\d,{} ]*\})\}", line)
  if m:
    return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
  m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
  if m:
    a = np.arange(math.prod(int(x) for x in m.group(2).split(","))).reshape(
        [int(x) for x in m.group(2).split(",")])
    if m.group(3):
      a = a.transpose([int(x) for x in m.group(3).split(",")])
    return a.reshape(-1, int(m.group(1).split(",")[-1])).tolist()
  m = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", line)
  if m:
    names = re.findall(r"'(\w+)'=(\d+)", m.group(1))
    keep = [i for i, (n, _) in enumerate(names) if f"'{n}'" in m.group(2)]
    a = np.arange(math.prod(int(k) for _, k in names)).reshape([int(k) for _, k in names])
    a = a.transpose([i for i in range(len(names)) if i not in keep] + keep)
    return a.reshape(-1, math.prod(int(names[i][1]) for i in keep)).tolist()
  m = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", line)
  return [[int(x) for x in p.split(",")] for p in re.findall(r"\{(\d+,\d+)\}", m.group(1))] if m else None


def _context_collectives(hlo: str, mesh):
  """``(kind, result shape text, op_name)`` of every collective whose groups join devices of
  different ``context`` coordinates."""
  ctx = np.indices(mesh.devices.shape)[mesh.axis_names.index("context")].reshape(-1)
  out = []
  for line in hlo.splitlines():
    m = re.search(r"= (\(?[^=]*?\)?) (all-gather|all-reduce|reduce-scatter|all-to-all|"
                  r"collective-permute)(?:-start)?\(", line)
    if not m:
      continue
    groups = _replica_groups(line)
    assert groups is not None, line[:200]
    if any(len({ctx[i] for i in g}) > 1 for g in groups):
      name = re.search(r'op_name="([^"]*)"', line)
      out.append((m.group(2), m.group(1), name.group(1) if name else ""))
  return out


def test_context_parallel_packed_step_equals_padded_single_device():
  """fsdp_cp on 2 fsdp x 2 context devices: 4 blocks, one per device (its 2 examples' whole
  histories), so the jagged ops need no token of another device."""
  hlo, mesh = _sharded_step({"fsdp": 2, "context": 2}, "fsdp_cp")
  coll = _context_collectives(hlo, mesh)
  # no token buffer crosses the context devices, except in the row-sharded tables' shard_map
  # (sharding.embedding: its overflow fallback, and the dense table gradient of this test's
  # loss, which sums the looked-up rows' gradients per batch shard as for the padded model;
  # the padded model has both as well)
  token = [c for c in coll if "EventEmbed/shard_map" not in c[2] and any(
      int(d) % NS == 0 for d in re.findall(r"\[([\d,]+)\]", c[1])[0].split(",") if d)]
  assert not token, token
  # the jagged ops' only collectives over context: the HSP summaries' all-gathers to the batch
  # axes (forward, 2 HSPs) and PFFN's generated keys / values' gradients back to them (backward,
  # k and v): per-example rows, B / 2 = 4 examples of a batch shard
  jagged_ops = [c for c in coll if "GDPA" in c[2]]
  assert sorted((k, n.split("KunlunLayer_0/")[-1].split("/")[0]) for k, _, n in jagged_ops) == [
      ("all-gather", "click_final_hsp"), ("all-gather", "click_hsp"),
      ("all-gather", "click_pffn"), ("all-gather", "click_pffn")], jagged_ops
  for _, shape, _ in jagged_ops:
    dims = [int(d) for d in re.search(r"\[([\d,]+)\]", shape).group(1).split(",")]
    assert dims[0] == B // 2 or dims[0] * dims[1] == B // 2, shape
