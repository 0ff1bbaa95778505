"""The in-memory runner (``run(..., engine="memory")``): the whole log held in memory, one
process, histories from ``history.FlatLogHistories``; the reference the DuckDB and Beam runners'
outputs are tested against."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from data import records
from data.ingest.coerce import CoerceError, Coercions
from data.ingest.history import FlatLogHistories
from data.ingest.layout import canonical, finalize
from data.ingest.parquet import table_to_records
from data.ingest.runner import Runner
from data.ingest.sources import Progress, row_error
from data.ingest.splits import cut_times


class MemoryRunner(Runner):
  """Stages nothing on disk: keeps the scanned times (and, for ``--history``, the canonical
  columns) for the split and the histories."""

  name = "memory"

  def __init__(self, tmp, spec, opts):
    super().__init__(tmp, spec, opts)
    self.ts_parts, self.parts, self.hist = [], [], None

  def stage(self, sname, split_i, src_i, src, first, cols):
    self.ts_parts.append(cols["request_ts"].to_numpy(zero_copy_only=False))
    if self.spec.history is not None:
      self.parts.append((sname, src, first, cols))

  def history(self, scan, surfaces, tasks, log, rows):
    hist = self.hist = FlatLogHistories([p[3] for p in self.parts], self.spec, surfaces, tasks,
                                        log)
    extra = [f"dense.{k}" for k in hist.index.stats(np.zeros(0, np.int64))] if hist.stats else []
    hs = {s: {"max_len": hist.max_len, "item_vocab": hist.item_vocab,
              "action_vocab": hist.action_vocab} for s in hist.observed_len}
    return hs, extra

  def split_times(self, kind, vals):
    return cut_times(np.concatenate(self.ts_parts), kind, vals)

  def convert(self, sources, full, schema, ctx, log, cpu):
    return _convert(sources, self.tmp, schema, full, ctx["hashed_events"], log, self.hist,
                    self.parts, ctx["used"], ctx["route"],
                    (ctx["records_per_shard"], ctx["records_per_chunk"]), self.opts.err,
                    self.spec)


def _convert(sources, tmp, schema, full, hashed_events, log, hist, parts, used, cuts,
             per_shard_chunk, err, spec):
  """The whole log -> ``(counts, pos, lab, manifest)``. ``per_shard_chunk``: (records per
  shard, records per chunk)."""
  writer = records.DatasetWriter(tmp, schema, *per_shard_chunk)
  counts = {s: {} for s in used}
  pos = {s: np.zeros(len(schema.tasks)) for s in used}
  lab = {s: np.zeros(len(schema.tasks)) for s in used}
  route = np.array(cuts)

  def convert(src, sname, first, cols, rows=None):
    if rows is not None:
      cols = {**cols, **hist.columns(rows, {s.name: s.max_len for s in schema.streams})}
    try:
      tbl = finalize(cols, schema, full, hashed_events, log)
    except CoerceError as e:
      raise row_error(src, first, e) from None
    n = tbl.num_rows
    if sname is not None:
      which = np.zeros(n, np.int64)
      names = [sname]
    else:
      which = np.searchsorted(route, tbl.column("request_ts").to_numpy(), side="right")
      names = ["train", "valid", "eval"]
    for k in np.unique(which).tolist():
      idx = np.flatnonzero(which == k)
      sub = tbl.take(pa.array(idx)) if len(idx) < n else tbl
      sp = names[k]
      for surface, recs in table_to_records(sub, schema, src.name, rows=first + idx).items():
        writer.write(sp, surface, recs)
        if recs:
          counts[sp][surface] = counts[sp].get(surface, 0) + len(recs)
      for j, t in enumerate(schema.tasks):
        y = sub.column(f"label.{t.name}").to_numpy(zero_copy_only=False)
        pos[sp][j] += np.nansum(y)
        lab[sp][j] += np.sum(~np.isnan(y))
    return n

  if hist is not None:
    prog = Progress("convert", hist.n, err)
    g = 0
    for sname, src, first, cols in parts:
      n = len(cols["request_ts"])
      for a in range(0, n, 50_000):
        b = min(n, a + 50_000)
        sl = {k: v.slice(a, b - a) for k, v in cols.items()}
        prog.add(convert(src, sname, first + a, sl, np.arange(g + a, g + b)))
      g += n
    prog.close()
  else:
    for sname, srcs in sources.items():
      for src in srcs:
        prog = Progress(f"convert {src.name}", src.counted, err)
        for table, first, frac in src.batches():
          try:
            cols, _ = canonical(table, spec, Coercions())
          except CoerceError as e:
            raise row_error(src, first, e) from None
          prog.add(convert(src, sname, first, cols), frac)
        prog.close()
  return counts, pos, lab, writer.close(tuple(used))
