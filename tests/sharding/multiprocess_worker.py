"""Worker for test_multiprocess.py (run as a subprocess; not collected by pytest).

  train:   python -m tests.sharding.multiprocess_worker train PID NPROC PORT OUT_DIR
           (4 CPU devices per process, gloo collectives, global mesh data=NPROC x fsdp=4)
  restore: python -m tests.sharding.multiprocess_worker restore 0 1 0 OUT_DIR
           (one process, 8 devices, fsdp=8: restores the checkpoint, retrains from scratch)
"""

import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
import jax  # noqa: E402

MODE, PID, NPROC, PORT, OUT = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
jax.config.update("jax_num_cpu_devices", 4 if MODE == "train" else 8)
if MODE == "train":
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{PORT}", num_processes=NPROC,
                             process_id=PID, initialization_timeout=120)

import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from sharding import mesh as M  # noqa: E402
from sharding import partition
from sharding import rules as R
from tests.sharding.toy import Toy, toy_batch  # noqa: E402

STEPS, B = 3, 16
MODEL, TX = Toy(vocab=64), optax.sgd(0.5, momentum=0.9)


def step(params, opt, batch):
  def loss_fn(p):
    logits = MODEL.apply({"params": p}, batch, train=True)
    return optax.sigmoid_binary_cross_entropy(logits, batch["labels"]).mean()
  loss, g = jax.value_and_grad(loss_fn)(params)
  u, opt = TX.update(g, opt, params)
  return optax.apply_updates(params, u), opt, loss


def train(mesh, rules):
  batches = [toy_batch(B=B, seed=s) for s in range(STEPS)]
  params, _ = partition.init_sharded(MODEL, jax.random.key(0), batches[0], mesh, rules)
  bs = partition.batch_sharding(mesh, rules)
  nproc, pid = jax.process_count(), jax.process_index()
  with partition.activate(mesh, rules):
    opt = jax.jit(TX.init, out_shardings=partition.state_shardings(TX.init, params))(params)
    f = jax.jit(step)
    losses = []
    for b in batches:
      local = jax.tree.map(lambda x: x[pid * B // nproc:(pid + 1) * B // nproc], b)
      gb = jax.tree.map(lambda x: jax.make_array_from_process_local_data(bs, x), local)
      params, opt, loss = f(params, opt, gb)
      losses.append(float(loss))
  return params, opt, losses


def main():
  if MODE == "train":
    mesh = M.make_mesh({"fsdp": -1}, {"data": NPROC})
    assert dict(mesh.shape) == {"data": NPROC, "fsdp": 4, "tensor": 1, "context": 1, "expert": 1}
    rules = R.get_rules("fsdp")
    params, opt, losses = train(mesh, rules)
    mngr = ocp.CheckpointManager(os.path.join(OUT, "ckpt"))
    mngr.save(STEPS, args=ocp.args.Composite(params=ocp.args.StandardSave(params),
                                             opt=ocp.args.StandardSave(opt)))
    mngr.wait_until_finished()
    mngr.close()
    full = jax.tree.map(lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)), params)
    if PID == 0:
      flat = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(full)}
      np.savez(os.path.join(OUT, "params.npz"), **flat)
      with open(os.path.join(OUT, "train.json"), "w") as f:
        json.dump({"losses": losses, "devices": jax.device_count(), "mesh": dict(mesh.shape)}, f)
    multihost_utils.sync_global_devices("done")
  else:
    mesh, rules = M.make_mesh({"fsdp": 8}), R.get_rules("fsdp_tp")   # another mesh and rule set
    batch = toy_batch(B=B, seed=0)
    target = partition.abstract_params(MODEL, jax.random.key(0), batch, mesh, rules)
    mngr = ocp.CheckpointManager(os.path.join(OUT, "ckpt"))
    restored = mngr.restore(mngr.latest_step(), args=ocp.args.Composite(
        params=ocp.args.StandardRestore(target)))["params"]
    saved = np.load(os.path.join(OUT, "params.npz"))
    for k, x in jax.tree_util.tree_leaves_with_path(restored):
      np.testing.assert_array_equal(np.asarray(x), saved[jax.tree_util.keystr(k)])
      assert x.sharding.mesh.shape["fsdp"] == 8
    _, _, losses = train(mesh, R.get_rules("fsdp"))
    with open(os.path.join(OUT, "restore.json"), "w") as f:
      json.dump({"losses": losses, "restored_step": int(mngr.latest_step())}, f)


if __name__ == "__main__":
  main()
