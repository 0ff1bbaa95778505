"""Progress: MFU formula, CPU peak is unknown, JSONL + TensorBoard files written."""

import glob
import io
import json
import os

import jax

from kunlun.train import progress


def test_mfu_and_peak():
  assert progress.device_peak_flops(jax.devices("cpu")[0]) is None
  assert progress.mfu(1e12, 0.5, 4, None) is None
  assert abs(progress.mfu(989e12, 2.0, 2, 989e12) - 0.25) < 1e-12


def test_log_writes_jsonl_tb_and_line(tmp_path):
  out = io.StringIO()
  p = progress.Progress(str(tmp_path), total_steps=10, stream=out)
  p.log(5, {"loss": 0.5, "ne": {"click": 0.9, "conversion": float("nan")}, "mfu": None,
            "examples_per_s": 100.0, "step_time_ms": 3.0})
  p.close()
  rec = json.loads(open(tmp_path / "metrics.jsonl").read().splitlines()[0])
  assert rec["step"] == 5 and rec["ne"]["click"] == 0.9 and rec["ne"]["conversion"] is None
  assert glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))
  line = out.getvalue()
  assert "step 5/10" in line and "click=0.9000" in line and "MFU n/a" in line


def test_lagged_stats_fetch_order_and_drain():
  """Stats stay on the device until ``lag`` newer steps are queued; a drain fetches the rest, in
  step order, as host numpy values."""
  import jax.numpy as jnp
  import numpy as np
  import pytest

  lag = progress.LaggedStats(lag=2)
  got = []
  for s in range(1, 6):
    lag.push(s, {"loss": jnp.float32(s) * 2, "ok": jnp.bool_(s != 3)})
    got += lag.pop(drain=s == 5)
    assert len(lag) == (0 if s == 5 else min(s, 2))
  assert [g[0] for g in got] == [1, 2, 3, 4, 5]
  assert [float(g[1]["loss"]) for g in got] == [2.0, 4.0, 6.0, 8.0, 10.0]
  assert [bool(g[1]["ok"]) for g in got] == [True, True, False, True, True]
  assert all(isinstance(g[1]["loss"], np.ndarray | np.generic) for g in got)
  assert all(a[2] <= b[2] for a, b in zip(got, got[1:], strict=False))      # fetch times
  zero = progress.LaggedStats(lag=0)
  zero.push(1, {"loss": jnp.float32(1)})
  assert [s for s, *_ in zero.pop()] == [1]
  with pytest.raises(ValueError, match="lag must be >= 0"):
    progress.LaggedStats(lag=-1)


def _events(path):
  """(step, tag, value) of every scalar in a TensorBoard event file: an independent TFRecord
  parse (length, crc, payload, crc) with the Event proto."""
  import struct

  from tensorboardX.proto import event_pb2
  out, data, i = [], open(path, "rb").read(), 0
  while i < len(data):
    n = struct.unpack("<Q", data[i:i + 8])[0]
    ev = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
    i += 12 + n + 4
    out += [(ev.step, v.tag, v.simple_value) for v in ev.summary.value]
  return out


def test_tensorboard_scalars_are_written_in_the_calling_thread(tmp_path):
  p = progress.Progress(str(tmp_path), total_steps=3, stream=io.StringIO())
  p.log(1, {"loss": 0.5, "ne": {"click": 0.75}})
  files = glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))
  assert len(files) == 1
  assert sorted(_events(files[0])) == [(1, "loss", 0.5), (1, "ne/click", 0.75)]   # no close
  p.close()


def test_write_errors_never_raise(tmp_path, monkeypatch):
  """ENOSPC from metrics.jsonl or TensorBoard sets ``disk_full`` (train.py stops, keeping its
  newest checkpoint); another OSError is one warning and that log is off; no exception."""
  import errno

  class Failing:
    def __init__(self, code):
      self.code, self.closed = code, False

    def write(self, _):
      raise OSError(self.code, os.strerror(self.code))

    def flush(self):
      pass

    def close(self):
      self.closed = True

  warnings = []
  p = progress.Progress(str(tmp_path), total_steps=3, stream=io.StringIO(), warn=warnings.append)
  p._jsonl = Failing(errno.EIO)
  p.log(1, {"loss": 0.5})
  p.log(2, {"loss": 0.5})
  assert p.disk_full is None and p._jsonl is None and len(warnings) == 1
  assert "metrics.jsonl" in warnings[0] and "training goes on" in warnings[0]

  def full(*a, **k):
    raise OSError(errno.ENOSPC, "No space left on device")
  monkeypatch.setattr(progress._TensorBoard, "scalars", full)
  p.log(3, {"loss": 0.5})
  assert p.disk_full == "tb/: No space left on device" and p._tb is None
  p.close()
  q = progress.Progress(str(tmp_path / "q"), total_steps=3, stream=io.StringIO())
  q._jsonl = Failing(errno.ENOSPC)
  q.log(1, {"loss": 0.5})
  assert q.disk_full == "metrics.jsonl: No space left on device"
  q.close()


def test_event_file_is_closed_even_when_its_flush_fails(tmp_path):
  """A full disk at close: the event file's flush fails, the file is closed all the same (left
  open, the garbage collector would flush it again and print a traceback)."""
  import errno

  class Raw:
    closed = False

    def write(self, _):
      pass

    def flush(self):
      raise OSError(errno.ENOSPC, "No space left on device")

    def close(self):
      self.closed = True
      raise OSError(errno.ENOSPC, "No space left on device")
  p = progress.Progress(str(tmp_path), total_steps=3, stream=io.StringIO(), warn=_no_warning)
  raw = Raw()
  p._tb._w._py_recordio_writer._writer = raw
  p.close()                                   # no exception
  assert raw.closed


def _no_warning(msg):
  raise AssertionError(msg)
