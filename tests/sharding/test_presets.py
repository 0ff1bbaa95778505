"""Every rule preset on 8 CPU devices against a single-device run of the same toy model.

One compiled train step per preset checks: sharded init == unsharded init; parameter specs;
forward logits, loss and the updated parameters == the single-device step; the collectives in the
compiled HLO (expected kinds present, none carrying a whole embedding-table shard); per-device
bytes of params + optimizer state (XLA's memory analysis) shrink by the preset's factor.
"""

import functools

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from sharding import checks, partition
from sharding import mesh as M
from sharding import rules as R
from tests.sharding.toy import Toy, toy_batch

VOCAB, DIM = 4096, 16
MODEL = Toy(vocab=VOCAB, dim=DIM)
TX = optax.sgd(0.5, momentum=0.9)
ALL = ("data", "fsdp", "tensor", "context", "expert")

# preset -> (mesh flag, expected specs of some parameters, min dense shrink factor,
#            (op, group size) pairs that must appear in the train step's HLO)
CASES = {
    "dp": ("data=2,fsdp=4", {"mlp_in": P(None, None), "wq": P(None, None, None),
                             "w_in": P(None, None, None)}, 1, {("all-reduce", 8)}),
    "fsdp": ("fsdp=8", {"mlp_in": P("fsdp", None), "wq": P("fsdp", None, None),
                        "w_in": P(None, "fsdp", None)}, 8, {("all-gather", 8), ("all-reduce", 8)}),
    "fsdp_tp": ("fsdp=4,tensor=2", {"mlp_in": P("fsdp", "tensor"), "wq": P("fsdp", "tensor", None),
                                    "w_in": P(None, "fsdp", "tensor")}, 4,
                {("all-gather", 4), ("all-reduce", 2)}),
    "fsdp_cp": ("fsdp=4,context=2", {"mlp_in": P(("fsdp", "context"), None),
                                     "wq": P(("fsdp", "context"), None, None),
                                     "w_in": P(None, ("fsdp", "context"), None)}, 8,
                {("all-gather", 8), ("all-gather", 2)}),
    "fsdp_ep": ("fsdp=4,expert=2", {"mlp_in": P(("fsdp", "expert"), None),
                                    "wq": P(("fsdp", "expert"), None, None),
                                    "w_in": P("expert", "fsdp", None)}, 8,
                {("all-gather", 8), ("all-gather", 4)}),
    "5d": ("fsdp=2,tensor=2,expert=2", {"mlp_in": P(("fsdp", "context", "expert"), "tensor"),
                                        "wq": P(("fsdp", "context", "expert"), "tensor", None),
                                        "w_in": P("expert", ("fsdp", "context"), "tensor")}, 4,
           {("all-gather", 4), ("all-reduce", 2)}),
}


def step(params, opt, batch):
  def loss_fn(p):
    logits = MODEL.apply({"params": p}, batch, train=True)
    return optax.sigmoid_binary_cross_entropy(logits, batch["labels"]).mean(), logits
  (loss, logits), g = jax.value_and_grad(loss_fn, has_aux=True)(params)
  u, opt = TX.update(g, opt, params)
  return optax.apply_updates(params, u), opt, loss, logits


def _nbytes(tree):
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _init_state(rng, batch):
  params = nn.meta.unbox(MODEL.init(rng, batch)["params"])
  return params, TX.init(params)


@functools.cache
def reference():
  """Single-device init and train step (no mesh, no rules): the batch, the initial params, the
  step's outputs, its memory analysis and the initial optimizer state (host copies)."""
  batch = toy_batch(B=16, vocab=VOCAB)
  params, opt = jax.jit(lambda k: _init_state(k, batch))(jax.random.key(0))    # on device 0
  compiled = jax.jit(step).lower(params, opt, batch).compile()
  out = jax.tree.map(np.asarray, compiled(params, opt, batch))
  params, opt = jax.tree.map(np.asarray, (params, opt))
  return batch, params, out, checks.memory_per_device(compiled), opt


def _flat(tree):
  return {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.mark.parametrize("preset", list(CASES))
def test_preset_matches_single_device(preset):
  flag, want_specs, factor, want_ops = CASES[preset]
  batch, ref_params, (ref_new, _, ref_loss, ref_logits), ref_mem, ref_opt = reference()
  mesh, rules = M.make_mesh(M.parse_mesh_flag(flag)), R.get_rules(preset)

  params, shardings = partition.init_sharded(MODEL, jax.random.key(0), batch, mesh, rules)
  # sharded init produces the same values as the unsharded init (partitionable threefry)
  for k, v in _flat(params).items():
    np.testing.assert_allclose(np.asarray(v), _flat(ref_params)[k], rtol=1e-6, atol=1e-7, err_msg=k)
  specs = {k.split("'")[-2]: v.sharding.spec for k, v in _flat(params).items()}
  assert specs["embedding"] == P(ALL, None)
  for name, spec in want_specs.items():
    assert specs[name] == spec, (name, specs[name])
  assert _flat(shardings).keys() == _flat(params).keys()

  with partition.activate(mesh, rules):
    opt = jax.device_put(ref_opt, partition.state_shardings(TX.init, params))
    b = jax.device_put(batch, partition.batch_sharding(mesh, rules))
    compiled = jax.jit(step).lower(params, opt, b).compile()
    new, _, loss, logits = compiled(params, opt, b)

  np.testing.assert_allclose(np.asarray(logits), ref_logits, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
  for k, v in _flat(new).items():
    np.testing.assert_allclose(np.asarray(v), _flat(ref_new)[k], rtol=1e-4, atol=1e-5, err_msg=k)
    assert v.sharding.is_equivalent_to(_flat(params)[k].sharding, v.ndim), k

  # HLO: expected collectives present; none moves a table shard's worth of rows (or more)
  hlo = compiled.as_text()
  ops = checks.collectives(hlo)
  assert want_ops <= {(c["op"], c["group"]) for c in ops}, sorted({(c["op"], c["group"]) for c in ops})
  shard_elems = VOCAB // 8 * DIM
  big = [c["line"] for c in ops if any(int(np.prod(s)) >= shard_elems for s in c["shapes"])]
  assert not big, big

  # per-device bytes of params + momentum: XLA's argument bytes minus this device's batch slice
  mem = checks.memory_per_device(compiled)
  batch_dev = sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
                  for x in jax.tree.leaves(b))
  state_dev = mem["argument"] - batch_dev
  table = VOCAB * DIM * 4
  dense = _nbytes(ref_params) - table
  assert ref_mem["argument"] - _nbytes(batch) == 2 * (dense + table)
  assert 2 * (dense + table) / 8 <= state_dev <= 2 * (dense / factor + table / 8) * 1.05 + 64, (
      state_dev, dense, table)


@pytest.mark.slow
def test_replicated_table_is_detected():
  """Control: a table replicated over ``data`` all-reduces a table-shard-sized gradient."""
  rules = tuple(("table_rows", "fsdp") if r[0] == "table_rows" else r for r in R.get_rules("fsdp"))
  mesh = M.make_mesh({"data": 2, "fsdp": 4})
  batch, host_params, *_, host_opt = reference()
  params = jax.device_put(host_params, partition.param_shardings(MODEL, jax.random.key(0), batch,
                                                                 mesh, rules))
  with partition.activate(mesh, rules):
    opt = jax.device_put(host_opt, partition.state_shardings(TX.init, params))
    b = jax.device_put(batch, partition.batch_sharding(mesh, rules))
    hlo = jax.jit(step).lower(params, opt, b).compile().as_text()
  shard = (VOCAB // 4, DIM)
  hits = [c for c in checks.collectives(hlo) if c["op"] == "all-reduce" and shard in c["shapes"]]
  assert hits and all(c["group"] == 2 for c in hits)
