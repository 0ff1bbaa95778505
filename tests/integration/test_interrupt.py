"""Ctrl-C during train.py's set-up (before the loop's stop handler) ends in one line and status
130, never a KeyboardInterrupt traceback (issue 39, 10)."""

import os
import signal
import subprocess
import sys

from tests.subproc import ROOT, worker_env


def test_ctrl_c_during_setup_is_one_line(tmp_path):
  """SIGINT once train.py prints that it generates its synthetic data (set-up, seconds of work
  left at 200k examples): one ``train.py: interrupted`` line on stderr, status 130."""
  env = dict(worker_env(), KUNLUN_COMPILATION_CACHE="")
  p = subprocess.Popen([sys.executable, "train.py", f"--workdir={tmp_path / 'wd'}",
                        "--config.data.num_examples=200000"], cwd=ROOT, env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    lines = []
    for line in p.stdout:
      lines.append(line)
      if line.startswith("generating synthetic preset"):
        break
    assert lines and lines[-1].startswith("generating"), (lines, p.stderr.read()[-3000:])
    os.kill(p.pid, signal.SIGINT)
    out, err = p.communicate(timeout=300)
  finally:
    if p.poll() is None:
      p.kill()
      p.wait()
  text = "".join(lines) + out + err
  assert p.returncode == 130, (p.returncode, text[-3000:])
  assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
  said = [x for x in err.splitlines() if "interrupted" in x]
  assert len(said) == 1 and said[0].startswith("train.py: interrupted"), err[-3000:]
