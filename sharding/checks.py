"""Sharding sanity checks: replicated-parameter report, HLO collectives, per-device memory.

  assert_params_sufficiently_sharded(params)        # ValueError listing the worst parameters
  ops = collectives(jax.jit(f).lower(*args).compile().as_text())
  mem = memory_per_device(compiled)
"""

from __future__ import annotations

import math
import re

import jax
import numpy as np


def _leaf_bytes(x) -> tuple[int, int]:
  """(total bytes, bytes held by one device) of an array or sharded ShapeDtypeStruct."""
  item = np.dtype(x.dtype).itemsize
  total = math.prod(x.shape) * item
  sharding = getattr(x, "sharding", None)
  if sharding is None:
    return total, total
  return total, math.prod(sharding.shard_shape(x.shape)) * item


def _mesh_of(params):
  for x in jax.tree.leaves(params):
    mesh = getattr(getattr(x, "sharding", None), "mesh", None)
    if mesh is not None:
      return mesh
  return None


def sharding_table(params, replica_axes=("data",)):
  """Per parameter: ``(path, total_bytes, device_bytes, excess_bytes, spec)``, worst first.

  ``excess_bytes`` = bytes one device holds beyond a perfect split over the non-replica axes.
  """
  mesh = _mesh_of(params)
  n = 1 if mesh is None else math.prod(s for a, s in mesh.shape.items() if a not in replica_axes)
  rows = []
  for path, x in jax.tree_util.tree_leaves_with_path(params):
    total, dev = _leaf_bytes(x)
    spec = getattr(getattr(x, "sharding", None), "spec", None)
    rows.append((jax.tree_util.keystr(path), total, dev, dev - total / n, spec))
  return sorted(rows, key=lambda r: -r[3])


def replicated_fraction(params, replica_axes=("data",)) -> float:
  """``(per-device bytes - perfect per-device bytes) / per-device bytes`` over all parameters.

  The perfect split divides every parameter over all mesh axes except ``replica_axes`` (data
  parallel replicas are intended copies). 0 = perfectly sharded; ~1 = everything replicated.
  """
  rows = sharding_table(params, replica_axes)
  dev = sum(r[2] for r in rows)
  excess = sum(r[3] for r in rows)
  return max(0.0, excess / dev) if dev else 0.0


def assert_params_sufficiently_sharded(params, tolerance: float = 0.02, replica_axes=("data",),
                                       show: int = 8) -> float:
  """Raises ValueError when more than ``tolerance`` of each device's parameter bytes are copies.

  ``params``: jax arrays or ShapeDtypeStructs carrying NamedShardings. For the ``dp`` preset
  (intentionally replicated) pass ``replica_axes=sharding.axes.MESH_AXES`` or skip the check.
  Returns the measured fraction.
  """
  frac = replicated_fraction(params, replica_axes)
  if frac > tolerance:
    worst = sharding_table(params, replica_axes)[:show]
    lines = "\n".join(f"  {p}: {t / 2**20:.3f} MiB total, {d / 2**20:.3f} MiB per device, "
                      f"spec {s}" for p, t, d, _, s in worst)
    raise ValueError(f"{frac:.1%} of the per-device parameter bytes are replicated copies "
                     f"(tolerance {tolerance:.1%}, replica axes {tuple(replica_axes)}); "
                     f"worst parameters:\n{lines}")
  return frac


# ---- HLO -----------------------------------------------------------------------------------

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
                "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
                "f8e4m3fn": 1, "f8e5m2": 1}
_OP_RE = re.compile(r"=\s*(?P<shape>\(.*?\)|[\w]+\[[\d,]*\](?:\{[^}]*\})?)\s+"
                    r"(?P<op>" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
_ARRAY_RE = re.compile(r"(\w+)\[([\d,]*)\]")


def _shape_bytes(text: str) -> tuple[int, list[tuple[int, ...]]]:
  total, shapes = 0, []
  for dtype, dims in _ARRAY_RE.findall(text):
    if dtype not in _DTYPE_BYTES:
      continue
    shape = tuple(int(d) for d in dims.split(",") if d)
    shapes.append(shape)
    total += math.prod(shape) * _DTYPE_BYTES[dtype]
  return total, shapes


def _group_size(line: str) -> int:
  m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)  # mesh['a'=2,..] {'a'}
  if m:
    sizes = dict((k.strip("' "), int(v)) for k, v in (e.split("=") for e in m.group(1).split(",")))
    return math.prod(sizes[a.strip("' ")] for a in m.group(2).split(",") if a.strip())
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)          # iota form [groups,size]<=[n]
  if m:
    return int(m.group(2))
  m = re.search(r"replica_groups=\{\{([\d,]*)\}", line)              # explicit {{0,1},{2,3}}
  if m:
    return max(1, len([x for x in m.group(1).split(",") if x]))
  m = re.search(r"source_target_pairs=\{([^}]*)\}", line)
  if m:
    return 2
  return 1


def collectives(hlo_text: str) -> list[dict]:
  """Collective ops of a compiled HLO module (``compiled.as_text()``).

  Each entry: ``op`` (one of COLLECTIVES), ``shapes`` (result arrays), ``bytes`` (result bytes),
  ``group`` (devices per group) and ``wire_bytes``: bytes one device sends in a ring
  implementation (all-gather: out (n-1)/n; reduce-scatter: in (n-1)/n = out (n-1); all-reduce:
  2 size (n-1)/n; all-to-all: size (n-1)/n; collective-permute: size).
  """
  out = []
  for line in hlo_text.splitlines():
    m = _OP_RE.search(line)
    if not m:
      continue
    op = m.group("op")
    nbytes, shapes = _shape_bytes(m.group("shape"))
    if m.group(0).endswith("-start(") and op in ("all-gather", "collective-permute") and shapes:
      # async starts return (operand, result, [contexts]): keep the result only
      sizes = [_shape_bytes(t)[0] for t in re.findall(r"\w+\[[\d,]*\]", m.group("shape"))]
      nbytes = max(sizes) if op == "all-gather" else sizes[0]
      shapes = shapes[:1] if op == "collective-permute" else [max(shapes, key=math.prod)]
    n = _group_size(line)
    frac = (n - 1) / n if n > 1 else 0.0
    wire = {"all-gather": nbytes * frac, "reduce-scatter": nbytes * (n - 1),
            "all-reduce": 2 * nbytes * frac, "all-to-all": nbytes * frac,
            "collective-permute": float(nbytes)}[op]
    out.append({"op": op, "shapes": shapes, "bytes": nbytes, "group": n, "wire_bytes": wire,
                "line": line.strip()[:300]})
  return out


def collective_summary(hlo_text: str) -> dict[str, dict]:
  """``{op: {"count", "bytes", "wire_bytes"}}`` summed over the module."""
  summary = {}
  for c in collectives(hlo_text):
    s = summary.setdefault(c["op"], {"count": 0, "bytes": 0, "wire_bytes": 0.0})
    s["count"] += 1
    s["bytes"] += c["bytes"]
    s["wire_bytes"] += c["wire_bytes"]
  return summary


def largest_collective(hlo_text: str, ops=COLLECTIVES) -> dict | None:
  """The collective with the largest result among ``ops`` (None when there is none)."""
  cands = [c for c in collectives(hlo_text) if c["op"] in ops]
  return max(cands, key=lambda c: c["bytes"]) if cands else None


def memory_per_device(compiled) -> dict[str, int]:
  """Per-device bytes from ``compiled.memory_analysis()`` (arguments, outputs, temporaries)."""
  m = compiled.memory_analysis()
  get = lambda name: int(getattr(m, name, 0) or 0)
  out = {"argument": get("argument_size_in_bytes"), "output": get("output_size_in_bytes"),
         "temp": get("temp_size_in_bytes"), "alias": get("alias_size_in_bytes"),
         "generated_code": get("generated_code_size_in_bytes")}
  out["peak_estimate"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
  return out
