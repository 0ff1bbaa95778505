"""Export a trained run's shared serving path (``kunlun.serving.score``) as a ``jax.export``
artifact: ``python -m kunlun.serving.export --workdir=W --out=O [--candidates=dynamic|N]
[--requests=1|dynamic|R] [--jagged_capacity=C|stream=C,...] [--step=S] [--data_dir=D]
[--platforms=cpu[,cuda]] [--no_verify] [--trust_workdir]``. Outputs and options:
docs/architecture.md, ``kunlun/serving/export.py``. ``--jagged_capacity``: those streams' request
events come packed at a static capacity of C tokens per call (``score.pack_requests``; recorded
in the signature as ``jagged_capacity``; more events than C are refused, never dropped)."""

from __future__ import annotations

import argparse
import os
import platform
import sys
from collections.abc import Mapping

import flax
import jax
import numpy as np
from jax import export as jex

from data.fake import random_batch
from data.schema import FIRST_ID, NULL_ID, OOV_ID
from kunlun.configs.fields import parse_capacity
from kunlun.configs.types import seq_lens
from kunlun.serving import loader, score
from kunlun.serving.loader import ARTIFACT, FORMAT, PARAMS, SIGNATURE, nest
from kunlun.train import checkpoint, run_info, startup
from kunlun.train.devices import get_rules
from kunlun.train.model import fit_and_build_model
from kunlun.train.plan import load_schema
from kunlun.train.startup import FatalError
from kunlun.train.workdir import check_output, check_outputs
from kunlun.utils import atomic
from sharding import mesh as mesh_lib
from sharding import partition

PLATFORMS = ("cpu", "cuda", "rocm", "tpu")


def parse_count(flag: str, value) -> int | None:
  """``"dynamic"`` -> None (symbolic); a positive integer -> int; else ValueError."""
  if isinstance(value, str) and value.strip().lower() in ("dynamic", "symbolic", "n", "r"):
    return None
  try:
    n = int(value)
  except (TypeError, ValueError):
    raise ValueError(f"--{flag}={value!r} must be a positive integer or 'dynamic'") from None
  if n < 1 or str(n) != str(value).strip():
    raise ValueError(f"--{flag}={value!r} must be a positive integer or 'dynamic'")
  return n


def parse_jagged_capacity(value, streams=None) -> dict[str, int]:
  """``--jagged_capacity``: "" / None -> {} (padded), "C" -> every stream of ``streams`` at C
  (``{"*": C}`` when None), "click=C,..." -> those streams; C a positive multiple of 64; a
  stream not in ``streams`` (when given): ValueError."""
  v = "" if value is None else str(value).strip()
  if v.isdigit():
    v = ",".join(f"{s}={v}" for s in (streams or ["*"]))
  try:
    caps = parse_capacity(v) if v != "auto" else "auto"
  except ValueError as e:
    raise ValueError(f"--jagged_capacity={value!r}: {e}") from None
  if caps == "auto":
    raise ValueError(f"--jagged_capacity={value!r}: give C or stream=C (a request batch has no "
                     "length sample to size it from)")
  unknown = sorted(set(caps or {}) - set(streams or caps or {}))
  if unknown:
    raise ValueError(f"--jagged_capacity={value!r}: unknown stream(s) {unknown}; streams are "
                     f"{list(streams)}")
  return caps or {}


def input_spec(schema, seq_lens: dict, n, r, capacity: dict | None = None) -> dict:
  """The serving batch as ``{path: (shape, dtype)}`` with ``n`` / ``r`` ints or dim names;
  the streams of ``capacity`` {stream: C} packed (token fields ``[C]``, ``offsets [r + 1]``)."""
  spec = {f"sparse/{f.name}": ((n, f.max_len), "int32") for f in schema.sparse}
  spec["dense"] = ((n, len(schema.dense)), "float32")
  spec["surface"] = ((n,), "int32")
  for st in schema.streams:
    C = (capacity or {}).get(st.name)
    rows = (r, seq_lens[st.name]) if C is None else (C,)
    for f in ("item", "action", "surface") + tuple(e.name for e in st.extra_fields):
      spec[f"events/{st.name}/{f}"] = (rows, "int32")
    spec[f"events/{st.name}/age"] = (rows, "float32")
    if C is not None:
      spec[f"events/{st.name}/offsets"] = ((r + 1,), "int32")
      spec[f"events/{st.name}/seg"] = ((C,), "int32")
      spec[f"events/{st.name}/pos"] = ((C,), "int32")
    spec[f"events/{st.name}/length"] = ((r,), "int32")
  spec["request_index"] = ((n,), "int32")
  return spec


def input_ranges(schema, seq_lens: dict) -> dict:
  """Allowed values per input path: ``[lo, hi)`` (``None``: unbounded), as ``data.schema``'s
  batch layout states them; float inputs must also be finite."""
  S = len(schema.surfaces)
  rng = {f"sparse/{f.name}": [-1, f.vocab_size] for f in schema.sparse}
  rng["dense"], rng["surface"], rng["request_index"] = [None, None], [0, S], [0, None]
  for st in schema.streams:
    p = f"events/{st.name}/"
    rng.update({p + "item": [0, st.item_vocab], p + "action": [0, st.action_vocab],
                p + "surface": [0, S], p + "age": [0, None],
                p + "length": [0, seq_lens[st.name] + 1]})
    rng.update({p + e.name: [0, e.vocab_size] for e in st.extra_fields})
    rng.update({p + "offsets": [0, None], p + "seg": [0, None], p + "pos": [0, None]})
  return rng


def flatten(tree: dict, prefix: str = "") -> dict:
  """``{"a": {"b": x}}`` -> ``{"a/b": x}`` (inverse of ``loader.nest``)."""
  out = {}
  for k, v in tree.items():
    p = f"{prefix}{k}"
    if isinstance(v, Mapping):
      out.update(flatten(v, p + "/"))
    else:
      out[p] = v
  return out


def _restore(workdir: str, step, data_dir, trust_workdir: bool = False):
  """``(config, schema, model, step, params)`` of a train.py workdir (FatalError if unusable)."""
  if not os.path.isdir(workdir):
    startup.fail(f"--workdir={workdir}: no such directory")
  try:
    ckpt = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"), read_only=True)
    if not ckpt.all_steps():
      startup.fail(f"--workdir={workdir}: no checkpoints in {ckpt.directory}")
  except checkpoint.CheckpointError as e:
    startup.fail(f"--workdir={workdir}: {e}")
  if step is not None and step not in ckpt.all_steps():
    startup.fail(f"--step={step}: no such checkpoint; available {ckpt.all_steps()}")
  config, saved = run_info.load_run_info(workdir, trust_workdir)
  data_dir = data_dir or saved
  if not data_dir:
    startup.fail("no --data_dir given and none recorded in the workdir (data_dir.txt)")
  schema, _ = run_info.schema_as_trained(run_info.saved_run_info(workdir),  # names and order
                                         load_schema(data_dir), f"--data_dir={data_dir}")
  model = fit_and_build_model(config, schema)
  mesh = mesh_lib.make_mesh(devices=jax.devices()[:1])
  example = random_batch(schema, 1, seq_lens(config))
  abstract = partition.abstract_params(model, jax.random.key(0), example, mesh,
                                       get_rules(config.sharding.rules))
  try:
    used, params = ckpt.restore_params(abstract, step)
  except checkpoint.CheckpointError as e:
    startup.fail(str(e))
  params = nest(flatten(jax.tree.map(np.asarray, params)))     # plain nested dicts
  return config, schema, model, used, params


def export(workdir: str, out: str, *, candidates="dynamic", requests=1, jagged_capacity=None,
           step=None, data_dir=None, platforms=("cpu",), verify: bool = True,
           trust_workdir: bool = False, log=print) -> dict:
  """Writes the artifact, parameters and signature to ``out``; returns the signature dict.
  Raises ``startup.FatalError`` (one line) on bad input."""
  try:
    n_fixed, r_fixed = parse_count("candidates", candidates), parse_count("requests", requests)
  except ValueError as e:
    startup.fail(str(e))
  bad = [p for p in platforms if p not in PLATFORMS]
  if bad or not platforms:
    startup.fail(f"--platforms={','.join(platforms)}: allowed {PLATFORMS}")
  try:
    packs = bool(parse_jagged_capacity(jagged_capacity))        # its form, before the model
  except ValueError as e:
    startup.fail(str(e))
  if packs and r_fixed is None:     # the jagged kernels size their work list by the batch
    startup.fail(f"--jagged_capacity={jagged_capacity} needs a fixed --requests=R (packed "
                 "towers have a static request count), got --requests=dynamic")
  workdir = os.path.abspath(workdir)
  check_outputs(dirs=[("--out", out, (ARTIFACT, PARAMS, SIGNATURE))],   # docs/outputs.md
                inputs=[("--data_dir", data_dir)], workdir=workdir)
  config, schema, model, used_step, params = _restore(workdir, step, data_dir, trust_workdir)
  try:
    caps = parse_jagged_capacity(jagged_capacity, schema.stream_names)
  except ValueError as e:
    startup.fail(str(e))
  check_output(os.path.join(out, SIGNATURE), "--out")       # before tracing the model
  lens = seq_lens(config)
  dims = ", ".join(d for d, f in (("n", n_fixed), ("r", r_fixed)) if f is None)
  sym = dict(zip([d.strip() for d in dims.split(",")], jex.symbolic_shape(dims), strict=True)
             ) if dims else {}
  n, r = sym.get("n", n_fixed), sym.get("r", r_fixed)
  spec = input_spec(schema, lens, n, r, caps)
  batch_struct = nest({p: jax.ShapeDtypeStruct(s, d) for p, (s, d) in spec.items()})
  param_struct = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
  scorer = score.make_scorer(model, jit=False)
  log(f"exporting {config.model.arch} (step {used_step}) for {','.join(platforms)}: "
      f"candidates={'n (symbolic)' if n_fixed is None else n_fixed}, "
      f"requests={'r (symbolic)' if r_fixed is None else r_fixed}"
      + (f", packed {caps}" if caps else ""))
  try:
    exp = jex.export(jax.jit(scorer), platforms=tuple(platforms))(param_struct, batch_struct)
  except Exception as e:  # tracing / lowering failures: name the cause in one line
    startup.fail(f"export failed ({type(e).__name__}: {str(e).splitlines()[0][:300]})")
  # each file atomically; signature.json (what the loader opens first) is removed before and
  # written last, so a killed export leaves an artifact the loader refuses, never a mixed one
  sig_path = os.path.join(out, SIGNATURE)
  try:
    if os.path.exists(sig_path):
      os.remove(sig_path)
    atomic.write_bytes(os.path.join(out, ARTIFACT), exp.serialize())
    with atomic.target(os.path.join(out, PARAMS)) as tmp, open(tmp, "wb") as f:
      np.savez(f, **flatten(params))
    params_sha256 = loader.file_sha256(os.path.join(out, PARAMS))
    artifact_sha256 = loader.file_sha256(os.path.join(out, ARTIFACT))
  except OSError as e:
    startup.fail(f"--out={out}: cannot write the export ({e.strerror or e})")
  name = lambda x: x if isinstance(x, int) else str(x)
  K = len(schema.tasks)
  sig = {
      "format": FORMAT,
      "inputs": {p: {"dtype": d, "shape": [name(x) for x in s]} for p, (s, d) in spec.items()},
      "ranges": input_ranges(schema, lens),
      "params_sha256": params_sha256, "artifact_sha256": artifact_sha256,
      "outputs": {k: {"dtype": "float32", "shape": [name(n), K]} for k in ("logits", "prob")},
      "candidates": "n" if n_fixed is None else n_fixed,
      "requests": "r" if r_fixed is None else r_fixed,
      "tasks": list(schema.task_names), "surfaces": list(schema.surfaces),
      "kept_len": lens, "jagged_capacity": caps, "platforms": list(platforms),
      "usage": {
          "rows": "sparse/dense/surface/request_index: one row per candidate ad (n); events: one "
                  "row per request (r); request_index[i] = the request of ad i, in [0, r)",
          "ranges": "each input's allowed values [lo, hi) (null: unbounded); floats finite",
          "params_sha256": "sha256 of params.npz; the loader refuses params that differ",
          "artifact_sha256": "sha256 of serving.jax_export; the loader refuses another program",
          "signature_sha256": "sha256 of this file's canonical JSON (sorted keys, separators "
                              "',' ':', ASCII) without this key; the loader refuses an edited "
                              "signature (loader.signature_sha256)",
          "sparse": "ids in [0, vocab); -1 = empty slot; hashed features: "
                    "data.pipeline.hash_ids(raw, vocab) = ((raw * 0x9E3779B97F4A7C15 mod 2^64) "
                    ">> 29) mod vocab",
          "dense": "raw values (the model normalises them)",
          "surface": "index into surfaces",
          "events": "per stream the most recent kept_len events, oldest first, valid ones in "
                    "[0, length); age = request time - event time in seconds; padding 0",
          "outputs": "logits / sigmoid probabilities per task on the ad row's surface",
          "jagged_capacity": "streams listed there come packed: the r requests' events back "
                             "to back, fields [C] (then 0 padding), offsets[r + 1] (request j "
                             "owns tokens [offsets[j], offsets[j+1])), seg[C] (each token's "
                             "request; r for padding), pos[C] (index in its request; 0 for "
                             "padding), length[r] = diff(offsets); "
                             "kunlun.serving.score.pack_requests builds it; more events than C "
                             "are refused",
      },
      "source": {"workdir": workdir, "step": int(used_step), "arch": config.model.arch,
                 "comp_skip": bool(config.model.comp_skip)},
      "versions": {"jax": jax.__version__, "flax": flax.__version__,
                   "python": platform.python_version()},
  }
  add_vocab(sig, schema)
  sig["signature_sha256"] = loader.signature_sha256(sig)     # last: binds every key above
  try:
    atomic.write_json(sig_path, sig)
  except OSError as e:
    startup.fail(f"--out={out}: cannot write {SIGNATURE} ({e.strerror or e})")
  log(f"wrote {out}/{{{ARTIFACT},{PARAMS},{SIGNATURE}}}")
  here = jax.default_backend()
  if verify and ({"gpu": "cuda"}.get(here, here) in platforms or here in platforms):
    err = _verify(out, schema, lens, model, params, n_fixed or 3, r_fixed or 1, caps)
    sig["verify_max_abs_diff"] = err
    log(f"verified: artifact vs in-process model, max |logit diff| = {err:.2e}")
  return sig


def add_vocab(sig: dict, schema) -> None:
  """Puts the exact vocabularies ingestion stored in schema.json (``SparseFeature.vocab``,
  ``data.ingest.vocab``) into the signature: ``sig["vocab"] = {feature: {"kind": "string" | "int",
  "values": [...], "null_id", "oov_id", "first_id"}}``, so serving maps a request's raw values
  with ``loader.vocab_ids`` exactly as ingestion did."""
  sig["vocab"] = {
      f.name: {"kind": "string" if f.vocab and isinstance(f.vocab[0], str) else "int",
               "values": list(f.vocab), "null_id": NULL_ID, "oov_id": OOV_ID,
               "first_id": FIRST_ID}
      for f in schema.sparse if f.vocab is not None}
  sig["usage"]["vocab"] = (
      "features in 'vocab' take ids from their exact vocabulary (loader.vocab_ids): null -> "
      "null_id, a value not in values -> oov_id, values[i] -> first_id + i; string values "
      "are compared by their 63-bit key (blake2b, 8-byte digest of the UTF-8 text, little-endian, "
      ">> 1) as data.ingest compared them")


def _verify(out, schema, lens, model, params, n: int, r: int, caps: dict) -> float:
  """Max |logit difference| between the reloaded artifact and the in-process shared path."""
  req = random_batch(schema, r, lens, seed=1, min_len=1)
  for s, c in caps.items():                  # within the capacity: at most c // r events each
    req["events"][s]["length"] = np.minimum(req["events"][s]["length"], c // r)
  ads = random_batch(schema, n, lens, seed=2)
  b = score.serving_batch(score.pack_requests(req["events"], caps), ads, np.arange(n) % r)
  got = loader.load(out)(b)["logits"]
  want = np.asarray(score.make_scorer(model)(params, b)["logits"])
  err = float(np.max(np.abs(got - want)))
  if not err <= 1e-3 * max(1.0, float(np.max(np.abs(want)))):
    raise AssertionError(f"exported artifact disagrees with the model: max |diff| {err}")
  return err


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="kunlun.serving.export", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--workdir", required=True, help="train.py workdir")
  ap.add_argument("--out", required=True, help="output directory")
  ap.add_argument("--candidates", default="dynamic", help="'dynamic' or a fixed count")
  ap.add_argument("--requests", default="1", help="requests per call: a count or 'dynamic'")
  ap.add_argument("--jagged_capacity", default="", help="pack request events: C (every "
                  "stream) or stream=C,... (C a multiple of 64 tokens per call); default padded")
  ap.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
  ap.add_argument("--data_dir", default=None, help="dataset dir with schema.json (default: the "
                  "run's)")
  ap.add_argument("--platforms", default="cpu", help=f"comma-separated, from {PLATFORMS}")
  ap.add_argument("--no_verify", action="store_true", help="skip the reload-and-compare check")
  ap.add_argument("--trust_workdir", action="store_true",
                  help="load an older workdir's config.pkl (pickle: runs code from the file)")
  a = ap.parse_args(argv)
  startup.quiet_checkpoint_logs()
  try:
    export(a.workdir, a.out, candidates=a.candidates, requests=a.requests,
           jagged_capacity=a.jagged_capacity, step=a.step,
           data_dir=a.data_dir, platforms=tuple(p.strip() for p in a.platforms.split(",")),
           verify=not a.no_verify, trust_workdir=a.trust_workdir)
  except (FatalError, OSError) as e:
    msg = f"{e.filename}: {e.strerror}" if isinstance(e, OSError) and e.strerror else str(e)
    print(f"kunlun.serving.export: error: {' '.join(msg.split())}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:                    # Ctrl-C: one line, status 130 (as train / eval)
    startup.interrupted("kunlun.serving.export")
  return 0


if __name__ == "__main__":
  sys.exit(main())
