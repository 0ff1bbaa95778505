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
impression=all`` builds each row's event streams from the same user's strictly earlier rows
(data.history; whole log in memory), ``--history_stats`` adds earlier-count / rate features.
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

from data import coerce, history, records
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


def run(sources: dict, out_dir: str, spec: Spec, *, split: str = "time:0.8,0.1,0.1",
        yes: bool = False, write_schema: str | None = None, overwrite: bool = False,
        records_per_shard: int = 200_000, out=None, err=None, ask=None) -> dict | None:
  """Converts ``sources`` (``{None: [Source]}`` split by ``split``, or ``{split: [Source]}``)
  into ``out_dir``. Returns the ingest report (also ``out_dir/ingest.json``), or None when it
  stopped after ``write_schema`` without ``yes``. ``ask(prompt) -> bool`` confirms an inferred
  schema (default: a terminal prompt; no terminal and no ``yes`` is an error)."""
  out, err = out or sys.stdout, err or sys.stderr
  say = lambda *a: print(*a, file=out, flush=True)
  warn = lambda m: print(f"{PROG}: warning: {m}", file=err, flush=True)
  if os.path.exists(out_dir) and os.listdir(out_dir) and (yes or not write_schema):
    if not (overwrite and os.path.exists(os.path.join(out_dir, "manifest.json"))):
      raise ValueError(f"--out={out_dir} exists and is not empty" + (
          " (and is not a kunlun dataset: not removed)" if overwrite else
          "; pass --overwrite to replace a dataset written before"))
  explicit = None not in sources
  kind, vals = ("none", ()) if explicit else parse_split(split)
  log = Coercions()
  stats, order, surfaces, unknown, ts_parts, parts = {}, [], set(), {}, [], []
  for sname, srcs in sources.items():
    for src in srcs:
      prog = Progress(f"scan {src.name}", src.rows, err)
      for table, first, frac in src.batches():
        try:
          cols, facts = canonical(table, spec, log)
        except CoerceError as e:
          raise _row_error(src, first, e) from None
        _scan_batch(cols, facts, stats, order, surfaces, unknown, src.name)
        ts_parts.append(cols["request_ts"].to_numpy(zero_copy_only=False))
        if spec.history is not None:
          parts.append((sname, src, first, cols))
        prog.add(table.num_rows, frac)
      prog.close()
      src.counted = prog.done
  if not ts_parts or not sum(map(len, ts_parts)):
    raise ValueError("the input has no rows")
  ts_all = np.concatenate(ts_parts)
  if ts_all.max() > coerce.INT32_MAX or ts_all.min() < 0:
    raise ValueError(f"request_ts ranges over {ts_all.min()}..{ts_all.max()}, outside unix seconds "
                     "in int32; are the times in ms or us? pass --ts_unit ms|us")
  hist = None
  if spec.history is not None:
    ev = [c for c in order if role(c) == "events"]
    if ev:
      raise ValueError(f"--history builds the event streams, but the log also has {ev}")
    base, _, _ = propose(stats, surfaces, order, spec)
    hist = history.FlatLogHistories([p[3] for p in parts], spec, base["surfaces"],
                     [t["name"] for t in base["tasks"]], log)
    if hist.stats:
      order += [f"dense.{k}" for k in hist.index.stats(np.zeros(0, np.int64))]
    hs = {s: {"max_len": hist.max_len, "item_vocab": hist.item_vocab,
              "action_vocab": hist.action_vocab} for s in hist.observed_len}
  proposal, hashed_events, notes = propose(stats, surfaces, order, spec,
                                           hs if hist is not None else None)
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
  inferred = [k for k in ("sparse", "dense", "streams", "surfaces", "tasks")
              if k not in spec.schema]
  if inferred:
    say(f"proposed spec (inferred: {', '.join(inferred)}):")
    say(json.dumps(full.to_dict(), indent=1))
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

  if kind == "none":
    t1 = t2 = float("inf")
  else:
    t1, t2 = cut_times(ts_all, kind, vals)
  if explicit:
    used = [s for s in SPLITS if s in sources] + sorted(set(sources) - set(SPLITS))
  else:
    used = ["train"] + (["valid"] if t2 > t1 else []) + (["eval"] if np.isfinite(t2) else [])
  if overwrite and os.path.exists(out_dir):
    shutil.rmtree(out_dir)
  writer = records.DatasetWriter(out_dir, schema, records_per_shard)
  counts = {s: {} for s in used}
  pos = {s: np.zeros(len(schema.tasks)) for s in used}
  lab = {s: np.zeros(len(schema.tasks)) for s in used}
  route = np.array([t1, t2])

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
  for line in log.lines():                       # coercions only the conversion met
    if line not in shown:
      say(f"coercion: {line}")
  manifest = writer.close(tuple(used))
  report = {
      "inputs": [s.name for ss in sources.values() for s in ss], "spec": full.to_dict(),
      "split": ({"kind": "explicit"} if explicit else
                {"kind": kind, "values": list(vals), "t1": t1, "t2": t2}),
      "coercions": log.lines(), "unknown_columns": sorted(unknown),
      "counts": counts,
      "positive_rate": {s: {t.name: (pos[s][j] / lab[s][j] if lab[s][j] else None)
                            for j, t in enumerate(schema.tasks)} for s in used},
      "examples": {s: sum(e["count"] for es in manifest["splits"][s].values() for e in es)
                   for s in used},
  }
  with open(os.path.join(out_dir, "ingest.json"), "w") as f:
    json.dump(report, f, indent=1, default=float)
  if kind in ("time", "ts"):
    say(f"split {kind}: train < {_utc(t1)} <= valid < {_utc(t2)} <= eval")
  for s in used:
    rates = ", ".join(f"{t}={'-' if r is None else f'{r:.4f}'}"
                      for t, r in report["positive_rate"][s].items())
    say(f"{s}: {sum(counts[s].values()):,} examples {dict(counts[s])}; positive rate {rates}")
  say(f"wrote {out_dir} (schema.json, manifest.json, ingest.json). Train with:\n"
      f"  python train.py --config=kunlun/configs/tiny.py --workdir=runs/mine --data_dir={out_dir}")
  return report


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
  p.add_argument("--delimiter", help="CSV field delimiter (default , ; tab for .tsv / .inter)")
  args = p.parse_args(argv)
  if args.records_per_shard < 1:
    p.error(f"--records_per_shard={args.records_per_shard} must be >= 1")

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
        overwrite=args.overwrite, records_per_shard=args.records_per_shard)
  return run_cli(PROG, go)


if __name__ == "__main__":
  sys.exit(main())
