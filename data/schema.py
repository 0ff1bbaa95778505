"""Declarative dataset schema (saved as ``schema.json`` beside the data).

The schema is the contract between the data pipeline and the model. It names the sparse
(categorical) features, the dense features, the event streams with their per-event fields,
the surfaces and the tasks. Model configs are checked against it (``check_model_config``); the
kept sequence lengths with ``check_seq_lens``.

Batch layout produced by ``data.pipeline`` (and by ``data.fake.random_batch`` in tests); every
array has a leading batch dimension B and a static shape::

    dense        f32[B, F_dense]           raw dense values (finite); the model normalises them
    sparse       {name: i32[B, max_len]}   ids in [0, vocab_size); -1 marks an empty slot
    surface      i32[B]                    index into ``schema.surfaces``
    events       {stream: {
        item       i32[B, T]               item / ad id in [0, item_vocab)
        action     i32[B, T]               action type in [0, action_vocab)
        surface    i32[B, T]               surface of the event in [0, len(surfaces))
        age        f32[B, T]               request time - event time, seconds, >= 0
        <field>    i32[B, T]               each extra categorical field, in [0, vocab_size)
        length     i32[B]                  number of valid events; valid ones are [0, length)
    }}                                     events are time-ordered (oldest first); the most
                                           recent ``T`` are kept; padded slots are 0 / 0.0
    labels       f32[B, K]                 0/1 per task (K = len(tasks))
    label_mask   f32[B, K]                 1 where the label is valid, else 0
    true_prob    f32[B, K]                 planted probabilities (synthetic data), NaN if unknown
    user_id      i32[B]                    join keys (knowledge transfer)
    ad_id        i32[B]
    request_ts   i32[B]                    request time, seconds
    example_mask f32[B]                    1 = real example, 0 = padding (last eval batch)

``T`` for a stream is the model's kept length for that stream (<= ``EventStream.max_len``).

Packed ("jagged") streams (opt-in ``jagged_capacity={stream: N}`` of ``data.pipeline``; issue #28;
``data.jagged``): such a stream's ``events[stream]`` is instead, at a static capacity N tokens
(a multiple of 64) per process-local batch::

        item, action, surface, <field>   i32[N]   example 0's kept events (its padded row's
        age                              f32[N]   order), then example 1's, ..., then 0 / 0.0
        offsets    i32[B+1]   example b owns tokens [offsets[b], offsets[b+1]); offsets[0] = 0,
                              offsets[B] = real tokens <= N; empty history: equal offsets
        seg        i32[N]     example of each token; B for padding tokens
        pos        i32[N]     position within its example, 0..length-1 (its padded-row index);
                              0 for padding
        length     i32[B]     offsets[1:] - offsets[:-1], after any drop

A batch with more than N events keeps the most recent ones: the oldest events of the longest
histories are dropped (positions restart at 0, as if the padded row had been truncated) and
counted (``data.pipeline.dropped_events``). ``offsets`` and the token fields do not have the
leading batch dimension B.

On a mesh that splits the batch (``jagged_shards`` S = the batch x context shards of a process's
devices, ``kunlun.train.capacity.local_blocks``) the buffer is S consecutive blocks, block s a
complete packed buffer as above of N / S tokens (a multiple of 64) for examples ``[s B/S, (s+1)
B/S)``: ``offsets i32[S (B/S + 1)]``, ``seg`` and ``offsets`` local to the block (``seg`` B/S for
padding). Every array then splits evenly over the batch shards; S = 1 is the layout above. The
model reads S off the shapes, ``len(offsets) - B``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import re
from typing import Any

NULL_ID, OOV_ID, FIRST_ID = 0, 1, 2   # exact-vocabulary ids: null, out of vocabulary, vocab[0]

# Upper bounds of the schema's sizes, checked whenever a schema is made (loaded, inferred by
# data.ingest): each becomes an allocation, so a larger number is an edit gone wrong, refused in
# one line rather than met as an out-of-memory traceback. MAX_VOCAB_SIZE: rows of one embedding
# table (vocab_size, item_vocab, action_vocab, an event field's vocab_size): 2**27 = 134M rows,
# 32 GiB at dim 64 in f32 to shard over the mesh, 32x data.ingest's largest hashed table; ids
# stay well inside int32. MAX_LEN: ids of a sparse feature and events of a stream per example
# (a batch holds [B, max_len] of each).
MAX_VOCAB_SIZE = 1 << 27
MAX_LEN = 1 << 16

# A name from the data (surface, task, stream, feature, event field) becomes part of file names
# (shards, plots) and queries: a letter, digit or _ first, then letters, digits, _ . + -
# (Unicode letters allowed), at most 100 characters; never a path.
_SAFE_NAME = re.compile(r"\w[\w.+\-]{0,99}")


def check_size(value, where: str, hi: int) -> int:
  """``value`` if it is an integer in ``[1, hi]``, else a one-line ``ValueError`` naming it."""
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 1 <= value <= hi:
    raise ValueError(f"{where} = {value!r} must be an integer in [1, {hi}]")
  return int(value)


def check_name(name, where: str) -> str:
  """``name`` if it is a safe name (``_SAFE_NAME``), else a one-line ``ValueError`` naming it."""
  if not isinstance(name, str) or not _SAFE_NAME.fullmatch(name):
    raise ValueError(f"{where}: {name!r} is not a safe name (a letter, digit or _ first, then "
                     "letters, digits, _ . + -; at most 100 characters): rename it")
  return name


@dataclasses.dataclass(frozen=True)
class SparseFeature:
  """A categorical feature. ``max_len > 1`` makes it multi-hot (pooled by the model).

  ``hashed``: raw ids are arbitrary non-negative integers, hashed into ``[0, vocab_size)`` by
  the pipeline; otherwise an id outside ``[0, vocab_size)`` is invalid input.
  ``vocab``: the exact vocabulary ``data.ingest`` mapped the column's values with (value ->
  id ``FIRST_ID + position``; ``NULL_ID`` = null, ``OOV_ID`` = out of vocabulary;
  ``data.ingest.vocab``), or None.
  """
  name: str
  vocab_size: int
  max_len: int = 1
  hashed: bool = False
  vocab: tuple | None = None


@dataclasses.dataclass(frozen=True)
class EventField:
  """An extra categorical field carried by every event of a stream."""
  name: str
  vocab_size: int


@dataclasses.dataclass(frozen=True)
class EventStream:
  """A user event stream (ads clicked, ads impressed, organic engaged, ...)."""
  name: str
  max_len: int
  item_vocab: int
  action_vocab: int
  extra_fields: tuple[EventField, ...] = ()


@dataclasses.dataclass(frozen=True)
class Task:
  """A binary prediction task. ``always_valid=False`` means labels carry a validity mask."""
  name: str
  always_valid: bool = True


@dataclasses.dataclass(frozen=True)
class Schema:
  sparse: tuple[SparseFeature, ...]
  dense: tuple[str, ...]
  streams: tuple[EventStream, ...]
  surfaces: tuple[str, ...]
  tasks: tuple[Task, ...]

  def __post_init__(self):
    for kind, names in (("sparse", [f.name for f in self.sparse]), ("dense", self.dense),
                        ("streams", [s.name for s in self.streams]),
                        ("surfaces", self.surfaces), ("tasks", [t.name for t in self.tasks])):
      for n in names:
        check_name(n, f"schema.{kind}")
    for s in self.streams:
      for e in s.extra_fields:
        check_name(e.name, f"schema.streams[{s.name}].extra_fields")
    for kind, items in (("sparse", self.sparse), ("streams", self.streams), ("tasks", self.tasks)):
      names = [x.name for x in items]
      if len(set(names)) != len(names):
        raise ValueError(f"schema.{kind}: duplicate names in {names}")
    if len(set(self.surfaces)) != len(self.surfaces) or not self.surfaces:
      raise ValueError(f"schema.surfaces must be unique and non-empty, got {self.surfaces}")
    if not self.tasks:
      raise ValueError("schema.tasks must be non-empty")
    if not self.sparse and not self.dense:
      raise ValueError("schema: no sparse or dense feature; the model's context encoder needs "
                       "at least one")
    for f in self.sparse:
      check_size(f.vocab_size, f"schema.sparse[{f.name}].vocab_size", MAX_VOCAB_SIZE)
      check_size(f.max_len, f"schema.sparse[{f.name}].max_len", MAX_LEN)
      if f.vocab is not None and (f.hashed or f.vocab_size != len(f.vocab) + 2
                                  or len(set(f.vocab)) != len(f.vocab)):
        raise ValueError(f"schema.sparse[{f.name}]: a vocab needs hashed: false, distinct values "
                         "and vocab_size = len(vocab) + 2 (null and out-of-vocabulary ids)")
    for s in self.streams:
      check_size(s.max_len, f"schema.streams[{s.name}].max_len", MAX_LEN)
      for k, v in [("item_vocab", s.item_vocab), ("action_vocab", s.action_vocab)] + [
          (f"extra_fields[{e.name}].vocab_size", e.vocab_size) for e in s.extra_fields]:
        check_size(v, f"schema.streams[{s.name}].{k}", MAX_VOCAB_SIZE)

  @property
  def task_names(self) -> tuple[str, ...]:
    return tuple(t.name for t in self.tasks)

  @property
  def stream_names(self) -> tuple[str, ...]:
    return tuple(s.name for s in self.streams)

  def stream(self, name: str) -> EventStream:
    for s in self.streams:
      if s.name == name:
        return s
    raise KeyError(f"unknown event stream {name!r}; schema has {self.stream_names}")

  # ---- serialisation -------------------------------------------------------------------------
  def to_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    for f in d["sparse"]:                  # no exact vocabulary: the key stays out of schema.json
      if f.get("vocab") is None:
        f.pop("vocab", None)
      else:
        f["vocab"] = list(f["vocab"])
    return d

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "Schema":
    try:
      return cls(
          sparse=tuple(SparseFeature(**{**f, "vocab": None if f.get("vocab") is None
                                        else tuple(f["vocab"])}) for f in d["sparse"]),
          dense=tuple(d["dense"]),
          streams=tuple(
              EventStream(**{**s, "extra_fields": tuple(EventField(**e)
                                                        for e in s.get("extra_fields", ()))})
              for s in d["streams"]),
          surfaces=tuple(d["surfaces"]),
          tasks=tuple(Task(**t) for t in d["tasks"]),
      )
    except (KeyError, TypeError) as e:
      raise ValueError(f"malformed schema: {e}") from e

  def save(self, directory: str) -> str:
    path = os.path.join(directory, "schema.json")
    with open(path, "w") as f:
      json.dump(self.to_dict(), f, indent=2)
    return path

  @classmethod
  def load(cls, path: str) -> "Schema":
    if os.path.isdir(path):
      path = os.path.join(path, "schema.json")
    if not os.path.exists(path):
      raise FileNotFoundError(f"no schema.json at {path}")
    with open(path) as f:
      try:
        d = json.load(f)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from e
    return cls.from_dict(d)


def check_seq_lens(schema: Schema, seq_lens: dict[str, int]) -> dict[str, int]:
  """Validates the model's kept length per stream; returns ``{stream: T}`` for every stream.

  A stream missing from ``seq_lens`` keeps ``max_len``. Unknown stream names, non-positive
  lengths or lengths above the stream's ``max_len`` are a ValueError naming the stream.
  """
  out = {}
  unknown = sorted(set(seq_lens) - set(schema.stream_names))
  if unknown:
    raise ValueError(f"seq_lens: unknown event stream(s) {unknown}; "
                     f"schema has {schema.stream_names}")
  for s in schema.streams:
    T = seq_lens.get(s.name, s.max_len)
    if isinstance(T, bool) or not isinstance(T, (int,)) and not hasattr(T, "__index__"):
      raise ValueError(f"seq_lens[{s.name!r}] must be an int, got {T!r}")
    T = int(T)
    if T <= 0 or T > s.max_len:
      raise ValueError(f"seq_lens[{s.name!r}] = {T} must be in [1, {s.max_len}] "
                       f"(the stream's max_len in the schema)")
    out[s.name] = T
  return out


def surface_weights(value, surfaces, counts: dict[str, int] | None = None) -> dict[str, float]:
  """``data.surface_weights`` -> ``{surface: weight}`` for every schema surface.

  ``value``: a mapping, a string ``"feed=0.5,reels=0.2"``, or ``"auto"`` / ``""`` (each surface in
  proportion to its record count, ``counts``). Surfaces not named get weight 0; names that are not
  schema surfaces are ignored when their weight is 0 and a ValueError otherwise (likely a typo or
  another dataset's surfaces). Weights must be finite and >= 0 with a positive sum.
  """
  if value is None or (isinstance(value, str) and value.strip().lower() in ("", "auto")):
    if counts is None:
      raise ValueError("data.surface_weights='auto' needs the surfaces' record counts")
    w = {s: float(counts.get(s, 0)) for s in surfaces}
    if sum(w.values()) <= 0:
      raise ValueError("data.surface_weights='auto': the split has no records")
    return w
  if isinstance(value, str):
    w = {}
    for part in value.split(","):
      name, sep, x = part.partition("=")
      try:
        if not sep or not name.strip():
          raise ValueError
        w[name.strip()] = float(x)
      except ValueError:
        raise ValueError(f"data.surface_weights={value!r}: expected 'auto' or "
                         "'surface=weight,...'") from None
  else:
    try:
      w = {str(k): float(v) for k, v in dict(value).items()}
    except (TypeError, ValueError):
      raise ValueError(f"data.surface_weights={value!r}: expected a mapping surface -> weight, "
                       "'surface=weight,...' or 'auto'") from None
  unknown = sorted(k for k, v in w.items() if k not in surfaces and v != 0)
  if unknown:
    raise ValueError(f"data.surface_weights: unknown surface(s) {unknown} with a non-zero weight; "
                     f"schema has {tuple(surfaces)} (set them to 0, or use 'auto')")
  bad = sorted(k for k, v in w.items() if not math.isfinite(v))
  if bad:
    raise ValueError(f"data.surface_weights: weight(s) of {bad} are not finite numbers "
                     f"(got {w}); give finite weights >= 0")
  out = {s: w.get(s, 0.0) for s in surfaces}
  if any(x < 0 for x in out.values()) or sum(out.values()) <= 0:
    raise ValueError(f"data.surface_weights must be >= 0 with a positive sum over the schema's "
                     f"surfaces {tuple(surfaces)}, got {w}")
  return out
