"""startup.run_main in a multi-process run: a collective that fails because another process died
(a Gloo / coordination error with a C++ traceback in its text) ends this process in ONE line
naming the lost peer, exit status 2, without running the atexit shutdown that would wait for the
dead peer and dump a C++ stack."""

import os
import signal
import time
import types

import jax
import pytest

from kunlun.serving import export as serving_export
from kunlun.train import startup
from kunlun.train.loop import StopFlag
from kunlun.transfer import export as transfer_export

GLOO = ("INTERNAL: Gloo AllReduce failed: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] "
        "Connection closed by peer [127.0.0.1]:42311\n"
        "*** Begin stack trace ***\n\t_PyObject_MakeTpCall\n\tPyEval_EvalCode\n"
        "*** End stack trace ***")


def test_lost_peer_in_a_collective_is_one_line(monkeypatch, capsys):
  exits = []

  def fake_exit(code):
    exits.append(code)
    raise SystemExit(code)
  monkeypatch.setattr(startup.os, "_exit", fake_exit)
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(jax, "process_index", lambda: 1)

  def step():
    raise jax.errors.JaxRuntimeError(GLOO)
  with pytest.raises(SystemExit):
    startup.run_main("train.py", step)
  assert exits == [2]
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1, err
  assert err[0].startswith("train.py: error: process 1 of 2:") and "peer" in err[0], err
  assert "Connection closed by peer" in err[0] and "stack trace" not in err[0]


def test_single_process_runtime_errors_keep_their_traceback(monkeypatch):
  """One process: a runtime error is a bug to report with its traceback, not mapped."""
  def step():
    raise jax.errors.JaxRuntimeError("INTERNAL: something")
  with pytest.raises(jax.errors.JaxRuntimeError):
    startup.run_main("train.py", step)


@pytest.mark.parametrize("module,prog", [(serving_export, "kunlun.serving.export"),
                                         (transfer_export, "kunlun.transfer.export")])
def test_ctrl_c_in_an_export_is_one_line(module, prog, monkeypatch, tmp_path):
  """Ctrl-C in either export ends as train.py's and eval.py's set-up: ``startup.interrupted``
  (one line, status 130), no traceback."""
  def interrupted_export(*a, **k):
    raise KeyboardInterrupt
  said = []

  def interrupted(p):
    said.append(p)
    raise SystemExit(130)
  monkeypatch.setattr(module, "export", interrupted_export)
  monkeypatch.setattr(startup, "interrupted", interrupted)
  with pytest.raises(SystemExit) as e:
    module.main(["--workdir", str(tmp_path), "--out", str(tmp_path / "out")])
  assert e.value.code == 130 and said == [prog]


def test_quiet_hook_drops_only_a_failed_restores_noise():
  """The unraisable hook drops 'Event loop is closed' and, while the interpreter shuts down, a
  suspended coroutine's finalization error; anything else, or a coroutine's error before
  shutdown, reaches the previous hook."""
  seen = []

  async def read():
    return None

  coro = read()
  u = lambda exc, obj=None: types.SimpleNamespace(exc_value=exc, object=obj)
  at_exit = startup.quiet_hook(seen.append, finalizing=lambda: True)
  running = startup.quiet_hook(seen.append, finalizing=lambda: False)
  at_exit(u(RuntimeError("Event loop is closed")))
  at_exit(u(KeyError("__import__"), coro))
  assert seen == []
  running(u(KeyError("__import__"), coro))
  at_exit(u(KeyError("x"), object()))
  at_exit(u(RuntimeError("other")))
  assert [str(x.exc_value) for x in seen] == ["'__import__'", "'x'", "other"]
  coro.close()


def test_a_swallowed_ctrl_c_still_stops_the_run_at_the_loop():
  """A Ctrl-C during set-up whose KeyboardInterrupt a library swallows (here: ``except
  BaseException``, as a finalizer's report does) is recorded; the train loop's StopFlag raises
  it before installing its own handler, so run_main ends in one line and status 130. Without a
  Ctrl-C the StopFlag installs as before."""
  saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
  try:
    startup.record_interrupts()
    StopFlag()                                         # nothing recorded: installs
    startup.record_interrupts()
    try:
      os.kill(os.getpid(), signal.SIGINT)
      for _ in range(100):                             # the handler runs between bytecodes
        time.sleep(0.01)
    except BaseException:  # noqa: BLE001 - the swallowing library
      pass
    with pytest.raises(KeyboardInterrupt):
      StopFlag()
  finally:
    startup._INTERRUPTED[0] = False
    for s, h in saved.items():
      signal.signal(s, h)
