"""startup.quiet_checkpoint_logs drops asyncio's "never retrieved" report of a task that failed
inside orbax (leftover reads of a failed restore, logged at garbage collection, with a traceback)
or a TensorStore future that failed (a read, or a save's write on a full disk) and keeps every
other asyncio report."""

import asyncio
import gc
import logging
import weakref

from kunlun.train import startup

# code whose frames carry an orbax file name, as the real failing read does
_ORBAX = compile("async def read():\n  raise ValueError('OUT_OF_RANGE: byte range')\n",
                 "/site-packages/orbax/checkpoint/_src/serialization/serialization.py", "exec")
SPEC = ("OUT_OF_RANGE: Error reading byte range of local file [tensorstore_spec='{\"driver\": "
        "\"zarr\"}']")
# a failed TensorStore write of a save (the disk filled): no traceback, no spec in the status
WRITE = ("RESOURCE_EXHAUSTED: Error writing \"opt_state.mu.kernel/0.0\" in OCDBT database at local "
         "file \"/wd/checkpoints/5.orbax-checkpoint-tmp/ocdbt.process_0/\": Failed to write 65040 "
         "bytes to file 10: No space left on device [os_error_code='28']")
_OTHER = compile("async def read():\n  raise ValueError('something else')\n",
                 "/site-packages/somelib/io.py", "exec")


def _unretrieved_failure(code) -> None:
  """Runs a task that raises, never retrieves its exception, and lets it be collected."""
  ns = {}
  exec(code, ns)
  loop = asyncio.new_event_loop()
  try:
    task = loop.create_task(ns["read"]())
    loop.run_until_complete(asyncio.sleep(0.01))
    assert task.done()
    ref = weakref.ref(task)
    del task
    _collect(ref)
  finally:
    loop.close()


def _unretrieved_future(message: str) -> None:
  """A future failed from outside Python code (no traceback, as TensorStore's read futures),
  never retrieved, collected."""
  loop = asyncio.new_event_loop()
  try:
    fut = loop.create_future()
    fut.set_exception(ValueError(message))
    ref = weakref.ref(fut)
    del fut
    _collect(ref)
  finally:
    loop.close()


def _collect(ref) -> None:
  """Collects the object behind ``ref`` (its __del__ logs the report): the young generations
  first, a full collection only if they did not free it (a full one costs seconds in a test
  process that holds many compiled programs)."""
  for generation in (1, 2):
    if ref() is None:
      return
    gc.collect(generation)
  assert ref() is None, "the failed task / future was not collected"


class _Capture(logging.Handler):
  def __init__(self):
    super().__init__()
    self.messages = []

  def emit(self, record):
    self.messages.append(self.format(record))


def test_orbax_task_noise_is_dropped_and_other_reports_kept():
  cap = _Capture()
  log = logging.getLogger("asyncio")
  installed = [f for f in log.filters if getattr(f, "_kunlun_quiet", False)]
  for f in installed:                            # an earlier test in this process installed it
    log.removeFilter(f)
  log.addHandler(cap)
  try:
    _unretrieved_failure(_ORBAX)                 # before: reported with a traceback
    assert any("never retrieved" in m and "Traceback" in m for m in cap.messages)
    _unretrieved_future(SPEC)
    assert any("Future exception was never retrieved" in m and SPEC in m for m in cap.messages)
    startup.quiet_checkpoint_logs()
    startup.quiet_checkpoint_logs()              # idempotent: one filter
    assert sum(getattr(f, "_kunlun_quiet", False) for f in log.filters) == 1
    cap.messages.clear()
    _unretrieved_failure(_ORBAX)
    _unretrieved_future(SPEC)
    _unretrieved_future(WRITE)
    assert not cap.messages
    _unretrieved_failure(_OTHER)                 # not orbax: still reported
    assert any("never retrieved" in m and "something else" in m for m in cap.messages)
    _unretrieved_future("a plain failure")
    assert any("never retrieved" in m and "a plain failure" in m for m in cap.messages)
    _unretrieved_future("RESOURCE_EXHAUSTED: a status from elsewhere")   # not TensorStore's I/O
    assert any("a status from elsewhere" in m for m in cap.messages)
  finally:
    log.removeHandler(cap)
    for f in installed:
      if f not in log.filters:
        log.addFilter(f)
