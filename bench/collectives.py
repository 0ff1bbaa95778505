"""Per-step collective bytes per device, from the compiled HLO of the real train step, per preset.

  JAX_PLATFORMS=cpu python -m bench.collectives --config mid [--presets fsdp,5d] [--layers 1]

Compiles (never runs) ``kunlun.train.step.make_train_step`` (AdamW + row-wise Adagrad, the
parameter / optimizer-state / batch shardings train.py uses; ``kunlun.train.step.build``) on
8 CPU devices for each rule preset and sums, per collective kind, the bytes one device sends (ring
estimates from ``sharding.checks.collectives``). Next to it: the analytic minimum of the
*parameter* traffic for the same layout (sharding/checks.py conventions):

  * a parameter (b bytes, n shards) sharded ZeRO-style over axes of total size g (every shard
    axis except ``tensor`` and an expert dimension's ``expert``) must be all-gathered and its
    gradient reduce-scattered: 2 (g - 1) b / n;
  * a parameter replicated over batch axes of size r needs a gradient all-reduce:
    2 (r - 1) / r * b / n;
  * embedding tables (rows on every device) and activation traffic (TP / CP / EP) are not in the
    minimum: the tables need only the looked-up rows, activations depend on the layout.

What a CPU compile overstates, and how it is accounted (``as_gpu``): XLA:CPU has no
reduce-scatter creation pass, so a gradient reduction whose result each device then slices to its
own shard stays an ``all-reduce`` followed by a ``dynamic-slice`` at ``partition-id`` (fused into
the optimizer update), where XLA:GPU rewrites the pair into a ``reduce-scatter`` (half the wire
bytes). ``reduce_scatter_equivalent`` lists every such all-reduce (or tuple element) found in the
HLO (all its users take ``partition-id`` and keep 1/group of it); ``as_gpu`` counts them as
reduce-scatters. ``measured`` counts one execution: of each ``conditional`` (the embedding
look-up's all-to-all exchange vs its overflow fallback) only the cheaper branch, the one a normal
step takes; ``all_branches`` counts every collective in the module text. Results go to
``bench/results/collectives_<config>[_L<layers>].json``.
"""

from __future__ import annotations

import argparse
import math
import os
import time

from bench.output import at_least

DEFAULT_MESH = {"dp": "data=2,fsdp=4", "fsdp": "fsdp=8", "fsdp_tp": "fsdp=4,tensor=2",
                "fsdp_cp": "fsdp=4,context=2", "fsdp_ep": "fsdp=4,expert=2",
                "5d": "fsdp=2,tensor=2,expert=2"}


def analytic_param_bytes(params, mesh, rules) -> dict:
  """Minimum per-device parameter traffic of one step (see module doc), split by kind.

  A parameter is gathered over every axis that shards it except ``tensor`` (the compute is split
  there too) and ``expert`` on a leading expert dimension; its gradient is all-reduced over the
  batch axes that do not shard it.
  """
  import jax

  from sharding.partition import batch_spec
  bx = batch_spec(rules)[0]
  bx = set(() if bx is None else (bx,) if isinstance(bx, str) else bx)
  as_t = lambda e: (e,) if isinstance(e, str) else (e or ())
  fsdp = replica = 0.0
  for path, x in jax.tree_util.tree_leaves_with_path(params):
    if "embedding" in jax.tree_util.keystr(path):
      continue
    b = x.size * x.dtype.itemsize
    spec = tuple(x.sharding.spec)
    axes = {a for e in spec for a in as_t(e)}
    n = math.prod(mesh.shape[a] for a in axes)
    gather = axes - {"tensor"} - ({"expert"} if spec and as_t(spec[0]) == ("expert",) else set())
    g = math.prod(mesh.shape[a] for a in gather)
    r = math.prod(mesh.shape[a] for a in bx - axes)
    fsdp += 2 * (g - 1) * b / n
    replica += 2 * (r - 1) / r * b / n
  return {"fsdp_gather_scatter": fsdp, "grad_allreduce": replica, "total": fsdp + replica}


def sliced_all_reduces(hlo_text: str) -> list[dict]:
  """All-reduce results (or tuple elements) that every user slices to the local shard.

  A user "slices" when it takes ``partition-id`` (or a value computed from it) as an operand (a
  dynamic-slice at this device's offset, usually fused into the optimizer update) and its result
  has ``1/group`` of the elements; element-preserving users (a convert or transpose fusion) are
  followed to their own users. Each entry: ``name``, ``shape``, ``bytes``, ``group``."""
  import re

  from sharding.checks import _group_size, _shape_bytes
  defs, users = {}, {}
  for line in hlo_text.splitlines():
    m = re.match(r"\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(\(.*?\)|\S+)\s+([\w\-]+)\((.*)$", line)
    if not m:
      continue
    name, shape, op, rest = m.groups()
    operands = re.findall(r"%([\w.\-]+)", rest.split("metadata=")[0])
    defs[name] = (shape, op, operands, line)
    for o in operands:
      users.setdefault(o, []).append(name)
  numel = lambda shape: sum(math.prod(s) for s in _shape_bytes(shape)[1]) or 1
  pid = set()                      # partition-id and values computed from it and constants only
  for name, (_, op, operands, _) in defs.items():
    if op in ("partition-id", "replica-id") or (
        operands and all(o in pid or defs.get(o, ("", ""))[1] == "constant" for o in operands)
        and any(o in pid for o in operands)):
      pid.add(name)
  out = []
  for name, (shape, op, _, line) in defs.items():
    if op != "all-reduce":
      continue
    n = _group_size(line)
    parts = [(name, shape)]
    if shape.startswith("("):
      parts = [(u, defs[u][0]) for u in users.get(name, []) if defs[u][1] == "get-tuple-element"]
    for part, pshape in parts:
      if n > 1 and _sliced(part, numel(pshape), n, defs, users, pid, numel):
        out.append({"name": part, "shape": pshape, "bytes": _shape_bytes(pshape)[0], "group": n})
  return out


_SAME_SIZE_OPS = ("fusion", "convert", "bitcast", "copy", "transpose", "reshape")


def _sliced(name, size, n, defs, users, pid, numel, depth=0) -> bool:
  """Every use of ``name`` (``size`` elements) keeps 1/n of it at a partition-id offset, possibly
  after element-preserving ops (a convert / transpose / copy fusion on the way)."""
  us = users.get(name, [])
  if not us or depth > 4:
    return False
  for u in us:
    shape, op, operands, _ = defs[u]
    if any(o in pid for o in operands) and numel(shape) * n == size:
      continue
    if op in _SAME_SIZE_OPS and numel(shape) == size and _sliced(u, size, n, defs, users, pid,
                                                                 numel, depth + 1):
      continue
    return False
  return True


def _blocks(hlo_text: str) -> tuple[dict[str, str], str | None]:
  """``({computation: its text}, entry name)`` of an HLO module's text."""
  import re
  blocks, entry, cur, buf = {}, None, None, []
  for line in hlo_text.splitlines():
    if cur is None:
      m = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
      if m and "=" not in line.split("(")[0]:
        cur, buf = m.group(2), []
        entry = cur if m.group(1) else entry
      continue
    if line.strip() == "}":
      blocks[cur] = "\n".join(buf)
      cur = None
    else:
      buf.append(line)
  return blocks, entry


def per_execution_summary(hlo_text: str) -> tuple[dict, dict]:
  """Collective summary of one execution of the module: the entry computation, plus for every
  ``conditional`` only its cheapest branch (the embedding look-up's overflow fallback is the
  other branch and is not taken in a normal step) and ``while`` bodies once. Returns
  ``(summary {op: {count, bytes, wire_bytes}}, info)``: ``info`` has ``conditionals``,
  ``fallback_wire_bytes`` (the traffic of the skipped branches) and ``wire_bytes_by_scope``
  ({named-scope group: {op: wire bytes}}, ``bench.profiling.hlo_stats.scope_group``)."""
  import re

  from bench.profiling.hlo_stats import scope_group
  from sharding.checks import collectives
  blocks, entry = _blocks(hlo_text)
  info = {"conditionals": 0, "fallback_wire_bytes": 0.0}

  def walk(comp, seen=()):
    if comp in seen or comp not in blocks:
      return []
    text = blocks[comp]
    out = []
    for line in text.splitlines():
      for c in collectives(line):
        m = re.search(r'op_name="([^"]*)"', line)
        c["scope"] = scope_group(m.group(1)) if m else "other"
        out.append(c)
    for line in text.splitlines():
      m = re.search(r"branch_computations=\{([^}]*)\}", line)
      if m and " conditional(" in line:
        branches = [walk(b.strip().lstrip("%"), seen + (comp,)) for b in m.group(1).split(",")]
        costs = [sum(c["wire_bytes"] for c in b) for b in branches]
        k = costs.index(min(costs))
        info["conditionals"] += 1
        info["fallback_wire_bytes"] += sum(costs) - costs[k]
        out += branches[k]
      m = re.search(r"body=%?([\w.\-]+)", line)
      if m and " while(" in line:
        out += walk(m.group(1), seen + (comp,))
    return out

  summary, by_scope = {}, {}
  for c in walk(entry):
    d = summary.setdefault(c["op"], {"count": 0, "bytes": 0, "wire_bytes": 0.0})
    d["count"] += 1
    d["bytes"] += c["bytes"]
    d["wire_bytes"] += c["wire_bytes"]
    g = by_scope.setdefault(c["scope"], {})
    g[c["op"]] = g.get(c["op"], 0.0) + c["wire_bytes"]
  info["wire_bytes_by_scope"] = by_scope
  return summary, info


def bench(config_name: str, presets, batch_size: int, layers: int | None,
          dump_dir: str | None = None) -> dict:
  import jax
  jax.config.update("jax_num_cpu_devices", 8)

  from bench.train_step import build_step, clip_layers, load_config, synthetic_batch
  from data.synthetic import PRESETS, preset_schema
  from kunlun.configs.types import seq_lens
  from sharding import checks, partition
  from sharding import mesh as M
  from sharding import rules as R

  cfg = load_config(config_name, [])
  if layers is not None:   # stand-in: fewer layers, tower depths clipped to match
    clip_layers(cfg, layers)
  cfg.model.backend = "xla"
  schema = preset_schema(PRESETS[cfg.data.preset])
  batch = synthetic_batch(schema, batch_size, seq_lens(cfg), "uniform")
  out = {"config": config_name, "num_layers": int(cfg.model.num_layers),
         "global_batch": batch_size, "devices": 8, "step": "kunlun.train.step.make_train_step",
         "presets": {}}
  for name in presets:
    t0 = time.time()
    mesh, rules = M.make_mesh(M.parse_mesh_flag(DEFAULT_MESH[name])), R.get_rules(name)
    cfg.sharding.rules = name
    step, _, params, opt, b = build_step(cfg, mesh, rules, batch, abstract=True)
    with partition.activate(mesh, rules):
      compiled = step.lower(params, opt, b, jax.random.key(0), 0).compile()
    text = compiled.as_text()
    if dump_dir:
      os.makedirs(dump_dir, exist_ok=True)
      with open(os.path.join(dump_dir, f"{config_name}_{name}.hlo"), "w") as f:
        f.write(text)
    summary, cond = per_execution_summary(text)
    measured = sum(v["wire_bytes"] for v in summary.values())
    sliced = sliced_all_reduces(text)
    # an all-reduce of b bytes sends 2 b (n-1)/n; the reduce-scatter XLA:GPU makes of it b (n-1)/n
    saved = sum(c["bytes"] * (c["group"] - 1) / c["group"] for c in sliced)
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    pmin = analytic_param_bytes(params, mesh, rules)
    out["presets"][name] = {
        "mesh": DEFAULT_MESH[name],
        "param_bytes": param_bytes,
        "replicated_fraction": checks.replicated_fraction(params),
        "collectives": summary,
        "measured_wire_bytes_per_device": measured,
        "all_branches_wire_bytes_per_device": sum(
            v["wire_bytes"] for v in checks.collective_summary(text).values()),
        "conditionals": cond,
        "reduce_scatter_equivalent": {"count": len(sliced),
                                      "bytes": sum(c["bytes"] for c in sliced),
                                      "examples": [c["name"] + " " + c["shape"]
                                                   for c in sliced[:5]]},
        "as_gpu_wire_bytes_per_device": measured - saved,
        "analytic_min_param_bytes_per_device": pmin,
        "ratio_measured": measured / pmin["total"],
        "ratio_as_gpu": (measured - saved) / pmin["total"],
        "memory_per_device": checks.memory_per_device(compiled),
        "compile_s": round(time.time() - t0, 1),
    }
    print(f"{name:8s} {DEFAULT_MESH[name]:26s} measured {measured / 2**20:8.2f} MiB/device "
          f"({measured / pmin['total']:.2f}x), as GPU lowers it {(measured - saved) / 2**20:8.2f}"
          f" MiB ({(measured - saved) / pmin['total']:.2f}x); param-min "
          f"{pmin['total'] / 2**20:8.2f} MiB ({time.time() - t0:.0f}s)", flush=True)
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--config", default="mid", help="a module of kunlun.configs (tiny, dev, mid)")
  ap.add_argument("--presets", default=",".join(DEFAULT_MESH), help="comma-separated presets")
  ap.add_argument("--batch", type=at_least(1), default=64, help="global batch (static shapes only)")
  ap.add_argument("--layers", type=at_least(1), default=None, help="override num_layers (stand-in)")
  ap.add_argument("--out", default=None)
  ap.add_argument("--dump_dir", default=None, help="write each preset's compiled HLO here")
  a = ap.parse_args(argv)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  presets = [p for p in a.presets.split(",") if p]
  bad = [p for p in presets if p not in DEFAULT_MESH]
  if bad:
    raise SystemExit(f"unknown presets {bad}; allowed: {list(DEFAULT_MESH)}")
  res = bench(a.config, presets, a.batch, a.layers, a.dump_dir)
  suffix = f"_L{a.layers}" if a.layers is not None else ""
  path = a.out or os.path.join(os.path.dirname(__file__), "results",
                               f"collectives_{a.config}{suffix}.json")
  from kunlun.utils import atomic
  atomic.write_json(path, res)
  print("wrote", path)


if __name__ == "__main__":
  main()
