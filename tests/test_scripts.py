"""scripts/: set-up refuses an option it does not know (it had set up the default venv);
scripts/jagged_demo.py never removes a data/ folder it did not write (it had removed any)."""

import importlib.util
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_setup_script_refuses_an_unknown_option():
  p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "setup.sh"), "--gpu"],
                     capture_output=True, text=True, timeout=60)
  assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
  assert p.stderr.strip() == ("scripts/setup.sh: unknown option '--gpu' (none, --gpu-compile or "
                              "--beam)"), p.stderr
  assert not p.stdout


def test_jagged_demo_keeps_a_data_folder_that_is_not_its_own(tmp_path, monkeypatch):
  spec = importlib.util.spec_from_file_location("jagged_demo",
                                                os.path.join(ROOT, "scripts", "jagged_demo.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  monkeypatch.setattr(mod, "run", lambda *a: pytest.fail("ran a command"))
  (tmp_path / "data").mkdir()
  (tmp_path / "data" / "mine.txt").write_text("keep")
  with pytest.raises(SystemExit) as e:
    mod.main(["--dir", str(tmp_path), "--examples", "128", "--out", str(tmp_path / "o.json")])
  assert "not synthetic data" in str(e.value.code) and len(str(e.value.code).splitlines()) == 1
  assert (tmp_path / "data" / "mine.txt").read_text() == "keep"
