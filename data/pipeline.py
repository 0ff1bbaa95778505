"""grain input pipeline: ArrayRecord shards -> numpy batches in the ``data.schema`` layout.

Train (``data.elastic.TrainPlan``; state independent of the process count, see there)::

    global position p -> surface by surface_weights (hash of shuffle_seed, p) -> that surface's
    next record in a per-epoch permutation -> process k reads its B = G / K rows of every step
    rows -> batched ArrayRecord read -> BatchValidator (vectorised decode + validate + truncate)
         -> Collate (hash, pad, ages, optional length balancing)     (num_threads, prefetch)

Eval (``data.elastic.EvalPlan``): every record of the split once, in stored order (surfaces in
schema order, files in order), rows ``shard_index::shard_count`` per process, padded up to whole
batches (``example_mask`` 0).

Invalid records under ``skip_invalid`` keep their row as padding (``example_mask`` 0) and are
counted; so are records in a damaged chunk (kind ``bytes``, ``data.shards``), which otherwise
raise a ``DamagedChunkError`` naming the file and the chunk's record range. Iterators support
``get_state``/``set_state``, ``grain.checkpoint.CheckpointSave/Restore`` and (for a changed
process count) ``data.elastic.CheckpointSave/Restore``; ``mp_prefetch`` works
(``invalid_counts(iterator)`` adds up the workers' skip counts). Opt-in ``jagged_capacity``
packs streams (``data.jagged``); ``dropped_events(iterator)`` counts the events over capacity.
"""

from __future__ import annotations

import jax
import numpy as np

from data import elastic, jagged, records
from data.hashing import hash_ids
from data.schema import Schema, check_seq_lens, surface_weights
from data.verify import BatchValidator, InvalidCounter


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


def check_jagged_capacity(seq_lens: dict[str, int], capacity, shards: int = 1) -> dict[str, int]:
  """``{stream: N}`` for the streams to pack (``data.jagged``); N a positive multiple of 64 in each
  of the ``shards`` blocks (of ``64 * shards``)."""
  out = {}
  for s, n in dict(capacity or {}).items():
    if s not in seq_lens:
      raise ValueError(f"jagged_capacity: unknown event stream {s!r}; streams are "
                       f"{sorted(seq_lens)}")
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n <= 0 or n % (64 * shards):
      per = "" if shards == 1 else f" x {shards} batch shards (64 tokens a block)"
      raise ValueError(f"jagged_capacity[{s!r}] = {n!r} must be a positive multiple of 64{per}")
    out[s] = int(n)
  return out


def check_jagged_buckets(seq_lens: dict[str, int], capacity, shards: int = 1
                         ) -> dict[str, tuple[int, ...]]:
  """``{stream: (N_0, ..., N_{K-1})}``: ``capacity`` {stream: N or ascending capacities, the same
  count K for every stream} (``data.jagged.capacity_buckets``), each as ``check_jagged_capacity``
  checks N."""
  caps = {s: tuple(n) if isinstance(n, (tuple, list)) else (n,)
          for s, n in dict(capacity or {}).items()}
  out = {s: tuple(check_jagged_capacity(seq_lens, {s: n}, shards)[s] for n in v)
         for s, v in caps.items()}
  if len({len(v) for v in out.values()}) > 1 or any(not v or list(v) != sorted(v)
                                                     for v in out.values()):
    raise ValueError(f"jagged_capacity {out}: every stream needs the same number of ascending "
                     "bucket capacities")
  return out


class Collate:
  """``BatchValidator`` columns of B rows + ``example_mask`` f32[B] -> batch (``data.schema``).

  ``jagged_capacity`` {stream: N, or K ascending bucket capacities}: those streams in the packed
  layout (``data.jagged``) at N, or at the smallest bucket into which every stream's batch fits
  (``data.jagged.pick_bucket``; one bucket index for all streams, so a batch's shapes are one of
  K), in ``jagged_shards`` blocks (one per batch x context shard of this process, N / S tokens
  each); ``collate`` also returns the events dropped per stream."""

  def __init__(self, schema: Schema, seq_lens: dict[str, int], balance_groups: int = 0,
               jagged_capacity: dict | None = None, jagged_shards: int = 1):
    self.schema, self.seq_lens = schema, seq_lens
    self.balance_groups = balance_groups
    self.shards = jagged.check_shards(jagged_shards)
    self.jagged = check_jagged_buckets(seq_lens, jagged_capacity, self.shards)
    self.cols = {s.name: records.event_columns(s) for s in schema.streams}

  def __call__(self, c: dict, mask: np.ndarray) -> dict:
    return self.collate(c, mask)[0]

  def collate(self, c: dict, mask: np.ndarray) -> tuple[dict, dict[str, int]]:
    """(batch, {jagged stream: events dropped over its capacity})."""
    if self.balance_groups:
      tot = sum(c[f"length/{s}"] for s in self.seq_lens).astype(np.int64)
      order = balance_order(tot, self.balance_groups)
      c, mask = {k: v[order] for k, v in c.items()}, mask[order]
    out = {k: c[k] for k in ("dense", "surface", "labels", "label_mask", "true_prob", "user_id",
                              "ad_id", "request_ts")}
    out["example_mask"] = mask.astype(np.float32)
    out["sparse"] = {}
    for f in self.schema.sparse:
      ids = c[f"sparse/{f.name}"]
      out["sparse"][f.name] = (np.where(ids >= 0, hash_ids(np.maximum(ids, 0), f.vocab_size), -1)
                               .astype(np.int32) if f.hashed else ids.astype(np.int32))
    out["events"], dropped = {}, {}
    req = c["request_ts"].astype(np.int64)
    bucket = jagged.pick_bucket({s: c[f"length/{s}"] for s in self.jagged}, self.jagged,
                                self.shards)
    for s, T in self.seq_lens.items():
      buf, length = c[f"events/{s}"], c[f"length/{s}"]
      ev = {n: np.ascontiguousarray(buf[..., i]) for i, n in enumerate(self.cols[s])}
      if s in self.jagged:
        ev, dropped[s] = pack_stream(ev, length, self.jagged[s][bucket], self.shards)
        example = jagged.block_examples(ev["seg"], len(length), self.shards)
        valid, row = example < len(length), np.minimum(example, len(length) - 1)
      else:
        valid, row = np.arange(T)[None, :] < length[:, None], np.arange(len(length))[:, None]
        ev["length"] = length
      ev["age"] = np.where(valid, req[row] - ev.pop("ts"), 0).astype(np.float32)
      out["events"][s] = ev
    return out, dropped


def pack_stream(events: dict, length, capacity: int, shards: int = 1) -> tuple[dict, int]:
  """One stream's padded ``{field: [B, T]}`` + ``length[B]`` -> its packed batch entry
  (``data.schema``: the fields at [N], ``offsets``, ``seg``, ``pos``, kept ``length``) in
  ``shards`` blocks and the events dropped over ``capacity`` (``data.jagged.pack_blocks``)."""
  toks, offsets, seg, pos, dropped = jagged.pack_blocks(events, length, capacity, shards)
  o = offsets.reshape(shards, -1)
  return {**toks, "length": (o[:, 1:] - o[:, :-1]).reshape(-1), "offsets": offsets, "seg": seg,
          "pos": pos}, dropped


def pack_batch(batch: dict, capacity: dict[str, int], shards: int = 1
               ) -> tuple[dict, dict[str, int]]:
  """A padded model batch (``data.schema``; e.g. ``data.fake.random_batch``) with the streams of
  ``capacity`` {stream: N} packed as ``Collate`` packs them (``shards`` blocks); also {stream:
  events dropped}."""
  events, dropped = dict(batch["events"]), {}
  for s, n in capacity.items():
    ev = {k: v for k, v in events[s].items() if k != "length"}
    events[s], dropped[s] = pack_stream(ev, events[s]["length"], n, shards)
  return {**batch, "events": events}, dropped


class Loader:
  """``elastic.Rows`` -> ``(batch, {kind: skipped}, {stream: events dropped})``: batched reads,
  vectorised decode and validation, collation. Rows with source -1 and skipped invalid records
  are padding; events over a jagged capacity are dropped (``Collate``) and counted."""

  def __init__(self, schema: Schema, seq_lens: dict[str, int], sources, source_surface,
               collate: Collate, counter: InvalidCounter | None,
               dropped_counter: jagged.DroppedCounter | None = None):
    self.sources = sources                     # [RecordSource]
    self.source_surface = source_surface       # per source: i64[n_files] surface of each file
    self.validator = BatchValidator(schema, seq_lens)
    self.collate, self.counter, self.dropped_counter = collate, counter, dropped_counter

  def __call__(self, rows: elastic.Rows):
    B = len(rows.source)
    real = np.flatnonzero(rows.source >= 0)
    raws: list[bytes] = [b""] * len(real)
    surf = np.empty(len(real), np.int64)
    names = [None] * len(real)
    damaged: dict[int, Exception] = {}              # row in ``real`` -> DamagedChunkError
    for s in np.unique(rows.source[real]).tolist():
      sel = np.flatnonzero(rows.source[real] == s)
      bad = []
      f, local, got = self.sources[s].read_many(rows.index[real[sel]],
                                                damaged=None if self.counter is None else bad)
      damaged.update((int(sel[n]), e) for n, e in bad)
      surf[sel] = self.source_surface[s][f]
      paths = self.sources[s].paths
      for j, r, fi, li in zip(sel.tolist(), got, f.tolist(), local.tolist(), strict=True):
        raws[j], names[j] = r, (paths[fi], li)
    cols, ok, errors = self.validator(raws, surf, names.__getitem__)
    if damaged:                                    # their b"" fails validation: name the chunk
      errors = [(j, damaged.get(j, e)) for j, e in errors]
    skipped: dict[str, int] = {}
    for _, e in errors:
      if self.counter is None:
        raise e
      self.counter.add(e)
      skipped[e.kind] = skipped.get(e.kind, 0) + 1
    keep = real[ok]
    mask = np.zeros(B, np.float32)
    mask[keep] = 1.0
    if len(keep) < B:                              # padding / skipped rows
      full = self.validator.empty(B)
      for k, v in cols.items():
        full[k][keep] = v[ok]
      cols = full
    batch, dropped = self.collate.collate(cols, mask)
    dropped = {s: n for s, n in dropped.items() if n}
    if self.dropped_counter is not None:
      self.dropped_counter.add(dropped)
    return batch, skipped, dropped


def invalid_counter(ds) -> InvalidCounter | None:
  """The ``InvalidCounter`` of a dataset built with ``skip_invalid=True`` (counts the records
  skipped in this process; under ``mp_prefetch`` use ``invalid_counts(iterator)``)."""
  return getattr(ds, "invalid_counter", None)


def invalid_counts(iterator) -> dict[str, int]:
  """{kind: records skipped} over the batches ``iterator`` has produced so far (since the start
  of training when restored at the same process count), found in its state: works for plain
  iterators and ``mp_prefetch`` ones (whose state holds every worker's)."""
  return elastic.global_state(iterator.get_state())["invalid"]


def dropped_counter(ds) -> jagged.DroppedCounter | None:
  """The ``DroppedCounter`` of a dataset built with ``jagged_capacity`` (events dropped over the
  capacity in this process; under ``mp_prefetch`` use ``dropped_events(iterator)``)."""
  return getattr(ds, "dropped_counter", None)


def dropped_events(iterator) -> dict[str, int]:
  """{stream: events dropped over its jagged capacity} over the batches ``iterator`` has
  produced so far, from its state like ``invalid_counts``."""
  return elastic.global_state(iterator.get_state())["dropped"]


def _get(cfg, name, default):
  return cfg.get(name, default) if hasattr(cfg, "get") else getattr(cfg, name, default)


def make_dataset(data_cfg, data_dir: str, split: str, seq_lens: dict[str, int], *, train: bool,
                 shard_index: int | None = None, shard_count: int | None = None,
                 jagged_capacity: dict | None = None, jagged_shards: int = 1):
  """grain ``IterDataset`` of numpy batches (``data.schema`` layout plus ``example_mask``).

  data_cfg fields: batch_size (global), surface_weights (mapping, "a=1,b=0.5" or "auto": in
  proportion to the records; ``data.schema.surface_weights``), shuffle_seed, num_threads (batch
  loader threads), prefetch (batches in flight; 0 = load synchronously), skip_invalid,
  length_balance (and optional length_balance_groups, default: local devices). Per-process batch =
  batch_size // shard_count. Skipped invalid records stay as padding rows (``example_mask`` 0);
  ``ds.invalid_counter`` counts them in this process (``None`` unless skip_invalid). Eval:
  ``num_eval_batches`` batches per process. Train iterators restore from a state written under
  any process count or global batch size (``data.elastic``).

  ``jagged_capacity`` {stream: N} (default None: every stream padded): those streams come in the
  packed layout (``data.schema``) at N tokens per process batch (or K ascending bucket capacities
  per stream: each batch at the smallest that fits, ``Collate``), in ``jagged_shards`` blocks of
  N / S tokens (one per batch x context shard of this process's devices); events dropped over a
  block's capacity are counted by ``ds.dropped_counter`` and ``dropped_events(iterator)``.
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
  groups = 0
  if _get(data_cfg, "length_balance", False):
    groups = int(_get(data_cfg, "length_balance_groups", 0) or jax.local_device_count())
  if jagged_capacity:
    jagged.check_shards(jagged_shards, B)
  collate = Collate(schema, seq_lens, groups, jagged_capacity, jagged_shards)
  drops = jagged.DroppedCounter() if collate.jagged else None

  if train:
    counts = {s: sum(c for _, c in files.get(s, [])) for s in schema.surfaces}
    weights = surface_weights(data_cfg.surface_weights, schema.surfaces, counts)
    sources, surf, sizes = [], [], {}
    for si, surface in enumerate(schema.surfaces):
      flist = files.get(surface, [])
      sources.append(records.RecordSource(flist))
      surf.append(np.full(len(flist), si, np.int64))
      sizes[surface] = len(sources[-1])
      if weights.get(surface, 0.0) > 0 and not sizes[surface]:
        raise ValueError(f"{data_dir}/{split}: surface {surface!r} has no records but weight "
                         f"{weights[surface]} in data.surface_weights")
    plan = elastic.TrainPlan(sizes, weights, int(_get(data_cfg, "shuffle_seed", 0)), gbs,
                             shard_index, shard_count)
  else:
    flist, fsurf = [], []
    for si, surface in enumerate(schema.surfaces):
      flist += files.get(surface, [])
      fsurf += [si] * len(files.get(surface, []))
    sources, surf = [records.RecordSource(flist)], [np.array(fsurf, np.int64)]
    plan = elastic.EvalPlan(len(sources[0]), B, shard_index, shard_count)
  load = Loader(schema, seq_lens, sources, surf, collate, counter, drops)
  ds = elastic.BatchIterDataset(plan, load, num_threads=int(_get(data_cfg, "num_threads", 2)),
                                prefetch=int(_get(data_cfg, "prefetch", 4)),
                                shard_index=shard_index, shard_count=shard_count)
  ds.invalid_counter, ds.dropped_counter = counter, drops
  return ds


def device_put_batch(batch: dict, sharding) -> dict:
  """Process-local numpy batch -> global jax arrays (leading axis sharded by ``sharding``)."""
  return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), batch)


def num_eval_batches(data_dir: str, split: str, batch_size: int, shard_count: int = 1) -> int:
  """Number of batches ``make_dataset(train=False)`` yields per process (every process the same;
  skipped invalid records keep their rows)."""
  schema = Schema.load(data_dir)
  n = sum(c for fl in records.split_files(data_dir, split, schema).values() for _, c in fl)
  rows = -(-n // shard_count)                        # rows of the largest process
  return -(-rows // (batch_size // shard_count))


__all__ = ["make_dataset", "device_put_batch", "invalid_counter", "invalid_counts", "hash_ids",
           "balance_order", "num_eval_batches", "Collate", "Loader", "check_jagged_capacity",
           "check_jagged_buckets",
           "pack_stream", "pack_batch",
           "dropped_counter", "dropped_events"]
