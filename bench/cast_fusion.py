"""Whether XLA:GPU fuses a weight's float32 -> bfloat16 cast into the GEMM that reads it (issue
#38's remaining parameter-cast launches), on the H200 program compiled without a device.

A train step of ``--layers`` dense layers ``x = gelu(x @ w.astype(bf16))`` (``w f32[d, d]``,
``x bf16[--rows, d]``) plus SGD, in two forms: ``shared``, the model's (the cast read by the
forward GEMM and by the backward's ``dx`` GEMM), and ``one_user`` (a custom VJP whose backward
casts ``w`` again behind an optimization barrier, so each cast has a single GEMM reading it).
Prints, per form, the launches and the cast launches (a kernel whose body is only a convert of a
float32 parameter to bfloat16), and writes bench/results/cast_fusion_h200.json.

  .venv-gpu/bin/python -m bench.cast_fusion [--layers 4] [--rows 4096] [--d 512]
"""

from __future__ import annotations

import argparse
import os
import sys

from bench.output import at_least, result_path, write_json
from bench.profiling import gpu_target, hlo_stats, roofline
from bench.train_step import versions


def _step(form: str, layers: int):
  import jax
  import jax.numpy as jnp
  bf = jnp.bfloat16

  @jax.custom_vjp
  def dense(x, w):
    return x @ w.astype(bf)

  def fwd(x, w):
    return x @ w.astype(bf), (x, w)

  def bwd(res, dy):
    x, w = res
    wb = jax.lax.optimization_barrier(w).astype(bf)
    return dy @ wb.T, jnp.einsum("bi,bo->io", x, dy, preferred_element_type=jnp.float32)

  dense.defvjp(fwd, bwd)
  layer = dense if form == "one_user" else (lambda x, w: x @ w.astype(bf))

  def loss(ws, x):
    for w in ws[:layers]:
      x = jax.nn.gelu(layer(x, w))
    return jnp.sum(x.astype(jnp.float32))

  def step(ws, x):
    return [w - 1e-3 * g for w, g in zip(ws, jax.grad(loss)(ws, x), strict=True)]
  return step


def _fused_bodies(text: str):
  """``(launch, its fused body without parameters)`` for every top-level launch."""
  comps, entry = hlo_stats.parse_hlo(text)
  for ins in hlo_stats.top_level(comps, entry):
    called = hlo_stats._called(ins[2]) if ins[1] == "fusion" else []
    yield ins, [x for x in comps.get(called[0], []) if x[1] != "parameter"] if called else []


def _casts(text: str) -> int:
  """Launches whose fused body is one convert of a float32 parameter to bfloat16."""
  return sum(ins[4] for ins, body in _fused_bodies(text)
             if len(body) == 1 and body[0][1] == "convert" and body[0][3].startswith("bf16"))


def _gemms_with_convert(text: str) -> int:
  """GEMM launches whose fused body holds a convert (a cast taken into the GEMM)."""
  return sum(ins[4] for ins, body in _fused_bodies(text)
             if any(x[1] == "dot" for x in body) and any(x[1] == "convert" for x in body))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--layers", type=at_least(1), default=4)
  ap.add_argument("--rows", type=at_least(1), default=4096)
  ap.add_argument("--d", type=at_least(1), default=512)
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  missing = gpu_target.missing()
  if missing:
    print(f"bench.cast_fusion: {missing}", file=sys.stderr)
    return 2
  gpu_target.set_flags(None, "h200")
  import jax
  import jax.numpy as jnp
  ws = [jax.ShapeDtypeStruct((args.d, args.d), jnp.float32) for _ in range(args.layers)]
  x = jax.ShapeDtypeStruct((args.rows, args.d), jnp.bfloat16)
  rows = {}
  for form in ("shared", "one_user"):
    text = gpu_target.compile_for(_step(form, args.layers), (ws, x),
                                  gpu_target.gpu_mesh("h200")).as_text()
    costs = roofline.op_costs(text)
    rows[form] = {"launches": sum(c["times"] for c in costs),
                  "gemm_launches": sum(c["times"] for c in costs if c["gemm"]),
                  "cast_launches": _casts(text),
                  "gemm_bodies_with_convert": _gemms_with_convert(text)}
  print(f"{'form':10s} {'launches':>8s} {'GEMMs':>6s} {'casts':>6s}")
  for form, r in rows.items():
    print(f"{form:10s} {r['launches']:8d} {r['gemm_launches']:6d} {r['cast_launches']:6d}")
  path = result_path("cast_fusion_h200", False, args.out)
  write_json(path, {"bench": "cast_fusion", "target": gpu_target.target_info("h200"),
                    "versions": versions(), "shapes": vars(args) | {"out": None},
                    "forms": rows})
  print(f"wrote {os.path.relpath(path)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
