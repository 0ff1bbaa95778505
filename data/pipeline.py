"""grain input pipeline: ArrayRecord shards -> numpy batches in the ``data.schema`` layout.

Train::

    per surface: MapDataset.source(records).seed.shuffle.repeat -> [shard_index::shard_count]
                 -> decode + validate + truncate (ReadOptions threads) -> to_iter_dataset
    IterDataset.mix({surface: ds}, data_cfg.surface_weights)    # per-surface state: weights may
    -> batch(B_local, drop_remainder, collate)                  # change on resume
       (collate pads each stream to its static length and optionally balances lengths)

Eval: every record of the split once, in stored order (surfaces in schema order, files in order),
rows ``shard_index::shard_count`` per process, padded up to whole batches (``example_mask`` 0).

Iterators support ``get_state``/``set_state`` and ``grain.checkpoint.CheckpointSave/Restore``.
"""

from __future__ import annotations

import grain
import jax
import numpy as np

from data import records
from data.schema import Schema, check_seq_lens
from data.validate import InvalidCounter, InvalidRecordError, Validator

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def hash_ids(ids: np.ndarray, vocab_size: int) -> np.ndarray:
  """Deterministic hash of non-negative int64 ids into ``[0, vocab_size)`` (multiplicative)."""
  with np.errstate(over="ignore"):
    h = ids.astype(np.uint64) * _GOLDEN
  return ((h >> np.uint64(29)) % np.uint64(vocab_size)).astype(np.int32)


class Decode:
  """``(file_id, local_index, bytes) -> example dict`` (or None when skipped as invalid).

  Validates against the schema, hashes hashed sparse features, pads sparse features to
  ``max_len`` with -1 and keeps the most recent ``seq_lens[s]`` events of each stream.
  """

  def __init__(self, schema: Schema, seq_lens: dict[str, int], paths: list[str],
               file_surface: list[int], counter: InvalidCounter | None):
    self.schema, self.seq_lens, self.paths = schema, seq_lens, paths
    self.file_surface, self.counter = file_surface, counter
    self.validator = Validator(schema)

  def __call__(self, item):
    f, j, raw = item
    try:
      rec = self.validator(raw, file=self.paths[f], index=j, surface=self.file_surface[f])
    except InvalidRecordError as e:
      if self.counter is None:
        raise
      self.counter.add(e)
      return None
    return self.example(rec)

  def example(self, rec: dict) -> dict:
    """Raw sparse ids (hashed and padded per batch by ``Collate``), most recent T events."""
    return {
        "dense": rec["dense"], "surface": rec["surface"],
        "sparse": {f.name: rec[f"sparse/{f.name}"] for f in self.schema.sparse},
        "events": {s: rec[f"events/{s}"][-T:] for s, T in self.seq_lens.items()},
        "labels": rec["labels"], "label_mask": rec["label_mask"], "true_prob": rec["true_prob"],
        "user_id": rec["user_id"], "ad_id": rec["ad_id"], "request_ts": rec["request_ts"],
    }


def empty_example(schema: Schema, seq_lens: dict[str, int]) -> dict:
  """A padding example (all zeros, no events, no valid labels)."""
  K = len(schema.tasks)
  return {
      "dense": np.zeros(len(schema.dense), np.float32),
      "sparse": {f.name: np.zeros(0, np.int64) for f in schema.sparse},
      "surface": np.int32(0),
      "events": {s.name: np.zeros((0, len(records.event_columns(s))), np.int32)
                 for s in schema.streams if s.name in seq_lens},
      "labels": np.zeros(K, np.float32), "label_mask": np.zeros(K, np.float32),
      "true_prob": np.zeros(K, np.float32), "user_id": np.int32(0), "ad_id": np.int32(0),
      "request_ts": np.int32(0), "_pad": True,
  }


def balance_order(total_len: np.ndarray, groups: int) -> np.ndarray:
  """Base Batch Shuffling: a permutation that deals examples sorted by total sequence length
  to ``groups`` contiguous slices in snake order, so every slice (device) gets heavy and light
  examples and similar total length."""
  B = len(total_len)
  if groups <= 1 or B % groups:
    groups = 1
  order = np.argsort(-total_len, kind="stable")
  rnd = np.arange(B) // groups
  pos = np.arange(B) % groups
  slot = np.where(rnd % 2 == 0, pos, groups - 1 - pos)   # snake: 0..g-1, g-1..0, ...
  buckets = [order[slot == g] for g in range(groups)]
  return np.concatenate(buckets)


class Collate:
  """List of examples -> batch dict (``data.schema`` layout), padded to ``batch_size`` rows."""

  def __init__(self, schema: Schema, seq_lens: dict[str, int], batch_size: int,
               balance_groups: int = 0):
    self.schema, self.seq_lens, self.B = schema, seq_lens, batch_size
    self.balance_groups = balance_groups
    self.pad = empty_example(schema, seq_lens)
    self.cols = {s.name: records.event_columns(s) for s in schema.streams}

  def _sparse(self, feat, ids: list[np.ndarray]) -> np.ndarray:
    """Raw id lists -> i32[B, max_len], hashed if ``feat.hashed``, -1 = empty slot."""
    lens = np.array([len(x) for x in ids])
    flat = np.concatenate(ids) if lens.sum() else np.zeros(0, np.int64)
    out = np.full((self.B, feat.max_len), -1, np.int32)
    out[np.arange(feat.max_len)[None, :] < lens[:, None]] = (
        hash_ids(flat, feat.vocab_size) if feat.hashed else flat)
    return out

  def __call__(self, examples: list[dict]) -> dict:
    n = len(examples)
    mask = np.zeros(self.B, np.float32)
    mask[:n] = [0.0 if e.get("_pad") else 1.0 for e in examples]
    examples = list(examples) + [self.pad] * (self.B - n)
    if self.balance_groups:
      tot = np.array([sum(len(v) for v in e["events"].values()) for e in examples])
      order = balance_order(tot, self.balance_groups)
      examples, mask = [examples[i] for i in order], mask[order]
    st = lambda k, dt: np.asarray([e[k] for e in examples], dt)
    out = {"dense": np.stack([e["dense"] for e in examples]),
           "sparse": {f.name: self._sparse(f, [e["sparse"][f.name] for e in examples])
                      for f in self.schema.sparse},
           "surface": st("surface", np.int32), "labels": np.stack([e["labels"] for e in examples]),
           "label_mask": np.stack([e["label_mask"] for e in examples]),
           "true_prob": np.stack([e["true_prob"] for e in examples]),
           "user_id": st("user_id", np.int32), "ad_id": st("ad_id", np.int32),
           "request_ts": st("request_ts", np.int32), "example_mask": mask, "events": {}}
    for s, T in self.seq_lens.items():
      cols = self.cols[s]
      buf = np.zeros((self.B, T, len(cols)), np.int32)
      length = np.zeros(self.B, np.int32)
      for b, e in enumerate(examples):
        ev = e["events"][s]
        buf[b, :len(ev)] = ev
        length[b] = len(ev)
      valid = np.arange(T)[None, :] < length[:, None]
      ev_out = {c: np.ascontiguousarray(buf[:, :, i]) for i, c in enumerate(cols) if c != "ts"}
      age = out["request_ts"][:, None].astype(np.int64) - buf[:, :, 3]
      ev_out["age"] = np.where(valid, age, 0).astype(np.float32)
      ev_out["length"] = length
      out["events"][s] = ev_out
    return out


class _EvalItem:
  """Eval row ``j`` of this process -> global record ``shard_index + j * shard_count`` or pad."""

  def __init__(self, src: records.RecordSource, decode: Decode, pad: dict, shard_index: int,
               shard_count: int):
    self.src, self.decode, self.pad = src, decode, pad
    self.shard_index, self.shard_count = shard_index, shard_count

  def __call__(self, j: int):
    i = self.shard_index + int(j) * self.shard_count
    return self.decode(self.src[i]) if i < len(self.src) else self.pad




def invalid_counter(ds) -> InvalidCounter | None:
  """The ``InvalidCounter`` of a dataset built with ``skip_invalid=True`` (in-process workers;
  under ``mp_prefetch`` each worker process keeps its own count)."""
  return getattr(ds, "invalid_counter", None)


def _get(cfg, name, default):
  return cfg.get(name, default) if hasattr(cfg, "get") else getattr(cfg, name, default)


def make_dataset(data_cfg, data_dir: str, split: str, seq_lens: dict[str, int], *, train: bool,
                 shard_index: int | None = None, shard_count: int | None = None):
  """grain ``IterDataset`` of numpy batches (``data.schema`` layout plus ``example_mask``).

  data_cfg fields: batch_size (global), surface_weights, shuffle_seed, num_threads, prefetch,
  skip_invalid, length_balance (and optional length_balance_groups, default: local devices).
  Per-process batch = batch_size // shard_count. ``ds.invalid_counter`` counts skipped records
  (``None`` unless skip_invalid). Eval: ``num_eval_batches`` batches per process; with skipped
  invalid records the processes may end up with different batch counts.
  """
  schema = Schema.load(data_dir)
  seq_lens = check_seq_lens(schema, dict(seq_lens))
  if shard_index is None or shard_count is None:
    shard_index, shard_count = jax.process_index(), jax.process_count()
  if not 0 <= shard_index < shard_count:
    raise ValueError(f"shard_index {shard_index} not in [0, shard_count={shard_count})")
  gbs = int(data_cfg.batch_size)
  if gbs <= 0 or gbs % shard_count:
    raise ValueError(f"data.batch_size {gbs} must be a positive multiple of the process "
                     f"count {shard_count}")
  B = gbs // shard_count
  files = records.split_files(data_dir, split, schema)
  counter = InvalidCounter() if _get(data_cfg, "skip_invalid", False) else None
  read = grain.ReadOptions(num_threads=int(_get(data_cfg, "num_threads", 2)),
                           prefetch_buffer_size=int(_get(data_cfg, "prefetch", 4)))
  groups = 0
  if _get(data_cfg, "length_balance", False):
    groups = int(_get(data_cfg, "length_balance_groups", 0) or jax.local_device_count())
  collate = Collate(schema, seq_lens, B, groups)

  if train:
    weights = {k: float(v) for k, v in dict(data_cfg.surface_weights).items()}
    unknown = sorted(set(weights) - set(schema.surfaces))
    if unknown:
      raise ValueError(f"data.surface_weights: unknown surface(s) {unknown}; "
                       f"schema has {schema.surfaces}")
    if any(w < 0 for w in weights.values()) or sum(weights.values()) <= 0:
      raise ValueError(f"data.surface_weights must be >= 0 with a positive sum, got {weights}")
    seed = int(_get(data_cfg, "shuffle_seed", 0))
    parents, mix_w = {}, {}
    for si, surface in enumerate(schema.surfaces):
      if weights.get(surface, 0.0) <= 0:
        continue
      flist = files.get(surface, [])
      src = records.RecordSource(flist)
      if len(src) < shard_count:
        raise ValueError(f"{data_dir}/{split}: surface {surface!r} has {len(src)} records, "
                         f"fewer than the {shard_count} processes, but weight {weights[surface]}")
      decode = Decode(schema, seq_lens, [p for p, _ in flist], [si] * len(flist), counter)
      ds = grain.MapDataset.source(src).seed(seed * 7919 + si).shuffle().repeat()
      ds = ds[shard_index::shard_count].map(decode)
      parents[surface] = ds.to_iter_dataset(read)
      mix_w[surface] = weights[surface]
    ds = grain.IterDataset.mix(parents, mix_w)
    ds = ds.batch(B, drop_remainder=True, batch_fn=collate)
  else:
    flist, fsurf = [], []
    for si, surface in enumerate(schema.surfaces):
      flist += files.get(surface, [])
      fsurf += [si] * len(files.get(surface, []))
    src = records.RecordSource(flist)
    decode = Decode(schema, seq_lens, [p for p, _ in flist], fsurf, counter)
    n_local = -(-len(src) // shard_count)                   # rows of the largest process
    n_rows = -(-n_local // B) * B
    item = _EvalItem(src, decode, collate.pad, shard_index, shard_count)
    ds = grain.MapDataset.range(n_rows).map(item).to_iter_dataset(read)
    ds = ds.batch(B, drop_remainder=False, batch_fn=collate)
  ds.invalid_counter = counter
  return ds


def device_put_batch(batch: dict, sharding) -> dict:
  """Process-local numpy batch -> global jax arrays (leading axis sharded by ``sharding``)."""
  return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), batch)


def num_eval_batches(data_dir: str, split: str, batch_size: int, shard_count: int = 1) -> int:
  """Number of batches ``make_dataset(train=False)`` yields per process (no skipped records)."""
  schema = Schema.load(data_dir)
  n = sum(c for fl in records.split_files(data_dir, split, schema).values() for _, c in fl)
  rows = -(-n // shard_count)                        # rows of the largest process
  return -(-rows // (batch_size // shard_count))


__all__ = ["make_dataset", "device_put_batch", "invalid_counter", "hash_ids", "balance_order",
           "num_eval_batches", "Decode", "Collate"]
