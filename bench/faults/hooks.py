"""Runs train.py / eval.py with injected faults (for bench/faults/run.py and the fault tests).

  KUNLUN_FAULTS='{"kill_at_step": 7}' python bench/faults/hooks.py train.py --workdir=... ...
Notes: docs/guides/benchmarks.md, ``bench/faults/hooks.py``."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import runpy
import signal
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from orbax.checkpoint._src.handlers import json_checkpoint_handler as jh  # noqa: E402

from data import elastic, pipeline, shards  # noqa: E402
from kunlun.train import checkpoint, progress  # noqa: E402


def _install(faults: dict) -> None:
  calls = {"n": 0}
  orig_put = pipeline.device_put_batch
  full = lambda: (faults.get("disk_full_at_step") is not None
                  and calls["n"] >= int(faults["disk_full_at_step"]))

  def put(batch, sharding):
    calls["n"] += 1
    n = calls["n"]
    if faults.get("kill_at_step") is not None and n == int(faults["kill_at_step"]) + 1:
      os.kill(os.getpid(), signal.SIGKILL)
    if faults.get("batch_log"):
      keys = np.stack([batch["user_id"], batch["ad_id"], batch["request_ts"],
                       batch["example_mask"].astype(np.int64)]).astype(np.int64)
      with open(faults["batch_log"], "a") as f:
        f.write(f"{n} {hashlib.sha1(keys.tobytes()).hexdigest()}\n")
    if faults.get("nan_at_step") is not None and n == int(faults["nan_at_step"]):
      batch = dict(batch, dense=np.full_like(batch["dense"], np.nan))
    return orig_put(batch, sharding)
  pipeline.device_put_batch = put

  if faults.get("kill_after_save") is not None:
    orig_save = checkpoint.Checkpointer.save

    def save(self, step, *a, **k):
      orig_save(self, step, *a, **k)
      if step == int(faults["kill_after_save"]):
        os.kill(os.getpid(), signal.SIGKILL)
    checkpoint.Checkpointer.save = save

  if faults.get("data_error_at_step") is not None:
    orig_next = elastic.BatchIterator.__next__

    def next_(self):
      if calls["n"] == int(faults["data_error_at_step"]):
        raise shards.DamagedChunkError("train/feed-00000-of-00001.arrayrecord", 10, 19, 12,
                                       "injected")
      return orig_next(self)
    elastic.BatchIterator.__next__ = next_

  if faults.get("kill_in_write") == "parquet":
    orig_write = pq.write_table

    def write_table(table, where, *a, **k):
      orig_write(table, where, *a, **k)
      with open(where, "r+b") as f:                     # as if killed mid-write
        f.truncate(os.path.getsize(where) // 2)
      os.kill(os.getpid(), signal.SIGKILL)
    pq.write_table = write_table

  if faults.get("disk_full_at_step") is not None:
    enospc = lambda: OSError(errno.ENOSPC, "No space left on device (injected)")

    class _Full:
      def __init__(self, f):
        self._f = f

      def write(self, text):
        if full():
          raise enospc()
        return self._f.write(text)

      def __getattr__(self, name):
        return getattr(self._f, name)
    progress.open = lambda *a, **k: _Full(open(*a, **k))
    orig_scalars = progress._TensorBoard.scalars

    def scalars(self, *a, **k):
      if full():
        raise enospc()
      return orig_scalars(self, *a, **k)
    progress._TensorBoard.scalars = scalars
    orig_json = jh.JsonCheckpointHandler._save_fn

    async def json_save(self, x, directory):
      if full():
        raise enospc()
      return await orig_json(self, x, directory)
    jh.JsonCheckpointHandler._save_fn = json_save

  if faults.get("save_oserror"):
    bad = {int(s) for s in faults["save_oserror"]}
    orig_fn = jh.JsonCheckpointHandler._save_fn

    async def save_fn(self, x, directory):
      if isinstance(x, dict) and x.get("step") in bad:
        raise OSError(errno.EIO, "Input/output error (injected)")
      return await orig_fn(self, x, directory)
    jh.JsonCheckpointHandler._save_fn = save_fn


def main() -> None:
  script, args = sys.argv[1], sys.argv[2:]
  _install(json.loads(os.environ.get("KUNLUN_FAULTS", "{}")))
  sys.argv = [script, *args]
  runpy.run_path(os.path.join(ROOT, script), run_name="__main__")


if __name__ == "__main__":
  main()
