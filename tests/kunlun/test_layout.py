"""The ``kunlun/`` layout: the Kunlun model's import chain holds no baseline and no FLOP counter,
and the module paths from before ``baselines/`` and ``serving/`` still work (with a warning)."""

import importlib
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MOVED = {"kunlun.serve": "kunlun.serving.score", "kunlun.request_rows": "kunlun.serving.rows",
         "kunlun.export_serving": "kunlun.serving.export",
         "kunlun.serving_loader": "kunlun.serving.loader",
         "kunlun.interformer": "kunlun.baselines.interformer",
         "kunlun.dhen": "kunlun.baselines.dhen"}


def _modules_after(stmt):
  code = f"import sys\n{stmt}\nprint(' '.join(sorted(sys.modules)))"
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300, check=True).stdout
  return set(out.split())


def test_model_imports_no_baseline_and_no_flop_counter():
  mods = _modules_after("import kunlun.model, kunlun.layer, kunlun.oneseq")
  assert not {m for m in mods if m.startswith("kunlun.baselines.")}, mods
  assert "kunlun.flops" not in mods


def test_serving_loader_imports_no_model_code():
  mods = _modules_after("import kunlun.serving.loader")
  assert {m for m in mods if m.startswith("kunlun")} == {"kunlun", "kunlun.serving",
                                                         "kunlun.serving.loader"}
  assert "flax" not in mods


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_module_paths_are_aliases(old):
  sys.modules.pop(old, None)
  with pytest.warns(DeprecationWarning, match=f"{old} moved to {MOVED[old]}"):
    mod = importlib.import_module(old)
  assert mod is importlib.import_module(MOVED[old])


def test_old_baselines_names_resolve():
  import kunlun.baselines as b
  from kunlun.baselines.ablated import ablated_config
  from kunlun.baselines.dlrm import DLRM
  with pytest.warns(DeprecationWarning, match="moved to kunlun.baselines.dlrm.DLRM"):
    assert b.DLRM is DLRM
  with pytest.warns(DeprecationWarning, match="moved to kunlun.baselines.ablated"):
    assert b.ablated_config is ablated_config
  with pytest.raises(AttributeError):
    b.nothing_here  # noqa: B018


def test_old_export_cli_still_runs():
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  p = subprocess.run([sys.executable, "-m", "kunlun.export_serving", "--help"], cwd=ROOT,
                     env=env, capture_output=True, text=True, timeout=300)
  assert p.returncode == 0 and "kunlun.serving.export" in p.stdout
  assert "moved to kunlun.serving.export" in p.stderr
