"""Exported serving artifact: round trip through the jax/numpy-only loader equals the in-process
model (N separate examples); signature; one-line errors on bad input."""

import ast
import json
import os
import shutil

import flax.linen as nn
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from data.fake import random_batch, tiny_schema
from kunlun.configs import tiny
from kunlun.configs.types import seq_lens
from kunlun.models.build import build_model
from kunlun.serving import export, loader, score
from kunlun.train import checkpoint, run_info


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A train.py-style workdir (config.pkl, data_dir.txt, checkpoints/5/params) and an export."""
  root = tmp_path_factory.mktemp("serving")
  data_dir, workdir = str(root / "data"), str(root / "work")
  schema = tiny_schema()
  os.makedirs(data_dir)
  schema.save(data_dir)
  config = tiny.get_config()
  run_info.save_run_info(workdir, config, data_dir)
  model = build_model(config, schema)
  shapes = nn.unbox(jax.eval_shape(model.init, jax.random.key(0),
                                   random_batch(schema, 2, seq_lens(config)))["params"])
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda s: (0.3 * rng.normal(size=s.shape)).astype(s.dtype), shapes)
  ck = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"))
  ck.mngr.save(5, args=ocp.args.Composite(params=ocp.args.StandardSave(params)))
  ck.close()
  out = str(root / "artifact")
  sig = export.export(workdir, out, verify=False, log=lambda *_: None)
  return schema, config, model, params, workdir, out, sig


@pytest.fixture(scope="module")
def padded_art(run):
  """The padded artifact, loaded once (its compiled programs are reused across tests)."""
  return loader.load(run[5])


def _batch(schema, config, n, r=1, seed=0):
  req = random_batch(schema, r, seq_lens(config), seed=seed + 1, min_len=1)
  ads = random_batch(schema, n, seq_lens(config), seed=seed + 2)
  return score.serving_batch(req["events"], ads, np.arange(n) % r)


def test_artifact_round_trip(run, padded_art):
  schema, config, model, params, _, out, sig = run
  assert sig["candidates"] == "n" and sig["requests"] == 1 and sig["source"]["step"] == 5
  on_disk = json.load(open(os.path.join(out, "signature.json")))
  assert on_disk["inputs"]["sparse/user_interests"] == {"dtype": "int32", "shape": ["n", 4]}
  assert on_disk["inputs"]["events/click/age"] == {"dtype": "float32", "shape": [1, 32]}
  art = padded_art
  b = _batch(schema, config, 6)
  got = art(b)
  # independent: the normal model on 6 separate examples (events repeated per ad)
  want = np.asarray(jax.jit(lambda p, e: model.apply({"params": p}, e))(params, score.expand(b)))
  assert got["logits"].shape == (6, 2) and np.abs(want).max() > 0.1
  np.testing.assert_allclose(got["logits"], want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got["prob"], 1 / (1 + np.exp(-want)), rtol=1e-5, atol=1e-6)
  # another candidate count through the same (symbolic) artifact
  b2 = jax.tree.map(lambda x: x, b)
  for k in ("dense", "surface", "request_index"):
    b2[k] = np.asarray(b[k])[:2]
  b2["sparse"] = {k: v[:2] for k, v in b["sparse"].items()}
  np.testing.assert_allclose(art(b2)["logits"], want[:2], rtol=1e-5, atol=1e-5)


def test_loader_rejects_bad_input(run):
  schema, config, _, _, _, out, _ = run
  art = loader.load(out)
  b = _batch(schema, config, 3)

  def err(batch):
    with pytest.raises(ValueError) as e:
      art(batch)
    assert "\n" not in str(e.value)
    return str(e.value)
  assert "'dense' is missing" in err({k: v for k, v in b.items() if k != "dense"})
  assert "dimension 'n' = 2" in err(dict(b, surface=b["surface"][:2]))
  ev = {s: dict(v) for s, v in b["events"].items()}
  ev["click"]["item"] = ev["click"]["item"][:, :16]
  assert "events/click/item" in err(dict(b, events=ev))
  assert "request_index must lie in [0, 1)" in err(dict(b, request_index=np.array([0, 1, 0])))
  assert "integer ids" in err(dict(b, surface=np.zeros(3, np.float32)))
  with pytest.raises(FileNotFoundError, match="not a kunlun.serving.export output"):
    loader.load(os.path.dirname(out))


def test_fixed_count_and_cli_errors(run, tmp_path, capsys):
  schema, config, _, _, workdir, _, _ = run
  out = str(tmp_path / "fixed")
  assert export.main([f"--workdir={workdir}", f"--out={out}", "--candidates=4",
                              "--no_verify"]) == 0
  art = loader.load(out)
  assert art.signature["candidates"] == 4 and art.inputs["dense"]["shape"] == [4, 3]
  with pytest.raises(ValueError, match=r"shape \[5, 1\], want \[4, 1\]"):
    art(_batch(schema, config, 5))
  capsys.readouterr()
  empty = tmp_path / "empty"
  empty.mkdir()
  run_info.save_run_info(str(empty), config, "/nonexistent")
  for args, msg in (([f"--workdir={tmp_path}/missing"], "no such directory"),
                    ([f"--workdir={empty}"], "no checkpoint"),
                    ([f"--workdir={workdir}", "--candidates=0"], "--candidates='0' must be"),
                    ([f"--workdir={workdir}", "--requests=two"], "--requests='two' must be"),
                    ([f"--workdir={workdir}", "--step=9"], "--step=9: no such checkpoint"),
                    ([f"--workdir={workdir}", "--platforms=cpu,quantum"], "--platforms")):
    assert export.main(args + [f"--out={tmp_path}/o"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("kunlun.serving.export: error: ") and msg in lines[-1], lines
    assert not any(line.startswith("Traceback") for line in lines)


def test_loader_imports_only_jax_and_numpy():
  src = open(loader.__file__).read()
  mods = set()
  for node in ast.walk(ast.parse(src)):
    if isinstance(node, ast.Import):
      mods |= {a.name.split(".")[0] for a in node.names}
    elif isinstance(node, ast.ImportFrom):
      mods.add((node.module or "").split(".")[0])
  assert mods <= {"__future__", "hashlib", "json", "os", "jax", "numpy"}, mods


def test_loader_checks_ranges_lengths_and_finiteness(run):
  """Each hostile input is refused in one line naming the input (before: scored, or 0.5)."""
  schema, config, _, _, _, out, _ = run
  art = loader.load(out)
  b = _batch(schema, config, 3)
  f = schema.sparse[0]
  st = schema.streams[0]
  T = seq_lens(config)[st.name]

  def err(batch):
    with pytest.raises(ValueError) as e:
      art(batch)
    assert "\n" not in str(e.value)
    return str(e.value)

  def with_sparse(x):
    return dict(b, sparse=dict(b["sparse"], **{f.name: x}))

  def with_event(field, x):
    ev = {s: dict(v) for s, v in b["events"].items()}
    ev[st.name][field] = x
    return dict(b, events=ev)

  ids = np.asarray(b["sparse"][f.name]).astype(np.int64)
  assert f"sparse/{f.name}" in err(with_sparse(np.full_like(ids, f.vocab_size)))
  assert f"sparse/{f.name}" in err(with_sparse(np.full_like(ids, -2)))
  wrapped = np.full_like(ids, 2**32 + 1)                     # wraps to 1 (a valid id) as int32
  assert f"sparse/{f.name}" in err(with_sparse(wrapped))
  item = np.asarray(b["events"][st.name]["item"])
  assert f"events/{st.name}/item" in err(with_event("item", np.full_like(item, st.item_vocab)))
  length = np.asarray(b["events"][st.name]["length"])
  assert f"events/{st.name}/length" in err(with_event("length", np.full_like(length, T + 1)))
  assert f"events/{st.name}/length" in err(with_event("length", np.full_like(length, -1)))
  dense = np.array(b["dense"], np.float32)
  dense[1, 0] = np.nan
  assert "dense" in err(dict(b, dense=dense))
  for s in (len(schema.surfaces), 7, -1):
    assert "surface" in err(dict(b, surface=np.full(3, s, np.int32)))
  assert "request_index" in err(dict(b, request_index=np.array([0, -1, 0])))
  assert art(b)["prob"].shape == (3, len(schema.tasks))          # the valid batch still scores


def test_loader_refuses_params_not_from_the_export(run, tmp_path):
  """params.npz is bound to signature.json by a checksum: zeros of the right shapes refused."""
  _, _, _, _, _, out, sig = run
  assert "params_sha256" in sig
  fake = tmp_path / "fake"
  shutil.copytree(out, fake)
  with np.load(fake / "params.npz") as z:
    zeros = {k: np.zeros_like(z[k]) for k in z.files}
  np.savez(fake / "params.npz", **zeros)
  with pytest.raises(ValueError, match="params.npz") as e:
    loader.load(str(fake))
  assert "\n" not in str(e.value)


def test_export_refuses_a_data_dir_with_other_surfaces(run, tmp_path, capsys):
  """The workdir records the schema's names: --data_dir with other surfaces is one error line."""
  import dataclasses
  schema, config, _, _, workdir, _, _ = run
  wd = str(tmp_path / "wd")
  shutil.copytree(workdir, wd)
  with open(os.path.join(wd, "run_info.json")) as f:
    data_dir = json.load(f)["data_dir"]
  run_info.save_run_info(wd, config, data_dir, schema)
  other = str(tmp_path / "other")
  os.makedirs(other)
  dataclasses.replace(schema, surfaces=schema.surfaces[:-1] + ("shorts",)).save(other)
  capsys.readouterr()
  assert export.main([f"--workdir={wd}", f"--out={tmp_path}/o", f"--data_dir={other}",
                      "--no_verify"]) == 2
  lines = capsys.readouterr().err.strip().splitlines()
  assert "shorts" in lines[-1] and "surfaces" in lines[-1], lines


def test_packed_artifact(run, padded_art, tmp_path, capsys):
  """``--jagged_capacity``: the artifact takes packed request events (capacity recorded in the
  signature) and scores ragged requests, one with no click history, as the padded artifact
  scores each request alone; bad descriptors and a dynamic request count are one-line errors."""
  schema, config, _, _, workdir, _, _ = run
  out = str(tmp_path / "packed")
  sig = export.export(workdir, out, requests=2, jagged_capacity="click=64", verify=False,
                      log=lambda *_: None)
  on_disk = json.load(open(os.path.join(out, "signature.json")))
  assert on_disk["jagged_capacity"] == sig["jagged_capacity"] == {"click": 64}
  assert on_disk["inputs"]["events/click/item"]["shape"] == [64]
  assert on_disk["inputs"]["events/click/offsets"]["shape"] == [3]
  assert on_disk["inputs"]["events/impression/item"]["shape"] == [2, 32]      # padded
  req = random_batch(schema, 2, seq_lens(config), seed=5, min_len=1)
  for v in req["events"]["click"].values():     # request 0: no click history
    v[0] = 0
  ads = random_batch(schema, 2, seq_lens(config), seed=6)
  ads = jax.tree.map(lambda a: np.concatenate([a, a]), ads)     # the same ads for both requests
  ri = np.array([0, 0, 1, 1], np.int32)
  b = score.serving_batch(score.pack_requests(req["events"], {"click": 64}), ads, ri)
  art = loader.load(out)
  got = art(b)["logits"]
  for r in (0, 1):          # reference: the padded artifact (requests=1), one request at a time
    one = {s: {f: a[r:r + 1] for f, a in ev.items()} for s, ev in req["events"].items()}
    want = padded_art(score.serving_batch(one, jax.tree.map(lambda a: a[:2], ads)))["logits"]
    np.testing.assert_allclose(got[2 * r:2 * r + 2], want, rtol=1e-5, atol=1e-5)
  assert np.abs(got[0] - got[2]).max() > 1e-3                  # the request matters

  def err(click, *words):
    with pytest.raises(ValueError) as e:
      art(dict(b, events=dict(b["events"], click=dict(b["events"]["click"], **click))))
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg
  pk = b["events"]["click"]
  n = int(pk["offsets"][-1])
  err({"offsets": np.array([0, n, 0], np.int32)}, "offsets", "monotone")
  err({"seg": np.zeros(64, np.int32)}, "seg / pos")
  err({"length": np.array([1, n - 1], np.int32)}, "length")
  err({"item": pk["item"][:32]}, "events/click/item", "[64]")
  capsys.readouterr()
  for args, msg in ((["--requests=dynamic", "--jagged_capacity=64"], "fixed --requests"),
                    (["--jagged_capacity=click=100"], "multiple of 64")):
    assert export.main([f"--workdir={workdir}", f"--out={tmp_path}/o"] + args) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("kunlun.serving.export: error: ") and msg in lines[-1], lines
  with pytest.raises(ValueError, match="unknown stream"):
    export.parse_jagged_capacity("views=64", schema.stream_names)


def test_loader_casts_then_checks_finiteness(run, padded_art):
  """float64 values that are finite but overflow float32 (1e300 -> inf) are refused in one line
  (before: finiteness was checked before the cast, and the batch scored NaN)."""
  schema, config, _, _, _, _, _ = run
  b = _batch(schema, config, 3)
  st = schema.streams[0].name
  dense = np.array(b["dense"], np.float64)
  dense[2, 1] = 1e300
  age = np.array(b["events"][st]["age"], np.float64)
  age[0, 0] = 1e300
  for batch, name in ((dict(b, dense=dense), "'dense'"),
                      (dict(b, events=dict(b["events"], **{st: dict(b["events"][st], age=age)})),
                       f"'events/{st}/age'")):
    with pytest.raises(ValueError) as e:
      padded_art(batch)
    msg = str(e.value)
    assert name in msg and "float32" in msg and "\n" not in msg, msg
  ok = np.array(b["dense"], np.float64)          # float64 that fits: cast and scored
  assert np.isfinite(padded_art(dict(b, dense=ok))["prob"]).all()


def test_signature_is_bound_and_needs_ranges(run, tmp_path):
  """``signature.json`` carries its own sha256 and that of the exported program: a signature
  that lost ``ranges`` (before: loaded, and scored surface 7 as 0.5), an edited range or a
  swapped program is refused at load in one line."""
  _, _, _, _, _, out, _ = run

  def refused(edit, *words):
    d = tmp_path / f"a{len(list(tmp_path.iterdir()))}"
    shutil.copytree(out, d)
    edit(d)
    with pytest.raises(ValueError) as e:
      loader.load(str(d))
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg

  def edit_sig(change):
    def edit(d):
      sig = json.loads((d / "signature.json").read_text())
      change(sig)
      (d / "signature.json").write_text(json.dumps(sig))
    return edit
  refused(edit_sig(lambda s: s.pop("ranges")), "signature.json", "ranges")
  refused(edit_sig(lambda s: s["ranges"].update(surface=[0, 8])), "signature.json", "sha256")
  refused(edit_sig(lambda s: s["ranges"].pop("surface")), "signature.json")
  refused(edit_sig(lambda s: s.pop("signature_sha256")), "signature.json", "export again")

  def other_program(d):
    data = bytearray((d / "serving.jax_export").read_bytes())
    data[-1] ^= 1
    (d / "serving.jax_export").write_bytes(bytes(data))
  refused(other_program, "serving.jax_export", "sha256")
  loader.load(out)                                  # the export itself still loads


def test_check_packed_kept_len_boundary():
  """A packed request of exactly ``kept_len`` events is accepted, one of ``kept_len + 1`` is
  refused (hand-built descriptor: 2 requests of 16 and 3 events in 64 tokens)."""
  def packed(lengths):
    n = sum(lengths)
    seg = np.full(64, len(lengths), np.int32)
    pos = np.zeros(64, np.int32)
    i = 0
    for r, k in enumerate(lengths):
      seg[i:i + k], pos[i:i + k] = r, np.arange(k)
      i += k
    return {"item": np.arange(64, dtype=np.int32) * (np.arange(64) < n),
            "offsets": np.array([0, lengths[0], n], np.int32), "seg": seg, "pos": pos,
            "length": np.array(lengths, np.int32)}
  loader.check_packed("click", packed([16, 3]), 16)
  loader.check_packed("click", packed([3, 16]), 16)
  with pytest.raises(ValueError, match="request 0 has 17 events, more than the kept length 16"):
    loader.check_packed("click", packed([17, 3]), 16)
  with pytest.raises(ValueError, match="request 1 has 17 events"):
    loader.check_packed("click", packed([3, 17]), 16)
