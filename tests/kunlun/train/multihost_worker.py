"""Worker for test_multihost_agreement.py (a subprocess; not collected by pytest).

  python -m tests.kunlun.train.multihost_worker PID NPROC PORT OUT_DIR

Two jax.distributed processes (gloo, one CPU device each) check that they agree:
  * the workdir lock: on a free workdir process 0 holds it and both go on; on one held by another
    program both stop with a LockError (process 1's names process 0);
  * a restore that fails on one process only (step 2 fails its checksums on process 1): both fall back to
    step 1 together, and step 2 is moved aside once.
Writes OUT_DIR/result_<PID>.json.
"""

import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
import jax  # noqa: E402

PID, NPROC, PORT, OUT = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
jax.config.update("jax_num_cpu_devices", 1)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{PORT}", num_processes=NPROC,
                           process_id=PID, initialization_timeout=120)

import grain  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from kunlun.train import checkpoint  # noqa: E402
from kunlun.utils import lock  # noqa: E402

res = {"pid": PID}
os.makedirs(os.path.join(OUT, "free"), exist_ok=True)
lk = lock.acquire_all(os.path.join(OUT, "free"))
res["free_held_here"] = lk.held
lk.release()
try:
  lock.acquire_all(os.path.join(OUT, "held"))
  res["held_error"] = None
except lock.LockError as e:
  res["held_error"] = str(e)

mesh = jax.make_mesh((NPROC,), ("x",))
sh = NamedSharding(mesh, P("x"))


def tree(v):
  local = np.random.default_rng(10 * int(v) + PID).normal(size=(4, 3)).astype(np.float32) + v
  return {"w": jax.make_array_from_process_local_data(sh, local)}


def data_iter():
  return iter(grain.MapDataset.range(100).to_iter_dataset().batch(4))


d = os.path.join(OUT, "ck")
ck = checkpoint.Checkpointer(d, keep=5)
for s in (1, 2):
  ck.save(s, tree(float(s)), tree(0.0), jax.random.key(s), data_iter())
  ck.wait()
ck.close()

if PID == 1:      # on this process alone step 2 fails its checksums (the collective digest ran)
  orig = checkpoint.tree_digest
  calls = {"n": 0}

  def digest(tree):
    got = orig(tree)
    calls["n"] += 1
    return {k: "f" * 16 for k in got} if calls["n"] == 1 else got     # step 2's params
  checkpoint.tree_digest = digest
warnings = []
ck = checkpoint.Checkpointer(d, warn=warnings.append)
abstract = checkpoint.abstract_like(tree(0.0))
step, params, _, _ = ck.restore_latest(abstract, abstract, data_iter())
res["restored_step"] = step
res["value_ok"] = bool(np.array_equal(np.asarray(params["w"].addressable_shards[0].data),
                                      np.asarray(tree(1.0)["w"].addressable_shards[0].data)))
res["warnings"] = warnings
res["steps_after"] = ck.all_steps()
ck.close()
res["moved"] = sorted(x for x in os.listdir(d) if ".corrupt-" in x)
with open(os.path.join(OUT, f"result_{PID}.json"), "w") as f:
  json.dump(res, f)
