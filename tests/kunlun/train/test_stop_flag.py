"""The train loop's StopFlag (kunlun/train/loop.py): a second SIGINT / SIGTERM exits at once and
says so, naming the step it does not save (never a silent exit after "saving step N")."""

import signal
import subprocess
import sys

from tests.subproc import ROOT, worker_env

TWICE = ("import os, signal\n"
         "from kunlun.train.loop import StopFlag\n"
         "stop = StopFlag(describe=lambda: 'step 100 (latest checkpoint: step 90)')\n"
         "os.kill(os.getpid(), signal.SIGINT)\n"
         "assert stop.signum == signal.SIGINT\n"
         "print('first handled', flush=True)\n"
         "os.kill(os.getpid(), signal.SIGINT)\n"
         "print('still alive', flush=True)\n")


def test_second_signal_says_it_exits_without_saving():
  p = subprocess.run([sys.executable, "-c", TWICE], cwd=ROOT, env=worker_env(),
                     capture_output=True, text=True, timeout=300)
  assert p.returncode == -signal.SIGINT, (p.returncode, p.stderr[-2000:])
  assert "first handled" in p.stdout and "still alive" not in p.stdout
  lines = [x for x in p.stderr.splitlines() if "signal" in x]
  assert len(lines) == 1 and "without saving step 100" in lines[0], p.stderr[-2000:]
  assert "latest checkpoint: step 90" in lines[0]
