"""Progress reporting: a printed line, JSONL in the workdir and TensorBoard event files
(tensorboardX, no TensorFlow), plus MFU against a device peak table, and ``LaggedStats``, which
fetches a step's statistics from the device only once later steps are queued.

A write that fails never raises: lack of space (ENOSPC / EDQUOT) sets ``disk_full`` (train.py then
stops, keeping its newest checkpoint); any other error is one warning and that log is off from
then on (training goes on). TensorBoard events are written synchronously (tensorboardX's event
writer without its background thread, whose errors would be tracebacks from the thread)."""

from __future__ import annotations

import collections
import errno
import json
import math
import os
import sys
import time

import jax
from tensorboardX.event_file_writer import EventsWriter
from tensorboardX.proto import event_pb2
from tensorboardX.summary import scalar

# Dense bf16 peak FLOP/s per device, by a substring of ``device.device_kind``.
PEAK_BF16_FLOPS = (
    ("H200", 989e12),
    ("H100", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("L4", 121e12),
)


def device_peak_flops(device=None) -> float | None:
  """Peak dense bf16 FLOP/s of ``device`` (default: the first device); None when unknown (CPU)."""
  device = device or jax.devices()[0]
  if device.platform == "cpu":
    return None
  kind = device.device_kind.upper()
  for name, peak in PEAK_BF16_FLOPS:
    if name in kind:
      return peak
  return None


def mfu(flops_per_step: float | None, step_time_s: float, num_devices: int,
        peak_flops: float | None) -> float | None:
  """Model FLOPs utilisation = FLOPs per step / (step time x devices x peak); None if unknown."""
  if not flops_per_step or not peak_flops or step_time_s <= 0:
    return None
  return flops_per_step / (step_time_s * num_devices * peak_flops)


class LaggedStats:
  """Per-step statistics kept on the device and fetched ``lag`` steps later.

  ``push(step, stats)`` after dispatching a step; ``pop(drain)`` returns ``[(step, host_stats,
  t)]`` for every pending step but the newest ``lag`` (all of them with ``drain=True``), in step
  order, each fetched with ``jax.device_get`` (which waits for that step only) and stamped with
  the time its fetch returned. A fetch of step ``s - lag`` then overlaps step ``s`` on the device:
  the host never stalls the device queue for a log line (``lag=0`` fetches every step at once).
  Drain before anything that must see every step's outcome (a checkpoint, the end, a stop).
  """

  def __init__(self, lag: int = 1):
    if lag < 0:
      raise ValueError(f"metrics lag must be >= 0, got {lag}")
    self.lag = int(lag)
    self._pending = collections.deque()

  def push(self, step: int, stats) -> None:
    self._pending.append((int(step), stats))

  def pop(self, drain: bool = False) -> list:
    out = []
    while len(self._pending) > (0 if drain else self.lag):
      step, stats = self._pending.popleft()
      stats = jax.device_get(stats)
      out.append((step, stats, time.perf_counter()))
    return out

  def __len__(self) -> int:
    return len(self._pending)


def _fmt(x, spec=".4f"):
  return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def _disk_full(e: OSError) -> bool:
  return e.errno in (errno.ENOSPC, errno.EDQUOT)


class _TensorBoard:
  """Scalars to ``<logdir>/events.out.tfevents.*``, written and flushed in the calling thread."""

  def __init__(self, logdir: str):
    os.makedirs(logdir, exist_ok=True)
    self._w = EventsWriter(os.path.join(logdir, "events"))

  def scalars(self, step: int, values: dict) -> None:
    now = time.time()
    for tag, x in values.items():
      self._w.write_event(event_pb2.Event(wall_time=now, step=int(step), summary=scalar(tag, x)))
    self._w.flush()

  def close(self) -> None:
    """Flushes and closes the event file; the file is closed even when the flush fails (a full
    disk), so nothing is left for the garbage collector to flush and report."""
    try:
      self._w.flush()
    finally:
      self._w._py_recordio_writer._writer.close()


class Progress:
  """Writes ``<workdir>/metrics.jsonl`` and ``<workdir>/tb/`` and prints one line per log.

  Only process 0 writes (``enabled``). Scalars may be nested one level (``{"ne": {task: x}}``);
  they are flattened as ``ne/task`` for TensorBoard. Write errors: module doc.
  """

  def __init__(self, workdir: str, total_steps: int, enabled: bool = True, stream=None,
               warn=None):
    self.total, self.enabled = total_steps, enabled
    self.stream = stream or sys.stdout
    self.warn = warn or (lambda m: print(f"warning: {m}", file=sys.stderr, flush=True))
    self.disk_full: str | None = None
    self._jsonl = self._tb = None
    if enabled:
      self._jsonl_path = os.path.join(workdir, "metrics.jsonl")
      self._jsonl = self._guard("metrics.jsonl", lambda: open(self._jsonl_path, "a"))
      self._tb = self._guard("tb/", lambda: _TensorBoard(os.path.join(workdir, "tb")))

  def _guard(self, what: str, fn):
    """``fn()``; an OSError is recorded (disk full) or warned about once; returns None then."""
    try:
      return fn()
    except OSError as e:
      msg = f"{what}: {e.strerror or e}"
      if _disk_full(e):
        self.disk_full = self.disk_full or msg
      else:
        self.warn(f"cannot write {msg}; that log is off for the rest of the run (training "
                  "goes on)")
      return None

  def log(self, step: int, scalars: dict, line: bool = True) -> None:
    if not self.enabled:
      return
    rec = _finite_or_none({"step": int(step), "time": time.time(), **scalars})
    if self._jsonl is not None:
      text = json.dumps(rec, default=_json_default) + "\n"

      def write():
        self._jsonl.write(text)
        self._jsonl.flush()
        return True
      if self._guard("metrics.jsonl", write) is None:
        self._close_quietly(self._jsonl)
        self._jsonl = None
    if self._tb is not None:
      flat = {}
      for k, v in scalars.items():
        for name, x in (v.items() if isinstance(v, dict) else [(None, v)]):
          if isinstance(x, (int, float)) and x is not None and math.isfinite(x):
            flat[k if name is None else f"{k}/{name}"] = x
      if flat and self._guard("tb/", lambda: self._tb.scalars(step, flat) or True) is None:
        self._close_quietly(self._tb)
        self._tb = None
    if line:
      self.print_line(step, scalars)

  def print_line(self, step: int, s: dict) -> None:
    ne = " ".join(f"{t}={_fmt(v)}" for t, v in (s.get("ne") or {}).items())
    mfu_s = "n/a" if s.get("mfu") is None else f"{100 * s['mfu']:.2f}%"
    msg = (f"step {step}/{self.total} | loss {_fmt(s.get('loss'))} | NE {ne} | "
           f"{_fmt(s.get('examples_per_s'), '.0f')} ex/s | "
           f"step {_fmt(s.get('step_time_ms'), '.1f')} ms"
           f" | MFU {mfu_s}")
    if s.get("bad_steps"):
      msg += f" | skipped {s['bad_steps']}"
    print(msg, file=self.stream, flush=True)

  @staticmethod
  def _close_quietly(f) -> None:
    try:
      f.close()
    except (OSError, ValueError):
      pass

  def close(self) -> None:
    for f in (self._jsonl, self._tb):
      if f is not None:
        self._close_quietly(f)
    self._jsonl = self._tb = None


def _json_default(x):
  try:
    return float(x)
  except (TypeError, ValueError):
    return str(x)


def _finite_or_none(x):
  """NaN / inf -> None, recursively (JSON has no NaN)."""
  if isinstance(x, dict):
    return {k: _finite_or_none(v) for k, v in x.items()}
  if isinstance(x, float) and not math.isfinite(x):
    return None
  return x
