"""Memory-traffic roofline of a compiled step, from its post-optimisation HLO text.

  python -m bench.profiling.roofline STEP.hlo [--group MoWE ...] [--top 20] [--by-op]

prints a saved program's scope groups against their floors and, per ``--group``, its largest ops
(``--by-op``: summed by op across launches and layers; ``bench/train_step --dump_hlo`` writes the
text). Notes: docs/guides/benchmarks.md,
``bench/profiling/roofline.py``."""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import math
import re
import sys
from collections import defaultdict

import jax
import numpy as np
from jax._src.interpreters import batching  # _vmap_copies: no public BatchTracer (jax pinned)

import pallas_kernels
from bench.profiling import hlo_stats
from kunlun.models.flops import band_pairs
from kunlun.nn import attention, hsp, packed, weightgen, wukong
from pallas_kernels import jagged_pallas, wgrad
from pallas_kernels import weightgen as wg_kernels
from pallas_kernels import wukong_fm as fm_kernels

# launch_s: one kernel in a CUDA graph (XLA runs the step's kernels as graphs), ~1 us.
H200 = {"peak_flops": 989e12, "bandwidth": 4.8e12, "launch_s": 1e-6}
CPU_NOTE = ("CPU compile standing in for the GPU one: the HLO is XLA:CPU's (its fusion differs "
            "from XLA:GPU's); bytes, FLOPs and launches are those of this program")



def gpu_note(target: str, autotune: str | None = None) -> str:
  tuning = (f"the device's autotune results loaded from {autotune}" if autotune else
            "no autotuning: GEMMs stay Triton GEMMs with default tiles")
  return (f"XLA:GPU program for {target} compiled deviceless ({tuning}; sorts fall back to "
          "multi-kernel sorts)")


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
                "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
                "s4": 0.5, "u4": 0.5, "s2": 0.25, "u2": 0.25, "token": 0}
_ARRAY_RE = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([<=0-9,]*)\]")
_OPERAND_RE = re.compile(r"%([\w.\-]+)")
_ELEMENTWISE = {"add", "subtract", "multiply", "divide", "maximum", "minimum", "remainder", "abs",
                "negate", "compare", "select", "and", "or", "xor", "not", "clamp", "floor",
                "ceil", "round-nearest-afz", "round-nearest-even", "sign", "is-finite",
                "shift-left", "shift-right-logical", "shift-right-arithmetic", "popcnt"}
_TRANSCENDENTAL = {"exponential", "exponential-minus-one", "log", "log-plus-one", "tanh",
                   "logistic", "sine", "cosine", "tan", "sqrt", "rsqrt", "cbrt", "power",
                   "atan2", "erf"}


def arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
  """``[(dtype, dims)]`` of an HLO shape text (an array or a tuple; layouts ignored)."""
  out = []
  for dt, dims in _ARRAY_RE.findall(shape):
    if dt in _DTYPE_BYTES or dt.startswith("f8"):
      out.append((dt, tuple(int(d.lstrip("<=")) for d in dims.split(",") if d)))
  return out


def shape_bytes(shape: str) -> float:
  """Bytes of an HLO shape text (tuple elements summed)."""
  return float(sum(math.prod(d) * _DTYPE_BYTES.get(t, 1) for t, d in arrays(shape)))


def _elems(shape: str) -> int:
  return sum(math.prod(d) for _, d in arrays(shape))


def operands(rest: str) -> list[str]:
  """Operand names of an instruction (``rest`` starts at ``opcode(``), in order."""
  i, depth = rest.index("("), 0
  for j in range(i, len(rest)):
    depth += rest[j] == "("
    depth -= rest[j] == ")"
    if depth == 0:
      return _OPERAND_RE.findall(rest[i:j])
  return _OPERAND_RE.findall(rest[i:])


def _dims_attr(rest: str, key: str) -> list[int]:
  m = re.search(key + r"=\{([0-9,]*)\}", rest)
  return [int(x) for x in m.group(1).split(",") if x] if m else []


class _Flops:
  """FLOPs and transcendentals of instructions and computations (see module doc)."""

  def __init__(self, comps):
    self.comps = comps
    self.shapes = {ins[0]: ins[3] for body in comps.values() for ins in body}
    self.memo = {}

  def has_dot(self, ins) -> bool:
    """Whether an instruction is or fuses a matmul (dot / convolution / cuBLAS call): a GEMM
    kernel."""
    name, op, rest = ins[:3]
    if op in ("dot", "convolution"):
      return True
    if op == "custom-call":                 # by its target: an operand's name may say "gemm"
      m = re.search(r'custom_call_target="([^"]*)"', rest)
      return bool(m) and any(k in m.group(1).lower() for k in ("gemm", "matmul", "cublas"))
    if op in ("fusion", "call"):
      return any(self.has_dot(i) for c in hlo_stats._called(rest) for i in self.comps.get(c, ()))
    return False

  def dims(self, name):
    a = arrays(self.shapes.get(name, ""))
    return a[0][1] if a else ()

  def computation(self, c):
    if c not in self.memo:
      self.memo[c] = (0.0, 0.0)
      f = t = 0.0
      for ins in self.comps.get(c, ()):
        a, b = self.instruction(ins)
        f, t = f + a, t + b
      self.memo[c] = (f, t)
    return self.memo[c]

  def instruction(self, ins):
    name, op, rest, shape = ins[:4]
    if op in ("fusion", "call"):
      parts = [self.computation(c) for c in hlo_stats._called(rest)]
      return sum(p[0] for p in parts), sum(p[1] for p in parts)
    if op in _ELEMENTWISE:
      return float(_elems(shape)), 0.0
    if op in _TRANSCENDENTAL:
      return 0.0, float(_elems(shape))
    ops = operands(rest)
    if op == "dot":
      lhs = self.dims(ops[0]) if ops else ()
      k = math.prod(lhs[i] for i in _dims_attr(rest, "lhs_contracting_dims") if i < len(lhs))
      return 2.0 * _elems(shape) * k, 0.0
    if op == "convolution" and len(ops) >= 2:
      rhs = self.dims(ops[1])
      m = re.search(r"dim_labels=\w+_(\w+)->", rest)
      o = m.group(1).find("o") if m else -1
      per_out = math.prod(rhs) / rhs[o] if rhs and 0 <= o < len(rhs) else 1
      return 2.0 * _elems(shape) * per_out, 0.0
    if op == "reduce" and ops:
      n_in = max(len(ops) // 2, 1)
      return float(sum(math.prod(self.dims(x)) for x in ops[:n_in])), 0.0
    if op == "reduce-window":
      m = re.search(r"window=\{size=([0-9x]+)", rest)
      win = math.prod(int(x) for x in m.group(1).split("x")) if m else 1
      return float(_elems(shape) * win), 0.0
    if op == "scatter" and ops:
      return float(math.prod(self.dims(ops[-1]))), 0.0
    return 0.0, 0.0


_PALLAS_TARGET = 'custom_call_target="__gpu$xla.gpu.triton"'
_PARTIAL_READ = ("slice", "dynamic-slice", "gather")
_VIEW = ("bitcast", "reshape")
_SAME_SIZE = _ELEMENTWISE | _TRANSCENDENTAL | {"convert", "copy"}


def _inplace_update(ins, shapes) -> tuple[list[str], list[float], list[float]]:
  """``(updated operands, bytes read of each, bytes written to each)`` of a ``scatter`` or
  ``dynamic-update-slice`` that updates its operand buffers in place: a scatter reads and writes
  (read-modify-write) the elements its updates touch, at the operand's bytes per element, at
  most the whole operand (more updates than rows: repeated rows); a dynamic-update-slice writes
  its update and reads nothing of the operand."""
  ops = operands(ins[2])
  if ins[1] == "dynamic-update-slice":
    return ops[:1], [0.0], [shape_bytes(shapes.get(ops[1], ""))] if len(ops) > 1 else [0.0]
  n = (len(ops) - 1) // 2                        # operands..., indices, updates...
  touched = []
  for x, u in zip(ops[:n], ops[n + 1:], strict=False):
    full, elems = shape_bytes(shapes.get(x, "")), _elems(shapes.get(x, ""))
    touched.append(min(_elems(shapes.get(u, "")) * full / elems, full) if elems else 0.0)
  return ops[:n], touched, touched


def _param_reads(comps, roots, comp: str, shapes) -> tuple[dict, float | None]:
  """For a fused computation: ``({parameter number: bytes read}, output bytes or None)``.

  Bytes are counted slice by slice: a parameter whose every use (through bitcasts / reshapes
  and same-size elementwise chains, e.g. the AdamW update of a flat buffer) ends as the sliced
  operand of a ``slice`` / ``dynamic-slice`` / ``gather`` reads the elements those produce
  (at the parameter's bytes per element); through a ``reduce`` whose result is itself partly
  read (a sum over experts then sliced apart), the reduced elements of what is read. A
  ``scatter`` / ``dynamic-update-slice`` that is the root (or an element of a root tuple) and
  updates a parameter updates that buffer in place (a donated table, its optimizer state): the
  parameter is charged what ``_inplace_update`` reads
  and the output what it writes (returned second, the whole output's bytes; None when the
  fusion updates nothing in place). Other parameters read everything."""
  body = comps.get(comp, [])
  by_name = {ins[0]: ins for ins in body}
  users = defaultdict(list)
  for ins in body:
    for i, x in enumerate(operands(ins[2])):
      users[x].append((ins, i))
  params = {ins[0]: int(re.match(r"parameter\((\d+)\)", ins[2]).group(1))
            for ins in body if ins[1] == "parameter"}
  root_name = roots.get(comp)
  root = by_name.get(root_name)
  outs = ([by_name.get(x) for x in operands(root[2])] if root is not None and root[1] == "tuple"
          else [root])
  skip, rmw, out_bytes, inplace = set(), defaultdict(float), 0.0, False
  for o in outs:
    if o is None:
      continue
    if o[1] not in ("scatter", "dynamic-update-slice"):
      out_bytes += shape_bytes(o[3])
      continue
    updated, read, written = _inplace_update(o, shapes)
    for pos, (x, r, w) in enumerate(zip(updated, read, written, strict=True)):
      if x in params:
        skip.add((o[0], pos))
        rmw[x] += r
        out_bytes, inplace = out_bytes + w, True
      else:                                      # not a parameter: a new buffer, all written
        out_bytes += shape_bytes(shapes.get(x, ""))

  def partial(name, depth=0):
    """Elements of ``name`` read through its uses, or None when some use reads all of it."""
    if name == root_name:
      return None
    total, n = 0.0, _elems(shapes.get(name, ""))
    for ins, pos in users.get(name, []):
      chain = ins[1] in _VIEW or (ins[1] in _SAME_SIZE and _elems(ins[3]) == n)
      if (ins[0], pos) in skip:                  # the buffer updated in place: in ``rmw``
        continue
      if chain and depth < 16:
        sub = partial(ins[0], depth + 1)
        if sub is None:
          return None
        total += sub
      elif ins[1] in _PARTIAL_READ and pos == 0:
        total += _elems(ins[3])
      elif ins[1] == "reduce" and pos == 0 and len(operands(ins[2])) == 2 and depth < 16:
        sub = partial(ins[0], depth + 1)          # a partly read sum reads its inputs' share
        if sub is None:
          return None
        total += sub * n / max(_elems(ins[3]), 1)
      else:
        return None
    return total

  reads = {}
  for name, k in params.items():
    r = partial(name)
    full, n = shape_bytes(shapes.get(name, "")), _elems(shapes.get(name, ""))
    if r is not None:
      reads[k] = min(r * full / n, full) if n else 0.0
    if name in rmw:
      reads[k] = min(reads.get(k, full) + rmw[name], full)
  return reads, (out_bytes if inplace else None)


def op_costs(text: str, attribute: str = "root") -> list[dict]:
  """Every top-level launched op of an HLO module: ``{name, opcode, op_name, times, bytes_in,
  bytes_out, flops, transcendentals, gemm, pallas, reads}`` (per execution; ``times`` executions
  per step; ``reads`` {operand: bytes read of it}; ``op_name``: ``hlo_stats.resolve_op_names``'
  with ``attribute``)."""
  comps, entry = hlo_stats.parse_hlo(text)
  roots = _roots(text)
  names = hlo_stats.resolve_op_names(comps, entry, attribute)
  fl = _Flops(comps)
  out = []
  for ins in hlo_stats.top_level(comps, entry):
    name, op, rest, shape, times = ins
    if not hlo_stats.is_launch(op):
      continue
    ops = list(dict.fromkeys(operands(rest)))
    nbytes = {x: shape_bytes(fl.shapes.get(x, "")) for x in ops}
    b_out = shape_bytes(shape)
    if op == "fusion":
      called = hlo_stats._called(rest)
      reads, inplace = (_param_reads(comps, roots, called[0], fl.shapes) if called
                        else ({}, None))
      all_ops = operands(rest)
      for k, r in reads.items():
        if k < len(all_ops):
          nbytes[all_ops[k]] = min(nbytes[all_ops[k]], r)
      b_out = b_out if inplace is None else inplace
    elif op in _PARTIAL_READ and ops:
      nbytes[ops[0]] = min(nbytes[ops[0]], b_out)
    elif op in ("scatter", "dynamic-update-slice") and len(ops) > 1:
      updated, read, written = _inplace_update(ins, fl.shapes)
      for x, r in zip(updated, read, strict=True):
        nbytes[x] = r
      b_out = sum(written)
    f, t = fl.instruction(ins)
    out.append({"name": name, "opcode": op, "op_name": names.get(name, ""), "times": times,
                "bytes_in": sum(nbytes.values()), "bytes_out": b_out, "flops": f,
                "transcendentals": t, "gemm": fl.has_dot(ins),
                "pallas": op == "custom-call" and _PALLAS_TARGET in rest, "reads": nbytes})
  return out


def group_floors(text: str, costs: list[dict] | None = None, attribute: str = "root") -> dict:
  """Compulsory bytes of each scope group (``hlo_stats.scope_group``) of a compiled step:
  ``{group: {"bytes", "read", "written", "launches"}}``.

  A group must read what it receives from outside it (entry parameters: parameters, optimizer
  state, the batch; values another group's launches produced) and write what it hands on
  (values a launch of another group reads, or that leave the computation: the step's outputs,
  a control-flow body's results). Each received buffer counts once per phase that reads it: the
  forward (op names without ``transpose(``) and the backward (with it), so an activation read by
  the forward and again by the backward (its weight gradient) counts twice, as under remat a
  recomputed forward in the backward does; each handed-on value once, at the bytes the program
  keeps it in (``op_costs``' partial reads and in-place updates apply). Values a group produces
  and reads itself (its intermediates) count nothing. Views (bitcasts, tuples) are followed to
  the launch that produced or reads the value. ``attribute``: how a fusion's group is named
  (``hlo_stats.resolve_op_names``; ``costs`` must be ``op_costs``' with the same).

  ``saved``: the group's own values kept from the forward for its backward, each counted once
  written and once read (read only, where the group also hands the value on and the floor has
  its write): what a forward GEMM or Pallas kernel of the group produced that a backward launch
  of the group reads (the projections and attention outputs a flash backward
  takes, say). A program that recomputes none of those products must move them on top of the
  floor, so ``(bytes + saved) / bytes`` (``bytes``: the floor) bounds the group's ratio from
  below unless it recomputes a GEMM or kernel (more FLOPs); elementwise values count nothing,
  as recomputing them is nearly free."""
  comps, entry = hlo_stats.parse_hlo(text)
  roots = _roots(text)
  costs = {c["name"]: c for c in (costs if costs is not None else op_costs(text, attribute))}
  names = hlo_stats.resolve_op_names(comps, entry, attribute)
  group = lambda n: hlo_stats.scope_group(names.get(n, ""))
  bodies, stack = [], [entry] if entry else []
  while stack:                                   # the entry and its control-flow bodies
    c = stack.pop()
    if c in bodies or c not in comps:
      continue
    bodies.append(c)
    stack += [b for ins in comps[c] if ins[1] in ("while", "conditional", "call")
              for b in hlo_stats._called(ins[2])]
  read, written, saved = defaultdict(dict), defaultdict(float), defaultdict(dict)
  launches = defaultdict(int)
  phase_of = lambda n: op_phase(names.get(n, ""))
  product = lambda n: n in costs and (costs[n]["gemm"] or costs[n]["pallas"])
  for c in bodies:
    flow = _Flow(comps[c], c, roots.get(c), group)
    for ins in comps[c]:
      name = ins[0]
      if name not in costs:
        continue
      cost, g = costs[name], group(name)
      launches[g] += cost["times"]
      phase = phase_of(name)
      for x, nbytes in cost["reads"].items():
        key, src = flow.source(x)
        if src != g:
          k = (phase, key)
          read[g][k] = max(read[g].get(k, 0.0), nbytes * cost["times"])
        elif phase == "bwd" and key[0] == c and product(key[1]) and phase_of(key[1]) == "fwd":
          once = flow.escapes(key[1], g, 0, key[2] or None)    # its write already in the floor
          saved[g][key] = (max(saved[g].get(key, (0.0,))[0], nbytes * cost["times"]), once)
      elems = arrays(ins[3])
      if ins[3].startswith("("):                 # a tuple: each element by its own users
        for u in flow.users.get(name, ()):
          m = re.search(r"index=(\d+)", u[2]) if u[1] == "get-tuple-element" else None
          if m and int(m.group(1)) < len(elems) and flow.escapes(u[0], g):
            dt, dims = elems[int(m.group(1))]
            written[g] += min(math.prod(dims) * _DTYPE_BYTES.get(dt, 1),
                              cost["bytes_out"]) * cost["times"]
        if flow.escapes(name, g) and name == roots.get(c):
          written[g] += cost["bytes_out"] * cost["times"]
      elif flow.escapes(name, g):
        written[g] += cost["bytes_out"] * cost["times"]
  out = {}
  for g in set(read) | set(written) | set(launches):
    r = sum(read[g].values())
    out[g] = {"bytes": r + written[g], "read": r, "written": written[g],
              "launches": int(launches[g]),
              "saved": sum(b * (1 if once else 2) for b, once in saved[g].values())}
  return out


class _Flow:
  """Where the values of one top-level computation come from and go (``group_floors``):
  ``body`` its instructions, ``comp`` its name, ``root`` its ROOT's name, ``group(name)`` an
  instruction's scope group."""

  def __init__(self, body, comp: str, root: str | None, group):
    self.table = {ins[0]: ins for ins in body}
    self.users = defaultdict(list)
    for ins in body:
      for x in dict.fromkeys(operands(ins[2])):
        self.users[x].append(ins)
    self.comp, self.root, self.group = comp, root, group

  def source(self, x, path=(), depth=0):
    """``(key, producing group)`` of value ``x`` (``path``: tuple indices into it); "input" for a
    parameter or constant, views followed to the launch behind them."""
    ins = self.table.get(x)
    if ins is None or depth > 64:
      return (self.comp, x, path), "input"
    op, ops = ins[1], operands(ins[2])
    if op == "bitcast" and ops:
      return self.source(ops[0], path, depth + 1)
    if op == "get-tuple-element" and ops:
      m = re.search(r"index=(\d+)", ins[2])
      return self.source(ops[0], (int(m.group(1)),) + path, depth + 1)
    if op in ("tuple", "opt-barrier") and path and ops:
      i = path[0] if op == "tuple" else 0
      rest = path[1:] if op == "tuple" else path
      if op == "opt-barrier" or i < len(ops):
        return self.source(ops[i], rest, depth + 1)
    if op in ("parameter", "constant"):
      return (self.comp, x, path), "input"
    return (self.comp, x, path), self.group(x)

  def escapes(self, x, g, depth=0, path=None) -> bool:
    """Whether value ``x`` reaches a launch outside group ``g`` or leaves the computation
    (``path``: only its tuple element at these indices, followed into the tuples that hold it
    and out through the ``get-tuple-element`` that takes it back)."""
    if x == self.root or depth > 64:
      return True
    for u in self.users.get(x, ()):
      if u[1] == "tuple":
        for i, y in enumerate(operands(u[2])):
          if y == x and self.escapes(u[0], g, depth + 1, (i,) + (path or ())):
            return True
      elif u[1] in ("bitcast", "opt-barrier"):
        if self.escapes(u[0], g, depth + 1, path):
          return True
      elif u[1] == "get-tuple-element":
        m = re.search(r"index=(\d+)", u[2])     # a tuple value's elements: their own users
        if path and m and int(m.group(1)) == path[0] and self.escapes(u[0], g, depth + 1,
                                                                      path[1:] or None):
          return True
      elif u[1] in ("while", "conditional", "call") or (
          hlo_stats.is_launch(u[1]) and self.group(u[0]) != g):
        return True
    return False


def _roots(text: str) -> dict:
  """{computation: the name of its ROOT instruction}."""
  out, cur = {}, None
  for line in text.splitlines():
    m = hlo_stats._COMP_RE.match(line)
    if m and "=" not in line.split("(")[0]:
      cur = m.group(2)
      continue
    s = line.strip()
    if cur and s.startswith("ROOT "):
      out[cur] = s[5:].split("=", 1)[0].strip().lstrip("%")
  return out


def scope_tower(op_name: str, towers) -> str:
  """The tower of a named-scope path: the first path component that is ``<tower>``,
  ``<tower>_<module>`` (``click_hsp``, ``click_attention._attend``) or ``embed_<tower>``; ""
  for shared modules (MoWE, heads, context, optimizer)."""
  names = sorted(towers, key=len, reverse=True)
  for comp in op_name.split("/"):
    c = comp.split(".")[0]
    for t in names:
      if c == t or c.startswith(t + "_") or c == "embed_" + t:
        return t
  return ""


# ---- kernels: analytic input + output bytes ------------------------------------------------------
def _nbytes(shape, dtype) -> float:
  return float(math.prod(shape) * np.dtype(dtype).itemsize)


def gdpa_kernel(q, k, v, out_batch: int, q_shared: bool, kv_shared: bool) -> dict:
  """Bytes and launches of the GDPA kernel's forward + backward (module doc); ``q, k, v`` have
  ``.shape`` and ``.dtype``."""
  Tq, Hq, D = q.shape[1:]
  o = _nbytes((out_batch, Tq, Hq, D), q.dtype)
  qkv = _nbytes(q.shape, q.dtype) + _nbytes(k.shape, k.dtype) + _nbytes(v.shape, v.dtype)
  fwd = qkv + o
  dq = _nbytes((out_batch, Tq, Hq, D), "float32" if q_shared else q.dtype)
  dkv = 2 * _nbytes((out_batch,) + tuple(k.shape[1:]), "float32" if kv_shared else k.dtype)
  bwd = 2 * (qkv + o) + dq + dkv
  bwd += (dq + _nbytes(q.shape, q.dtype)) if q_shared else 0.0
  bwd += (dkv + 2 * _nbytes(k.shape, k.dtype)) if kv_shared else 0.0
  return {"bytes": fwd + bwd, "launches": 3 + int(q_shared) + int(kv_shared)}


def attention_flops(batch, tq, tk, heads, d, window=None) -> float:
  """FLOPs of a fused attention kernel's forward + backward over its (query, key) pairs (all
  tq x tk, or the ``|i - j| <= window`` band): forward q k^T and p v (2 matmuls), backward the
  recomputed scores, dv, dp, dq, dk (5)."""
  pairs = tq * tk if window is None else float(band_pairs(tq, window))
  return 7 * 2.0 * batch * heads * pairs * d


def block_attention_flops(batch, t, heads, d, block) -> float:
  """FLOPs of the block attention kernel's forward + backward: ``attention_flops`` over the
  (query, key) pairs of the ``ceil(t / block)`` blocks of ``block`` x ``block`` (the kernel
  computes every pair of a block, padding and invalid rows included)."""
  return attention_flops(batch, -(-t // block) * block, block, heads, d)


def jagged_kernel(q, k, v, o) -> dict:
  """Bytes and launches of a packed (jagged) kernel's forward + backward (``jagged_pallas``): the
  forward reads q, k, v and writes o; the backward reads them and do, writes dq, dk, dv (the
  offsets / seg / pos vectors are negligible). ``o``: the output's ``.shape`` / ``.dtype``."""
  qkv = sum(_nbytes(x.shape, x.dtype) for x in (q, k, v))
  out = _nbytes(o.shape, o.dtype)
  return {"bytes": (qkv + out) + (qkv + 2 * out + qkv), "launches": 3}


def jagged_calls(kind: str, q, k, v, jag, kw) -> tuple[str, dict]:
  """``(recorded kind, {bytes, launches, flops})`` of one packed op of ``kunlun.nn.packed``
  (``q, k, v`` shapes as that op takes them; ``jag.capacity`` N, ``jag.batch`` B). FLOPs as the
  Pallas kernels visit the static buffer: every one of the N tokens scores its own example's
  ``n_kv`` keys (``gdpa_cross``), the S seeds score every token (``gdpa_pool``), a token its
  ``block_size`` block or its band (``|i - j| <= window``, the buffer as one row); full softmax
  attention: N x N / B pairs (examples of equal length; the kernel visits only the key tiles of
  the examples a query tile overlaps)."""
  S = jax.ShapeDtypeStruct
  N, B = q.shape[0] if kind != "gdpa_pool" else k.shape[0], jag.batch
  H, D = q.shape[-2:]
  # GDPA: one backward kernel (3 launches where the keys or seeds must be split)
  if kind == "gdpa_cross":
    return "gdpa", {**jagged_kernel(q, k, v, q), "launches": 2,
                    "flops": attention_flops(1, N, k.shape[1], H, D)}
  if kind == "gdpa_pool":
    o = S((B,) + tuple(q.shape), q.dtype)
    return "gdpa", {**jagged_kernel(q, k, v, o), "launches": 2,
                    "flops": attention_flops(1, q.shape[0], N, H, D)}
  if kind == "block_attention":
    bs = kw.get("block_size", 64)
    return "block", {"bytes": 0.0, "launches": 0, "block_size": bs,
                     "flops": block_attention_flops(1, N, H, D, bs)}
  window = kw.get("window")
  lse = S((H, N), "float32")
  io = jagged_kernel(q, k, v, q)
  io["bytes"] += 2 * _nbytes(lse.shape, lse.dtype)          # lse: written, read by the bwd
  io["launches"] = 2                  # the backward is one kernel (dq, dk, dv of a tile's rows)
  flops = (attention_flops(1, N, N, H, D, window) if window is not None
           else attention_flops(1, N, N / max(B, 1), H, D))
  return "attention", {**io, "window": window, "flops": flops}


def pool_proj_kernel(q, x, w, o, recompute: bool = False, through: bool = False) -> dict:
  """Bytes and launches of HSP's pool projecting its own keys and values
  (``jagged_pallas.jagged_gdpa_pool_proj_pallas``), forward + backward: the forward reads q, x
  and the two weights ``w``, writes o, k and v; the pool's backward reads q, k, v and do, writes
  dq, dk, dv; the projections' backward reads x, dk, dv and the weights, writes dx and the rows'
  RMS factors r f32[N]; the weight gradients' kernel (``pallas_kernels.wgrad``) reads x, r, dk,
  dv and writes the weights' gradients (its float32 partials not counted). ``recompute``
  (``jagged_pallas.pool_proj_recomputes``): the forward writes no k, v and the pool's backward
  reads x and the weights in their place. ``through`` (x passed through to the PFFN,
  ``jagged_gdpa_pool_proj_pallas(through=eps)``): the projections' backward also reads the two
  pass-throughs' cotangents ``[N, d]`` (in x's dtype)."""
  nb = lambda a: _nbytes(a.shape, a.dtype)
  qb, xb, ob, wb = nb(q), nb(x), nb(o), sum(nb(a) for a in w)
  rb = _nbytes(x.shape[:1], "float32")
  kv = 2 * _nbytes(w[0].shape[1:], q.dtype) * x.shape[0]             # k, v (dk, dv) [N, H, D]
  if recompute:
    fwd = (qb + xb + wb) + ob
    pool_bwd = (qb + xb + wb + ob) + (qb + kv)
  else:
    fwd = (qb + xb + wb) + (ob + kv)
    pool_bwd = (qb + kv + ob) + (qb + kv)
  proj_bwd = (xb + kv + wb + 2 * xb * through) + (xb + rb)
  gemm = (xb + rb + kv) + wb
  return {"bytes": fwd + pool_bwd + proj_bwd + gemm, "launches": 4}


def flash_attention_kernel(q, k, v) -> dict:
  """Bytes and launches of a fused softmax attention's forward + backward (module doc)."""
  B, T, H, _ = q.shape
  qkv = _nbytes(q.shape, q.dtype) + _nbytes(k.shape, k.dtype) + _nbytes(v.shape, v.dtype)
  o, lse = _nbytes(q.shape, q.dtype), _nbytes((B, H, T), "float32")
  fwd = qkv + o + lse
  bwd = qkv + 2 * o + lse + qkv                 # reads q, k, v, o, do, lse; writes dq, dk, dv
  return {"bytes": fwd + bwd, "launches": 3}


def _name_stack() -> str:
  try:
    from jax._src import source_info_util
    return str(source_info_util.current_name_stack())
  except Exception:  # noqa: BLE001 - private API; without it the calls get no scope
    return ""


def _under_autodiff() -> bool:
  """Whether the current trace differentiates: a JVP / linearize trace is the current trace or
  a parent of it (under ``jax.checkpoint`` the remat'd function is traced in a jaxpr trace whose
  parent is the linearize trace, and its name stack carries no ``jvp(``)."""
  try:
    from jax._src import core
    t = core.trace_ctx.trace
  except Exception:  # noqa: BLE001 - private API; without it the name stack decides
    return False
  for _ in range(64):
    if t is None:
      return False
    if type(t).__name__ in ("JVPTrace", "LinearizeTrace"):
      return True
    t = getattr(t, "parent_trace", None)
  return False


@functools.cache
def _fence_fn():
  @jax.custom_vjp
  def fence(x):
    return jax.lax.optimization_barrier(x)

  fence.defvjp(lambda x: (jax.lax.optimization_barrier(x), None),
               lambda _, g: (jax.lax.optimization_barrier(g),))
  return fence


def _fence(x):
  """Identity whose value and cotangent pass an optimization barrier: XLA fuses nothing across
  it, so the ops around a fenced kernel call read and write exactly the kernel's operands, as
  they would around the GPU kernel (a custom call)."""
  return _fence_fn()(x)


# kunlun.nn.packed's ops that record_kernels wraps
JAGGED_OPS = ("gdpa_cross", "gdpa_pool", "block_attention", "softmax_attention")
# kunlun.nn.packed's fused norm -> projection ops (pallas_kernels.norm_qkv): {op: rotated}
PROJECTION_OPS = {"fused_qkv": 2, "fused_proj": 0}


def _out_flops(x, o, w, *a, **kw) -> float:
  """``pallas_kernels.proj_residual``'s forward GEMM and its weight gradient
  (``pallas_kernels.wgrad``; ``do = dy w^T`` is XLA's GEMM, in the HLO)."""
  return 2.0 * x.shape[0] * o.shape[1] * o.shape[2] * x.shape[1] * 2      # forward, dw


def _event_mlp_flops(x, w1, b1, w2, *a, **kw) -> float:
  """``pallas_kernels.event_mlp``'s kernels on ``x [S, Ns, K]`` (or a pair of such, read as
  their concatenation): the forward's two layers ``2 N (K F + F D)``, the backward's recomputed
  first layer and its two back-projections ``2 N (2 K F + F D)``, the two weight gradients
  (``pallas_kernels.wgrad``) ``2 N (K F + F D)``."""
  x = x[0] if isinstance(x, tuple) else x
  N = x.shape[0] * x.shape[1]
  (K, F), D = w1.shape, w2.shape[1]
  return 2.0 * N * (4 * K * F + 3 * F * D)


def _dense_flops(x, w, *a, **kw) -> float:
  """``kunlun.nn.packed.dense_kernel``: the weight gradient's kernel (``pallas_kernels.wgrad``),
  ``2 N K C`` over the ``N`` rows of ``x [..., K]``, once per copy the enclosing vmaps run; the
  forward and ``dx`` are XLA's GEMMs, in the HLO."""
  return wgrad.flops(x.size // x.shape[-1], w.shape[0], w.shape[1], 1) * _vmap_copies(w)


# kunlun.nn.packed's other GEMM kernels: {op: FLOPs of its kernels from its arguments}
GEMM_OPS = {"fused_out": _out_flops, "fused_event_mlp": _event_mlp_flops,
            "dense_kernel": _dense_flops}


def wukong_fm_flops(B: int, N: int, d: int, r: int, mixes) -> float:
  """FLOPs of ``pallas_kernels.wukong_fm``'s token-side kernels on ``B`` examples of ``N`` tokens
  of width ``d`` (the output norm's are elementwise, not counted): the forward's ``X^T y``,
  ``X (X^T y)`` and maps (``4 N d r + 2 N d sum(m)``), the backward's recomputed two, its four
  ``[N, d, r]`` products and two per map (``12 N d r + 4 N d sum(m)``); an example in column
  chunks (``wukong_fm.chunked``) computes ``X^T y`` once more in the backward (``2 N d r``)."""
  again = 2 if fm_kernels.chunked(N, d) else 0
  return float(B) * N * d * ((16 + again) * r + 6 * sum(mixes))


def _vmap_copies(a) -> int:
  """How many copies of a traced ``a`` the enclosing vmaps run (MoWE's experts); 1 outside."""
  n = 1
  while isinstance(a, batching.BatchTracer):
    if isinstance(a.batch_dim, int):
      n *= a.val.shape[a.batch_dim]
    a = a.val
  return n


def fused_projection_flops(N: int, d: int, P: int, H: int, D: int, rot: int) -> float:
  """FLOPs of ``pallas_kernels.norm_qkv``'s kernels on ``N`` tokens: the forward's ``P``
  projections, the backward's recomputed ``rot`` ones and its ``P`` back-projections, each ``2 N
  d H D``, and ``pallas_kernels.wgrad``'s ``P`` weight gradients."""
  return 2.0 * N * d * H * D * (2 * P + rot) + wgrad.flops(N, d, H * D, P)


@contextlib.contextmanager
def record_kernels(fence: bool = True):
  """Records, while active, the GDPA, softmax- and block-attention calls of the train step's
  forward, padded or packed (``kunlun.nn.packed``'s ops, ``jagged_calls``): yields a list,
  filled when the context exits, of ``{kind, scope, bytes, launches, flops}`` (kind "gdpa",
  "attention" or "block"; ``scope`` the name stack, e.g.
  ``Kunlun/.../click_hsp/HSP/GDPA``, or from the remat'd module on under remat).

  The step may trace its forward more than once: under autodiff (``jvp(`` in the name stack,
  or ``_under_autodiff`` under remat) and, for the sparse table update, in an ``eval_shape``.
  Under remat the second trace of a layer can reuse the first's cached jaxpr and make no calls
  at all, so each call site (kind and scope, ``jvp(...)`` unwrapped) is kept as often as the
  trace that made it most often, differentiated calls first.

  Softmax attention is recorded at ``kunlun.nn.attention.softmax_attention_op``, the dispatch that
  ``SeqAttention._attend`` calls for every backend (xla reference, pallas / cudnn directly or per
  shard through ``sharding.context``), with the global ``q, k, v`` shapes.

  ``fence``: the recorded calls' operands and results (and their cotangents) pass optimization
  barriers (``_fence``), so that XLA fuses none of the reference computation into the ops
  around it: those then move the kernel's interface (q, k, v in, o out; do in, dq, dk, dv
  out), the bytes they would move around the GPU kernel, and the replaced region is exactly the
  call. Values are unchanged; the XLA column is that of the fenced program."""
  calls = []
  orig = {"gdpa": pallas_kernels.gdpa, "softmax": attention.softmax_attention_op,
          "block": pallas_kernels.block_attention}

  seen = []

  def keep(kind, cost):
    scope = _name_stack()
    diff = "jvp(" in scope or _under_autodiff()
    seen.append((diff, {"kind": kind, "scope": re.sub(r"jvp\(([^)]*)\)", r"\1", scope),
                        **cost}))

  def gdpa(q, k, v, **kw):
    qi, ki = kw.get("q_index"), kw.get("kv_index")
    out_b = (qi.shape[0] if qi is not None else ki.shape[0] if ki is not None else k.shape[0])
    keep("gdpa", {**gdpa_kernel(q, k, v, out_b, bool(kw.get("broadcast_q")) or qi is not None,
                                ki is not None),
                  "flops": attention_flops(out_b, q.shape[1], k.shape[1], q.shape[2], q.shape[3])})
    if not fence:
      return orig["gdpa"](q, k, v, **kw)
    return _fence(orig["gdpa"](*_fence((q, k, v)), **kw))

  def softmax(q, k, v, *a, **kw):
    window = a[1] if len(a) > 1 else kw.get("window")
    keep("attention", {**flash_attention_kernel(q, k, v), "window": window,
                       "flops": attention_flops(q.shape[0], q.shape[1], k.shape[1], q.shape[2],
                                                q.shape[3], window)})
    if not fence:
      return orig["softmax"](q, k, v, *a, **kw)
    return _fence(orig["softmax"](*_fence((q, k, v)), *a, **kw))

  def block(q, k, v, **kw):
    bs = kw["block_size"] if "block_size" in kw else (
        inspect.signature(orig["block"]).parameters["block_size"].default)
    keep("block", {"bytes": 0.0, "launches": 0, "block_size": bs,
                   "flops": block_attention_flops(q.shape[0], q.shape[1], q.shape[2],
                                                  q.shape[3], bs)})
    return orig["block"](q, k, v, **kw)

  def jagged_op(name):
    fn = getattr(packed, name)

    def call(q, k, v, jag, **kw):
      kind, cost = jagged_calls(name, q, k, v, jag, kw)
      # softmax attention in the scope the kernel column replaces, as SeqAttention._attend's
      with jax.named_scope("SoftmaxAttention") if kind == "attention" else contextlib.nullcontext():
        keep(kind, cost)
        if not fence or kind == "block":
          return fn(q, k, v, jag, **kw)
        if kw.get("q_norm") is not None:
          # the query's LayerNorm inside the kernels (the PFFN's): its backward is XLA's, which
          # fuses into the pass that adds x's other cotangents, as the norm's did outside the
          # op; a fence on q's cotangent would keep it a pass of its own (with ln_split there is
          # no such pass: q's cotangent goes as the kernels write it to HSP's pool's backward)
          k, v = _fence((k, v))
          return _fence(fn(q, k, v, jag, **kw))
        return _fence(fn(*_fence((q, k, v)), jag, **kw))
    return call

  def pool_proj(q, x, w, jag, **kw):
    N, d, S = x.shape[0], x.shape[1], q.shape[0]
    H, D = q.shape[-2:]
    o = jax.ShapeDtypeStruct((jag.batch, S, H, D), q.dtype)
    again = jagged_pallas.pool_proj_recomputes(q, x, w, **kw)
    keep("gdpa", {**pool_proj_kernel(q, x, w, o, again, kw.get("through") is not None),
                  "flops": attention_flops(1, S, N, H, D)})
    # the projections: forward (in the pool's kernel), back-projected (norm_proj's backward) and,
    # where the pool's backward projects k, v again, those
    keep("projection", {"bytes": 0.0, "launches": 0,
                        "flops": fused_projection_flops(N, d, len(w), H, D, len(w) * again)})
    if not fence:
      return pool_proj_orig(q, x, w, jag, **kw)
    q, x, w = _fence((q, x, w))
    return _fence(pool_proj_orig(q, x, w, jag, **kw))

  def projection(name, rot):
    fn = getattr(packed, name)

    def call(x, w, *a, **kw):
      d, P, H, D = (w[0].shape[0], len(w), *w[0].shape[1:]) if isinstance(w, tuple) else w.shape
      keep("projection", {"bytes": 0.0, "launches": 0,
                          "flops": fused_projection_flops(x.shape[0], d, P, H, D, rot)})
      return fn(x, w, *a, **kw)
    return call

  def qkv_attention_call(x, w, *a, **kw):
    # the input side's projections (norm_qkv's count) and the softmax attention, one op
    # (pallas_kernels.qkv_attention): both FLOPs on the attention's scope, its bytes as compiled
    N, d = x.shape
    _, P, H, D = w.shape
    q = jax.ShapeDtypeStruct((N, H, D), kw.get("dtype", x.dtype))
    att = jagged_calls("softmax_attention", q, q, q, a[-1], {"window": kw.get("window")})[1]
    keep("projection", {"bytes": 0.0, "launches": 0,
                        "flops": att["flops"] + fused_projection_flops(N, d, P, H, D, 2)})
    return qkv_orig(x, w, *a, **kw)

  def gemm_op(name):
    fn = getattr(packed, name)

    def call(*a, **kw):
      keep("projection", {"bytes": 0.0, "launches": 0, "flops": GEMM_OPS[name](*a, **kw)})
      return fn(*a, **kw)
    return call

  def wukong_fm(x, y, ws, scale, bias, **kw):
    B, N, d = x.shape
    flops = wukong_fm_flops(B, N, d, y.shape[1], [w.shape[1] for w in ws]) * _vmap_copies(y)
    keep("projection", {"bytes": 0.0, "launches": 0, "flops": flops})
    return fm_orig(x, y, ws, scale, bias, **kw)

  def seed_kron_call(a, e, z, **kw):
    B, S, d = a.shape          # forward z^T h; backward z dt and h dt^T: each 2 B S K d
    K = z.shape[0] * z.shape[2]                  # z [rank, S, n_out]
    keep("projection", {"bytes": 0.0, "launches": 0, "flops": 6.0 * B * S * K * d})
    return kron_orig(a, e, z, **kw)

  def weightgen_call(x, w_tok, a1, b1, a_k, a_v, **kw):
    B, N, d = x.shape
    keep("projection", {"bytes": 0.0, "launches": 0,
                        "flops": wg_kernels.flops(B, N, w_tok.shape[1], d, *a_k.shape)})
    return wg_orig(x, w_tok, a1, b1, a_k, a_v, **kw)

  fm_orig = wukong.fm_pallas
  wukong.fm_pallas = wukong_fm
  kron_orig = hsp.kron_pallas
  hsp.kron_pallas = seed_kron_call
  wg_orig = weightgen.gen_pallas
  weightgen.gen_pallas = weightgen_call
  proj_orig = {n: getattr(packed, n) for n in (*PROJECTION_OPS, *GEMM_OPS)}
  for n, rot in PROJECTION_OPS.items():
    setattr(packed, n, projection(n, rot))
  for n in GEMM_OPS:
    setattr(packed, n, gemm_op(n))
  pallas_kernels.gdpa = gdpa
  attention.softmax_attention_op = softmax
  pallas_kernels.block_attention = block
  jagged_orig = {n: getattr(packed, n) for n in JAGGED_OPS}
  for n in JAGGED_OPS:
    setattr(packed, n, jagged_op(n))
  pool_proj_orig = packed.gdpa_pool_proj
  packed.gdpa_pool_proj = pool_proj
  qkv_orig = packed.fused_qkv_attention
  packed.fused_qkv_attention = qkv_attention_call
  try:
    yield calls
  finally:
    pallas_kernels.gdpa = orig["gdpa"]
    attention.softmax_attention_op = orig["softmax"]
    pallas_kernels.block_attention = orig["block"]
    for n, f in {**jagged_orig, **proj_orig}.items():
      setattr(packed, n, f)
    packed.gdpa_pool_proj = pool_proj_orig
    packed.fused_qkv_attention = qkv_orig
    wukong.fm_pallas = fm_orig
    hsp.kron_pallas = kron_orig
    weightgen.gen_pallas = wg_orig
    calls += _call_sites(seen)


def _call_sites(seen: list) -> list[dict]:
  """``record_kernels``' calls from ``[(differentiated, call)]``: per (kind, scope), the
  differentiated calls, then as many more undifferentiated ones as that trace made more."""
  sites = defaultdict(lambda: ([], []))
  for diff, c in seen:
    sites[(c["kind"], c["scope"])][0 if diff else 1].append(c)
  return [c for d, nd in sites.values() for c in d + nd[len(d):]]


# ---- the table ----------------------------------------------------------------------------------
def _replaced(group: str, op_name: str) -> bool:
  """Whether an op lies in a region the kernel column replaces."""
  return group == "GDPA" or (group == "attention" and "/SoftmaxAttention" in op_name)


def roofline(costs: list[dict], calls: list[dict] | None, towers=(), *, examples: int = 1,
             peak_flops: float = H200["peak_flops"], bandwidth: float = H200["bandwidth"],
             launch_s: float = H200["launch_s"], repeat: int = 1, note: str = CPU_NOTE) -> dict:
  """Rows by (scope group, tower) with XLA and kernel columns, totals and roofline bounds.

  ``costs``: ``op_costs``; ``calls``: ``record_kernels`` (None: no kernel column, it equals the
  XLA one); ``examples``: the global batch (bytes per example); ``repeat``: how often the traced
  calls run per step (microbatches)."""
  rows = defaultdict(lambda: defaultdict(float))
  for c in costs:
    g = hlo_stats.scope_group(c["op_name"])
    r = rows[(g, scope_tower(c["op_name"], towers))]
    n, b = c["times"], (c["bytes_in"] + c["bytes_out"]) * c["times"]
    r["launches"] += n
    r["bytes"] += b
    r["flops"] += c["flops"] * n
    r["transcendentals"] += c["transcendentals"] * n
    r["pallas_launches"] += n * bool(c.get("pallas"))
    r["pallas_bytes"] += b * bool(c.get("pallas"))
    if c.get("gemm"):
      r["gemm_launches"] += n
      r["gemm_bytes"] += b
      r["gemm_flops"] += c["flops"] * n
    if calls is not None and _replaced(g, c["op_name"]):
      r["replaced_bytes"] += b
      r["replaced_launches"] += n
  for k in calls or ():
    g = ("GDPA" if k["kind"] == "gdpa" else hlo_stats.scope_group(k["scope"])
         if k["kind"] == "projection" else "attention")
    r = rows[(g, scope_tower(k["scope"], towers))]
    r["kernel_calls"] += repeat
    r["analytic_bytes"] += k["bytes"] * repeat
    r["analytic_launches"] += k["launches"] * repeat
    if r["pallas_launches"]:   # Pallas custom calls carry no FLOPs in the HLO: their formula's
      r["flops"] += k.get("flops", 0.0) * repeat
      r["pallas_flops"] += k.get("flops", 0.0) * repeat
  out_rows = []
  for (g, t), r in rows.items():
    kb = r["bytes"] - r["replaced_bytes"] + r["analytic_bytes"]
    kl = r["launches"] - r["replaced_launches"] + r["analytic_launches"]
    out_rows.append({"group": g, "tower": t, "launches": int(r["launches"]), "bytes": r["bytes"],
                     "kernel_bytes": kb, "kernel_launches": int(kl), "flops": r["flops"],
                     "transcendentals": r["transcendentals"],
                     "kernel_calls": int(r["kernel_calls"]), "replaced_bytes": r["replaced_bytes"],
                     "analytic_bytes": r["analytic_bytes"],
                     "pallas_launches": int(r["pallas_launches"]),
                     "pallas_bytes": r["pallas_bytes"], "pallas_flops": r["pallas_flops"],
                     "gemm_launches": int(r["gemm_launches"]),
                     "gemm_bytes": r["gemm_bytes"], "gemm_flops": r["gemm_flops"]})
  out_rows.sort(key=lambda r: -r["bytes"])
  tot = lambda key: sum(r[key] for r in out_rows)
  flops, launches = tot("flops"), tot("launches")

  def bound(nbytes, nlaunch):
    compute, memory = flops / peak_flops, nbytes / bandwidth
    return {"compute_s": compute, "memory_s": memory, "launch_s": nlaunch * launch_s,
            "bound_s": max(compute, memory) + nlaunch * launch_s}

  col = lambda nbytes, nlaunch: {
      "bytes": nbytes, "bytes_per_example": nbytes / max(examples, 1), "launches": int(nlaunch),
      "flop_per_byte": flops / nbytes if nbytes else None, **bound(nbytes, nlaunch)}
  groups = defaultdict(lambda: defaultdict(float))
  for r in out_rows:
    for key in ("launches", "bytes", "kernel_bytes", "kernel_launches", "flops", "pallas_bytes",
                "gemm_bytes"):
      groups[r["group"]][key] += r[key]
  return {"note": note, "kernel_column": calls is not None,
          "device": {"peak_flops": peak_flops, "bandwidth": bandwidth, "launch_s": launch_s},
          "examples": examples, "flops": flops, "transcendentals": tot("transcendentals"),
          "gemm": {"launches": int(tot("gemm_launches")), "bytes": tot("gemm_bytes"),
                   "flops": tot("gemm_flops"),
                   "launch_share": tot("gemm_launches") / launches if launches else None,
                   "byte_share": tot("gemm_bytes") / tot("bytes") if tot("bytes") else None,
                   "flop_share": tot("gemm_flops") / flops if flops else None},
          "pallas": {"launches": int(tot("pallas_launches")), "flops": tot("pallas_flops")},
          "xla": col(tot("bytes"), launches),
          "kernel": col(tot("kernel_bytes"), tot("kernel_launches")),
          "groups": {g: {k: (int(v) if "launch" in k else v) for k, v in d.items()}
                     for g, d in sorted(groups.items(), key=lambda kv: -kv[1]["bytes"])},
          "rows": out_rows}


def add_floors(rl: dict, floors: dict) -> dict:
  """``rl`` (``roofline``) with each group's compulsory bytes (``group_floors``): per group
  ``floor_bytes``, ``floor_ratio`` (its XLA bytes / floor), ``kernel_gemm_ratio`` (the bytes
  of its Pallas kernels and GEMMs alone / floor: its ratio were every other XLA pass free, a
  lower bound while its kernels and GEMMs stay as they are), ``saved_bytes`` and
  ``least_ratio`` ((floor + saved) / floor: the least ratio of a program that recomputes none of
  the group's GEMM or kernel products), and ``rl["floor"]``: the total and the bound at the
  floor, max(FLOPs / peak, floor bytes / bandwidth) + the XLA launches."""
  for g, v in rl["groups"].items():
    f = floors.get(g, {}).get("bytes", 0.0)
    v["floor_bytes"] = f
    v["floor_ratio"] = v["bytes"] / f if f else None
    if "saved" in floors.get(g, {}):
      v["saved_bytes"] = floors[g]["saved"]
      v["least_ratio"] = (f + v["saved_bytes"]) / f if f else None
    if "pallas_bytes" in v:
      v["kernel_gemm_ratio"] = (v["pallas_bytes"] + v["gemm_bytes"]) / f if f else None
  total = sum(v.get("bytes", 0.0) for v in floors.values())
  d = rl["device"]
  rl["floor"] = {"bytes": total, "ratio": rl["xla"]["bytes"] / total if total else None,
                 "bound_s": max(rl["flops"] / d["peak_flops"], total / d["bandwidth"])
                 + rl["xla"]["launches"] * d["launch_s"]}
  return rl


# the reduction computation XLA's split-K rewrite gives the partial sums' reduce, over the split
# dimension: the first, or the one after a batched GEMM's batch dimensions (the experts' vmap)
_SPLIT_K_REDUCE = re.compile(r"dimensions=\{\d+\}, to_apply=%[\w.\-]+\.reduce_sub_computation")


def split_k(text: str, costs: list[dict] | None = None) -> dict:
  """``{group: {"gemms", "launches", "bytes"}}``: the round trip of the partial sums XLA's split-K
  adds to GEMMs with few output tiles (a weight gradient's ``[d_in, d_out]`` over many tokens: it
  splits the contraction for parallelism). ``bytes``: the float32 partials the GEMM fusion writes
  plus what the fusions that reduce them (``launches``) read of them, per step; a GEMM without
  the split would write its result itself. Attributed to the GEMM's scope group."""
  costs = op_costs(text) if costs is None else costs
  comps, entry = hlo_stats.parse_hlo(text)
  strip = lambda shape: re.sub(r"\{[^}]*\}", "", shape)        # without the layout
  partials = defaultdict(set)          # computation -> the shapes of the partials it reduces
  for c, body in comps.items():
    local = {name: strip(shape) for name, _, _, shape in body}
    for _, op, rest, _ in body:
      if op == "reduce" and _SPLIT_K_REDUCE.search(rest):
        partials[c].add(local.get(operands(rest)[0], ""))
  top = hlo_stats.top_level(comps, entry)
  shapes = {name: strip(shape) for name, _, _, shape, _ in top}
  reduced = {name: set().union(*(partials.get(c, set()) for c in hlo_stats._called(rest)))
             for name, op, rest, _, _ in top if op == "fusion"}
  by_name = {c["name"]: c for c in costs}
  readers = defaultdict(list)                        # GEMM fusion -> the fusions reducing it
  for c in costs:
    for x in c["reads"] if reduced.get(c["name"]) else ():
      if x in by_name and by_name[x]["gemm"] and shapes.get(x) in reduced[c["name"]]:
        readers[x].append(c)
  out = defaultdict(lambda: {"gemms": 0, "launches": 0, "bytes": 0.0})
  for g, rs in readers.items():
    gemm = by_name[g]
    v = out[hlo_stats.scope_group(gemm["op_name"])]
    v["gemms"] += 1
    v["launches"] += sum(r["times"] for r in rs)
    v["bytes"] += gemm["bytes_out"] * gemm["times"] + sum(r["reads"][g] * r["times"] for r in rs)
  return dict(out)


def print_floors(groups: dict, stream=None, title: str = "by group") -> None:
  """One line per scope group: XLA bytes, compulsory bytes (``add_floors``), their ratio and
  launches, and where known the kernels' and GEMMs' ratio alone (``groups``: ``rl["groups"]`` or
  combined figures of the same keys)."""
  s = stream or sys.stdout
  kg = any("kernel_gemm_ratio" in v for v in groups.values())
  sv = any("least_ratio" in v for v in groups.values())
  x = lambda r: "-" if r is None else f"{r:.2f}x"
  print(f"{title:<12} {'GB':>8} {'floor GB':>9} {'ratio':>6} {'launches':>8}"
        + (f" {'kernels+GEMMs':>13}" if kg else "")
        + (f" {'saved GB':>8} {'least':>6}" if sv else ""), file=s)
  for g, v in sorted(groups.items(), key=lambda kv: -kv[1]["bytes"]):
    print(f"{g:<12} {v['bytes'] / 1e9:8.2f} {v.get('floor_bytes', 0.0) / 1e9:9.2f} "
          f"{x(v.get('floor_ratio')):>6} {v['launches']:>8.0f}"
          + (f" {x(v.get('kernel_gemm_ratio')):>13}" if kg else "")
          + (f" {v.get('saved_bytes', 0.0) / 1e9:8.2f} {x(v.get('least_ratio')):>6}"
             if sv else ""), file=s)


def print_roofline(rl: dict, stream=None, top: int = 40) -> None:
  """The rows (largest XLA bytes first), the groups and the totals / bounds."""
  s = stream or sys.stdout
  tx = rl["xla"]["bytes"] or 1.0
  unit, scale = ("GB", 1e9) if tx >= 1e10 else ("MB", 1e6)
  gb = lambda b: b / scale
  print(f"roofline ({rl['note']})", file=s)
  print(f"{'scope':<24} {'launch':>6} {'k.launch':>8} {'XLA ' + unit:>8} {'kernel ' + unit:>9} "
        f"{'share':>6} {'GFLOP':>9} {'F/B xla':>7} {'F/B krn':>7}", file=s)
  for r in rl["rows"][:top]:
    name = r["group"] + (f"/{r['tower']}" if r["tower"] else "")
    fb = lambda b, r=r: f"{r['flops'] / b:.1f}" if b else "-"
    print(f"{name:<24} {r['launches']:>6} {r['kernel_launches']:>8} {gb(r['bytes']):>8.2f} "
          f"{gb(r['kernel_bytes']):>9.2f} {r['bytes'] / tx:>6.1%} {r['flops'] / 1e9:>9.1f} "
          f"{fb(r['bytes']):>7} {fb(r['kernel_bytes']):>7}", file=s)
  if len(rl["rows"]) > top:
    print(f"... {len(rl['rows']) - top} more rows in the JSON", file=s)
  print("by group: " + ", ".join(
      f"{g} {gb(v['bytes']):.1f} {unit} ({v['bytes'] / tx:.0%}) / {int(v['launches'])} launches"
      for g, v in rl["groups"].items()), file=s)
  g, pk = rl.get("gemm"), rl.get("pallas")
  if g and g["launches"]:
    print(f"GEMM kernels: {g['launches']} launches ({g['launch_share']:.0%}), "
          f"{gb(g['bytes']):.1f} {unit} ({g['byte_share']:.0%}), {g['flops'] / 1e12:.2f} TFLOP "
          f"({g['flop_share'] or 0:.0%})", file=s)
  if pk and pk["launches"]:
    print(f"Pallas custom calls: {pk['launches']} launches, {pk['flops'] / 1e12:.2f} TFLOP "
          "(from the kernels' formulas)", file=s)
  if "floor" in rl:
    print_floors(rl["groups"], s)
    f = rl["floor"]
    print(f"floor: {gb(f['bytes']):.1f} {unit}/step compulsory ({f['ratio']:.2f}x under the XLA "
          f"column), bound at it {1e3 * f['bound_s']:.2f} ms", file=s)
  d = rl["device"]
  for col in ("xla", "kernel"):
    c = rl[col]
    print(f"{col:>6}: {gb(c['bytes']):.1f} {unit}/step, "
          f"{c['bytes_per_example'] / 1e6:.1f} MB/example, "
          f"{rl['flops'] / 1e12:.2f} TFLOP, {c['flop_per_byte'] or 0:.1f} FLOP/byte, "
          f"{c['launches']} launches; bound {1e3 * c['bound_s']:.2f} ms = max(compute "
          f"{1e3 * c['compute_s']:.2f}, memory {1e3 * c['memory_s']:.2f}) + launches "
          f"{1e3 * c['launch_s']:.2f} (peak {d['peak_flops']:.3g} FLOP/s, {d['bandwidth']:.3g} "
          f"B/s, {1e6 * d['launch_s']:.1f} us/launch)", file=s)


def op_kind(c: dict) -> str:
  """``pallas``, ``gemm`` or ``xla`` (any other fusion or op) of an ``op_costs`` entry."""
  return "pallas" if c.get("pallas") else "gemm" if c.get("gemm") else "xla"


def op_phase(op_name: str) -> str:
  """``bwd`` for an op of the step's backward (autodiff's ``transpose(...)`` in its name), else
  ``fwd``."""
  return "bwd" if "transpose(" in op_name else "fwd"


_LAYER_INDEX = re.compile(r"(layer_|Layer_)\d+")


def op_totals(ops: list[dict]) -> list[dict]:
  """A scope group's launched ops (``group_ops``) summed by what they do, largest bytes per step
  first: one row per phase (``op_phase``), kind (``op_kind``) and op, the last two parts of the
  op's name with layer indices folded (``layer_0/mul`` and ``layer_7/mul`` are
  ``layer_N/mul``); each row's ``launches``, ``bytes_in``, ``bytes_out`` and ``bytes`` are per
  step."""
  rows = {}
  for c in ops:
    op = _LAYER_INDEX.sub(r"\1N", "/".join(c["op_name"].split("/")[-2:]))
    key = (op_phase(c["op_name"]), c["kind"], op)
    r = rows.setdefault(key, {"phase": key[0], "kind": key[1], "op": op, "launches": 0,
                              "bytes_in": 0.0, "bytes_out": 0.0})
    r["launches"] += c["times"]
    r["bytes_in"] += c["bytes_in"] * c["times"]
    r["bytes_out"] += c["bytes_out"] * c["times"]
  out = [{**r, "bytes": r["bytes_in"] + r["bytes_out"]} for r in rows.values()]
  return sorted(out, key=lambda r: -r["bytes"])


def group_ops(costs: list[dict], group: str, top: int | None = None) -> list[dict]:
  """A scope group's launched ops, largest bytes per step first: ``op_costs`` entries with
  ``kind`` (``op_kind``) and ``bytes`` (in + out, times executions per step) added."""
  rows = [{**c, "kind": op_kind(c), "bytes": (c["bytes_in"] + c["bytes_out"]) * c["times"]}
          for c in costs if hlo_stats.scope_group(c["op_name"]) == group]
  rows.sort(key=lambda r: -r["bytes"])
  return rows[:top] if top else rows


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description="A saved program's scope groups against their "
                               "floors, and a group's largest ops (the HLO text of "
                               "bench/train_step --dump_hlo).")
  ap.add_argument("hlo", help="post-optimisation HLO text")
  ap.add_argument("--group", action="append", default=[],
                  help="list this scope group's largest ops (repeatable)")
  ap.add_argument("--top", type=int, default=20, help="ops listed per group")
  ap.add_argument("--by-op", action="store_true",
                  help="list a group's ops summed by phase, kind and op, layers folded "
                       "(op_totals), instead of one launch a row")
  ap.add_argument("--attribute", choices=hlo_stats.ATTRIBUTIONS, default="root",
                  help="a fusion's scope group: its root op's (XLA's name, the default) or that "
                       "of most of its fused ops")
  args = ap.parse_args(argv)
  try:
    with open(args.hlo) as f:
      text = f.read()
  except OSError as e:
    print(f"error: cannot read {args.hlo}: {e.strerror}", file=sys.stderr)
    return 2
  costs = op_costs(text, args.attribute)
  if not costs:
    print(f"error: {args.hlo} has no launched ops (not a compiled HLO module's text?)",
          file=sys.stderr)
    return 2
  rl = add_floors(roofline(costs, None), group_floors(text, costs, args.attribute))
  print_floors(rl["groups"])
  sk = split_k(text, costs)
  if sk:
    print("split-K partial sums (XLA splits a GEMM with few output tiles for parallelism; a "
          "group's ratio without their round trip):")
    for g, v in sorted(sk.items(), key=lambda kv: -kv[1]["bytes"]):
      grp = rl["groups"].get(g, {})
      f = grp.get("floor_bytes")
      r = f"{(grp['bytes'] - v['bytes']) / f:.2f}x" if f else "-"
      print(f"  {g:<12} {v['bytes'] / 1e9:8.3f} GB, {v['gemms']} GEMMs, {v['launches']} reducing "
            f"launches; {r}")
  for g in args.group:
    if g not in rl["groups"]:
      print(f"error: no scope group {g!r}; the program's: {', '.join(sorted(rl['groups']))}",
            file=sys.stderr)
      return 2
    rows = group_ops(costs, g)
    total = sum(r["bytes"] for r in rows)
    if args.by_op:
      sums = op_totals(rows)
      print(f"\n{g}: {len(rows)} launched ops as {len(sums)} kinds of op, {total / 1e9:.3f} GB; "
            f"the {min(args.top, len(sums))} largest (MB in / out per step, launches per step)")
      for r in sums[:args.top]:
        print(f"{r['bytes'] / 1e6:9.1f} MB {r['phase']} {r['kind']:6} {r['bytes_in'] / 1e6:8.1f} "
              f"{r['bytes_out'] / 1e6:8.1f} x{r['launches']:<3} {r['op'][-90:]}")
      continue
    print(f"\n{g}: {len(rows)} launched ops, {total / 1e9:.3f} GB; the {min(args.top, len(rows))}"
          " largest (MB in / out per launch, launches per step)")
    for r in rows[:args.top]:
      print(f"{r['bytes'] / 1e6:9.1f} MB {r['kind']:6} {r['bytes_in'] / 1e6:8.1f} "
            f"{r['bytes_out'] / 1e6:8.1f} x{r['times']:<3} {r['name'][:32]:32} "
            f"{r['op_name'][-90:]}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
