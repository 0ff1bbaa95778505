"""Your logs -> a kunlun dataset, without code: Parquet / CSV -> ArrayRecord + schema.json.

  python -m data.ingest --input logs.parquet --out data/mine \
      --rename request_ts=time,ad_id=item,label.click=clicked --ids_as_features --yes
  python -m data.ingest --input ratings.csv --out data/ml --schema my_spec.yaml

Without a complete schema in ``--schema`` the schema is inferred from the columns (data.infer)
and printed for confirmation (``--yes`` accepts it; ``--write_schema FILE`` saves it, with the
renames and options, as a spec file to edit and pass back with ``--schema``). Two passes: a scan
(types, id ranges, list lengths, surfaces, label nulls, times for the split) and the conversion;
both show progress. Every type change is a logged coercion (data.coerce); columns that play no
role are listed as a warning; bad input stops with one line naming file, row and column.

Splits: ``--split time:0.8,0.1,0.1`` (default) cuts the time range at the request_ts quantiles
into train / valid / eval (every valid row is later than every train row, ...);
``--split ts:T1,T2`` cuts at given unix times; ``--split none`` puts everything in train;
``--train/--valid/--eval FILES`` give the splits explicitly.

Flat logs (one row per interaction, no history columns): ``--history click=label.click,
impression=all`` builds each row's event streams from the same user's strictly earlier rows,
``--history_stats`` adds earlier-count / rate features.

Engines: ``--runner duckdb`` (default; data.engine: out of core, all cores, ``--workers``,
``--memory_limit``) or ``--runner beam`` (data.beam_ingest: an Apache Beam pipeline, the other
arguments are its options). ``run(..., engine="memory")`` keeps the whole log in memory
(data.history): the reference the tests compare both with. The dataset is written beside
``--out`` and renamed into place when complete. Categorical columns get exact vocabularies or
stay hashed (data.vocab; ``ingest.json`` reports each hashed column's collision rate).
Column layout and a worked example: data/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import time

import numpy as np
import pyarrow as pa

from data import coerce, history, records, shards
from data.coerce import CoerceError, Coercions
from data.infer import ColumnStats, Spec, propose, role, schema_from
from data.layout import canonical, finalize
from data.parquet import table_to_records

SPLITS = ("train", "valid", "eval")
PROG = "data.ingest"


class Progress:
  """Rows done / total (or bytes for a first CSV pass), rate and ETA; a line every few seconds."""

  def __init__(self, label: str, total: int | None, stream=None, every: float = 2.0):
    self.label, self.total, self.every = label, total, every
    self.stream = stream or sys.stderr
    self.done, self.t0 = 0, time.perf_counter()
    self.last = self.t0

  def add(self, n: int, frac: float | None = None) -> None:
    self.done += n
    now = time.perf_counter()
    if now - self.last >= self.every:
      self.last = now
      self._line(now, frac)

  def _line(self, now, frac=None):
    if self.done == getattr(self, "_shown", None):
      return
    self._shown = self.done
    dt = max(now - self.t0, 1e-9)
    msg = f"{PROG}: {self.label}: {self.done:,} rows"
    if frac is None and self.total:
      frac = self.done / self.total
      msg += f" / {self.total:,}"
    if frac is not None and frac > 0:
      msg += f" ({100 * frac:.0f}%, ETA {dt * (1 - frac) / frac:.0f}s)"
    print(msg + f", {self.done / dt:,.0f} rows/s", file=self.stream, flush=True)

  def close(self):
    self._line(time.perf_counter(), 1.0 if self.total is None else None)


class Source:
  """One input: a Parquet / CSV file or an in-memory table (``name`` for messages)."""

  def __init__(self, path: str | None = None, table: pa.Table | None = None,
               name: str | None = None, batch_rows: int = 65536, delimiter: str | None = None):
    self.path, self.table, self.batch_rows = path, table, batch_rows
    self.name = name or path or "<table>"
    self.kind = "table" if table is not None else (
        "parquet" if path.endswith((".parquet", ".pq")) else "csv")
    self.delimiter = delimiter or ("\t" if path and path.endswith((".tsv", ".inter")) else ",")
    if path is not None and not os.path.exists(path):
      raise ValueError(f"{path}: no such file")
    if path is not None and os.path.isdir(path):
      raise ValueError(f"{path}: a directory; give its Parquet / CSV files")

  @property
  def rows(self) -> int | None:
    if self.kind == "table":
      return self.table.num_rows
    if self.kind == "parquet":
      import pyarrow.parquet as pq
      try:
        return pq.ParquetFile(self.path).metadata.num_rows
      except (pa.ArrowInvalid, OSError) as e:
        raise ValueError(f"{self.name}: unreadable: {str(e).splitlines()[0]}") from None
    return None

  def batches(self):
    """Yields ``(table, first_row, fraction_of_file_read)``."""
    if self.kind == "table":
      for a in range(0, max(self.table.num_rows, 1), self.batch_rows):
        t = self.table.slice(a, self.batch_rows)
        yield t, a, None
      return
    try:
      if self.kind == "parquet":
        import pyarrow.parquet as pq
        first = 0
        for b in pq.ParquetFile(self.path).iter_batches(batch_size=self.batch_rows):
          yield pa.Table.from_batches([b]), first, None
          first += b.num_rows
        return
      import pyarrow.csv as pcsv
      size = max(os.path.getsize(self.path), 1)
      with open(self.path, "rb") as f:
        reader = pcsv.open_csv(f, read_options=pcsv.ReadOptions(block_size=64 << 20),
                               parse_options=pcsv.ParseOptions(delimiter=self.delimiter))
        first = 0
        for b in reader:
          yield pa.Table.from_batches([b]), first, f.tell() / size
          first += b.num_rows
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
      raise ValueError(f"{self.name}: unreadable: {str(e).splitlines()[0]}") from None


# ---- the two passes ---------------------------------------------------------------------------

def parse_split(text: str) -> tuple[str, tuple[float, ...]]:
  """``time:a,b,c`` (fractions), ``ts:T1,T2`` (unix seconds) or ``none``."""
  kind, _, rest = text.partition(":")
  try:
    if kind == "none" and not rest:
      return "none", ()
    vals = tuple(float(x) for x in rest.split(","))
    if kind == "time" and len(vals) == 3 and min(vals) >= 0 and abs(sum(vals) - 1) < 1e-6 \
        and vals[0] > 0:
      return kind, vals
    if kind == "ts" and len(vals) == 2 and vals[0] <= vals[1]:
      return kind, vals
  except ValueError:
    pass
  raise ValueError(f"--split={text}: expected time:TRAIN,VALID,EVAL (fractions summing to 1, "
                   "train > 0), ts:T1,T2 (unix seconds) or none")


def cut_times(ts: np.ndarray, kind: str, vals) -> tuple[float, float]:
  """Split boundaries (t1, t2): train ts < t1 <= valid < t2 <= eval."""
  if kind == "ts":
    return vals
  s = np.sort(ts)
  n = len(s)
  at = lambda f: float(s[int(np.ceil(f * n))]) if int(np.ceil(f * n)) < n else float("inf")
  t1, t2 = at(vals[0]), at(vals[0] + vals[1])
  if vals[1] == 0:
    t2 = t1
  if not n or t1 <= s[0]:
    raise ValueError(f"--split=time:...: no train rows (the earliest {vals[0]:.0%} of the rows all "
                     "have the first request_ts); use --split ts:T1,T2 or none")
  return t1, t2


def _utc(t: float) -> str:
  if not np.isfinite(t):
    return "end"
  return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _scan_batch(cols, facts, stats, order, surfaces, unknown, src_name):
  for c, a in cols.items():
    r = role(c)
    if r in (None, "true_prob") or c.startswith("_"):
      continue
    if c not in stats:
      stats[c] = ColumnStats()
      order.append(c)
    st = stats[c]
    if r in ("sparse", "events"):
      offs = np.asarray(a.offsets, np.int64)
      if len(offs) > 1:
        st.max_len = max(st.max_len, int(np.diff(offs).max()))
      st.values(a.values.to_numpy(zero_copy_only=False)[offs[0]:offs[-1]])
      st.hashed |= c in facts["hashed"]
      if c in facts.get("strings", {}):
        st.add_strings(*facts["strings"][c])
    elif r == "label":
      st.nulls += a.null_count
      st.count += len(a) - a.null_count
      st.pos += float(np.nansum(a.fill_null(0).to_numpy(zero_copy_only=False)))
  surfaces.update(cols["surface"].unique().to_pylist())
  for u in facts["unknown"]:
    unknown.setdefault(u, src_name)


def _row_error(src, first, e):
  """A CoerceError of a batch -> one-line ValueError naming file and row."""
  where = f"{src.name}: row {first + e.row}: " if e.row is not None else f"{src.name}: "
  return ValueError(where + e.msg)


ENGINES = ("duckdb", "memory", "beam")


def check_out(out_dir: str, sources: dict, overwrite: bool, yes: bool, write_schema) -> None:
  """``--out`` may not contain or lie inside an input; an existing non-empty one is replaced
  only with ``--overwrite`` and only when it is a dataset (has a manifest)."""
  real = os.path.realpath(out_dir)
  for srcs in sources.values():
    for s in srcs:
      if s.path is None:
        continue
      p = os.path.realpath(s.path)
      if os.path.commonpath([p, real]) in (p, real):
        raise ValueError(f"--out={out_dir} " + ("contains" if os.path.commonpath([p, real]) == real
                                                else "lies inside")
                         + f" the input {s.path}: write the dataset somewhere else")
  if os.path.exists(out_dir) and not os.path.isdir(out_dir):
    raise ValueError(f"--out={out_dir} exists and is not a directory")
  if os.path.exists(out_dir) and os.listdir(out_dir) and (yes or not write_schema):
    if not (overwrite and os.path.exists(os.path.join(out_dir, "manifest.json"))):
      raise ValueError(f"--out={out_dir} exists and is not empty" + (
          " (and is not a kunlun dataset: not removed)" if overwrite else
          "; pass --overwrite to replace a dataset written before"))


def _staging_dir(out_dir: str) -> str:
  """Where the dataset is written before it is renamed to ``out_dir`` (same filesystem)."""
  parent, base = os.path.split(os.path.abspath(out_dir))
  return os.path.join(parent, f".{base}.ingest-{os.getpid()}")


def clear_stale(out_dir: str, warn=None) -> None:
  """Removes the staging folders (``_staging_dir``) that killed runs left beside ``out_dir``:
  those whose process is gone."""
  parent, base = os.path.split(os.path.abspath(out_dir))
  prefix = f".{base}.ingest-"
  for name in os.listdir(parent) if os.path.isdir(parent) else ():
    pid = name[len(prefix):].split(".")[0]
    if not name.startswith(prefix) or not pid.isdigit():
      continue
    try:
      os.kill(int(pid), 0)
      continue                              # still running (another ingest): leave it
    except ProcessLookupError:
      pass
    except PermissionError:
      continue
    shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
    if warn:
      warn(f"removed {os.path.join(parent, name)}, left by an ingest that was killed")


def publish(tmp: str, out_dir: str) -> None:
  """Makes the finished dataset in ``tmp`` appear at ``out_dir`` by renames: a killed run leaves
  the previous dataset (or nothing), never a partial one."""
  old = None
  if os.path.exists(out_dir) and os.listdir(out_dir):
    old = tmp + ".old"
    os.rename(out_dir, old)
  elif os.path.exists(out_dir):
    os.rmdir(out_dir)
  os.rename(tmp, out_dir)
  if old:
    shutil.rmtree(old, ignore_errors=True)


def _history_plan(spec: Spec, first_cols: dict, tasks, ad_range, act_range, log,
                  null_free=(), rows: int = 0) -> dict:
  """The engine's history configuration (as data.history.FlatLogHistories decides it).
  ``null_free``: the tasks whose labels the scan found never null (their valid counts are the
  row counts); ``rows``: the log's size (``pack``: counts fit 40 bits, ``data.engine.ad_sql``)."""
  h = spec.history
  streams = {}
  for name, sel in h["streams"].items():
    if sel != "all" and sel not in first_cols:
      raise CoerceError(f"history.streams.{name}: no column {sel!r}")
    streams[name] = None if sel == "all" else sel
  if h.get("action"):
    if act_range[0] is not None and act_range[0] < 0:
      raise CoerceError(f"history.action: column {h['action']!r} has negative values")
    action_vocab = act_range[1] + 1 if act_range[1] is not None else 1
  else:
    action_vocab = 1 << len(tasks)
  lo, hi = ad_range
  item_vocab = hi + 1 if hi is not None else 1
  hash_items = False
  if item_vocab > 1 << 22 or (lo is not None and lo < 0):
    item_vocab, hash_items = 1 << 22, True
    log.add("history", f"ad ids hashed into [0, {item_vocab}) as event items")
  return {"streams": streams, "stats": bool(h.get("stats", False)), "tasks": list(tasks),
          "action": bool(h.get("action")), "item_vocab": item_vocab,
          "action_vocab": action_vocab, "hash_items": hash_items,
          "max_len": int(h.get("max_len", 50)),
          "null_free": [t for t in tasks if t in null_free], "pack": rows < 1 << 40}


def encodings(stats: dict, order, schema, spec: Spec, key_stats: dict) -> dict:
  """Per categorical column: exact vocabulary, kept ids or hashed (with the expected collision
  rate and, when the scan kept the distinct values, the values that share a row)."""
  from data import vocab as V
  out = {}
  for f in schema.sparse:
    c = f"sparse.{f.name}"
    st = stats.get(c)
    if f.vocab is not None:
      out[c] = {"kind": "vocab", "values": len(f.vocab), "vocab_size": f.vocab_size}
    elif not f.hashed:
      out[c] = {"kind": "ids", "vocab_size": f.vocab_size}
    else:
      d = {"kind": "hash", "vocab_size": f.vocab_size}
      if st is not None:
        d["distinct"] = st.n_distinct if st.distinct is not None else None
        d["distinct_at_least"] = st.n_distinct
        d["expected_collision_rate"] = V.expected_collision_rate(st.n_distinct, f.vocab_size)
        if st.distinct is not None:
          d["colliding_values"], d["rows_used"] = V.colliding_values(
              np.fromiter(st.distinct, np.int64, len(st.distinct)), f.vocab_size)
      out[c] = d
  for k, n in key_stats.items():          # join keys hashed to 31 bits
    out[k] = {"kind": "hash", "vocab_size": 2**31, "distinct": n,
              "expected_collision_rate": V.expected_collision_rate(n, 2**31)}
  return out


def run(sources: dict, out_dir: str, spec: Spec, *, split: str = "time:0.8,0.1,0.1",
        yes: bool = False, write_schema: str | None = None, overwrite: bool = False,
        records_per_shard: int = 200_000, records_per_chunk: int | None = None, out=None,
        err=None, ask=None, engine: str = "duckdb",
        workers: int | None = None, memory_limit: str = "1GB",
        rows_per_bucket: int | None = None, beam_args: list | None = None) -> dict | None:
  """Converts ``sources`` (``{None: [Source]}`` split by ``split``, or ``{split: [Source]}``)
  into ``out_dir``. Returns the ingest report (also ``out_dir/ingest.json``), or None when it
  stopped after ``write_schema`` without ``yes``. ``ask(prompt) -> bool`` confirms an inferred
  schema (default: a terminal prompt; no terminal and no ``yes`` is an error).

  ``engine``: ``duckdb`` (out of core, ``workers`` processes, ``data.engine``), ``beam`` (an
  Apache Beam pipeline, ``beam_args`` its options, ``data.beam_ingest``) or ``memory`` (the whole
  log in memory: the reference the tests compare the others with)."""
  if engine not in ENGINES:
    raise ValueError(f"engine={engine!r}; one of {ENGINES}")
  check_out(out_dir, sources, overwrite, yes, write_schema)
  clear_stale(out_dir, lambda m: print(f"{PROG}: warning: {m}", file=err or sys.stderr))
  tmp = _staging_dir(out_dir)
  if os.path.exists(tmp):
    shutil.rmtree(tmp)
  try:
    return _run(sources, out_dir, tmp, spec, split=split, yes=yes, write_schema=write_schema,
                records_per_shard=records_per_shard,
                records_per_chunk=records_per_chunk or records.INGEST_RECORDS_PER_CHUNK,
                out=out, err=err, ask=ask, engine=engine,
                workers=workers or os.cpu_count() or 1, memory_limit=memory_limit,
                rows_per_bucket=rows_per_bucket or engine_mod().ROWS_PER_BUCKET,
                beam_args=beam_args or [])
  finally:
    if os.path.exists(tmp):
      shutil.rmtree(tmp, ignore_errors=True)


def engine_mod():
  from data import engine as E
  return E


def _run(sources, out_dir, tmp, spec, *, split, yes, write_schema, records_per_shard,
         records_per_chunk, out, err,
         ask, engine, workers, memory_limit, rows_per_bucket, beam_args):
  out, err = out or sys.stdout, err or sys.stderr
  say = lambda *a: print(*a, file=out, flush=True)
  warn = lambda m: print(f"{PROG}: warning: {m}", file=err, flush=True)
  explicit = None not in sources
  kind, vals = ("none", ()) if explicit else parse_split(split)
  split_names = [s for s in SPLITS if s in sources] + sorted(set(sources) - set(SPLITS))
  log = Coercions()
  cpu = {"start": time.process_time()}
  stats, order, surfaces, unknown, ts_parts, parts = {}, [], set(), {}, [], []
  names = [s.name for ss in sources.values() for s in ss]
  staging = None
  if engine != "memory":
    work = os.path.join(tmp, ".work")
    os.makedirs(work)
    staging = engine_mod().Staging(work)
  ts_lo, ts_hi = None, None
  ad_lo = ad_hi = act_lo = act_hi = None
  first_cols, key_sets = None, {}
  src_i = 0
  for sname, srcs in sources.items():
    for src in srcs:
      prog = Progress(f"scan {src.name}", src.rows, err)
      for table, first, frac in src.batches():
        try:
          cols, facts = canonical(table, spec, log)
        except CoerceError as e:
          raise _row_error(src, first, e) from None
        _scan_batch(cols, facts, stats, order, surfaces, unknown, src.name)
        ts = cols["request_ts"].to_numpy(zero_copy_only=False)
        if len(ts):
          ts_lo = int(ts.min()) if ts_lo is None else min(ts_lo, int(ts.min()))
          ts_hi = int(ts.max()) if ts_hi is None else max(ts_hi, int(ts.max()))
          ad = cols["_ad_feature"].to_numpy(zero_copy_only=False)
          ad_lo = int(ad.min()) if ad_lo is None else min(ad_lo, int(ad.min()))
          ad_hi = int(ad.max()) if ad_hi is None else max(ad_hi, int(ad.max()))
          if "_action" in cols:
            ac = cols["_action"].to_numpy(zero_copy_only=False)
            act_lo = int(ac.min()) if act_lo is None else min(act_lo, int(ac.min()))
            act_hi = int(ac.max()) if act_hi is None else max(act_hi, int(ac.max()))
        for k in facts.get("hashed_keys", ()):
          sset = key_sets.setdefault(k, set())
          if sset is not None:
            sset.update(np.unique(cols[k].to_numpy(zero_copy_only=False)).tolist())
            if len(sset) > 1 << 22:
              key_sets[k] = None
        first_cols = first_cols or cols
        if engine == "memory":
          ts_parts.append(ts)
          if spec.history is not None:
            parts.append((sname, src, first, cols))
        elif engine == "duckdb":
          staging.add(cols, src_i, first, -1 if sname is None else split_names.index(sname))
        else:
          staging.add({"request_ts": cols["request_ts"]}, src_i, first, -1)
        prog.add(table.num_rows, frac)
      prog.close()
      src.counted = prog.done
      src_i += 1
  cpu["scan"] = time.process_time() - cpu.pop("start")
  if ts_lo is None:
    raise ValueError("the input has no rows")
  if ts_hi > coerce.INT32_MAX or ts_lo < 0:
    raise ValueError(f"request_ts ranges over {ts_lo}..{ts_hi}, outside unix seconds "
                     "in int32; are the times in ms or us? pass --ts_unit ms|us")
  hist = plan = None
  hs = None
  if spec.history is not None:
    ev = [c for c in order if role(c) == "events"]
    if ev:
      raise ValueError(f"--history builds the event streams, but the log also has {ev}")
    base, _, _ = propose(stats, surfaces, order, spec)
    tasks = [t["name"] for t in base["tasks"]]
    if engine == "memory":
      hist = history.FlatLogHistories([p[3] for p in parts], spec, base["surfaces"], tasks, log)
      if hist.stats:
        order += [f"dense.{k}" for k in hist.index.stats(np.zeros(0, np.int64))]
      hs = {s: {"max_len": hist.max_len, "item_vocab": hist.item_vocab,
                "action_vocab": hist.action_vocab} for s in hist.observed_len}
    else:
      null_free = [t for t in tasks if f"label.{t}" in stats and not stats[f"label.{t}"].nulls]
      plan = _history_plan(spec, first_cols, tasks, (ad_lo, ad_hi), (act_lo, act_hi), log,
                           null_free, sum(s.counted for ss in sources.values() for s in ss))
      if plan["stats"]:
        order += [f"dense.{k}" for k in engine_mod().stat_names(tasks)]
      hs = {s: {"max_len": plan["max_len"], "item_vocab": plan["item_vocab"],
                "action_vocab": plan["action_vocab"]} for s in plan["streams"]}
  proposal, hashed_events, notes = propose(stats, surfaces, order, spec, hs)
  schema = schema_from(proposal, "proposed schema" if len(spec.schema) < 5 else "--schema")
  full = Spec(**{**spec.to_dict(), "schema": proposal, "hashed_events": hashed_events})
  shown = set(log.lines())
  for line in log.lines():
    say(f"coercion: {line}")
  if unknown:
    warn(f"columns with no role, not converted: {sorted(unknown)} (rename them to a role with "
         "--rename or a 'columns' entry, or drop them)")
  if not spec.ids_as_features:
    say("note: user_id / ad_id are join keys only: the model never sees them; pass "
        "--ids_as_features to also feed them as sparse features")
  for n_ in notes:
    say(f"note: {n_}")
  if not schema.streams:
    say("note: no event streams: the model sees context features only (a flat interaction log? "
        "--history builds streams from each user's earlier rows)")
  key_stats = {k: len(v) for k, v in key_sets.items() if v is not None}
  enc = encodings(stats, order, schema, spec, key_stats)
  for c, d in enc.items():
    if d.get("colliding_values"):
      warn(f"{c}: {d['colliding_values']} of its {d['distinct']} distinct values share a hash "
           f"row with another ({d['distinct'] - d['rows_used']} merged; vocab_size "
           f"{d['vocab_size']}); give it an exact vocabulary (vocab: {{{c.split('.', 1)[1]}: "
           "exact}) or a larger vocab_size")
  inferred = [k for k in ("sparse", "dense", "streams", "surfaces", "tasks")
              if k not in spec.schema]
  if inferred:
    say(f"proposed spec (inferred: {', '.join(inferred)}):")
    shown_spec = full.to_dict()
    from data.vocab import display
    shown_spec["schema"] = {**proposal, "sparse": [
        {**f, "vocab": display(f["vocab"])} if f.get("vocab") else f
        for f in proposal["sparse"]]}
    say(json.dumps(shown_spec, indent=1))
  if write_schema:
    with open(write_schema, "w") as f:
      if write_schema.endswith((".yaml", ".yml")):
        import yaml
        yaml.safe_dump(full.to_dict(), f, sort_keys=False)
      else:
        json.dump(full.to_dict(), f, indent=1)
    say(f"wrote {write_schema}: edit it and run again with --schema {write_schema}")
    if not yes:
      return None
  if inferred and not yes:
    if ask is None and not sys.stdin.isatty():
      raise ValueError("the schema above was inferred: pass --yes to accept it, or "
                       "--write_schema FILE to edit it and pass it back with --schema FILE")
    ask = ask or (lambda p: input(p).strip().lower() in ("y", "yes"))
    if not ask("Write the dataset with this schema? [y/N] "):
      raise ValueError("not confirmed; nothing written")

  con = None
  if engine != "memory":
    con = engine_mod().connect(os.path.join(tmp, ".work"), workers, memory_limit)
  if kind == "none":
    t1 = t2 = float("inf")
  elif engine == "memory":
    t1, t2 = cut_times(np.concatenate(ts_parts), kind, vals)
  else:
    t1, t2 = engine_mod().split_times(con, staging, kind, vals)
  if explicit:
    used = split_names
  else:
    used = ["train"] + (["valid"] if t2 > t1 else []) + (["eval"] if np.isfinite(t2) else [])
  c0 = time.process_time()
  ctx = {"schema": schema.to_dict(), "spec": full.to_dict(), "hashed_events": hashed_events,
         "plan": plan, "sources": names, "explicit": explicit,
         "splits": split_names if explicit else ["train", "valid", "eval"], "used": used,
         "route": [t1, t2], "records_per_shard": records_per_shard,
         "records_per_chunk": records_per_chunk,
         "worker_memory": "512MB"}
  if engine == "memory":
    counts, pos, lab, manifest = _convert_memory(sources, tmp, schema, full, hashed_events, log,
                                                 hist, parts, used, (t1, t2),
                                                 (records_per_shard, records_per_chunk),
                                                 err, spec)
  elif engine == "duckdb":
    counts, pos, lab, manifest = _convert_engine(con, staging, tmp, schema, ctx, log, workers,
                                                 rows_per_bucket, err, cpu)
    con = None
  else:
    con.close()
    con = None
    from data import beam_ingest
    counts, pos, lab, manifest = beam_ingest.convert(sources, tmp, schema, ctx, log,
                                                     rows_per_bucket, beam_args, err)
  if con is not None:
    con.close()
  for line in log.lines():                       # coercions only the conversion met
    if line not in shown:
      say(f"coercion: {line}")
  cpu["convert_parent"] = time.process_time() - c0 - cpu.get("partition", 0.0)
  report = {
      "inputs": names, "engine": engine, "spec": full.to_dict(), "cpu_s": cpu,
      "split": ({"kind": "explicit"} if explicit else
                {"kind": kind, "values": list(vals), "t1": t1, "t2": t2}),
      "coercions": log.lines(), "unknown_columns": sorted(unknown),
      "encodings": enc,
      "counts": counts,
      "positive_rate": {s: {t.name: (pos[s][j] / lab[s][j] if lab[s][j] else None)
                            for j, t in enumerate(schema.tasks)} for s in used},
      "examples": {s: sum(e["count"] for es in manifest["splits"][s].values() for e in es)
                   for s in used},
  }
  shutil.rmtree(os.path.join(tmp, ".work"), ignore_errors=True)
  with open(os.path.join(tmp, "ingest.json"), "w") as f:
    json.dump(report, f, indent=1, default=float)
  publish(tmp, out_dir)
  if kind in ("time", "ts"):
    say(f"split {kind}: train < {_utc(t1)} <= valid < {_utc(t2)} <= eval")
  for s in used:
    rates = ", ".join(f"{t}={'-' if r is None else f'{r:.4f}'}"
                      for t, r in report["positive_rate"][s].items())
    say(f"{s}: {sum(counts[s].values()):,} examples {dict(counts[s])}; positive rate {rates}")
  hashed = {c: d for c, d in enc.items() if d["kind"] == "hash"}
  if hashed:
    say("hashed columns (expected share of values colliding): " + ", ".join(
        f"{c} {d['expected_collision_rate']:.2%}" for c, d in hashed.items()))
  say(f"wrote {out_dir} (schema.json, manifest.json, ingest.json). Train with:\n"
      f"  python train.py --config=kunlun/configs/tiny.py --workdir=runs/mine --data_dir={out_dir}")
  return report


def _convert_memory(sources, tmp, schema, full, hashed_events, log, hist, parts, used, cuts,
                    per_shard_chunk, err, spec):
  """The reference conversion: the whole log in memory (``data.history``), one process.
  ``per_shard_chunk``: (records per shard, records per chunk)."""
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
      raise _row_error(src, first, e) from None
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
            raise _row_error(src, first, e) from None
          prog.add(convert(src, sname, first, cols), frac)
        prog.close()
  return counts, pos, lab, writer.close(tuple(used))


def _convert_engine(con, staging, tmp, schema, ctx, log, workers, rows_per_bucket, err, cpu):
  """Passes 2 and 3 on the embedded engine (``data.engine``)."""
  E = engine_mod()
  work = os.path.join(tmp, ".work")
  c0 = time.process_time()
  if ctx["plan"] is not None:
    buckets = max(1, -(-staging.rows // rows_per_bucket))
    groups = E.partition(con, staging, ctx["plan"], work, buckets)
  else:
    groups = E.part_groups(staging, rows_per_bucket)
  con.close()
  cpu["partition"] = time.process_time() - c0
  tasks = [{"id": i, **g, "ctx": ctx, "out_dir": tmp, "work_dir": work}
           for i, g in enumerate(groups)]
  prog = Progress(f"convert ({min(workers, len(tasks))} workers)", staging.rows, err)
  results = E.run_tasks(tasks, workers, prog.add)
  prog.close()
  used = ctx["used"]
  counts = {s: {} for s in used}
  pos = {s: np.zeros(len(schema.tasks)) for s in used}
  lab = {s: np.zeros(len(schema.tasks)) for s in used}
  files = {}
  for k in ("queries", "history", "encode", "write"):
    cpu[f"tasks_{k}"] = sum(r["cpu_s"][k] for r in results)
  for r in results:
    for m, v in r["log"].items():
      log.add(m, v)
    for s in used:
      for surface, c in r["counts"][s].items():
        counts[s][surface] = counts[s].get(surface, 0) + c
      pos[s] += r["pos"][s]
      lab[s] += r["lab"][s]
    for key, fs in r["files"].items():
      files.setdefault(tuple(key), []).extend(fs)
  return counts, pos, lab, write_manifest(tmp, schema, used, files)


def write_manifest(out_dir: str, schema, used, files: dict) -> dict:
  """Renames each (split, surface)'s shards ``[(rel, count, bytes, sha256)]`` (in order) to
  ``<surface>-0000i-of-0000N.arrayrecord``, adds an empty shard where a split has no records of
  a surface, then writes ``schema.json`` and ``manifest.json`` (last: its presence marks the
  dataset complete)."""
  from array_record.python import array_record_module
  manifest = {"format": records.FORMAT, "splits": {}}
  for split in used:
    os.makedirs(os.path.join(out_dir, split), exist_ok=True)
    for surface in schema.surfaces:
      fs = files.get((split, surface), [])
      if not fs:
        rel = os.path.join(split, f".{surface}-empty.tmp")
        array_record_module.ArrayRecordWriter(os.path.join(out_dir, rel),
                                              records.WRITER_OPTIONS).close()
        fs = [(rel, 0, None, None)]
      entries = []
      for i, (rel, c, size, sha) in enumerate(fs):
        final = os.path.join(split, records.shard_name(surface, i, len(fs)))
        os.replace(os.path.join(out_dir, rel), os.path.join(out_dir, final))
        if sha is None:
          entries.append(shards.file_entry(out_dir, final, c))
        else:
          entries.append({"file": final, "count": int(c), "bytes": int(size), "sha256": sha})
      manifest["splits"].setdefault(split, {})[surface] = entries
  schema.save(out_dir)
  with open(os.path.join(out_dir, "manifest.json"), "w") as f:
    json.dump(manifest, f, indent=1)
  return manifest


# ---- command line -----------------------------------------------------------------------------

def _files(values) -> list[str]:
  return [p for v in values or () for p in v.split(",") if p]


def build_spec(args) -> Spec:
  spec = Spec.load(args.schema) if args.schema else Spec()
  d = spec.to_dict()
  if args.rename:
    cols = dict(d["columns"])
    for part in args.rename.split(","):
      r, sep, c = part.partition("=")
      if not sep or not r or not c:
        raise ValueError(f"--rename={args.rename}: expected role=column,... (e.g. "
                         "request_ts=time,label.click=clicked)")
      cols[r.strip()] = c.strip()
    d["columns"] = cols
  for k in ("surface", "ts_unit"):
    if getattr(args, k) is not None:
      d[k] = getattr(args, k)
  for k in ("ids_as_features", "truncate_history"):
    if getattr(args, k):
      d[k] = True
  if args.history:
    streams = {}
    for part in args.history.split(","):
      name, sep, sel = part.partition("=")
      streams[name.strip()] = sel.strip() if sep else "all"
    d["history"] = {"streams": streams, "max_len": args.history_len,
                    "stats": bool(args.history_stats), "action": args.history_action}
  return Spec.from_dict(d, "options")


def run_cli(prog: str, fn) -> int:
  """Runs ``fn()`` for a command line: bad input (``ValueError`` / ``OSError``) is one line
  ``<prog>: error: ...`` on stderr and status 2; Ctrl-C is status 130 without a traceback."""
  try:
    fn()
  except (ValueError, OSError) as e:
    print(f"{prog}: error: {' '.join(str(e).split())}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print(f"{prog}: interrupted", file=sys.stderr)
    return 130
  return 0


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog=f"python -m {PROG}", description=__doc__.split("\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--input", action="extend", nargs="+", help="Parquet / CSV files (several, "
                 "comma-separated or repeated: a shell glob works), split by --split")
  for s in SPLITS:
    p.add_argument(f"--{s}", action="extend", nargs="+",
                   help=f"files of the {s} split (instead of --input)")
  p.add_argument("--out", required=True, help="output dataset directory")
  p.add_argument("--schema", help="spec file (JSON / YAML): renames, options, schema sections")
  p.add_argument("--rename", help="role=column,... e.g. request_ts=time,label.click=clicked")
  p.add_argument("--surface", help="surface name of every row when there is no surface column")
  p.add_argument("--ids_as_features", action="store_true",
                 help="also feed user_id / ad_id to the model as sparse features")
  p.add_argument("--truncate_history", action="store_true",
                 help="keep the most recent max_len events of longer histories")
  p.add_argument("--ts_unit", choices=("s", "ms", "us"), help="unit of integer times")
  p.add_argument("--history", help="flat log: build streams from earlier rows, e.g. "
                 "click=label.click,impression=all")
  p.add_argument("--history_len", type=int, default=50, help="events kept per built stream")
  p.add_argument("--history_stats", action="store_true",
                 help="add earlier-count / positive-rate dense features per user and ad")
  p.add_argument("--history_action", help="integer column used as the event action "
                 "(default: the row's labels as bits)")
  p.add_argument("--split", default="time:0.8,0.1,0.1", help="time:A,B,C | ts:T1,T2 | none")
  p.add_argument("--yes", action="store_true", help="accept an inferred schema")
  p.add_argument("--write_schema", help="write the proposed spec to this file")
  p.add_argument("--overwrite", action="store_true", help="replace an existing dataset in --out")
  p.add_argument("--records_per_shard", type=int, default=200_000)
  p.add_argument("--records_per_chunk", type=int, default=records.INGEST_RECORDS_PER_CHUNK,
                 help="records per ArrayRecord chunk (the unit of a random read and of a hash "
                 "check; the writer's cost is per chunk)")
  p.add_argument("--delimiter", help="CSV field delimiter (default , ; tab for .tsv / .inter)")
  p.add_argument("--runner", choices=("duckdb", "beam"), default="duckdb",
                 help="duckdb: out of core on this machine (default); beam: an Apache Beam "
                 "pipeline (other arguments are its pipeline options, e.g. --runner_options "
                 "below, --beam_runner=FlinkRunner ...)")
  p.add_argument("--workers", type=int, help="processes converting buckets (default: all cores)")
  p.add_argument("--memory_limit", default="1GB", help="DuckDB memory limit (it spills beyond)")
  args, rest = p.parse_known_args(argv)
  if rest and args.runner != "beam":
    p.error(f"unrecognized arguments: {' '.join(rest)}")
  if args.records_per_shard < 1:
    p.error(f"--records_per_shard={args.records_per_shard} must be >= 1")
  if args.records_per_chunk < 1:
    p.error(f"--records_per_chunk={args.records_per_chunk} must be >= 1")
  if args.workers is not None and args.workers < 1:
    p.error(f"--workers={args.workers} must be >= 1")

  def go():
    spec = build_spec(args)
    mk = lambda files: [Source(f, delimiter=args.delimiter) for f in _files(files)]
    explicit = {s: mk(getattr(args, s)) for s in SPLITS if getattr(args, s)}
    if explicit and args.input:
      raise ValueError("give either --input (with --split) or --train/--valid/--eval, not both")
    sources = explicit or {None: mk(args.input)}
    if not any(sources.values()):
      raise ValueError("no input files (--input or --train/--valid/--eval)")
    run(sources, args.out, spec, split=args.split, yes=args.yes, write_schema=args.write_schema,
        overwrite=args.overwrite, records_per_shard=args.records_per_shard,
        records_per_chunk=args.records_per_chunk, engine=args.runner,
        workers=args.workers, memory_limit=args.memory_limit, beam_args=rest)
  return run_cli(PROG, go)


if __name__ == "__main__":
  sys.exit(main())
