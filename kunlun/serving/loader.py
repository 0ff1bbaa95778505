"""Runs a serving artifact written by ``kunlun.serving.export`` with jax and numpy only.

  from kunlun.serving.loader import load       # or copy this one file next to the artifact
  scorer = load("runs/tiny_serving")
  out = scorer(batch)     # {"logits": f32[N, K], "prob": f32[N, K]} as numpy

``batch`` is a nested dict of arrays in the layout of ``signature.json`` (its ``usage`` section):
``sparse {name: i32[N, L]}``, ``dense f32[N, F]``, ``surface i32[N]``, ``events {stream:
{field: [R, T], length i32[R]}}``, ``request_index i32[N]``; the streams in the signature's
``jagged_capacity`` come packed (the R requests' events back to back: ``{field: [C], offsets
i32[R+1], seg i32[C], pos i32[C], length i32[R]}``, checked by ``check_packed``); extra keys are
ignored. Inputs are checked against the signature (missing arrays, shapes, dtypes, the
candidate / request counts, each input's value range: ids, surfaces, lengths <= ``kept_len``,
``request_index``; floats finite after the cast to float32) and a mismatch is a ``ValueError``
with one line naming it. ``signature.json`` must match its own ``signature_sha256`` (any edit,
e.g. a lost ``ranges``, is refused), ``serving.jax_export`` and ``params.npz`` its
``artifact_sha256`` and ``params_sha256`` (a program or params from elsewhere are refused).
This module imports nothing of the model code (no flax, no ``kunlun.models.kunlun``, no ``data``).

Categorical features with an exact vocabulary (``signature.json`` ``vocab``, from the dataset's
schema) take their ids from it, as ingestion mapped them::

  ids = scorer.vocab_ids("category", ["cat-03", None, "never seen"])   # -> [5, 0, 1]
"""

from __future__ import annotations

import hashlib
import json
import os

import jax
import numpy as np
from jax import export as jex

FORMAT = "kunlun-serving-v1"
ARTIFACT, PARAMS, SIGNATURE = "serving.jax_export", "params.npz", "signature.json"
REQUIRED = ("inputs", "ranges", "kept_len", "params_sha256", "artifact_sha256",
            "signature_sha256")     # signature.json keys the loader needs


def nest(flat: dict) -> dict:
  """``{"a/b": x}`` -> ``{"a": {"b": x}}`` (the artifact's paths: params.npz keys, inputs)."""
  out = {}
  for path, v in flat.items():
    d = out
    *head, last = path.split("/")
    for k in head:
      d = d.setdefault(k, {})
    d[last] = v
  return out


def _get(batch, path: str):
  x = batch
  for k in path.split("/"):
    if not isinstance(x, dict) or k not in x:
      raise ValueError(f"serving input {path!r} is missing")
    x = x[k]
  return x


def file_sha256(path: str) -> str:
  """Hex sha256 of a file (binds ``params.npz`` to ``signature.json``)."""
  with open(path, "rb") as f:
    return hashlib.file_digest(f, "sha256").hexdigest()


def signature_sha256(sig: dict) -> str:
  """Hex sha256 of ``sig`` without its ``signature_sha256`` key, as canonical JSON (as read back
  from JSON, then sorted keys, no spaces, ASCII): what binds ``signature.json`` to itself."""
  body = json.loads(json.dumps({k: v for k, v in sig.items() if k != "signature_sha256"}))
  text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
  return hashlib.sha256(text.encode()).hexdigest()


def _cast_checked(path: str, x: np.ndarray, dtype: str, rng) -> np.ndarray:
  """``x`` cast to ``dtype``; one-line ValueError when ``x`` holds a value outside ``rng`` =
  [lo, hi) (checked before the cast, so an int64 id that would wrap to int32 is caught) or when a
  float is not finite after it (NaN, inf, or a float64 beyond float32's range)."""
  _check_range(path, x, rng)
  with np.errstate(over="ignore"):               # an overflow becomes inf: refused below
    y = x.astype(dtype)
  if y.dtype.kind == "f" and not np.isfinite(y).all():
    raise ValueError(f"serving input {path!r}: {int((~np.isfinite(y)).sum())} value(s) not "
                     f"finite as {dtype} (NaN, inf, or beyond +-{np.finfo(dtype).max:.3g})")
  return y


def _check_range(path: str, x: np.ndarray, rng) -> None:
  lo, hi = rng if rng is not None else (None, None)
  if x.size == 0 or (lo is None and hi is None):
    return
  mn, mx = x.min(), x.max()
  if (lo is not None and mn < lo) or (hi is not None and mx >= hi):
    want = f"[{'-inf' if lo is None else lo}, {'inf' if hi is None else hi})"
    raise ValueError(f"serving input {path!r}: values must lie in {want}, got [{mn}, {mx}]")


def _string_key(s: str) -> int:
  """A string's 63-bit key (``data.ingest.coerce.hash_strings``: blake2b, 8-byte digest, >> 1)."""
  return int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "little") >> 1


def vocab_ids(entry: dict, values) -> np.ndarray:
  """Raw values of one feature -> ids i64[N] by its exact vocabulary ``entry`` (an item of
  ``signature.json`` ``vocab``), as ``data.ingest`` mapped them (``data.ingest.vocab.ids_for``):
  None -> ``null_id``, a value not in ``values`` -> ``oov_id``, ``values[i]`` ->
  ``first_id + i``. Strings are compared by their 63-bit key, integers as int64."""
  vals = list(values)
  if entry["kind"] == "string":
    key = lambda xs: [_string_key(str(x)) for x in xs]
  else:
    key = lambda xs: np.asarray(xs, np.int64).tolist()
  table = {}
  for i, k in enumerate(key(entry["values"])):
    table.setdefault(k, entry["first_id"] + i)
  present = [v for v in vals if v is not None]
  got = iter([table.get(k, entry["oov_id"]) for k in key(present)] if present else [])
  return np.array([entry["null_id"] if v is None else next(got) for v in vals], np.int64)


def check_packed(stream: str, ev: dict, kept_len: int | None = None) -> None:
  """One packed stream of a serving batch (the R requests' events back to back, layout of
  ``data/schema.py``): token fields ``[C]``, ``offsets i32[R+1]``, ``seg``/``pos i32[C]``,
  ``length i32[R]``. ValueError with one line on a bad descriptor: a capacity C not a multiple of
  64, offsets not starting at 0, not monotone or past C, seg/pos that do not follow the offsets,
  length != diff(offsets), a request over ``kept_len`` events."""
  p = f"events[{stream!r}]"
  missing = [k for k in ("offsets", "seg", "pos", "length") if k not in ev]
  if missing:
    raise ValueError(f"{p}: packed stream lacks {missing}")
  off, seg, pos, length = (np.asarray(ev[k]) for k in ("offsets", "seg", "pos", "length"))
  if any(a.ndim != 1 or a.dtype.kind not in "iu" for a in (off, seg, pos, length)):
    raise ValueError(f"{p}: offsets, seg, pos and length must be 1-d integer arrays")
  R, C = length.shape[0], seg.shape[0]
  if C % 64 or C < 64:
    raise ValueError(f"{p}: capacity {C} (tokens) must be a positive multiple of 64")
  bad = {k: np.shape(a) for k, a in ev.items() if k not in ("offsets", "length")
         and np.shape(a) != (C,)}
  if bad:
    raise ValueError(f"{p}: token fields, seg and pos must all be [{C}], got {bad}")
  if off.shape[0] != R + 1:
    raise ValueError(f"{p}: offsets has {off.shape[0]} entries, want R + 1 = {R + 1}")
  d = np.diff(off.astype(np.int64))
  if off[0] != 0 or (d < 0).any() or off[-1] > C:
    raise ValueError(f"{p}: offsets must start at 0, be monotone and end <= capacity {C}, got "
                     f"{off.tolist() if R <= 8 else f'[{off[0]}, ..., {off[-1]}]'}")
  if (length != d).any():
    raise ValueError(f"{p}: length != offsets[1:] - offsets[:-1] at request "
                     f"{int(np.flatnonzero(length != d)[0])}")
  n = int(off[-1])
  want_seg = np.full(C, R, np.int64)
  want_seg[:n] = np.repeat(np.arange(R), d)
  want_pos = np.zeros(C, np.int64)
  want_pos[:n] = np.arange(n) - off[want_seg[:n]]
  if (seg != want_seg).any() or (pos != want_pos).any():
    raise ValueError(f"{p}: seg / pos do not match offsets (seg: each token's request, R = {R} "
                     "for padding; pos: its index in the request, 0 for padding)")
  if kept_len is not None and R and d.max() > kept_len:
    raise ValueError(f"{p}: request {int(np.argmax(d))} has {int(d.max())} events, more than "
                     f"the kept length {kept_len}")


class ServingArtifact:
  """A loaded artifact: ``__call__(batch) -> {"logits", "prob"}`` (numpy)."""

  def __init__(self, directory: str):
    for f in (ARTIFACT, PARAMS, SIGNATURE):
      if not os.path.exists(os.path.join(directory, f)):
        raise FileNotFoundError(f"{directory}: no {f} (not a kunlun.serving.export output)")
    self.signature = sig = _load_signature(directory)
    for name, key in ((ARTIFACT, "artifact_sha256"), (PARAMS, "params_sha256")):
      if file_sha256(os.path.join(directory, name)) != sig[key]:
        raise ValueError(f"{directory}: {name} does not match {SIGNATURE} (sha256 differs): "
                         "not the file this artifact was exported with")
    with open(os.path.join(directory, ARTIFACT), "rb") as f:
      self.exported = jex.deserialize(bytearray(f.read()))
    with np.load(os.path.join(directory, PARAMS)) as z:
      flat = {k: z[k] for k in z.files}
    p_avals = self.exported.in_avals[:len(flat)]
    leaves, tree = jax.tree.flatten(nest(flat))
    # the params' leaves come first in the exported (params, batch) argument order
    self._params = jax.tree.unflatten(tree, [
        np.asarray(x, a.dtype) for x, a in zip(leaves, p_avals, strict=True)])
    self._params = jax.device_put(self._params)

  @property
  def inputs(self) -> dict:
    return self.signature["inputs"]

  def vocab_ids(self, feature: str, values) -> np.ndarray:
    """``vocab_ids`` with the artifact's vocabulary of sparse feature ``feature``."""
    vocab = self.signature.get("vocab", {})
    if feature not in vocab:
      raise ValueError(f"sparse feature {feature!r} has no exact vocabulary in this artifact "
                       f"(those with one: {sorted(vocab)})")
    return vocab_ids(vocab[feature], values)

  def _check(self, batch) -> dict:
    dims, flat = {}, {}
    for path, s in self.inputs.items():
      x = np.asarray(_get(batch, path))
      want = s["shape"]
      if x.ndim != len(want):
        raise ValueError(f"serving input {path!r}: rank {x.ndim}, want shape {want}")
      for got, w in zip(x.shape, want, strict=True):
        if isinstance(w, str):
          if dims.setdefault(w, got) != got:
            raise ValueError(f"serving input {path!r}: dimension {w!r} = {got} but "
                             f"{dims[w]} elsewhere (shape {list(x.shape)}, want {want})")
        elif got != w:
          raise ValueError(f"serving input {path!r}: shape {list(x.shape)}, want {want}")
      kind = np.dtype(s["dtype"]).kind
      if kind == "i" and x.dtype.kind not in "iu":
        raise ValueError(f"serving input {path!r}: integer ids expected, got {x.dtype}")
      if kind == "f" and x.dtype.kind not in "iuf":
        raise ValueError(f"serving input {path!r}: numbers expected, got {x.dtype}")
      flat[path] = _cast_checked(path, x, s["dtype"], self.signature["ranges"][path])
    for name, size in dims.items():
      if size < 1:
        raise ValueError(f"serving inputs: dimension {name!r} must be >= 1, got {size}")
    ri = flat["request_index"]
    r = next(np.shape(v)[0] for p, v in flat.items()
             if p.startswith("events/") and p.endswith("/length"))
    for stream in self.signature.get("jagged_capacity", {}):
      p = f"events/{stream}/"
      check_packed(stream, {k[len(p):]: v for k, v in flat.items() if k.startswith(p)},
                   self.signature["kept_len"][stream])
    if ri.size and (ri.min() < 0 or ri.max() >= r):
      raise ValueError(f"request_index must lie in [0, {r}) (the request rows), got "
                       f"[{ri.min()}, {ri.max()}]")
    return nest(flat)

  def __call__(self, batch) -> dict:
    out = self.exported.call(self._params, self._check(batch))
    return {k: np.asarray(v) for k, v in out.items()}


def _load_signature(directory: str) -> dict:
  """``signature.json`` of ``directory``: its format, the keys of ``REQUIRED``, a range for every
  input, and its own ``signature_sha256`` (one-line ValueErrors)."""
  path = os.path.join(directory, SIGNATURE)
  try:
    with open(path) as f:
      sig = json.load(f)
  except ValueError as e:
    raise ValueError(f"{path}: not valid JSON ({e})") from None
  if not isinstance(sig, dict) or sig.get("format") != FORMAT:
    got = sig.get("format") if isinstance(sig, dict) else type(sig).__name__
    raise ValueError(f"{directory}: format {got!r}, want {FORMAT!r}")
  missing = [k for k in REQUIRED if k not in sig]
  if missing:
    raise ValueError(f"{path}: no {', '.join(missing)} (edited, or an older export: export "
                     "again)")
  if signature_sha256(sig) != sig["signature_sha256"]:
    raise ValueError(f"{path}: its content does not match its signature_sha256 (the file was "
                     "edited after the export: export again)")
  unranged = sorted(set(sig["inputs"]) - set(sig["ranges"]))
  if unranged:
    raise ValueError(f"{path}: no value range for input(s) {unranged}")
  return sig


def load(directory: str) -> ServingArtifact:
  return ServingArtifact(directory)
