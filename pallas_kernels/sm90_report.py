"""Compile-only sm_90 report for the GPU kernels (no GPU needed; needs ``triton`` 3.6).

For each kernel and tile configuration: compile to PTX for sm_90a with triton, run the ptxas
bundled with triton (``-v``) and report registers per thread, spill bytes, shared memory and the
instruction mix that matters on Hopper (``wgmma`` = tensor-core warpgroup MMA, ``cp.async`` =
asynchronous (pipelined) copies, ``tanh.approx`` / ``ex2.approx`` = MUFU ops).

- jax-triton kernels (``_triton_src.py``): compiled from source with their constexprs.
- Pallas kernels (``pallas_gdpa.py``, ``pallas_block.py``, ``pallas_softmax.py``): lowered by
  jax to Triton IR (with jax's GPU-info query stubbed to sm_90), then the same IR is compiled by
  triton 3.6.

  python -m pallas_kernels.sm90_report            # table for the default shapes and candidates
  python -m pallas_kernels.sm90_report --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile

import jax
import jax.numpy as jnp
from jax._src.pallas.triton import gpu_info
from jax._src.pallas.triton import pallas_call_registration as reg

from pallas_kernels import activations, pallas_block, pallas_gdpa, pallas_softmax, tuning

SHAPES = {  # bench/kernels.py shapes (batch 2: the batch does not change the kernel)
    "self": dict(Tq=2048, Tk=2048, Hq=8, Hkv=8, D=128),
    "cross": dict(Tq=1024, Tk=128, Hq=4, Hkv=4, D=128),
}


def ptxas_stats(ptx: str) -> dict:
  """Registers, spills and stack of the (single) kernel in ``ptx``, from ``ptxas -v``."""
  import triton
  ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
  with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "k.ptx")
    with open(path, "w") as f:
      f.write(ptx)
    out = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", os.devnull],
                         capture_output=True, text=True, check=True).stderr
  num = lambda pat: int(m.group(1)) if (m := re.search(pat, out)) else 0
  return {"regs": num(r"Used (\d+) registers"), "spill_st": num(r"(\d+) bytes spill stores"),
          "spill_ld": num(r"(\d+) bytes spill loads"), "stack": num(r"(\d+) bytes stack frame")}


def _stats(compiled, num_warps, num_stages) -> dict:
  ptx = compiled.asm["ptx"]
  st = ptxas_stats(ptx)
  st.update(warps=num_warps, stages=num_stages, smem=int(compiled.metadata.shared),
            wgmma=ptx.count("wgmma.mma_async"), mma_sync=ptx.count("mma.sync"),
            cp_async=len(re.findall(r"cp\.async\.(?:cg|ca)", ptx)) + ptx.count("cp.async.bulk"),
            mufu=ptx.count("tanh.approx") + ptx.count("ex2.approx"))
  return st


def _target():
  from triton.backends.compiler import GPUTarget
  return GPUTarget("cuda", 90, 32)


# ----------------------------------------------------------------------------- jax-triton


def triton_kernel_stats(kernel: str, tiles, shape: dict, *, act="fast_gelu", dtype="bf16",
                        window=-1, clip=0.0, mixed=()):
  """Compiles one jax-triton GDPA kernel ("fwd", "dq", "dkv") for sm_90; returns its stats."""
  import triton
  from triton.compiler import ASTSource

  from pallas_kernels import _triton_src as src
  fn = {"fwd": src.fwd_kernel, "dq": src.dq_kernel, "dkv": src.dkv_kernel}[kernel]
  bq, bk, warps, stages = tiles
  codes = sorted({activations.CODES[a] for a in (mixed or (act,))})
  consts = dict(TQ=shape["Tq"], TK=shape["Tk"], HQ=shape["Hq"], HKV=shape["Hkv"], D=shape["D"],
                BQ=bq, BK=bk, ACT=codes[0] if len(codes) == 1 else -1,
                ACT_SET=sum(1 << c for c in codes), WINDOW=window, HAS_QI=False, HAS_KI=False,
                SCALE=shape["D"] ** -0.5, OUT_SCALE=1.0, CLIP=clip, FAST=dtype != "fp32",
                PREC="ieee" if dtype == "fp32" else "tf32")
  ptr = {n: ("*i32" if n in ("QL", "KL", "QI", "KI", "ACTC") else f"*{dtype}")
         for n in fn.arg_names if n not in consts}
  sig = {n: ptr.get(n, "constexpr") for n in fn.arg_names}
  # jax-triton specialises every pointer as 16-byte aligned (XLA buffers are): without this the
  # loads cannot be vectorised nor pipelined.
  attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n in ptr}
  compiled = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=_target(),
                            options=dict(num_warps=warps, num_stages=stages))
  return _stats(compiled, warps, stages)


# ----------------------------------------------------------------------------- Pallas


def pallas_ttir(f, *args):
  """``[(kernel name, Triton IR text, num_warps, num_stages)]`` of the ``pallas_call``s in
  ``jax.jit(f)`` lowered for CUDA sm_90 (on any host)."""
  mods = []
  orig_lower, orig_info = reg.lowering.lower_jaxpr_to_triton_module, reg.gpu_info_lib.get_gpu_info

  def grab(*a, **kw):
    res = orig_lower(*a, **kw)
    mods.append(res.module.operation.get_asm(enable_debug_info=False))
    return res

  reg.lowering.lower_jaxpr_to_triton_module = grab
  reg.gpu_info_lib.get_gpu_info = lambda: gpu_info.GpuInfo(
      gpu_version=None, arch_name="sm_90", compute_capability=90)
  try:
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  finally:
    reg.lowering.lower_jaxpr_to_triton_module = orig_lower
    reg.gpu_info_lib.get_gpu_info = orig_info
  calls = re.findall(r'name = "([^"]+)", num_stages = (\d+) : i32, num_warps = (\d+) : i32',
                     text)
  if len(calls) != len(mods):
    raise RuntimeError(f"found {len(calls)} Triton custom calls for {len(mods)} kernels")
  return [(n, m, int(w), int(s)) for (n, s, w), m in zip(calls, mods, strict=True)]


def compile_ttir(ttir: str, num_warps: int, num_stages: int) -> dict:
  import triton
  with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "k.ttir")
    with open(path, "w") as f:
      f.write(ttir)
    compiled = triton.compile(path, target=_target(),
                              options=dict(num_warps=num_warps, num_stages=num_stages))
  return _stats(compiled, num_warps, num_stages)


def pallas_gdpa_stats(shape: dict, tuning_kw: dict, dtype=jnp.bfloat16, **kw) -> dict:
  """Stats of the Pallas GDPA forward, dq and dk/dv kernels at ``shape`` (batch 2)."""
  q = jax.ShapeDtypeStruct((2, shape["Tq"], shape["Hq"], shape["D"]), dtype)
  k = jax.ShapeDtypeStruct((2, shape["Tk"], shape["Hkv"], shape["D"]), dtype)
  loss = jax.grad(lambda q, k, v: jnp.sum(pallas_gdpa.gdpa_pallas(
      q, k, v, **tuning_kw, **kw).astype(jnp.float32)), (0, 1, 2))
  return {name: compile_ttir(ir, w, s) for name, ir, w, s in pallas_ttir(loss, q, k, k)}


def pallas_block_stats(T=4096, H=8, D=128, block=64, activation="softmax", dtype=jnp.bfloat16):
  x = jax.ShapeDtypeStruct((2, T, H, D), dtype)
  loss = jax.grad(lambda q, k, v: jnp.sum(pallas_block.block_attention_pallas(
      q, k, v, block_size=block, activation=activation).astype(jnp.float32)), (0, 1, 2))
  return {name: compile_ttir(ir, w, s) for name, ir, w, s in pallas_ttir(loss, x, x, x)}


def pallas_softmax_stats(T=2048, H=8, D=128, window=64, dtype=jnp.bfloat16, **tiles):
  """Stats of the Pallas softmax-attention forward, dq and dk/dv kernels (batch 2, ragged)."""
  x = jax.ShapeDtypeStruct((2, T, H, D), dtype)
  lens = jnp.array([T, 3 * T // 4], jnp.int32)
  loss = jax.grad(lambda q, k, v: jnp.sum(pallas_softmax.softmax_attention_pallas(
      q, k, v, window=window, q_lengths=lens, kv_lengths=lens, **tiles).astype(jnp.float32)),
      (0, 1, 2))
  return {name: compile_ttir(ir, w, s) for name, ir, w, s in pallas_ttir(loss, x, x, x)}


# ----------------------------------------------------------------------------- report


def report() -> dict:
  out = {"triton": {}, "pallas": {}, "pallas_block": {}, "pallas_softmax": {}}
  for cls, shape in SHAPES.items():
    for kern, cands in tuning.CANDIDATES.items():
      for tiles in cands:
        try:
          st = triton_kernel_stats(kern, tiles, shape)
        except Exception as e:  # noqa: BLE001 - report and continue
          st = {"error": f"{type(e).__name__}: {e}"[:200]}
        out["triton"][f"{cls}/{kern}/{'x'.join(map(str, tiles))}"] = st
    for bq, bk, w, s in tuning.CANDIDATES["fwd"][:3]:
      kw = dict(block_q=bq, block_k=bk, block_q_bwd=64, block_k_bwd=64, num_warps=w,
                num_stages=s)
      for name, st in pallas_gdpa_stats(shape, kw).items():
        out["pallas"][f"{cls}/{name}/{bq}x{bk}x{w}x{s}"] = st
  for act in ("softmax", "silu"):
    for name, st in pallas_block_stats(activation=act).items():
      out["pallas_block"][f"{act}/{name}"] = st
  for window in (64, None):
    for name, st in pallas_softmax_stats(window=window).items():
      out["pallas_softmax"][f"{'swa64' if window else 'full'}/{name}"] = st
  return out


def print_report(rep: dict) -> None:
  cols = ("regs", "spill_st", "spill_ld", "smem", "wgmma", "cp_async", "mufu")
  print(f"{'kernel / config (bq x bk x warps x stages)':48s} " + " ".join(f"{c:>8s}" for c in cols))
  for group, rows in rep.items():
    for name, st in rows.items():
      if "error" in st:
        print(f"{group + ':' + name:48s} {st['error']}")
        continue
      print(f"{group + ':' + name:48s} " + " ".join(f"{st[c]:8d}" for c in cols))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--json", default=None, help="also write the report here")
  a = p.parse_args(argv)
  rep = report()
  print_report(rep)
  if a.json:
    with open(a.json, "w") as f:
      json.dump(rep, f, indent=1)


if __name__ == "__main__":
  main()
