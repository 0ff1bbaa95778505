"""The console commands of pyproject.toml's [project.scripts] (kunlun-train, kunlun-eval,
kunlun-ingest, kunlun-export) name functions that import and can be called; the installed package
declares the same ones; ``kunlun-train --help`` answers as ``python train.py --help`` does."""

import importlib
import os
import subprocess
import sys
import tomllib
from importlib import metadata

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMANDS = {"kunlun-train", "kunlun-eval", "kunlun-ingest", "kunlun-export"}


def _scripts() -> dict:
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    return tomllib.load(f)["project"]["scripts"]


def test_every_command_names_a_function():
  scripts = _scripts()
  assert set(scripts) == COMMANDS
  for name, target in scripts.items():
    module, _, attr = target.partition(":")
    assert callable(getattr(importlib.import_module(module), attr)), name


def test_the_installed_package_declares_the_same_commands():
  try:
    dist = metadata.distribution("kunlun-jax")
  except metadata.PackageNotFoundError:
    pytest.skip("kunlun-jax is not installed (bash scripts/setup.sh installs it)")
  got = {e.name: e.value for e in dist.entry_points if e.group == "console_scripts"}
  assert got == _scripts(), "the installed package is older than pyproject.toml: run " \
                            "bash scripts/setup.sh"


def test_kunlun_train_help_lists_the_flags_of_train_py():
  exe = os.path.join(os.path.dirname(sys.executable), "kunlun-train")
  if not os.path.exists(exe):
    pytest.skip(f"no {exe} (bash scripts/setup.sh installs the commands)")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  got = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120, env=env,
                       cwd=os.path.dirname(ROOT))               # outside the checkout
  want = subprocess.run([sys.executable, "train.py", "--help"], capture_output=True, text=True,
                        timeout=120, env=env, cwd=ROOT)
  assert "Traceback" not in got.stderr and got.returncode == want.returncode, got.stderr
  assert "kunlun-train --config=" in got.stdout and "--workdir:" in got.stdout, got.stdout
  flags = lambda out: out.split("\nflags:\n\n", 1)[1].split("\n", 1)[1]   # below its name
  assert flags(got.stdout) == flags(want.stdout)
