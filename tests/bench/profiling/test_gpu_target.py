"""The deviceless H200 compile of the tiny train step (bench/train_step.py --target h200) and its
report, compiled by the venv ``scripts/setup.sh --gpu-compile`` makes (.venv-gpu, or
``KUNLUN_GPU_PYTHON``): the CUDA plugin stays out of the main venv."""

import importlib.util
import json
import os
import subprocess

import pytest

from bench.profiling import gpu_target

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))))
GPU_PY = os.environ.get("KUNLUN_GPU_PYTHON", os.path.join(ROOT, ".venv-gpu", "bin", "python"))


def test_missing_names_the_install_command():
  msg = gpu_target.missing()
  assert msg is None or gpu_target.INSTALL in msg


def test_missing_without_any_jax_plugin_package(monkeypatch):
  """A venv with no ``jax_plugins`` and no ``nvidia`` package at all (CI's .venv: the compiler
  lives in .venv-gpu): find_spec of a sub-module raises there; missing() names the packages."""
  real = importlib.util.find_spec

  def find_spec(name, *a, **k):
    if name.split(".")[0] in ("jax_plugins", "nvidia"):
      raise ModuleNotFoundError(f"No module named {name.split('.')[0]!r}")
    return real(name, *a, **k)
  monkeypatch.setattr(importlib.util, "find_spec", find_spec)
  msg = gpu_target.missing()
  assert msg is not None and "jax-cuda12-pjrt" in msg and "nvidia-cuda-nvcc-cu12" in msg
  assert gpu_target.INSTALL in msg


@pytest.mark.skipif(not os.path.exists(GPU_PY),
                    reason=f"no {GPU_PY}: {gpu_target.INSTALL} makes it")
def test_tiny_train_step_compiles_for_h200_with_pallas_kernels(tmp_path):
  dump = tmp_path / "dump"
  p = subprocess.run(
      [GPU_PY, "-m", "bench.train_step", "--small", "--layers", "1", "--target", "h200",
       "--backend", "pallas", "--dump_dir", str(dump), "--out_dir", str(tmp_path)],
      cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True)
  assert p.returncode == 0, p.stderr[-2000:]
  (path,) = tmp_path.glob("train_step_tiny_pallas_b16_L1_small.json")
  r = json.load(open(path))
  assert r["platform"] == "gpu" and r["device_kind"] == "NVIDIA H200"
  assert r["target"]["deviceless"] and r["target"]["file"].endswith("h200_sxm.txtpb")
  assert "XLA:GPU" in r["roofline"]["note"]
  launches = r["hlo"]["kernel_launches"]
  assert launches > 0 and r["roofline"]["xla"]["bytes"] > 0
  assert r["memory"]["peak_estimate"] > 0
  # the --xla_dump_to thunk sequence launches as many kernels as the scheduled HLO, up to the
  # copies / control flow the two count differently
  thunks = r["thunks"]
  assert thunks["kernel_thunks"] > 0
  assert abs(thunks["kernel_thunks"] - launches) <= 0.1 * launches
  # Pallas kernels are Triton custom calls in the GPU program, counted with their FLOPs
  assert r["roofline"]["pallas"]["launches"] > 0 and r["roofline"]["pallas"]["flops"] > 0
  assert any(c["kind"] == "gdpa" for c in r["kernel_calls"])
  assert r["roofline"]["gemm"]["launches"] > 0


def test_train_step_without_the_compiler_says_what_is_missing(monkeypatch, capsys):
  from bench import train_step
  monkeypatch.setattr(gpu_target, "missing", lambda: "deviceless GPU compile needs X: install")
  with pytest.raises(SystemExit) as e:
    train_step.main(["--small", "--target", "h200"])
  assert "deviceless GPU compile needs X" in str(e.value)


def test_unknown_target_is_one_line():
  with pytest.raises(SystemExit) as e:
    gpu_target.target_file("h300")
  assert "--target 'h300'" in str(e.value)


# One GPU-venv interpreter for the two checks below (the Pallas switch under a GPU mesh; the
# scatter's bytes): each prints one JSON line. The XLA flags are set before the first backend
# starts (the switch only traces; the scatter compiles for the H200).
_SWITCH_AND_SCATTER = """
import json
import jax
import jax.numpy as jnp
from bench.profiling import gpu_target, roofline
from pallas_kernels import api
gpu_target.set_flags()
seen = []

def f(x):
  seen.append({"platform": api.compile_platform(), "interpret": api._interpret("pallas", False),
               "auto": api.select_backend("block_attention", 64, 64)})
  return x

x = jax.ShapeDtypeStruct((4,), jnp.float32)
with jax.set_mesh(gpu_target.gpu_mesh("h200")):
  jax.jit(f).trace(x)
jax.jit(f).trace(x)
print(json.dumps(seen))

R, D, N = 10000, 8, 16

def g(table, acc, ids, u):
  return table.at[ids].add(-0.1 * u), acc.at[ids].add(jnp.sum(u * u, -1))

args = (jnp.zeros((R, D)), jnp.zeros((R,)), jnp.zeros((N,), jnp.int32), jnp.zeros((N, D)))
c = gpu_target.compile_for(jax.jit(g, donate_argnums=(0, 1)), args, gpu_target.gpu_mesh("h200"))
print(json.dumps([x for x in roofline.op_costs(c.as_text()) if "scatter" in x["op_name"]]))
"""


@pytest.fixture(scope="module")
def switch_and_scatter():
  """The two JSON lines of ``_SWITCH_AND_SCATTER`` run by the GPU venv."""
  p = subprocess.run([GPU_PY, "-c", _SWITCH_AND_SCATTER], cwd=ROOT, capture_output=True,
                     text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert p.returncode == 0, p.stderr[-2000:]
  switch, scatter = p.stdout.strip().splitlines()[-2:]
  return json.loads(switch), json.loads(scatter)


@pytest.mark.skipif(not os.path.exists(GPU_PY),
                    reason=f"no {GPU_PY}: {gpu_target.INSTALL} makes it")
def test_pallas_compiles_real_kernels_for_a_gpu_mesh_on_a_cpu_host(switch_and_scatter):
  """Under ``jax.set_mesh`` of the H200 target's devices the Pallas switch sees a GPU (no
  interpret mode) and ``auto`` selects for the H200; without the mesh this CPU host interprets."""
  under_mesh, plain = switch_and_scatter[0]
  assert under_mesh == {"platform": "gpu", "interpret": False, "auto": "pallas"}
  assert plain == {"platform": "cpu", "interpret": True, "auto": "xla"}


@pytest.mark.skipif(not os.path.exists(GPU_PY),
                    reason=f"no {GPU_PY}: {gpu_target.INSTALL} makes it")
def test_h200_scatter_into_a_donated_table_is_charged_its_rows(switch_and_scatter):
  """XLA:GPU fuses each scatter-add with its updates' computation (scaling g; g * g summed per
  row): each fusion reads the indices and all of g, and reads + writes the rows it touches; the
  10^4-row tables do not appear."""
  sc = switch_and_scatter[1]
  N, D = 16, 8
  ids, g = N * 4, N * D * 4
  assert sorted((c["bytes_in"], c["bytes_out"]) for c in sc) == sorted(
      [(ids + g + N * D * 4, N * D * 4), (ids + g + N * 4, N * 4)])


def _device_files(tmp_path, monkeypatch, autotune="version: 3\n"):
  """A targets folder holding the H200's text proto and a hand-written device autotune file."""
  import shutil
  shutil.copy(gpu_target.TARGETS["h200"], tmp_path / "h200_sxm.txtpb")
  (tmp_path / "h200_device.autotune.pbtxt").write_text(autotune)
  monkeypatch.setattr(gpu_target, "TARGET_DIR", str(tmp_path))
  monkeypatch.setitem(gpu_target.TARGETS, "h200", str(tmp_path / "h200_sxm.txtpb"))
  return tmp_path / "h200_device.autotune.pbtxt"


def test_device_autotune_results_are_passed_to_xla_and_reported(tmp_path, monkeypatch):
  tuned = _device_files(tmp_path, monkeypatch)
  monkeypatch.setenv("XLA_FLAGS", "")
  gpu_target.set_flags(None, "h200")
  assert f"--xla_gpu_load_autotune_results_from={tuned}" in os.environ["XLA_FLAGS"].split()
  info = gpu_target.target_info("h200")
  assert info["autotune_results"].endswith("h200_device.autotune.pbtxt")
  assert info["file"].endswith("h200_sxm.txtpb") and not info["device_topology"]
  monkeypatch.setenv("XLA_FLAGS", "")
  gpu_target.set_flags(None, "h100")          # no h100 device files: nothing loaded
  assert "autotune" not in os.environ["XLA_FLAGS"]
  assert gpu_target.target_info("h100")["autotune_results"] is None


def test_a_saved_device_topology_is_the_target_file_for_one_device(tmp_path, monkeypatch):
  _device_files(tmp_path, monkeypatch)
  (tmp_path / "h200_device.topology.pb").write_bytes(b"")
  assert gpu_target.target_file("h200").endswith("h200_device.topology.pb")
  assert gpu_target.target_info("h200")["device_topology"]
  assert gpu_target.target_file("h200", n_devices=8).endswith("h200_sxm.txtpb")


def test_merge_autotune_keeps_one_header_and_every_distinct_result(tmp_path):
  a, b, out = tmp_path / "a.pbtxt", tmp_path / "b.pbtxt", tmp_path / "out.pbtxt"
  r1 = 'results {\n  device: "d"\n  hlo: "x {y}"\n  result {\n    gemm { algorithm: 1 }\n  }\n}\n'
  r2 = r1.replace("algorithm: 1", "algorithm: 2")
  a.write_text("version: 3\n" + r1)
  b.write_text("version: 3\n" + r1 + r2)
  assert gpu_target.merge_autotune([str(a), str(b)], str(out)) == 2
  assert out.read_text() == "version: 3\n" + r1 + r2


def test_device_names_and_save_device_off_a_gpu():
  assert gpu_target.device_name("NVIDIA H200") == "h200"
  assert gpu_target.device_name("NVIDIA H100 80GB HBM3") == "h100"
  with pytest.raises(SystemExit) as e:
    gpu_target.save_device("/tmp")
  assert "needs a GPU" in str(e.value)


_LOAD = """
import json, sys
import jax
import jax.numpy as jnp
from bench.profiling import gpu_target
gpu_target.TARGET_DIR = sys.argv[1]
gpu_target.TARGETS["h200"] = sys.argv[2]
# what --save_device writes on a real H200, made here from the compile-only device
saved = jax.experimental.topologies.TopologyDescription(gpu_target.gpu_devices("h200")).serialize()
with open(sys.argv[1] + "/h200_device.topology.pb", "wb") as f:
  f.write(saved)
gpu_target.set_flags(None, "h200")
mesh = jax.sharding.Mesh(gpu_target.gpu_devices("h200"), ("d",))
c = gpu_target.compile_for(lambda x: (x @ x).sum(), (jnp.ones((256, 256)),), mesh)
print(json.dumps({**gpu_target.target_info("h200"), "kind": mesh.devices.flat[0].device_kind}))
"""


@pytest.mark.skipif(not os.path.exists(GPU_PY),
                    reason=f"no {GPU_PY}: {gpu_target.INSTALL} makes it")
def test_h200_compile_loads_the_device_files(tmp_path, monkeypatch):
  """A deviceless compile from a saved device topology with a hand-written autotune file
  (the legacy text format, no results): XLA logs that it loaded the file; a missing file named
  in the flag fails the compile (so the flag is read)."""
  import jax.experimental.topologies  # noqa: F401 - the child's import, checked here first
  tuned = _device_files(tmp_path, monkeypatch)
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "0", "XLA_FLAGS": ""}
  p = subprocess.run([GPU_PY, "-c", _LOAD, str(tmp_path), str(tmp_path / "h200_sxm.txtpb")],
                     cwd=ROOT, capture_output=True, text=True, env=env)
  assert p.returncode == 0, p.stderr[-2000:]
  info = json.loads(p.stdout.strip().splitlines()[-1])
  assert info["device_topology"] and info["kind"] == "NVIDIA H200"
  assert info["autotune_results"].endswith("h200_device.autotune.pbtxt")
  assert f"Autotune results loaded from file: {tuned}" in p.stderr
  tuned.unlink()
  env["XLA_FLAGS"] = f"--xla_gpu_load_autotune_results_from={tuned}"
  p = subprocess.run([GPU_PY, "-c", _LOAD, str(tmp_path), str(tmp_path / "h200_sxm.txtpb")],
                     cwd=ROOT, capture_output=True, text=True, env=env)
  assert p.returncode != 0 and "Autotune results file does not exist" in p.stderr
