"""What a compiled train step is made of: HLO op / fusion / launch counts and named-scope groups.

  stats = hlo_stats(compiled.as_text())          # counts, by opcode and by model scope
  groups = scope_group(op_name)                  # "GDPA", "PFFN", ..., "optimizer", "other"
Notes: docs/guides/benchmarks.md, ``bench/profiling/hlo_stats.py``."""

from __future__ import annotations

import re
from collections import Counter, defaultdict

# scope group -> substrings of a named-scope path; the first group that matches wins (GDPA first:
# it is nested inside PFFN, HSP and attention)
SCOPE_GROUPS = (
    ("GDPA", ("/GDPA/", "/GDPA")),
    ("optimizer", ("/optimizer",)),
    ("embeddings", ("/EventEmbed", "/SparseEmbed", "/ContextEncoder", "/TableBatched",
                    "/DenseTokens", "/LCE")),
    ("PFFN", ("/PFFN",)),
    ("HSP", ("/HSP", "/PMA", "/SumKronLinear")),
    ("attention", ("/SeqAttention",)),
    ("WeightGen", ("/WeightGen",)),
    ("MoWE", ("/MoWE", "/WukongLayer", "/WukongCrossLayer")),
    ("heads", ("/Heads",)),
    ("loss", ("/loss",)),
)
GROUP_NAMES = tuple(g for g, _ in SCOPE_GROUPS) + ("other",)

_NO_LAUNCH = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all",
              "opt-barrier", "partition-id", "replica-id", "add-dependency", "domain",
              "all-gather-done", "all-reduce-done", "collective-permute-done", "copy-done",
              "async-done", "send-done", "recv-done", "while", "conditional", "call"}
ATTRIBUTIONS = ("root", "majority")    # how a fusion is named (resolve_op_names)
# a fused computation's ops that do not count towards its scope group (``_fusion_op_name``):
# operands, constants and views, which XLA names after whichever op it cloned them for
_NOT_COUNTED = {"parameter", "constant", "bitcast", "broadcast", "reshape", "tuple",
                "get-tuple-element", "iota"}
# ops that keep a fusion under its root's name: a GEMM (XLA's Triton GEMM fusions nest their dot
# in a fusion or call a custom kernel) is the fusion's work, whatever its epilogue's scope
_KEEPS_ROOT = {"dot", "convolution", "custom-call", "fusion"}
_COMP_RE = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_OPNAME_RE = re.compile(r'op_name="([^"]*)"')
_TRIP_RE = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_CALLS_RE = re.compile(r"(?:calls|body|condition|to_apply|branch_computations|"
                       r"true_computation|false_computation)=\{?([^,}]+(?:,\s*%[\w.\-]+)*)\}?")


def _split_instruction(line: str):
  """``(name, opcode, rest, shape)`` of an HLO instruction line, or None (``shape``: the result
  shape text, e.g. ``f32[3,128]{1,0}`` or a parenthesised tuple)."""
  s = line.strip()
  if s.startswith("ROOT "):
    s = s[5:]
  if "=" not in s or not s.startswith("%") and not re.match(r"[\w.\-]+\s*=", s):
    return None
  name, _, rhs = s.partition("=")
  rhs = rhs.lstrip()
  if rhs.startswith("("):                       # tuple shape: skip the balanced parentheses
    depth, shape = 0, rhs
    for i, ch in enumerate(rhs):
      depth += ch == "("
      depth -= ch == ")"
      if depth == 0:
        shape, rhs = rhs[:i + 1], rhs[i + 1:].lstrip()
        break
  else:
    shape, _, rhs = rhs.partition(" ")
  m = re.match(r"([\w\-]+)\(", rhs)
  if not m:
    return None
  return name.strip().lstrip("%"), m.group(1), rhs, shape


def parse_hlo(text: str):
  """``({computation: [(name, opcode, rest, shape)]}, entry_name)`` of an HLO module's text."""
  comps, entry, cur = {}, None, None
  for line in text.splitlines():
    if cur is None:
      m = _COMP_RE.match(line)
      if m and "=" not in line.split("(")[0]:
        cur = m.group(2)
        comps[cur] = []
        if m.group(1):
          entry = cur
      continue
    if line.strip() == "}":
      cur = None
      continue
    ins = _split_instruction(line)
    if ins:
      comps[cur].append(ins)
  return comps, entry


def scope_group(op_name: str) -> str:
  """The scope group (``GROUP_NAMES``) of an HLO op's ``op_name`` metadata."""
  p = "/" + op_name
  for group, keys in SCOPE_GROUPS:
    if any(k in p for k in keys):
      return group
  return "other"


def _called(rest: str) -> list[str]:
  out = []
  for m in _CALLS_RE.finditer(rest):
    out += [c.strip().lstrip("%") for c in m.group(1).split(",") if c.strip()]
  return out


def top_level(comps, entry) -> list:
  """``[(name, opcode, rest, shape, times)]``: the instructions of the entry computation and of
  the bodies of its control flow (while / conditional / call), not fusion bodies, i.e. what the
  runtime schedules. ``times``: the product of the enclosing ``while`` loops' known trip counts
  (``backend_config`` ``known_trip_count``; 1 where XLA does not know it)."""
  out, seen, stack = [], set(), [(entry, 1)] if entry else []
  while stack:
    c, times = stack.pop()
    if c in seen or c not in comps:
      continue
    seen.add(c)
    for ins in comps[c]:
      out.append((*ins, times))
      if ins[1] in ("while", "conditional", "call"):
        m = _TRIP_RE.search(ins[2]) if ins[1] == "while" else None
        stack += [(b, times * (int(m.group(1)) if m else 1)) for b in _called(ins[2])]
  return out


def _fusion_op_name(comps, ins, names) -> str:
  """A launched fusion's op_name: its root's, unless most of its fused computation's ops (not
  parameters, constants, broadcasts or reshapes) come from another scope group; then the
  last of that group's ops (of the root's phase, forward or backward, where it has one). XLA
  names a fusion after its root, which can be one add of a cotangent from a neighbouring scope
  (the PFFN's LayerNorm backward fused under the HSP's ``add_any``). Fusions with a GEMM keep
  their root's name (the GEMM's epilogue)."""
  name, _, rest, _ = ins[:4]
  root = names[name]
  inner = [i for c in _called(rest) for i in comps.get(c, ())]
  if any(op in _KEEPS_ROOT for _, op, *_ in inner):
    return root
  ops = [names[i[0]] for i in inner if i[1] not in _NOT_COUNTED and i[0] in names]
  count = Counter(scope_group(n) for n in ops)
  if not count:
    return root
  group, n = count.most_common(1)[0]
  if count.get(scope_group(root), 0) >= n:
    return root
  mine = [o for o in ops if scope_group(o) == group]
  phase = [o for o in mine if ("transpose(" in o) == ("transpose(" in root)]
  return (phase or mine)[-1]


def resolve_op_names(comps, entry, attribute: str = "root") -> dict:
  """{instruction: op_name}: its ``metadata`` op_name, or (top-level ops XLA created without
  metadata: copies, the row-wise reduce-windows of a cond branch, ...) that of a fused inner op,
  of the first user or operand in its computation that has one, or of the control-flow op that
  runs its computation. ``attribute="majority"``: a launched fusion takes the name of the scope
  group most of its fused ops come from (``_fusion_op_name``); "root" (the default): its root's,
  as XLA names it."""
  if attribute not in ATTRIBUTIONS:
    raise ValueError(f"attribute={attribute!r}: one of {ATTRIBUTIONS}")
  names, parent = {}, {}
  for ins in (i for body in comps.values() for i in body):
    m = _OPNAME_RE.search(ins[2])
    if m:
      names[ins[0]] = m.group(1)
  for ins in top_level(comps, entry):
    if ins[1] in ("while", "conditional", "call"):
      for b in _called(ins[2]):
        parent.setdefault(b, ins[0])
    elif attribute == "majority" and ins[1] == "fusion" and ins[0] in names:
      names[ins[0]] = _fusion_op_name(comps, ins, names)
  operands = lambda rest: re.findall(r"%([\w.\-]+)", rest[rest.index("("):].split("),")[0])
  for comp in [c for c in comps if c == entry or c in parent]:
    body = comps[comp]
    users = defaultdict(list)
    for ins in body:
      for x in operands(ins[2]):
        users[x].append(ins[0])
    for _ in range(4):                       # neighbours of neighbours
      for name, op, rest, _ in body:
        if name in names:
          continue
        inner = [i[0] for c in _called(rest) if op == "fusion" for i in comps.get(c, ())]
        for cand in inner + users[name] + operands(rest) + [parent.get(comp)]:
          if cand in names:
            names[name] = names[cand]
            break
  return names


def is_launch(opcode: str) -> bool:
  """Whether a top-level instruction runs device work (module doc: ``kernel_launches``)."""
  return opcode not in _NO_LAUNCH


def hlo_stats(text: str) -> dict:
  """Counts of a compiled module (see module doc) plus ``op_names`` {instruction: op_name} and
  ``launches_by_group`` / ``launches_by_opcode`` of the top-level launches."""
  comps, entry = parse_hlo(text)
  total = sum(len(v) for v in comps.values())
  top = [ins[:3] for ins in top_level(comps, entry)]
  launches = [(n, op, rest) for n, op, rest in top if is_launch(op)]
  op_names = resolve_op_names(comps, entry)
  by_group = Counter(scope_group(op_names.get(n, "")) for n, _, _ in launches)
  by_op = Counter(op for _, op, _ in launches)
  return {"hlo_instructions": total, "top_level_ops": len(top),
          "fusions": sum(op == "fusion" for _, op, _ in top),
          "kernel_launches": len(launches),
          "launches_by_opcode": dict(by_op.most_common()),
          "launches_by_group": {g: by_group.get(g, 0) for g in GROUP_NAMES if by_group.get(g)},
          "transposes": _count_ops(comps, "transpose"), "copies": _count_ops(comps, "copy"),
          "converts": _count_ops(comps, "convert"),
          "op_names": op_names}


def _count_ops(comps, opcode: str) -> int:
  return sum(ins[1] == opcode for body in comps.values() for ins in body)


def profile_groups(xplane_path: str, op_names: dict, steps: int, top: int = 15) -> dict:
  """Device time per scope group and the top ops from a ``jax.profiler`` trace.

  Events carrying an ``hlo_op`` stat (GPU kernels; CPU thunks) are attributed to scope groups
  through ``op_names`` (instruction -> op_name, from ``hlo_stats``). Times are per step
  (divided by ``steps``); ``launches_per_step`` counts those events.
  """
  from jax.profiler import ProfileData
  pd = ProfileData.from_file(xplane_path)
  planes = [p for p in pd.planes if p.name.startswith("/device:")]
  device = bool(planes)
  if not planes:                                 # CPU: thunks run on the host plane
    planes = [p for p in pd.planes if p.name.startswith("/host:CPU")]
  per_op, count = defaultdict(float), 0
  derived = ("XLA ", "Steps", "Framework", "Source", "TensorFlow", "Launch")
  for plane in planes:
    for line in plane.lines:
      if str(line.name).startswith(derived):          # summaries of the kernel lines
        continue
      for ev in line.events:
        name = str(ev.name)
        if name.startswith("end:"):
          continue
        hlo_op = dict(ev.stats).get("hlo_op")
        if hlo_op is None:                            # kernel named after its fusion
          alt = name.rsplit("_", 1)
          hlo_op = name if name in op_names else (
              ".".join(alt) if len(alt) == 2 and ".".join(alt) in op_names else None)
        if hlo_op is None and device:                 # a kernel with no HLO op: "other"
          hlo_op = name
        if hlo_op is None:
          continue
        per_op[str(hlo_op)] += ev.duration_ns
        count += 1
  by_group = defaultdict(float)
  for op, ns in per_op.items():
    by_group[scope_group(op_names.get(op, ""))] += ns
  total = sum(per_op.values())
  ms = lambda ns: round(ns / 1e6 / max(steps, 1), 4)
  top_ops = sorted(per_op.items(), key=lambda kv: -kv[1])[:top]
  return {"device_ms_per_step": ms(total), "launches_per_step": round(count / max(steps, 1), 1),
          "by_group_ms": {g: ms(v) for g, v in sorted(by_group.items(), key=lambda kv: -kv[1])},
          "top_ops": [{"op": op, "ms": ms(ns), "group": scope_group(op_names.get(op, "")),
                       "op_name": op_names.get(op, "")[-160:]} for op, ns in top_ops]}
