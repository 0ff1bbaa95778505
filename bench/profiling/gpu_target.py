"""Deviceless XLA:GPU compilation for an sm_90 target (H200 / H100) on a CPU-only host.

``gpu_mesh("h200")`` is a mesh of compile-only CUDA devices described by a GpuTargetConfig text
proto (``targets/*.txtpb``); lowering under ``jax.set_mesh`` of it gives the scheduled GPU HLO,
its memory analysis and real Triton (Pallas) kernels through ptxas. Needs the optional packages
``scripts/setup.sh --gpu-compile`` installs (``missing()`` says which are absent). Files a real
GPU saved (``python -m bench.profiling.gpu_target --save_device``, in ``scripts/gpu_check.sh``)
take precedence: ``<name>_device.topology.pb`` (its topology, with its own GpuTargetConfig) and
``<name>_device.autotune.pbtxt`` (its autotune results, loaded into every deviceless compile).
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import re
import sys

import jax
import jaxlib.xla_client as xla_client
from jax.experimental import topologies

TARGET_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "targets")
TARGETS = {"h200": os.path.join(TARGET_DIR, "h200_sxm.txtpb"),
           "h100": os.path.join(TARGET_DIR, "h100_sxm.txtpb")}
INSTALL = "bash scripts/setup.sh --gpu-compile, then run with .venv-gpu/bin/python"
# Roofline numbers of each target: bf16 dense peak, HBM bandwidth (the target file's).
DEVICE = {"h200": {"peak_flops": 989e12, "bandwidth": 4.917e12, "memory": 141e9},
          "h100": {"peak_flops": 989e12, "bandwidth": 3.352e12, "memory": 80e9}}


def _find_spec(name: str):
  """``importlib.util.find_spec(name)``, or None (not an error) when a parent package of
  ``name`` is absent (a venv without ``nvidia`` / ``jax_plugins`` at all, such as CI's)."""
  try:
    return importlib.util.find_spec(name)
  except ModuleNotFoundError:
    return None


def cuda_data_dir() -> str | None:
  """The folder holding ``bin/ptxas`` and ``nvvm/libdevice`` (the nvidia-cuda-nvcc-cu12 wheel, or
  ``$CUDA_HOME``), or None."""
  cands = [os.environ.get("CUDA_HOME", "")]
  spec = _find_spec("nvidia.cuda_nvcc")
  if spec is not None and spec.submodule_search_locations:
    cands += list(spec.submodule_search_locations)
  for c in cands:
    if c and os.path.exists(os.path.join(c, "bin", "ptxas")) and glob.glob(
        os.path.join(c, "nvvm", "libdevice", "libdevice*.bc")):
      return c
  return None


def missing() -> str | None:
  """One line naming what deviceless GPU compilation lacks here, or None when all is present."""
  need = []
  if _find_spec("jax_plugins.xla_cuda12") is None:
    need.append(f"jax-cuda12-pjrt / jax-cuda12-plugin =={jax.__version__}")
  if cuda_data_dir() is None:
    need.append("ptxas + libdevice (nvidia-cuda-nvcc-cu12)")
  if not need:
    return None
  return f"deviceless GPU compile needs {' and '.join(need)}: install with `{INSTALL}`"


_DEVICE_FILES = {"topology": "topology.pb", "autotune": "autotune.pbtxt"}


def device_file(target: str, what: str) -> str | None:
  """The file a real GPU of ``target`` (a name in TARGETS) saved here, ``what`` "topology" or
  "autotune", or None when there is none."""
  if target not in TARGETS:
    return None
  path = os.path.join(TARGET_DIR, f"{target}_device.{_DEVICE_FILES[what]}")
  return path if os.path.exists(path) else None



def set_flags(dump_dir: str | None = None, target: str | None = None) -> None:
  """XLA flags for the deviceless compile (call before the first compile of the process):
  ptxas / libdevice from ``cuda_data_dir()``, ``--xla_dump_to`` when given, and the device's
  autotune results (``--xla_gpu_load_autotune_results_from``) when ``target`` has them."""
  flags = os.environ.get("XLA_FLAGS", "")
  d = cuda_data_dir()
  if d and "xla_gpu_cuda_data_dir" not in flags:
    flags += f" --xla_gpu_cuda_data_dir={d}"
  if dump_dir and "xla_dump_to" not in flags:
    flags += f" --xla_dump_to={dump_dir}"
  tuned = device_file(target, "autotune") if target else None
  if tuned and "xla_gpu_load_autotune_results_from" not in flags:
    flags += f" --xla_gpu_load_autotune_results_from={tuned}"
  os.environ["XLA_FLAGS"] = flags.strip()


def target_file(target: str, n_devices: int = 1) -> str:
  """The file describing ``target``: the device's own topology when a real GPU saved one (one
  device only: it holds the saving machine's GPUs), else the GpuTargetConfig text proto."""
  if target in TARGETS:
    saved = device_file(target, "topology")
    return saved if saved and n_devices == 1 else TARGETS[target]
  if os.path.exists(target):
    return target
  raise SystemExit(f"--target {target!r}: expected h200, h100, cpu or a GpuTargetConfig .txtpb")


def target_info(target: str, n_devices: int = 1) -> dict:
  """What a report says of the target: its name, the file it was compiled for, whether that is
  the device's own topology, and the autotune results ``set_flags`` loads (None: no autotuning)."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  rel = lambda p: os.path.relpath(p, root) if p else None
  f = target_file(target, n_devices)
  m = re.search(r"--xla_gpu_load_autotune_results_from=(\S+)", os.environ.get("XLA_FLAGS", ""))
  return {"name": target, "file": rel(f), "deviceless": True,
          "memory": DEVICE.get(target, {}).get("memory"),
          "device_topology": f.endswith(_DEVICE_FILES["topology"]),
          "autotune_results": rel(m.group(1) if m else device_file(target, "autotune"))}


def gpu_devices(target: str, n_devices: int = 1) -> list:
  """``n_devices`` compile-only CUDA devices of ``target`` (a name in TARGETS or a file; a saved
  ``*_device.topology.pb`` is deserialized as it is)."""
  msg = missing()
  if msg:
    raise SystemExit(msg)
  path = target_file(target, n_devices)
  if path.endswith(".pb"):
    jax.devices()                     # registers the CUDA plugin (loaded, not yet initialized)
    if not xla_client.pjrt_plugin_initialized("cuda"):
      xla_client.initialize_pjrt_plugin("cuda")
    with open(path, "rb") as f:
      return list(topologies.TopologyDescription.deserialize(f.read()).devices)
  with open(path) as f:
    cfg = f.read()
  topo = topologies.get_topology_desc("deviceless", platform="cuda", target_config=cfg,
                                      topology=f"1x1x{n_devices}")
  return list(topo.devices)


def device_name(device_kind: str) -> str:
  """The target name of a device kind: "NVIDIA H200" -> "h200", "NVIDIA H100 80GB HBM3" ->
  "h100"."""
  m = re.search(r"\b([a-z]\d{2,3})\b", device_kind.lower())
  if not m:
    raise SystemExit(f"device kind {device_kind!r}: no target name in it (e.g. H200)")
  return m.group(1)


def save_device(out_dir: str) -> str:
  """On a real GPU: writes the first device's topology (its GpuTargetConfig included) to
  ``out_dir/<name>_device.topology.pb``; returns the path."""
  dev = jax.devices()[0]
  if dev.platform != "gpu":
    raise SystemExit(f"--save_device needs a GPU; this process has {dev.platform}")
  name = f"{device_name(dev.device_kind)}_device.{_DEVICE_FILES['topology']}"
  path = os.path.join(out_dir, name)
  with open(path, "wb") as f:
    f.write(topologies.TopologyDescription([dev]).serialize())
  return path


def merge_autotune(paths: list[str], out: str) -> int:
  """Merges autotune-result text protos (one per process: XLA rewrites its dump file at every
  compile) into ``out``: the first file's top-level scalar fields (e.g. ``version``), then every
  distinct top-level message block of all files. Returns the number of blocks."""
  head, blocks = [], []
  for i, p in enumerate(paths):
    depth, cur = 0, []
    with open(p) as f:
      for line in f:
        if depth == 0 and not cur and "{" not in line:
          if i == 0 and line.strip():
            head.append(line)
          continue
        cur.append(line)
        depth += line.count("{") - line.count("}")
        if depth == 0:
          block = "".join(cur)
          if block not in blocks:
            blocks.append(block)
          cur = []
  with open(out, "w") as f:
    f.write("".join(head) + "".join(blocks))
  return len(blocks)


def gpu_mesh(target: str, axes=("d",), n_devices: int = 1) -> jax.sharding.Mesh:
  return jax.sharding.Mesh(gpu_devices(target, n_devices), axes)


def compile_for(fn, args, mesh: jax.sharding.Mesh, options: dict | None = None):
  """``jax.jit(fn)`` lowered under ``jax.set_mesh(mesh)`` for ``args`` (arrays or
  ShapeDtypeStructs, placed replicated on the mesh) and compiled; returns the Compiled."""
  rep = jax.sharding.NamedSharding(mesh, jax.P())
  specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), args)
  jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
  with jax.set_mesh(mesh):
    lowered = jitted.lower(*specs)
  return lowered.compile(options or {})


# ---- the --xla_dump_to cross-checks ------------------------------------------------------------
_LAUNCH_RE = re.compile(r"kernel_name|KernelThunk|kKernel|CustomKernelThunk", re.I)


_THUNK_RE = re.compile(r"^\s*\d+: k(\w+)")
# Thunks that launch a kernel (a memcpy / memset / control-flow thunk launches none of ours).
_KERNEL_THUNKS = ("Kernel", "CustomKernel", "Gemm", "CublasLtMatmul", "CuDnn", "Fft",
                  "CustomCall", "Sort", "TopK")


def thunk_kernels(dump_dir: str) -> dict:
  """Kernel launches of the largest ``*thunk_sequence.txt`` in ``dump_dir`` (the step's
  module): ``{"file", "kernel_thunks", "by_kind"}``; by_kind counts every thunk kind."""
  files = sorted(glob.glob(os.path.join(dump_dir, "*thunk_sequence.txt")), key=os.path.getsize)
  if not files:
    return {}
  kinds: dict = {}
  with open(files[-1]) as f:
    for line in f:
      m = _THUNK_RE.match(line)
      if m:
        kinds[m.group(1)] = kinds.get(m.group(1), 0) + 1
  return {"file": os.path.basename(files[-1]),
          "kernel_thunks": sum(v for k, v in kinds.items() if k in _KERNEL_THUNKS),
          "by_kind": kinds}


_PTXAS_FN = re.compile(r"Compiling entry function '([^']+)'")


def parse_ptxas(text: str) -> list[dict]:
  """``ptxas -v`` output (XLA's log with ``ptxas_env``) -> one dict per entry function:
  ``{kernel, regs, spill_st, spill_ld, stack, smem (static), spills}``."""
  rows, cur = [], None
  num = lambda pat, s: int(m.group(1)) if (m := re.search(pat, s)) else 0
  for line in text.splitlines():
    m = _PTXAS_FN.search(line)
    if m:
      cur = {"kernel": m.group(1), "regs": 0, "spill_st": 0, "spill_ld": 0, "stack": 0,
             "smem": 0}
      rows.append(cur)
      continue
    if cur is None:
      continue
    if "spill" in line:
      cur["stack"] = num(r"(\d+) bytes stack frame", line)
      cur["spill_st"] = num(r"(\d+) bytes spill stores", line)
      cur["spill_ld"] = num(r"(\d+) bytes spill loads", line)
    if "Used" in line:
      cur["regs"] = num(r"Used (\d+) registers", line)
      cur["smem"] = num(r"(\d+) bytes smem", line)
  for r in rows:
    r["spills"] = r["spill_st"] + r["spill_ld"] > 0
  return rows


_PALLAS_NAME = re.compile(r'name = \\?"([\w.]+)\\?", num_stages = (\d+) : i32, num_warps = (\d+)')


def pallas_kernel_names(hlo: str) -> list[str]:
  """Names of the Pallas (Triton) kernels in a compiled GPU module's HLO text."""
  return list(dict.fromkeys(m.group(1) for m in _PALLAS_NAME.finditer(hlo)))


def thunk_launches(path: str) -> dict:
  """``{kernel name: {"grid", "threads", "smem"}}`` of one ``*thunk_sequence.txt`` (the launch
  dimensions and dynamic shared memory XLA gives each kernel of that module)."""
  out = {}
  pat = re.compile(r"\] (\S+) grid: \[([\d, ]+)\] threads: \[([\d, ]+)\]\s+shared_memory: (\d+)")
  with open(path) as f:
    for line in f:
      m = pat.search(line)
      if m:
        out[m.group(1)] = {"grid": [int(x) for x in m.group(2).split(",")],
                           "threads": [int(x) for x in m.group(3).split(",")],
                           "smem": int(m.group(4))}
  return out


def ptxas_env() -> dict:
  """Environment for a child process whose XLA logs every ptxas ``-v`` report to stderr."""
  return {**os.environ, "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "0",
          "TF_CPP_VMODULE": "subprocess_compilation=2"}


def main(argv=None):
  ap = argparse.ArgumentParser(description="device files for deviceless compiles (run on a GPU)")
  ap.add_argument("--save_device", metavar="DIR", help="write <name>_device.topology.pb here")
  ap.add_argument("--merge_autotune", nargs="+", metavar="FILE",
                  help="OUT IN...: merge autotune-result dumps into OUT")
  a = ap.parse_args(argv)
  if a.save_device:
    print("wrote", save_device(a.save_device))
  if a.merge_autotune:
    if len(a.merge_autotune) < 2:
      raise SystemExit("--merge_autotune OUT IN...: no input files")
    out, ins = a.merge_autotune[0], [p for p in a.merge_autotune[1:] if os.path.exists(p)]
    if not ins:
      print(f"no autotune dumps to merge into {out}", file=sys.stderr)
      return
    print(f"wrote {out}: {merge_autotune(ins, out)} results from {len(ins)} files")


if __name__ == "__main__":
  main()
