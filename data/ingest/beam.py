"""``--runner beam``: the DuckDB runner's conversion as an Apache Beam pipeline (``BeamRunner``).
Read (per Parquet row group) -> AdStats (per ad bucket) -> Convert (per user bucket,
``bucket.convert_task``) -> WriteToArrayRecord (per split x surface) -> Manifest; ``--out`` must
be a filesystem every worker mounts. Steps and options: data/README.md.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import shutil
import tempfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from data import records, shards
from data.ingest.bucket import convert_task
from data.ingest.coerce import CoerceError, Coercions
from data.ingest.engine import EngineRunner
from data.ingest.infer import Spec
from data.ingest.layout import canonical
from data.ingest.sources import Source
from data.ingest.sql import ad_sql
from data.schema import Schema

BUCKETS = 64
_TMP: list[str] = []        # this process's temp dir for Beam (``_beam_tempdir``), once made


@contextlib.contextmanager
def _beam_tempdir():
  """Runs Beam with Python's temp dir set to one of this process's own, removed at exit: Beam
  (2.x, its local Prism runner) leaves dirs in the system temp dir on every run (its job
  server's temp root, the SDK's staging dirs, a requirements cache). Made before Beam registers
  its exit handlers, so removed after them."""
  if not _TMP:
    _TMP.append(tempfile.mkdtemp(prefix="kunlun-beam-"))
    atexit.register(shutil.rmtree, _TMP[0], ignore_errors=True)
  saved, tempfile.tempdir = tempfile.tempdir, _TMP[0]
  try:
    yield
  finally:
    tempfile.tempdir = saved


def _bucket(x: np.ndarray, n: int) -> np.ndarray:
  with np.errstate(over="ignore"):
    h = np.asarray(x, np.int64).astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
  return ((h >> np.uint64(29)) % np.uint64(n)).astype(np.int64)


def _read(element, spec_dict, plan, buckets):
  """(src index, path, row group or None, split index) -> keyed canonical sub-tables."""
  src_i, path, rg, split_i, delimiter = element
  spec = Spec.from_dict(spec_dict)
  log = Coercions()                       # (the launcher's scan reported the coercions)
  if rg is None:
    batches = ((t, first) for t, first, _ in Source(path, delimiter=delimiter).batches())
  else:
    f = pq.ParquetFile(path)
    first = sum(f.metadata.row_group(i).num_rows for i in range(rg))
    batches = [(f.read_row_group(rg), first)]
  for table, first in batches:
    try:
      cols, _ = canonical(table, spec, log)
    except CoerceError as e:
      where = f"{path}: row {first + e.row}: " if e.row is not None else f"{path}: "
      raise ValueError(where + e.msg) from None
    n = len(cols["request_ts"])
    t = pa.table({**cols, "_src": pa.array(np.full(n, src_i, np.int32)),
                  "_row": pa.array(np.arange(first, first + n, dtype=np.int64)),
                  "_split": pa.array(np.full(n, split_i, np.int8))})
    if plan:
      ub = _bucket(t.column("user_id").to_numpy(), buckets)
    else:                                  # no histories: any grouping will do
      ub = np.full(n, (src_i * 1_000_003 + first) % buckets, np.int64)
    for b in np.unique(ub).tolist():
      sub = t.filter(pa.array(ub == b))
      yield ("rows", int(b), sub)
      if plan and plan["stats"]:
        narrow = sub.select(["_src", "_row", "user_id", "_ad_feature", "request_ts"]
                            + [f"label.{x}" for x in plan["tasks"]])
        ab = _bucket(narrow.column("_ad_feature").to_numpy(), buckets)
        for a in np.unique(ab).tolist():
          yield ("ads", int(a), narrow.filter(pa.array(ab == a)))


def _ad_stats(item, plan, buckets):
  """One ad bucket -> (user bucket, ad statistic counts of its rows)."""
  import duckdb
  _, tables = item
  t = pa.concat_tables(list(tables), promote_options="permissive")
  con = duckdb.connect()
  con.execute("SET threads=1")
  con.register("ads", t)
  out = con.sql(ad_sql(plan, "ads", ["_src", "_row", "user_id"])).to_arrow_table()
  con.close()
  ub = _bucket(out.column("user_id").to_numpy(), buckets)
  out = out.drop_columns(["user_id"])
  for b in np.unique(ub).tolist():
    yield int(b), out.filter(pa.array(ub == b))


def _convert(item, ctx, work_dir):
  """One user bucket (its rows and their ad statistics) -> (split, surface, record) and a
  ('stats', ...) summary."""
  import duckdb
  _, groups = item
  rows = list(groups["rows"])
  if not rows:
    return
  t = pa.concat_tables(rows, promote_options="permissive")
  if ctx["plan"] and ctx["plan"]["stats"]:
    ads = pa.concat_tables(list(groups["ads"]), promote_options="permissive")
    con = duckdb.connect()
    con.execute("SET threads=1")
    con.register("r", t)
    con.register("a", ads)
    t = con.sql("SELECT r.*, a.* EXCLUDE (_src, _row) FROM r JOIN a USING (_src, _row)"
                ).to_arrow_table()
    con.close()
  out = []
  res = convert_task({"id": 0, "table": t, "ctx": ctx, "work_dir": work_dir},
                            emit=lambda sp, surface, recs: out.append((sp, surface, recs)))
  for sp, surface, recs in out:
    for r in recs:
      yield f"{sp}/{surface}", r
  yield "stats", {k: res[k] for k in ("counts", "pos", "lab", "log", "rows")}


def _merge_stats(parts) -> dict:
  out = {"counts": {}, "pos": {}, "lab": {}, "log": {}, "rows": 0}
  for p in parts:
    out["rows"] += p["rows"]
    for m, v in p["log"].items():
      out["log"].setdefault(m, v)
    for s, cs in p["counts"].items():
      d = out["counts"].setdefault(s, {})
      for surface, c in cs.items():
        d[surface] = d.get(surface, 0) + c
    for k in ("pos", "lab"):
      for s, v in p[k].items():
        cur = out[k].setdefault(s, [0.0] * len(v))
        out[k][s] = [a + b for a, b in zip(cur, v, strict=True)]
  return out


def _manifest(_, files, stats, out_dir, schema_dict, used):
  """The final step: manifest.json (records, bytes, SHA-256 of every written shard) and
  schema.json; the run's counts for ingest.json."""
  from array_record.python import array_record_module
  schema = Schema.from_dict(schema_dict)
  manifest = {"format": records.FORMAT, "splits": {}}
  by = {}
  for f in files:
    rel = os.path.relpath(f, out_dir)
    split, name = rel.split(os.sep)
    m = re.match(r"(.*)-\d{5}-of-\d{5}\.arrayrecord$", name)
    by.setdefault((split, m.group(1)), []).append(rel)
  for split in used:
    for surface in schema.surfaces:
      entries = []
      for rel in sorted(by.get((split, surface), [])):
        r = array_record_module.ArrayRecordReader(os.path.join(out_dir, rel))
        n = r.num_records()
        r.close()
        entries.append(shards.file_entry(out_dir, rel, n))
      manifest["splits"].setdefault(split, {})[surface] = entries
  schema.save(out_dir)
  st = _merge_stats(stats)
  with open(os.path.join(out_dir, ".beam_stats.json"), "w") as f:
    json.dump(st, f)
  with open(os.path.join(out_dir, "manifest.json"), "w") as f:
    json.dump(manifest, f, indent=1)
  yield "manifest.json"


def pipeline_options(beam_args):
  """Our flags -> Beam's: ``--beam_runner X`` is Beam's ``--runner X`` (``--runner beam``
  picks this path); ``--buckets N`` is ours."""
  from apache_beam.options.pipeline_options import PipelineOptions
  args, buckets, i = [], BUCKETS, 0
  while i < len(beam_args):
    a = beam_args[i]
    key, eq, val = a.partition("=")
    if key in ("--beam_runner", "--buckets"):
      if not eq:
        if i + 1 >= len(beam_args):
          raise ValueError(f"{key} needs a value")
        val, i = beam_args[i + 1], i + 1
      if key == "--buckets":
        try:
          buckets = int(val)
        except ValueError:
          buckets = 0
        if buckets < 1:
          raise ValueError(f"--buckets={val} must be an integer >= 1")
      else:
        args.append(f"--runner={val}")
    else:
      args.append(a)
    i += 1
  return PipelineOptions(args), buckets


def convert(sources, tmp, schema, ctx, log, beam_args):
  """Runs the Beam pipeline writing the dataset into ``tmp``; returns
  ``(counts, pos, lab, manifest)`` as ``data.ingest`` expects."""
  try:
    import apache_beam as beam
    from array_record.beam.arrayrecordio import WriteToArrayRecord
  except ImportError as e:
    raise ValueError(f"--runner beam needs apache-beam ({e}); install the beam extra in its own "
                     "venv: bash scripts/setup.sh --beam, then .venv-beam/bin/python -m "
                     "data.ingest ...") from None
  opts, buckets = pipeline_options(beam_args)
  work = os.path.join(tmp, ".work")
  os.makedirs(work, exist_ok=True)
  elements, i = [], 0
  split_names = ctx["splits"]
  for sname, srcs in sources.items():
    for src in srcs:
      split_i = -1 if sname is None else split_names.index(sname)
      path = src.path
      if path is None:                       # an in-memory table: staged as Parquet
        path = os.path.join(work, f"table-{i}.parquet")
        pq.write_table(src.table, path)
      if path.endswith((".parquet", ".pq")):
        n_rg = pq.ParquetFile(path).num_row_groups
        elements += [(i, path, rg, split_i, src.delimiter) for rg in range(max(n_rg, 1))]
      else:
        elements.append((i, path, None, split_i, src.delimiter))
      i += 1
  plan, used = ctx["plan"], ctx["used"]
  dests = [f"{sp}/{surface}" for sp in used for surface in schema.surfaces]
  with _beam_tempdir(), beam.Pipeline(options=opts) as p:
    read = (p | "Inputs" >> beam.Create(elements)
            | "Read" >> beam.FlatMap(_read, ctx["spec"], plan, buckets))
    rows = read | "Rows" >> beam.Filter(lambda x: x[0] == "rows") \
        | "KeyRows" >> beam.Map(lambda x: (x[1], x[2]))
    groups = {"rows": rows}
    if plan and plan["stats"]:
      ads = (read | "Ads" >> beam.Filter(lambda x: x[0] == "ads")
             | "KeyAds" >> beam.Map(lambda x: (x[1], x[2]))
             | "GroupAds" >> beam.GroupByKey()
             | "AdStats" >> beam.FlatMap(_ad_stats, plan, buckets))
      groups["ads"] = ads
    out = (groups | "Join" >> beam.CoGroupByKey()
           | "Convert" >> beam.FlatMap(_convert, ctx, work))
    stats = out | "Stats" >> beam.Filter(lambda x: x[0] == "stats") \
        | "StatDicts" >> beam.Map(lambda x: x[1])
    recs = out | "Records" >> beam.Filter(lambda x: x[0] != "stats")
    parts = recs | "ByDest" >> beam.Partition(lambda x, n: dests.index(x[0]), len(dests))
    written = []
    for d, part in zip(dests, parts, strict=True):
      sp, surface = d.split("/")
      written.append(part | f"Bytes {d}" >> beam.Map(lambda x: x[1])
                     | f"Write {d}" >> WriteToArrayRecord(
                         os.path.join(tmp, sp, surface), file_name_suffix=".arrayrecord"))
    files = written | "AllFiles" >> beam.Flatten()
    _ = (p | "Once" >> beam.Create([None])
         | "Manifest" >> beam.FlatMap(
             _manifest, beam.pvalue.AsList(files), beam.pvalue.AsList(stats), tmp,
             schema.to_dict(), used))
  with open(os.path.join(tmp, ".beam_stats.json")) as f:
    st = json.load(f)
  os.remove(os.path.join(tmp, ".beam_stats.json"))
  with open(os.path.join(tmp, "manifest.json")) as f:
    manifest = json.load(f)
  for m, v in st["log"].items():
    log.add(m, v)
  counts = {s: st["counts"].get(s, {}) for s in used}
  pos = {s: np.asarray(st["pos"].get(s, [0.0] * len(schema.tasks))) for s in used}
  lab = {s: np.asarray(st["lab"].get(s, [0.0] * len(schema.tasks))) for s in used}
  return counts, pos, lab, manifest


class BeamRunner(EngineRunner):
  """``--runner beam``: the scan stages only the times (for the split on this machine); the
  conversion is the Beam pipeline of ``convert`` (``opts.beam_args``: its options)."""

  name = "beam"

  def stage(self, sname, split_i, src_i, src, first, cols):
    self.staging.add({"request_ts": cols["request_ts"]}, src_i, first, -1)

  def convert(self, sources, full, schema, ctx, log, cpu):
    self.close()
    return convert(sources, self.tmp, schema, ctx, log, self.opts.beam_args)
