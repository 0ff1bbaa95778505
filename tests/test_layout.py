"""The project's layering, read from the source: every import (inside functions too) goes from a
layer to a lower one, no file-level import circle, every module placed in a layer; the Kunlun
model's import chain holds no baseline and no FLOP counter; the serving loader imports no model."""

import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Lowest first. A module belongs to the longest prefix that names it; it may import only from
# its own layer (without a circle) or from lower ones.
LAYERS = [
    "kunlun.utils", "pallas_kernels", "sharding", "data", "data.ingest",
    "kunlun", "kunlun.configs", "kunlun.nn", "kunlun.models", "kunlun.train",
    "kunlun.serving", "kunlun.transfer", "kunlun.cli",
    "bench.profiling", "bench", "bench.experiments", "bench.faults", "bench.report",
    "train", "eval",
]
SKIP = {"tests", "docs", "scripts", "build", "dist"}


def _modules(root=ROOT):
  files = {}
  for d, dirs, fs in os.walk(root):
    dirs[:] = sorted(x for x in dirs if x not in SKIP and not x.startswith((".", "_")))
    for f in fs:
      if f.endswith(".py"):
        rel = os.path.relpath(os.path.join(d, f), root)
        mod = rel[:-3].replace(os.sep, ".")
        files[mod.removesuffix(".__init__")] = rel
  return files


def _edges(files, root=ROOT):
  def resolve(name):
    while name:
      if name in files:
        return name
      name = name.rpartition(".")[0]
    return None

  edges = {m: set() for m in files}
  for mod, rel in files.items():
    tree = ast.parse(open(os.path.join(root, rel), encoding="utf-8").read())
    pkg = mod if rel.endswith("__init__.py") else mod.rpartition(".")[0]
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
          parts = pkg.split(".")
          base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
        # a name that is a submodule imports that module; any other name imports the package
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
      else:
        continue
      for name in names:
        target = resolve(name)
        if target and target != mod:
          edges[mod].add(target)
  return edges


def _layer(mod):
  best = None
  for i, name in enumerate(LAYERS):
    if mod == name or mod.startswith(name + "."):
      if best is None or len(name) > len(LAYERS[best]):
        best = i
  return best


def _upward(edges):
  return sorted(f"{a} -> {b}" for a, bs in edges.items() for b in bs
                if _layer(a) is not None and _layer(b) is not None and _layer(b) > _layer(a))


def _cycles(edges):
  """Strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

  def visit(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on.add(v)
    for w in sorted(edges[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        cycles.append(sorted(comp))

  for v in sorted(edges):
    if v not in index:
      visit(v)
  return cycles


def test_every_module_has_a_layer():
  assert not sorted(m for m in _modules() if _layer(m) is None)


def test_imports_go_down_the_layers():
  up = _upward(_edges(_modules()))
  assert not up, "imports from a lower layer to a higher one:\n" + "\n".join(up)


def test_no_import_circle():
  assert not _cycles(_edges(_modules()))


def test_the_checks_see_an_upward_import_and_a_circle(tmp_path):
  """A low module importing a high one (inside a function) is reported, and so is the circle."""
  for d in ("sharding", "kunlun/train"):
    (tmp_path / d).mkdir(parents=True)
    (tmp_path / d / "__init__.py").write_text("")
  (tmp_path / "sharding" / "bad.py").write_text("def f():\n  from kunlun.train import step\n")
  (tmp_path / "kunlun" / "train" / "step.py").write_text("import sharding.bad\n")
  edges = _edges(_modules(str(tmp_path)), str(tmp_path))
  assert "sharding.bad -> kunlun.train.step" in _upward(edges)
  assert _cycles(edges) == [["kunlun.train.step", "sharding.bad"]]


def _modules_after(stmt):
  code = f"import sys\n{stmt}\nprint(' '.join(sorted(sys.modules)))"
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300, check=True).stdout
  return set(out.split())


def test_model_imports_no_baseline_and_no_flop_counter():
  mods = _modules_after("import kunlun.models.kunlun, kunlun.nn.layer, kunlun.nn.oneseq")
  assert not {m for m in mods if m.startswith("kunlun.models.") and m != "kunlun.models.kunlun"}, mods
  assert "kunlun.models.flops" not in mods


def test_serving_loader_imports_no_model_code():
  mods = _modules_after("import kunlun.serving.loader")
  assert {m for m in mods if m.startswith("kunlun")} == {"kunlun", "kunlun.serving",
                                                         "kunlun.serving.loader"}
  assert "flax" not in mods
