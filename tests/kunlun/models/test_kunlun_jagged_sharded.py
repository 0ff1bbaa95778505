"""Packed (jagged) towers on a data-parallel mesh: a batch packed per batch shard (S blocks) trains
like the padded batch on one device, with no all-gather of the token buffers."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from data.fake import random_batch
from data.pipeline import pack_batch
from kunlun.configs.types import seq_lens
from kunlun.nn.losses import masked_bce
from sharding import partition
from sharding import mesh as M
from sharding import rules as R
from tests.sharding import tiny_kunlun

B, S, NS = 8, 4, 192          # 4 blocks of 2 examples, 192 tokens each (token dims stand out)


def _loss_and_grad(model):
  def f(p, b):
    return masked_bce(model.apply({"params": p}, b, True), b["labels"], b["label_mask"])[0]
  return jax.value_and_grad(f)


def _case():
  cfg, schema, model = tiny_kunlun.small()
  batch = random_batch(schema, B, seq_lens(cfg), seed=3)
  for ev in batch["events"].values():             # empty histories, in two different blocks
    ev["length"][[1, 6]] = 0
    for k, v in ev.items():
      if k != "length":
        v[[1, 6]] = 0
  return model, batch, tiny_kunlun.host_params(model, batch)


def _token_gathers(hlo: str):
  """op_names of the all-gathers whose result holds the tokens of more than one block."""
  out = []
  for line in hlo.splitlines():
    m = re.search(r"= \(?\w+\[([\d,]*)\][^=]*? all-gather(?:-start)?\(", line)
    if not m:
      continue
    dims = [int(d) for d in m.group(1).split(",") if d]
    pairs = zip(dims, dims[1:])
    if any(d in (k * NS for k in range(2, S + 1)) for d in dims) or any(
        a > 1 and b == NS for a, b in pairs):
      name = re.search(r'op_name="([^"]*)"', line)
      out.append(name.group(1) if name else line.strip()[:200])
  return out


def test_sharded_packed_step_equals_padded_single_device():
  model, batch, params = _case()
  loss_ref, g_ref = jax.jit(_loss_and_grad(model))(params, batch)
  packed, dropped = pack_batch(batch, {s: S * NS for s in batch["events"]}, S)
  assert not any(dropped.values())
  mesh = M.make_mesh({"data": 2, "fsdp": 2}, devices=jax.devices()[:4])
  rules = R.get_rules("fsdp")
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
  # the jagged ops run per block: the only token-sized all-gathers are the row-sharded tables'
  # overflow fallback (sharding.embedding, a lax.cond branch the padded model has as well)
  gathers = _token_gathers(compiled.as_text())
  assert all("EventEmbed/shard_map/cond" in g for g in gathers), gathers


def _one_line_error(fn, *words):
  with pytest.raises(ValueError) as e:
    fn()
  msg = str(e.value)
  assert "\n" not in msg and all(w in msg for w in words), msg


def test_bad_shard_counts_are_one_line_errors():
  model, batch, params = _case()
  apply = lambda b: jax.eval_shape(lambda p: model.apply({"params": p}, b), params)
  packed, _ = pack_batch(batch, {s: 2 * 64 for s in batch["events"]}, 2)
  bad = dict(packed, events={s: dict(ev, offsets=np.zeros(B + 3, np.int32))  # 3 blocks: 8 % 3
                             for s, ev in packed["events"].items()})
  _one_line_error(lambda: apply(bad), "offsets [11]", "S dividing B=8")
  mesh = M.make_mesh({"data": 4}, devices=jax.devices()[:4])
  with partition.activate(mesh, R.get_rules("dp")):   # 2 blocks on a 4-way batch
    _one_line_error(lambda: apply(packed), "split over 4 devices", "[2] blocks")
  mesh = M.make_mesh({"data": 2, "context": 2}, devices=jax.devices()[:4])
  with partition.activate(mesh, R.get_rules("fsdp_cp")):
    _one_line_error(lambda: apply(packed), "context parallelism", "over 2 devices")


def test_jagged_kernels_take_one_block():
  from pallas_kernels import jagged
  jag = jagged.Jagged(jnp.zeros(6, jnp.int32), jnp.zeros(128, jnp.int32),
                      jnp.zeros(128, jnp.int32), 2)
  q = jnp.zeros((128, 2, 8))
  _one_line_error(lambda: jagged.jagged_softmax_attention(q, q, q, jag), "2 shards")
