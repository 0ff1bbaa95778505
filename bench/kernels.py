"""Kernel check and benchmark: GDPA and block attention, xla / pallas / triton / cuDNN softmax.

On a GPU: first checks every backend against the XLA reference at the real shapes (forward, and
gradients at a reduced batch), then times forward and forward+backward (median of ``--iters``
runs after two warm-ups) and prints a table of ms and TFLOP/s. Results (device, versions, shapes,
errors, medians) go to ``bench/results/kernels_<device>_<time>.json``.

  python bench/kernels.py                # GPU, real shapes, bf16
  python bench/kernels.py --small        # CPU-friendly: tiny shapes, Pallas in interpret mode
  python bench/kernels.py --autotune --write_tables DIR --peer DIR   # the prepared GPU run

``--autotune`` first times the candidate tiles of ``pallas_kernels.tuning.CANDIDATES`` per kernel
and shape (Triton: fwd, dq, dk/dv; Pallas: fwd) and uses the fastest; ``--write_tables DIR``
writes ``tuning.json`` (those tiles) and ``backend_table.json`` (per shape class and mode the
fastest backend whose check passed) for ``pallas_kernels/``. ``--peer DIR`` also times Meta's
Triton GDPA forward (``DIR/bench_peer_gdpa.py``, a PyTorch subprocess; only when torch is
importable) at the same shapes: column ``meta_triton``.

FLOPs: GDPA / attention forward ``4 B Tq Tk H D`` (block attention: ``Tk`` = block size);
forward+backward counted as 3.5x forward (the convention of jax_stack_notes §2.2), i.e. model
FLOPs, not the recomputed scores. cuDNN is softmax attention (not GDPA): a speed yardstick only;
for block attention it runs on the sequence reshaped to ``[B * T / 64, 64, H, D]``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

if __package__ in (None, ""):  # run as a script: make the repository importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels import api, pallas_block, pallas_gdpa, reference, tuning  # noqa: E402

FULL = {
    "self_attention": dict(kind="gdpa", B=16, Tq=2048, Tk=2048, H=8, D=128),
    "cross_attention": dict(kind="gdpa", B=512, Tq=1024, Tk=128, H=4, D=128),
    "block_attention": dict(kind="block", B=16, Tq=4096, Tk=4096, H=8, D=128, block=64),
}
SMALL = {
    "self_attention": dict(kind="gdpa", B=2, Tq=40, Tk=40, H=2, D=16),
    "cross_attention": dict(kind="gdpa", B=2, Tq=48, Tk=16, H=2, D=16),
    "block_attention": dict(kind="block", B=2, Tq=64, Tk=64, H=2, D=16, block=16),
}
CLASS = {"self_attention": "self", "cross_attention": "cross", "block_attention": "block"}

# Targets of issue 12 (H200, bf16): (case, mode) -> minimum TFLOP/s, or ("x_xla", factor).
TARGETS = {
    ("self_attention", "fwd"): 450.0,
    ("self_attention", "fwd+bwd"): 400.0,
    ("cross_attention", "fwd"): 250.0,
    ("cross_attention", "fwd+bwd"): 200.0,
    ("block_attention", "fwd+bwd"): ("x_xla", 3.0),
}


def check_targets(results):
  """Best of pallas/triton against each target (only meaningful on the H200 at full shapes)."""
  out = {}
  for (name, mode), target in TARGETS.items():
    case = results["cases"].get(name)
    if case is None:
      continue
    key = "fwd_ms" if mode == "fwd" else "fwd_bwd_ms"
    ours = {i: ms for i, ms in case[key].items() if i in ("pallas", "triton") and ms}
    if not ours:
      continue
    impl, ms = min(ours.items(), key=lambda kv: kv[1])
    flops = case["fwd_flops"] * (1.0 if mode == "fwd" else 3.5)
    tflops = flops / (ms * 1e-3) / 1e12
    if isinstance(target, tuple):
      xla = case[key].get("xla")
      ok = bool(xla) and xla / ms >= target[1]
      goal = f">= {target[1]}x xla"
    else:
      ok, goal = tflops >= target, f">= {target} TFLOP/s"
    out[f"{name}/{mode}"] = {"best": impl, "tflops": tflops, "target": goal, "met": ok}
  return out


def fwd_flops(s):
  return 4.0 * s["B"] * s["Tq"] * (s.get("block") or s["Tk"]) * s["H"] * s["D"]


def make_fns(name, s, small, on_gpu, tuned=None):
  """name -> forward function (q, k, v) -> out, for every backend that applies. ``tuned``:
  {"triton": {kernel: tiles}, "pallas": {kernel: tiles}} from ``autotune`` (else defaults)."""
  interp = not on_gpu
  tuned = tuned or {}
  fns = {}
  if s["kind"] == "gdpa":
    kw = dict(activation="fast_gelu", out_scale=1.0 / s["Tk"])
    fns["xla"] = lambda q, k, v: reference.gdpa_reference(q, k, v, **kw)
    pt = {} if small else pallas_tiles(tuned.get("pallas", {}))
    fns["pallas"] = lambda q, k, v: pallas_gdpa.gdpa_pallas(q, k, v, interpret=interp, **kw, **pt)
    if on_gpu and _has("jax_triton"):
      from pallas_kernels import triton_gdpa
      cfg = tuned.get("triton") or None
      fns["triton"] = lambda q, k, v: triton_gdpa.gdpa_triton(q, k, v, config=cfg, **kw)
    if on_gpu:
      fns["cudnn_softmax"] = lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, implementation="cudnn")
  else:
    bs = s["block"]
    fns["xla"] = lambda q, k, v: reference.block_attention_reference(q, k, v, block_size=bs)
    fns["pallas"] = lambda q, k, v: pallas_block.block_attention_pallas(
        q, k, v, block_size=bs, interpret=interp)
    if on_gpu:
      def cudnn_blocks(q, k, v):
        B, T, H, D = q.shape
        r = lambda x: x.reshape(B * T // bs, bs, H, D)
        return jax.nn.dot_product_attention(r(q), r(k), r(v), implementation="cudnn").reshape(
            q.shape)
      fns["cudnn_softmax"] = cudnn_blocks
  return fns


def pallas_tiles(t):
  """Pallas keyword tiles from {"fwd": (bq, bk, warps, stages), "dkv": ...}."""
  out = {}
  if "fwd" in t:
    bq, bk, w, st = t["fwd"]
    out.update(block_q=bq, block_k=bk, num_warps=w, num_stages=st)
  return out


def _has(module):
  return importlib.util.find_spec(module) is not None


def autotune(name, s, q, k, v, iters):
  """Times the candidate tiles of each GPU kernel at this shape; returns the fastest per kernel
  and every timing. Triton: fwd (forward), then dq and dk/dv (forward+backward, the others at
  their defaults / the winner so far); Pallas: fwd."""
  fwd_kw = dict(activation="fast_gelu", out_scale=1.0 / s["Tk"])
  best, log = {"triton": {}, "pallas": {}}, {}

  def pick(backend, kern, make, mode):
    times = {}
    for tiles in tuning.CANDIDATES[kern]:
      f = make(tiles)
      try:
        times["x".join(map(str, tiles))] = median_ms(jax.jit(f if mode == "fwd" else fwd_bwd(f)),
                                                      (q, k, v), iters)
      except Exception as e:  # noqa: BLE001 - a config that does not compile or fit is skipped
        times["x".join(map(str, tiles))] = f"{type(e).__name__}: {e}"[:120]
    ok = {t: ms for t, ms in times.items() if isinstance(ms, float)}
    log[f"{backend}/{kern}"] = times
    if ok:
      best[backend][kern] = tuple(int(x) for x in min(ok, key=ok.get).split("x"))
    print(f"  autotune {name:16s} {backend}/{kern}: best {best[backend].get(kern)}", flush=True)

  if _has("jax_triton"):
    from pallas_kernels import triton_gdpa
    tri = lambda cfg: (lambda q, k, v: triton_gdpa.gdpa_triton(q, k, v, config=cfg, **fwd_kw))
    pick("triton", "fwd", lambda t: tri({"fwd": t}), "fwd")
    pick("triton", "dq", lambda t: tri({**best["triton"], "dq": t}), "fwd_bwd")
    pick("triton", "dkv", lambda t: tri({**best["triton"], "dkv": t}), "fwd_bwd")
  pick("pallas", "fwd", lambda t: (lambda q, k, v: pallas_gdpa.gdpa_pallas(
      q, k, v, **fwd_kw, **pallas_tiles({"fwd": t}))), "fwd")
  return best, log


def run_peer(peer_dir, out_dir):
  """Meta's Triton GDPA timed by its own PyTorch script (a subprocess); {} when unavailable."""
  script = os.path.join(peer_dir or "", "bench_peer_gdpa.py")
  if not peer_dir or not os.path.exists(script) or not _has("torch"):
    return {}
  with tempfile.TemporaryDirectory() as d:
    try:
      subprocess.run([sys.executable, script, "--out_dir", d], cwd=peer_dir, timeout=150,
                     check=True)
      with open(os.path.join(d, "peer_gdpa.json")) as f:
        res = json.load(f)
    except (subprocess.SubprocessError, OSError, ValueError) as e:
      return {"error": f"{type(e).__name__}: {e}"[:300]}
  if out_dir:
    with open(os.path.join(out_dir, "peer_gdpa.json"), "w") as f:
      json.dump(res, f, indent=1)
  return res


def inputs(s, dtype, batch=None, seed=0):
  B = batch or s["B"]
  ks = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(ks[0], (B, s["Tq"], s["H"], s["D"]), dtype),
          jax.random.normal(ks[1], (B, s["Tk"], s["H"], s["D"]), dtype),
          jax.random.normal(ks[2], (B, s["Tk"], s["H"], s["D"]), dtype))


def fwd_bwd(f):
  def loss(q, k, v):
    return jnp.sum(f(q, k, v).astype(jnp.float32))
  return jax.grad(loss, argnums=(0, 1, 2))


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def median_ms(f, args, iters):
  for _ in range(2):
    jax.block_until_ready(f(*args))
  times = []
  for _ in range(iters):
    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    times.append((time.perf_counter() - t) * 1e3)
  return statistics.median(times)


def run(small=False, iters=20, dtype="bfloat16", out_dir=None, cases=None, tune=False,
        tables_dir=None, peer_dir=None):
  on_gpu = jax.default_backend() == "gpu"
  shapes = SMALL if small else FULL
  dt = jnp.dtype(dtype)
  results = {"device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
             "versions": {"jax": jax.__version__, "jaxlib": jax.lib.__version__,
                          "python": platform.python_version()},
             "dtype": dtype, "small": small, "iters": iters, "cases": {}}
  try:
    import jax_triton
    import triton
    results["versions"].update(jax_triton=jax_triton.__version__, triton=triton.__version__)
  except ImportError:
    pass
  rows = []
  peer = run_peer(peer_dir, out_dir) if on_gpu else {}
  results["tuned"] = {}
  for name, s in shapes.items():
    if cases and name not in cases:
      continue
    q, k, v = inputs(s, dt)
    tuned = None
    if tune and on_gpu and s["kind"] == "gdpa":
      tuned, log = autotune(name, s, q, k, v, max(3, iters // 2))
      results["tuned"][name] = {"best": tuned, "ms": log}
    fns = make_fns(name, s, small, on_gpu, tuned)
    case = {"shape": s, "fwd_flops": fwd_flops(s), "check": {}, "fwd_ms": {}, "fwd_bwd_ms": {}}
    pc = peer.get("cases", {}).get(name, {})
    if pc.get("fwd_ms"):
      case["fwd_ms"]["meta_triton"] = pc["fwd_ms"]
      rows.append((name, "meta_triton", "fwd", pc["fwd_ms"],
                   case["fwd_flops"] / (pc["fwd_ms"] * 1e-3) / 1e12))
    if peer.get("error") or pc.get("error"):
      case.setdefault("errors", {})["meta_triton"] = peer.get("error") or pc["error"]
    # Correctness against the XLA reference (the cuDNN softmax is not GDPA: timing only).
    ref = jax.jit(fns["xla"])(q, k, v)
    nb = min(s["B"], 2 if not small else s["B"])
    qs, ks, vs = inputs(s, jnp.float32, batch=nb, seed=1)
    g_ref = jax.jit(fwd_bwd(fns["xla"]))(qs, ks, vs)
    for impl, f in fns.items():
      if impl in ("xla", "cudnn_softmax"):
        continue
      try:
        err = {"fwd_rel_err": rel_err(jax.jit(f)(q, k, v), ref)}
        g = jax.jit(fwd_bwd(f))(qs, ks, vs)
        err.update({f"d{n}_rel_err": rel_err(a, b) for n, a, b in zip("qkv", g, g_ref,
                                                                       strict=True)})
        case["check"][impl] = err
      except Exception as e:  # report and keep benchmarking the others
        case["check"][impl] = {"error": f"{type(e).__name__}: {e}"[:300]}
    for impl, f in fns.items():
      for mode, fn, key in (("fwd", f, "fwd_ms"), ("fwd+bwd", fwd_bwd(f), "fwd_bwd_ms")):
        try:
          ms = median_ms(jax.jit(fn), (q, k, v), iters)
        except Exception as e:
          case[key][impl] = None
          case.setdefault("errors", {})[f"{impl}/{mode}"] = f"{type(e).__name__}: {e}"[:300]
          rows.append((name, impl, mode, None, None))
          continue
        case[key][impl] = ms
        flops = case["fwd_flops"] * (1.0 if mode == "fwd" else 3.5)
        rows.append((name, impl, mode, ms, flops / (ms * 1e-3) / 1e12))
    results["cases"][name] = case
  results["targets"] = check_targets(results)
  print_table(rows, results)
  out_dir = out_dir or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
  os.makedirs(out_dir, exist_ok=True)
  if tables_dir:
    write_tables(results, tables_dir)
  stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
  dev = results["device"].replace(" ", "_").replace("/", "_")
  path = os.path.join(out_dir, f"kernels_{dev}{'_small' if small else ''}_{stamp}.json")
  with open(path, "w") as f:
    json.dump(results, f, indent=1)
  print(f"wrote {path}")
  return results, path


# A backend's result counts only if it matched the reference (bf16 forward, fp32 gradients).
MAX_ERR = {"fwd_rel_err": 1e-2, "dq_rel_err": 1e-3, "dk_rel_err": 1e-3, "dv_rel_err": 1e-3}


def backend_table(results):
  """{device kind: {kind: {shape class: {mode: fastest correct backend}}}} from this run."""
  dev = {}
  for name, case in results["cases"].items():
    kind = "gdpa" if case["shape"]["kind"] == "gdpa" else "block_attention"
    ok = {"xla"} | {i for i, err in case["check"].items()
                    if "error" not in err and all(err.get(k, 0.0) <= m for k, m in MAX_ERR.items())}
    for mode, key in (("fwd", "fwd_ms"), ("fwd_bwd", "fwd_bwd_ms")):
      cand = {i: ms for i, ms in case[key].items() if i in ok and ms}
      if cand:
        dev.setdefault(kind, {}).setdefault(CLASS[name], {})[mode] = min(cand, key=cand.get)
  return {results["device"]: dev}


def write_tables(results, tables_dir):
  """tuning.json and backend_table.json (merged with the files already in ``tables_dir``)."""
  os.makedirs(tables_dir, exist_ok=True)
  dtype = jnp.dtype(results["dtype"])
  tun_path = os.path.join(tables_dir, "tuning.json")
  tun = api.load_table.__wrapped__(tun_path)
  for name, t in results.get("tuned", {}).items():
    s = results["cases"][name]["shape"]
    key = tuning.key(CLASS[name], s["D"], dtype)
    for backend, kernels in t["best"].items():
      if kernels:
        tun.setdefault(results["device"], {}).setdefault(backend, {})[key] = {
            k: list(v) for k, v in kernels.items()}
  tab_path = os.path.join(tables_dir, "backend_table.json")
  tab = api.load_table.__wrapped__(tab_path)
  tab.setdefault("devices", {}).update(backend_table(results))
  tab["source"] = {"bench": "bench/kernels.py", "versions": results["versions"],
                   "dtype": results["dtype"]}
  for path, obj in ((tun_path, tun), (tab_path, tab)):
    with open(path, "w") as f:
      json.dump(obj, f, indent=1, sort_keys=True)
    print(f"wrote {path}")


def print_table(rows, results):
  print(f"device {results['device']} ({results['backend']}), dtype {results['dtype']}, "
        f"versions {results['versions']}")
  for name, case in results["cases"].items():
    for impl, err in case["check"].items():
      print(f"  check {name:16s} {impl:8s} {err}")
  print(f"{'case':16s} {'impl':14s} {'mode':8s} {'median ms':>10s} {'TFLOP/s':>9s}")
  for name, impl, mode, ms, tf in rows:
    ms_s = "error" if ms is None else f"{ms:10.3f}"
    tf_s = "" if tf is None else f"{tf:9.4g}"
    print(f"{name:16s} {impl:14s} {mode:8s} {ms_s:>10s} {tf_s:>9s}")
  for k, t in results.get("targets", {}).items():
    print(f"target {k:28s} {t['best']:7s} {t['tflops']:9.4g} TFLOP/s  ({t['target']}): "
          f"{'met' if t['met'] else 'NOT met'}")


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--small", action="store_true", help="tiny shapes; Pallas in interpret mode")
  p.add_argument("--iters", type=int, default=None, help="timed runs (default 20; small: 2)")
  p.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                 help="input dtype (default bfloat16; small: float32)")
  p.add_argument("--out_dir", default=None, help="where the JSON goes (default bench/results)")
  p.add_argument("--cases", default=None, help="comma-separated subset of " + ",".join(FULL))
  p.add_argument("--autotune", action="store_true", help="GPU: time the candidate tiles first")
  p.add_argument("--write_tables", default=None, metavar="DIR",
                 help="write tuning.json and backend_table.json here (for pallas_kernels/)")
  p.add_argument("--peer", default=None, metavar="DIR",
                 help="folder of Meta's Triton GDPA peer (bench_peer_gdpa.py); needs torch")
  a = p.parse_args(argv)
  cases = a.cases.split(",") if a.cases else None
  for c in cases or ():
    if c not in FULL:
      p.error(f"unknown case {c!r}; allowed: {', '.join(FULL)}")
  run(small=a.small, iters=a.iters or (2 if a.small else 20),
      dtype=a.dtype or ("float32" if a.small else "bfloat16"), out_dir=a.out_dir, cases=cases,
      tune=a.autotune, tables_dir=a.write_tables, peer_dir=a.peer)


if __name__ == "__main__":
  main()
