"""Packed towers in K capacity buckets (``data.jagged_buckets``) on the H200 program (issue #28).

A run with K buckets executes one of K compiled programs per batch: the smallest bucket its
lengths fit (``data.jagged.pick_bucket``). This combines the K programs' ``bench/train_step``
JSONs (``--jagged auto --jagged_buckets K --jagged_bucket i``; the largest bucket is the plain
``--jagged auto`` program, whose capacities it must equal) with the padded program's, over
``--batches`` batches of lengths drawn as bench/train_step draws them (fresh seeds): each batch's
useful FLOPs (``kunlun.models.flops.batch_flops``, actual lengths) and real events, against the
compiled FLOPs, roofline bytes and bound of the program it takes. Figures are sums over the
batches (what a run of them pays): useful share = sum useful / sum compiled, bytes per real
event, useful-MFU bound = sum useful / (sum bound x peak); K = 1 (the largest bucket for every
batch) and padded side by side, with issue #28's targets.

  python -m bench.jagged_buckets --padded P.json --buckets B0.json ... B{K-1}.json [--out J]
"""

from __future__ import annotations

import argparse
import io
import json
import os

import numpy as np

from bench.output import RESULTS, at_least, result_path, write_json
from bench.profiling.roofline import print_floors
from bench.train_step import (
  FLOOR_RATIO,
  FUSED_TARGETS,
  JAGGED_TARGETS,
  draw_lengths,
  load_config,
)
from data import jagged
from data.synthetic import PRESETS, preset_schema
from kunlun.configs import types as model_config
from kunlun.models.flops import batch_flops


def _load(path: str) -> dict:
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    raise SystemExit(f"jagged_buckets: cannot read {path}: {e}") from None


UNFUSED = ("attention", "GDPA")   # roofline groups whose XLA twins materialise score tensors


def _program(r: dict) -> dict:
  u, rl = r["useful"], r["roofline"]
  out = {"name": r["name"], "tokens": u["tokens"], "flops": u["flops_compiled"],
         "bytes": u["bytes"], "bound_s": u["bound_s"], "peak_flops": rl["device"]["peak_flops"],
         "launches": rl["xla"].get("launches"), "device": rl["device"]}
  if all("floor_bytes" in v for v in rl.get("groups", {}).values()) and rl.get("groups"):
    out["groups"] = {g: {k: v[k] for k in ("bytes", "floor_bytes", "launches", "pallas_bytes",
                                            "gemm_bytes", "saved_bytes") if k in v}
                     for g, v in rl["groups"].items()}
  rows = [x for x in rl.get("rows", []) if x["group"] in UNFUSED]
  if r["backend"] == "xla" and rows:
    # A floor for any XLA program of this model that materialises scores: attention and GDPA
    # charged only their GEMMs' operands and outputs (every softmax, mask and activation pass
    # free, though each must read at least one GEMM output back); the rest as compiled.
    d = rl["device"]
    nbytes = u["bytes"] - sum(x["bytes"] for x in rows) + sum(x["gemm_bytes"] for x in rows)
    out["gemm_only_bytes"] = nbytes
    out["gemm_only_bound_s"] = (max(u["flops_compiled"] / d["peak_flops"],
                                    nbytes / d["bandwidth"]) + out["launches"] * d["launch_s"])
  return out


def check_runs(padded: dict, runs: list[dict]) -> dict:
  """{stream: (N_0, ..., N_{K-1})} from the bucket runs (K = 1: the one run's packed streams),
  each checked against its program's tokens, all of one config / backend / batch / target as
  the padded run."""
  caps = next((r["jagged_buckets"]["capacities"] for r in runs if r.get("jagged_buckets")), None)
  if caps is None and len(runs) == 1:           # K = 1: the plain --jagged program
    caps = {s: [n] for s, n in runs[0]["useful"]["tokens"].items()
            if n != padded["useful"]["tokens"].get(s)}
  if caps is None:
    raise SystemExit("jagged_buckets: no --buckets JSON records its buckets (run bench/train_step "
                     "with --jagged_buckets K --jagged_bucket i)")
  K = len(next(iter(caps.values())))
  if len(runs) != K:
    raise SystemExit(f"jagged_buckets: {K} buckets need {K} --buckets JSONs, got {len(runs)}")
  key = lambda r: (r["config"], r["backend"], r["global_batch"], r["target"]["name"],
                   r["lengths"])
  for i, r in enumerate(runs):
    if key(r) != key(padded) or r.get("layout") != "packed":
      raise SystemExit(f"jagged_buckets: {r['name']} is not a packed run of {key(padded)}")
    want = {s: c[i] for s, c in caps.items()}
    got = {s: r["useful"]["tokens"][s] for s in caps}
    if got != want:
      raise SystemExit(f"jagged_buckets: {r['name']} has capacities {got}, bucket {i} is {want}")
  return {s: tuple(c) for s, c in caps.items()}


def combine(padded: dict, runs: list[dict], batches: int, seed: int) -> dict:
  caps = check_runs(padded, runs)
  cfg = load_config(padded["config"], padded.get("overrides", []))
  cfg.model.backend, cfg.data.batch_size = padded["backend"], padded["global_batch"]
  schema = preset_schema(PRESETS[cfg.data.preset])
  seq_lens = model_config.seq_lens(cfg)
  B, shards = padded["global_batch"], 1
  progs = [_program(r) for r in runs]
  pad = _program(padded)
  K = len(progs)
  pick = np.zeros(batches, np.int64)
  useful, real, dropped = np.zeros(batches), np.zeros(batches), np.zeros(batches)
  for b in range(batches):
    L = draw_lengths(schema, seq_lens, B, padded["lengths"], seed + b)
    pick[b] = jagged.pick_bucket({s: L[s] for s in caps}, caps, shards)
    kept = {s: jagged.fit_lengths(L[s], caps[s][pick[b]]) if s in caps else L[s] for s in L}
    dropped[b] = sum(int(L[s].sum() - kept[s].sum()) for s in L)
    fake = {"surface": np.zeros(B, np.int32), "events": {s: {"length": v} for s, v in kept.items()}}
    useful[b] = batch_flops(cfg, schema, fake)["train_step"]
    real[b] = sum(float(v.sum()) for v in kept.values())

  def figures(flops, nbytes, bound_s, peak):
    return {"useful_share": useful.sum() / flops.sum(),
            "bytes_per_real_event": nbytes.sum() / real.sum(),
            "useful_mfu_bound": useful.sum() / (bound_s.sum() * peak),
            "bound_ms_mean": 1e3 * bound_s.mean()}

  col = lambda k: np.array([p[k] for p in progs])[pick]
  top = lambda k: np.full(batches, progs[-1][k])
  flat = lambda k: np.full(batches, pad[k])
  out = {
      "bench": "jagged_buckets", "config": padded["config"], "backend": padded["backend"],
      "global_batch": B, "target": padded["target"], "device_kind": padded.get("device_kind"),
      "versions": padded.get("versions"), "lengths": padded["lengths"],
      "batches": batches, "seeds": [seed, seed + batches - 1],
      "capacities": {s: list(c) for s, c in caps.items()},
      "bucket_quantiles": list(jagged.BUCKET_QUANTILES[K]),
      "bucket_share": (np.bincount(pick, minlength=K) / batches).tolist(),
      "programs": progs, "padded_program": pad,
      "fill": {"buckets": real.sum() / sum(sum(p["tokens"][s] for s in caps) for p in
                                            (progs[i] for i in pick)),
               "one_bucket": real.sum() / (batches * sum(progs[-1]["tokens"][s] for s in caps))},
      "dropped_events_per_batch": dropped.mean(),
      "batches_over_capacity": float(np.mean(dropped > 0)),
      "useful_tflop_per_batch": useful.mean() / 1e12,
      "padded": figures(flat("flops"), flat("bytes"), flat("bound_s"), pad["peak_flops"]),
      "one_bucket": figures(top("flops"), top("bytes"), top("bound_s"), pad["peak_flops"]),
      "buckets": figures(col("flops"), col("bytes"), col("bound_s"), pad["peak_flops"]),
  }
  if all("gemm_only_bound_s" in p for p in progs):
    out["buckets_gemm_only"] = {
        "bytes_per_real_event": col("gemm_only_bytes").sum() / real.sum(),
        "useful_mfu_bound": useful.sum() / (col("gemm_only_bound_s").sum() * pad["peak_flops"])}
  if all("groups" in p for p in progs):
    out["groups"], out["floor"], out["at_floor_ratio"] = _group_floors(
        progs, pick, real, useful, pad["peak_flops"])
  out["launches_per_batch"] = float(col("launches").mean())
  out["targets_fused"] = fused_targets(out)
  t = JAGGED_TARGETS
  q = out["buckets"]
  out["targets"] = {
      "useful_share": {"target": t["useful_share"], "value": q["useful_share"],
                       "met": bool(q["useful_share"] >= t["useful_share"])},
      "bytes_per_event_ratio": {
          "target": t["bytes_per_event_ratio"],
          "value": out["padded"]["bytes_per_real_event"] / q["bytes_per_real_event"],
          "met": bool(out["padded"]["bytes_per_real_event"] / q["bytes_per_real_event"]
                      >= t["bytes_per_event_ratio"])},
      "useful_mfu_bound": {"target": t["useful_mfu_bound"].get(B), "value": q["useful_mfu_bound"],
                           "met": bool(q["useful_mfu_bound"] >= t["useful_mfu_bound"].get(B, 0))}}
  return out


def fused_targets(r: dict) -> dict:
  """Issue #38's targets (``bench.train_step.FUSED_TARGETS``) against the combined figures:
  ``{name: {target, value, met}}``; every scope group's bytes / floor against ``FLOOR_RATIO``
  where the programs carry floors."""
  want = FUSED_TARGETS.get((os.path.basename(str(r["config"])).removesuffix(".py"),
                            r["global_batch"]), {})
  got = {"useful_mfu_bound": r["buckets"]["useful_mfu_bound"],
         "bytes_per_real_event": r["buckets"]["bytes_per_real_event"],
         "launches_per_batch": r.get("launches_per_batch")}
  out = {}
  for k, target in want.items():
    v = got[k]
    met = v >= target if k == "useful_mfu_bound" else v <= target
    out[k] = {"target": target, "value": v, "met": bool(met)}
  for g, v in (r.get("groups") or {}).items():
    if v.get("floor_ratio") is not None:
      out[f"floor_ratio/{g}"] = {"target": FLOOR_RATIO, "value": v["floor_ratio"],
                                 "met": bool(v["floor_ratio"] <= FLOOR_RATIO)}
      if v.get("least_ratio") is not None:         # the bound without recomputing a product
        out[f"floor_ratio/{g}"]["least"] = v["least_ratio"]
  return out


def _group_floors(progs: list[dict], pick, real, useful,
                  peak: float) -> tuple[dict, dict, dict]:
  """Per scope group over the drawn batches (each the program it takes): mean bytes, compulsory
  bytes (``roofline.group_floors``) and launches per batch, and their ratio; the floor's bytes
  per real event and useful-MFU bound (FLOPs and launches as compiled); and the same with every
  group moving at most ``FLOOR_RATIO`` x its floor (those under it as they are): what meeting
  issue #38's per-group target would buy."""
  groups = sorted({g for p in progs for g in p["groups"]})
  n = len(pick)
  out = {}
  for g in groups:
    val = lambda k, g=g: sum(progs[i]["groups"].get(g, {}).get(k, 0.0) for i in pick) / n
    b, f = val("bytes"), val("floor_bytes")
    out[g] = {"bytes": b, "floor_bytes": f, "floor_ratio": b / f if f else None,
              "launches": val("launches")}
    if all("pallas_bytes" in p["groups"].get(g, {"pallas_bytes": 0}) for p in progs):
      kg = val("pallas_bytes") + val("gemm_bytes")   # every other pass free (add_floors)
      out[g].update(kernel_gemm_bytes=kg, kernel_gemm_ratio=kg / f if f else None)
    if all("saved_bytes" in p["groups"].get(g, {"saved_bytes": 0}) for p in progs):
      sb = val("saved_bytes")        # kept for the backward (roofline.group_floors' saved)
      out[g].update(saved_bytes=sb, least_ratio=(f + sb) / f if f else None)
  d = progs[0]["device"]

  def figures(group_bytes):          # group_bytes(name, v) per group -> the combined figures
    nbytes = np.array([sum(group_bytes(g, v) for g, v in progs[i]["groups"].items())
                       for i in pick])
    bound = np.array([max(progs[i]["flops"] / d["peak_flops"], b / d["bandwidth"])
                      + progs[i]["launches"] * d["launch_s"]
                      for i, b in zip(pick, nbytes, strict=True)])
    return {"bytes_per_real_event": nbytes.sum() / real.sum(),
            "useful_mfu_bound": useful.sum() / (bound.sum() * peak)}

  cap = lambda v: min(v["bytes"], FLOOR_RATIO * v["floor_bytes"])
  at_ratio = {"ratio": FLOOR_RATIO, **figures(lambda g, v: cap(v)), "alone": {}}
  for g in groups:                   # each group over the ratio brought down alone
    if (out[g]["floor_ratio"] or 0) > FLOOR_RATIO:
      at_ratio["alone"][g] = figures(lambda h, v, g=g: cap(v) if h == g else v["bytes"])
  return out, figures(lambda g, v: v["floor_bytes"]), at_ratio


def report(r: dict) -> str:
  lines = [f"{r['config']} {r['backend']} b{r['global_batch']} {r['target']['name']}: "
           f"{len(r['programs'])} buckets {r['capacities']}, batches per bucket "
           f"{[round(x, 3) for x in r['bucket_share']]} ({r['batches']} batches)",
           f"{'layout':<11} {'useful':>6} {'MB/event':>8} {'bound_ms':>8} {'useful_MFU_bound':>16}"]
  for k in ("padded", "one_bucket", "buckets"):
    f = r[k]
    lines.append(f"{k:<11} {f['useful_share']:6.2f} {f['bytes_per_real_event'] / 1e6:8.3f} "
                 f"{f['bound_ms_mean']:8.2f} {f['useful_mfu_bound']:16.1%}")
  lines.append(f"fill {r['fill']['one_bucket']:.3f} -> {r['fill']['buckets']:.3f}; dropped "
               f"{r['dropped_events_per_batch']:.2f} events per batch, "
               f"{r['batches_over_capacity']:.2%} of the batches over capacity")
  for k, v in r["targets"].items():
    lines.append(f"  {k}: {v['value']:.3f} (target {v['target']}): "
                 f"{'met' if v['met'] else 'MISSED'}")
  if "launches_per_batch" in r:
    lines.append(f"launches per batch {r['launches_per_batch']:.0f}")
  if "groups" in r:
    buf = io.StringIO()
    print_floors(r["groups"], buf, title="per batch")
    lines.append(buf.getvalue().rstrip())
    f = r["floor"]
    lines.append(f"at the floor (every group moving only its compulsory bytes): "
                 f"{f['bytes_per_real_event'] / 1e6:.3f} MB per real event, useful-MFU bound "
                 f"{f['useful_mfu_bound']:.1%}")
    a = r.get("at_floor_ratio")
    if a:
      lines.append(f"every group at most {a['ratio']}x its floor (the others as they are): "
                   f"{a['bytes_per_real_event'] / 1e6:.3f} MB per real event, useful-MFU bound "
                   f"{a['useful_mfu_bound']:.1%}" + "".join(
                       f"; {g} alone {v['useful_mfu_bound']:.1%}"
                       for g, v in a.get("alone", {}).items()))
  fused = r.get("targets_fused") or {}
  if fused:
    lines.append("issue #38 targets: " + "; ".join(
        f"{k} {v['value']:.4g} (target {v['target']:.4g}): {'met' if v['met'] else 'MISSED'}"
        + (f" (least {v['least']:.3g} without recompute)" if "least" in v and not v["met"]
           else "") for k, v in fused.items()))
  if "buckets_gemm_only" in r:
    g = r["buckets_gemm_only"]
    lines.append(f"floor (attention and GDPA charged only their GEMMs' bytes): "
                 f"{r['padded']['bytes_per_real_event'] / g['bytes_per_real_event']:.2f}x lower "
                 f"bytes per real event, useful-MFU bound {g['useful_mfu_bound']:.1%}")
  return "\n".join(lines)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--padded", required=True, help="bench/train_step JSON of the padded program")
  ap.add_argument("--buckets", nargs="+", required=True,
                  help="bench/train_step JSONs of buckets 0..K-1, in order")
  ap.add_argument("--batches", type=at_least(1), default=2000)
  ap.add_argument("--seed", type=at_least(0), default=1000, help="first batch seed (fresh batches)")
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  padded = _load(args.padded)
  r = combine(padded, [_load(p) for p in args.buckets], args.batches, args.seed)
  print(report(r))
  name = f"jagged_buckets_{r['config']}_{r['backend']}_b{r['global_batch']}_{r['target']['name']}"
  path = result_path(name, False, args.out or os.path.join(RESULTS, name + ".json"))
  write_json(path, r)
  print(f"wrote {path}")
  return r


if __name__ == "__main__":
  main()
