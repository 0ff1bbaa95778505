"""tests/subproc.Programs against the real interpreter: the same stdout, stderr's last line and
exit status for a clean exit, sys.exit codes, an uncaught exception, SIGKILL, ``-m`` and ``-c``."""

import os
import subprocess
import sys

from tests import subproc

CMDS = [
    ["-c", "import sys; print('out', sys.argv[1:]); print('err', file=sys.stderr)", "a", "b"],
    ["-c", "import sys; sys.exit(3)"],
    ["-c", "import sys; sys.exit('a message')"],
    ["-c", "raise ValueError('boom')"],
    ["-c", "import os; print('before', flush=True); os.kill(os.getpid(), 9)"],
    ["-m", "json.tool", "/nonexistent/file.json"],
    ["-m", "json.tool", "--bogus"],
]


def test_forked_programs_match_the_interpreter(tmp_path):
  script = tmp_path / "prog.py"
  script.write_text("import sys\nprint(__name__, sys.argv[1:])\nsys.exit(int(sys.argv[1]))\n")
  cmds = [*CMDS, [str(script), "7"]]
  env = dict(os.environ, PYTHONPATH=subproc.ROOT)
  with subproc.Programs(env, ("json",)) as progs:
    got = progs.run(cmds)
  for cmd, g in zip(cmds, got, strict=True):
    want = subprocess.run([sys.executable, *cmd], cwd=subproc.ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert (g.returncode, g.stdout) == (want.returncode, want.stdout), cmd
    assert g.stderr.strip().splitlines()[-1:] == want.stderr.strip().splitlines()[-1:], cmd
    assert ("Traceback" in g.stderr) == ("Traceback" in want.stderr), cmd


def test_timeout_kills_and_keeps_the_output():
  with subproc.Programs(dict(os.environ)) as progs:
    p = progs.run([["-c", "import time; print('started', flush=True); time.sleep(60)"]],
                  timeout=1)[0]
  assert p.returncode == "timeout" and p.stdout == "started\n"
