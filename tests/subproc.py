"""Helpers for tests that start JAX worker processes (gloo on CPU) or run the command-line
programs: ``run`` (one subprocess) and ``Programs`` (many, forked from one interpreter that
imported jax once; ``python -m tests.subproc`` is that interpreter)."""

import atexit
import importlib
import json
import os
import runpy
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def compile_cache(fallback) -> str:
  """The suite's persistent compilation cache (``tests/conftest.py`` exports it), shared with the
  other tests' train.py / eval.py / bench runs, which compile many of the same programs; outside
  the suite, ``fallback``."""
  return os.environ.get("KUNLUN_COMPILATION_CACHE") or str(fallback)


def worker_env() -> dict:
  """The current environment without JAX settings (the workers set their own), on CPU, with the
  repository importable. ``XLA_FLAGS`` is kept: the suite's XLA:CPU -O0 (tests/conftest.py)
  halves the workers' compile time too."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  return env


# what train.py / eval.py import: a Programs preload for the tests that run them
TRAIN_MODULES = ("numpy", "pyarrow.parquet", "jax", "flax.linen", "optax", "orbax.checkpoint",
                 "grain", "data.pipeline", "kunlun.train.loop", "kunlun.train.checkpoint")
LONG_TIMEOUT = 3600      # seconds; a guard against a hang, not a speed test (CI has its own limit)


def run(cmd, *, timeout: float = LONG_TIMEOUT, check: bool = False, **kw):
  """``subprocess.run(cmd, capture_output=True, text=True)``; a timeout (or, with ``check``, a
  non-zero exit) is an AssertionError carrying the child's last output, so a slow or stuck
  child shows what it was doing instead of a bare ``TimeoutExpired``."""
  try:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
  except subprocess.TimeoutExpired as e:
    out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (
        e.stdout or "")
    err = (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (
        e.stderr or "")
    raise AssertionError(f"{' '.join(map(str, cmd))} did not finish in {timeout:.0f}s; its last "
                         f"output:\n{out[-3000:]}\n{err[-5000:]}") from None
  if check and p.returncode != 0:
    raise AssertionError(f"{' '.join(map(str, cmd))} failed ({p.returncode}):\n"
                         f"{p.stdout[-3000:]}\n{p.stderr[-5000:]}")
  return p


class Programs:
  """One interpreter (``python -m tests.subproc``) that imported the modules ``preload`` once;
  ``run(cmds)`` runs each command line ``cmds[i]`` (what follows ``python``: a script path,
  ``-m module`` or ``-c code``, then its arguments) as ``subprocess.run([sys.executable, *cmd],
  cwd=cwd, env=env, capture_output=True, text=True)`` would, but forked from it: the program's file
  runs as ``__main__`` with its argv, its stdout / stderr go to their own files and its exit
  status is the interpreter's (``sys.exit`` code, 1 and the traceback for an uncaught exception,
  ``-signal`` when killed). Saves the 2-3 s of CPU each interpreter spends importing jax & co.
  ``env`` is the interpreter's (what jax reads at import, e.g. ``JAX_NUM_CPU_DEVICES``, is fixed
  there); ``run(..., env=...)`` adds variables for one call's programs only."""

  def __init__(self, env: dict, preload=(), cwd: str = ROOT):
    self._err = tempfile.TemporaryFile("w+")
    self._proc = subprocess.Popen([sys.executable, "-m", "tests.subproc"], cwd=cwd,
                                  env=dict(env, PYTHONPATH=ROOT), stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=self._err, text=True)
    self._send({"preload": list(preload)})

  def _send(self, obj) -> dict:
    try:
      self._proc.stdin.write(json.dumps(obj) + "\n")
      self._proc.stdin.flush()
      line = self._proc.stdout.readline()
      return json.loads(line)
    except (OSError, ValueError):
      self._err.seek(0)
      raise AssertionError(f"python -m tests.subproc failed:\n"
                           f"{self._err.read()[-5000:]}") from None

  def run(self, cmds, *, env: dict | None = None, parallel: int = 2,
          timeout: float = LONG_TIMEOUT) -> list:
    """``parallel`` programs at a time; one running past ``timeout`` seconds is killed
    (returncode ``"timeout"``, its output so far kept). A ``CompletedProcess`` per command."""
    cmds = [list(map(str, c)) for c in cmds]
    out = self._send({"cmds": cmds, "env": env or {}, "parallel": parallel, "timeout": timeout})
    return [subprocess.CompletedProcess([sys.executable, *c], r["returncode"], r["stdout"],
                                        r["stderr"]) for c, r in zip(cmds, out, strict=True)]

  def run1(self, cmd, *, env: dict | None = None, check: bool = False,
           timeout: float = LONG_TIMEOUT) -> subprocess.CompletedProcess:
    """One program, as ``run`` (the module's ``run`` semantics): running past ``timeout`` (or,
    with ``check``, a non-zero exit) is an AssertionError carrying its last output."""
    p = self.run([cmd], env=env, timeout=timeout)[0]
    if p.returncode == "timeout" or (check and p.returncode != 0):
      raise AssertionError(f"{' '.join(map(str, cmd))} failed ({p.returncode}):\n"
                           f"{p.stdout[-3000:]}\n{p.stderr[-5000:]}")
    return p

  def close(self) -> None:
    self._proc.stdin.close()
    self._proc.wait(timeout=60)
    self._err.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def _exit_status(e: SystemExit) -> int:
  """The exit status the interpreter gives an uncaught ``SystemExit`` (printing a non-integer
  code to stderr, as it does)."""
  if e.code is None:
    return 0
  if isinstance(e.code, int):
    return e.code & 0xff
  print(e.code, file=sys.stderr)
  return 1


def _child(cmd, out_path: str, err_path: str) -> None:
  """In a forked child: fds 0/1/2 to /dev/null and the two files, run ``cmd`` as ``__main__``,
  exit as the interpreter would."""
  for fd, path, mode in ((0, os.devnull, os.O_RDONLY), (1, out_path, os.O_WRONLY | os.O_CREAT),
                         (2, err_path, os.O_WRONLY | os.O_CREAT)):
    f = os.open(path, mode, 0o644)
    os.dup2(f, fd)
    os.close(f)
  code = 0
  try:
    if cmd[0] == "-m":
      sys.argv = ["-m", *cmd[2:]]
      runpy.run_module(cmd[1], run_name="__main__", alter_sys=True)
    elif cmd[0] == "-c":
      sys.argv = ["-c", *cmd[2:]]
      exec(compile(cmd[1], "<string>", "exec"),  # noqa: S102  (python -c: a fresh __main__)
           {"__name__": "__main__", "__builtins__": __builtins__, "__doc__": None})
    else:
      sys.argv = list(cmd)
      runpy.run_path(cmd[0], run_name="__main__")
  except SystemExit as e:
    code = _exit_status(e)
  except BaseException:          # noqa: BLE001  (what the interpreter does with it)
    sys.excepthook(*sys.exc_info())
    code = 1
  try:
    threading._shutdown()                 # the interpreter's exit: join non-daemon threads,
    atexit._run_exitfuncs()               # then the atexit handlers
  finally:
    for s in (sys.stdout, sys.stderr):
      try:
        s.flush()
      except Exception:  # noqa: BLE001, S110
        pass
    os._exit(code)


def _read(path: str) -> str:
  with open(path, errors="replace") as f:
    return f.read()


def _serve() -> None:
  """``python -m tests.subproc``: the other side of ``Programs``: JSON lines on stdin (first the
  modules to import, then one job per line), one JSON line answering each on stdout."""
  for m in json.loads(sys.stdin.readline())["preload"]:
    importlib.import_module(m)
  if "jax" in sys.modules:         # forking a process with a live XLA client is not safe
    from jax._src import xla_bridge
    assert not xla_bridge.backends_are_initialized(), "preload initialised a jax backend"
  # numpy's and pyarrow's thread pools are running: they handle fork (at-fork handlers)
  warnings.filterwarnings("ignore", "This process .* is multi-threaded", DeprecationWarning)
  print(json.dumps({"ready": True}), flush=True)
  tmp = tempfile.mkdtemp(prefix="run-programs-")
  for line in sys.stdin:
    job = json.loads(line)
    cmds = job["cmds"]
    todo, running, results = list(range(len(cmds))), {}, [None] * len(cmds)
    while todo or running:
      while todo and len(running) < job["parallel"]:
        i = todo.pop(0)
        paths = [os.path.join(tmp, f"{i}.{k}") for k in ("out", "err")]
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
          os.environ.update(job["env"])
          _child(cmds[i], *paths)
        running[pid] = (i, time.monotonic(), paths)
      pid, status = os.waitpid(-1, os.WNOHANG)
      if pid == 0:
        for pid, (i, t0, _) in running.items():
          if time.monotonic() - t0 > job["timeout"] and results[i] is None:
            os.kill(pid, 9)
            results[i] = "timeout"
        time.sleep(0.01)
        continue
      i, _, paths = running.pop(pid)
      out, err = (_read(p) for p in paths)
      rc = results[i] or os.waitstatus_to_exitcode(status)
      results[i] = {"returncode": rc, "stdout": out, "stderr": err}
      for p in paths:
        os.remove(p)
    print(json.dumps(results), flush=True)
  os.rmdir(tmp)


if __name__ == "__main__":
  _serve()
