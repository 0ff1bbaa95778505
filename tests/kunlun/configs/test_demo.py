"""The demo (scripts/demo.sh, kunlun/configs/demo.py) keeps what makes it learn (issue #21 item 5):
one pass over 5x the tiny preset's data with the tiny model. 300 tiny steps (~1 pass over 20k
examples) ended at conversion NE ~1.01 and more passes overfit; the full run prints its metrics
(docs/guides/train.md). A full demo run takes minutes, so this checks the settings, not the run."""

import os
import re
import subprocess

import pytest

from kunlun.configs import demo, tiny

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _script():
  with open(os.path.join(ROOT, "scripts", "demo.sh")) as f:
    return f.read()


def test_demo_config_is_tiny_model_one_pass_over_more_data():
  d, t = demo.get_config(), tiny.get_config()
  assert d.model.to_dict() == t.model.to_dict()          # every tiny test covers the demo's model
  assert d.data.preset == t.data.preset == "tiny"
  assert d.train.epochs == 1.0                           # each example once: nothing to memorise
  assert d.data.num_examples >= 5 * t.data.num_examples
  # enough steps for the heads to leave their zero-bias start (tiny's 300 were too few)
  assert d.data.num_examples / d.data.batch_size >= 2 * t.train.steps


def test_demo_script_trains_the_demo_config_on_its_data_size():
  s = _script()
  assert "--config=kunlun/configs/demo.py" in s
  m = re.search(r'EXAMPLES="\$\{DEMO_EXAMPLES:-(\d+)\}"', s)
  assert m and int(m.group(1)) == demo.get_config().data.num_examples
  assert '--num_examples "$EXAMPLES"' in s
  # data of another size (an older demo's 20k) is regenerated, not silently reused
  assert re.search(r'if \[ "\$have" != "\$EXAMPLES" \]', s)


def _demo(tmp_path, **env):
  return subprocess.run(["bash", os.path.join(ROOT, "scripts", "demo.sh")], capture_output=True,
                        text=True, timeout=600, env={**os.environ, "DEMO_DIR": str(tmp_path),
                                                     **env})


@pytest.mark.parametrize("env, why", [
    ({"DEMO_EXAMPLES": "-5"}, "DEMO_EXAMPLES=-5: expected a positive integer"),
    ({"DEMO_EPOCHS": "0"}, "DEMO_EPOCHS=0: expected a positive integer"),
    ({"DEMO_STEPS": "x"}, "DEMO_STEPS=x: expected a positive integer"),
])
def test_bad_demo_settings_are_one_line_errors_before_any_work(tmp_path, env, why):
  p = _demo(tmp_path / "demo", **env)
  assert p.returncode == 2 and p.stderr.strip() == f"[demo] {why}", (p.stdout, p.stderr)
  assert not (tmp_path / "demo").exists()


def test_a_demo_dir_the_demo_did_not_make_is_never_emptied(tmp_path):
  """DEMO_DIR pointing at a folder with someone's data/ and work/ (a home folder, say): the demo
  stops instead of starting afresh there (which removes data/ and work/)."""
  for d in ("data", "work"):
    (tmp_path / d).mkdir()
    (tmp_path / d / "mine.txt").write_text("keep")
  p = _demo(tmp_path, DEMO_EXAMPLES="64")
  assert p.returncode == 2, (p.stdout[-2000:], p.stderr[-2000:])
  assert "not made by the demo" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
  assert all((tmp_path / d / "mine.txt").read_text() == "keep" for d in ("data", "work"))
