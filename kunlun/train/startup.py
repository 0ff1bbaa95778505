"""The jax-free start-up of train.py and eval.py: one-line fatal errors (``FatalError``,
``run_main``), quiet orbax / asyncio logs, the settings check. Importing it loads no jax, so
``--help``, ``--show_config`` and bad flags answer before jax starts."""

from __future__ import annotations

import logging as std_logging
import os
import re
import signal
import sys
import traceback
import types

from absl import logging

from data.shards import DataError
from kunlun.train import settings


class FatalError(Exception):
  """A user-facing error (bad flag, missing data, unusable checkpoint), printed without a
  traceback."""


def fail(msg: str):
  raise FatalError(msg)


def run_main(prog: str, fn, *args):
  """Runs ``fn(*args)``; a ``FatalError`` or a data error naming a file (``data.shards.DataError``:
  damaged shard, invalid record) exits with status 2 and one line ``<prog>: error: <msg>`` on
  stderr; so does a runtime error of a multi-process run (a lost peer, ``lost_peer_message``),
  at once, without the atexit shutdown. Ctrl-C (``KeyboardInterrupt``: set-up, compilation,
  eval.py) is one line and status 130 (``interrupted``): the Ctrl-C is also recorded
  (``record_interrupts``), so one that a library swallows still ends the run at the train loop's
  start (``raise_if_interrupted``)."""
  quiet_checkpoint_logs()
  record_interrupts()
  try:
    return fn(*args)
  except KeyboardInterrupt:          # Ctrl-C before the train loop's stop handler, or in eval.py
    interrupted(prog)
  except (FatalError, DataError) as e:
    msg = " ".join(str(e).split("\n"))
    if hasattr(e, "kind"):                       # an invalid record or a damaged chunk
      msg += " (config.data.skip_invalid=True skips and counts such records)"
    print(f"{prog}: error: {msg}", file=sys.stderr, flush=True)
    sys.exit(2)
  except Exception as e:
    jax = sys.modules.get("jax")            # loaded by then if the error can be jax's
    if jax is None or not isinstance(e, jax.errors.JaxRuntimeError) or jax.process_count() < 2:
      raise                                      # one process: a bug, keep its traceback
    print(f"{prog}: error: {lost_peer_message(e)}", file=sys.stderr, flush=True)
    # skip atexit: jax.distributed's shutdown would wait on the dead peer and dump a C++ stack
    os._exit(2)


_INTERRUPTED = [False]


def record_interrupts() -> None:
  """SIGINT raises ``KeyboardInterrupt`` (Python's default) and is recorded first. The exception
  can be lost where it lands in code that does not let it through (a finalizer or a callback
  reports it as unraisable and goes on); the record is not."""
  def handler(signum, frame):
    _INTERRUPTED[0] = True
    raise KeyboardInterrupt
  _INTERRUPTED[0] = False
  signal.signal(signal.SIGINT, handler)


def raise_if_interrupted() -> None:
  """``KeyboardInterrupt`` if a Ctrl-C was recorded (``record_interrupts``) and not yet acted on:
  the train loop asks before it installs its own stop handler."""
  if _INTERRUPTED[0]:
    raise KeyboardInterrupt


def interrupted(prog: str):
  """Ctrl-C (SIGINT) outside the train loop: one line ``<prog>: interrupted (Ctrl-C)`` on stderr and
  status 130, at once (``os._exit``: the data loader's and orbax's threads are not waited for;
  the ``finally`` blocks on the way here released the workdir lock, and outputs are written
  atomically, so nothing partial is left at their paths)."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)   # a second Ctrl-C cannot cut the line short
  sys.stdout.flush()
  print(f"{prog}: interrupted (Ctrl-C)", file=sys.stderr, flush=True)
  os._exit(130)


def lost_peer_message(e: BaseException) -> str:
  """One line for a collective / coordination failure of a multi-process run (usually another
  process died): this process, the first line of the runtime's message, what to do."""
  import jax  # the jax-free start-up path: jax only here
  first = next((x.strip() for x in str(e).splitlines() if x.strip()), type(e).__name__)
  return (f"process {jax.process_index()} of {jax.process_count()}: a collective failed, most "
          f"likely another process died or lost its connection ({first[:300]}); check the other "
          "processes' logs, then restart all of them (training resumes from the last checkpoint)")


def quiet_checkpoint_logs() -> None:
  """Silences orbax's routine logs and its tracebacks of failed saves / restores (which
  kunlun.train.checkpoint reports itself, in one line), and the closed-loop noise below."""
  logging.set_verbosity(logging.ERROR)   # orbax logs every save (INFO) and read-only use (WARNING)
  handler = logging.get_absl_handler()
  if not getattr(handler, "_kunlun_quiet", False):
    handler.addFilter(lambda r: "/orbax/" not in r.pathname or r.levelno >= 50)   # 50: CRITICAL
    handler._kunlun_quiet = True
  aio = std_logging.getLogger("asyncio")
  if not any(getattr(f, "_kunlun_quiet", False) for f in aio.filters):
    aio.addFilter(_OrbaxTaskNoise())
  quiet_closed_loop_errors()


class _OrbaxTaskNoise:
  """Drops asyncio's "Task / Future exception was never retrieved" report (with the exception,
  and a traceback for tasks) for a task that failed inside orbax or a future that TensorStore
  failed: a failed restore's leftover reads, or a failed save's writes (a full disk), logged
  whenever they are garbage-collected. The restore or save itself failed, and
  kunlun.train.checkpoint reports it in one line. Everything else asyncio logs passes."""
  _kunlun_quiet = True

  def filter(self, record) -> bool:
    if not record.exc_info or "never retrieved" not in str(record.msg):
      return True
    _, exc, tb = record.exc_info
    from_orbax = tb is not None and any("/orbax/" in f.filename
                                        for f in traceback.extract_tb(tb))
    return not (from_orbax or _tensorstore_io_status(str(exc)))


_STATUS = re.compile(r"^[A-Z_]+: ")              # an absl status, as TensorStore words its errors
_TENSORSTORE_MARKS = ("tensorstore_spec", "OCDBT database", "[os_error_code=")


def _tensorstore_io_status(message: str) -> bool:
  """Whether an exception's message is a TensorStore I/O status (its spec, its OCDBT store or
  the OS error it carries)."""
  return bool(_STATUS.match(message)) and any(m in message for m in _TENSORSTORE_MARKS)


def quiet_closed_loop_errors() -> None:
  """Drops the noise a failed orbax restore leaves (the restore already raised; its TensorStore
  reads were abandoned): their ``RuntimeError('Event loop is closed')`` when they complete after
  orbax closed its event loop, and, while the interpreter shuts down, the errors of those
  suspended coroutines being finalized (``KeyError: '__import__'``: builtins already torn down).
  Every other unraisable exception still goes to the previous hook."""
  prev = sys.unraisablehook
  if getattr(prev, "_kunlun_quiet", False):
    return
  sys.unraisablehook = quiet_hook(prev)


def quiet_hook(prev, finalizing=sys.is_finalizing):
  """``quiet_closed_loop_errors``' hook in front of ``prev``. What it calls is bound now: at
  shutdown the module's globals and builtins may be gone."""
  def hook(u, _fin=finalizing, _coro=types.CoroutineType, _is=isinstance, _str=str,
           _err=RuntimeError, _prev=prev):
    if _is(u.exc_value, _err) and _str(u.exc_value) == "Event loop is closed":
      return
    if _is(u.object, _coro) and _fin():
      return
    _prev(u)
  hook._kunlun_quiet = True
  return hook


def check_settings(config, steps_flag=None, where: str = "") -> None:
  """``kunlun.train.settings.check`` (and ``--steps``) as a one-line FatalError; ``where``
  prefixes the message (e.g. the run_info.json a config was loaded from)."""
  try:
    steps = settings.FIELDS["train.steps"]
    settings.check_flag("steps", steps_flag, steps.lo, f"{steps.allowed()} (training steps)",
                        steps.hi)
    settings.check(config)
  except settings.SettingsError as e:
    fail(f"{where}: {e}" if where else str(e))
