"""``data.ingest.run``: Parquet / CSV logs -> a kunlun dataset (ArrayRecord + schema.json +
manifest.json + ingest.json), in three steps whatever the runner: the scan (``scan.Scan``), the
schema proposal and its confirmation, then the runner's conversion (``RUNNERS``) into a staging
folder that is renamed into place (``output``)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

import numpy as np

from data import records
from data.ingest.beam import BeamRunner
from data.ingest.coerce import INT32_MAX, CoerceError, Coercions
from data.ingest.engine import ROWS_PER_BUCKET, EngineRunner
from data.ingest.infer import Spec, label_delays, propose, role, schema_from
from data.ingest.layout import canonical
from data.ingest.memory import MemoryRunner
from data.ingest.output import check_out, clear_stale, publish, staging_dir
from data.ingest.runner import Options
from data.ingest.scan import Scan
from data.ingest.sources import PROG, Progress, key_decision, row_error
from data.ingest.splits import SPLITS, parse_split, utc
from data.ingest.sql import check_memory_limit, check_workers
from data.ingest.vocab import display, encodings

RUNNERS = {"duckdb": EngineRunner, "memory": MemoryRunner, "beam": BeamRunner}
ENGINES = tuple(RUNNERS)


def run(sources: dict, out_dir: str, spec: Spec, *, split: str = "time:0.8,0.1,0.1",
        yes: bool = False, write_schema: str | None = None, overwrite: bool = False,
        records_per_shard: int = 200_000, records_per_chunk: int | None = None, out=None,
        err=None, ask=None, engine: str = "duckdb",
        workers: int | None = None, memory_limit: str = "1GB",
        rows_per_bucket: int | None = None, beam_args: list | None = None,
        allow_overlap: bool = False) -> dict | None:
  """Converts ``sources`` (``{None: [Source]}`` split by ``split``, or ``{split: [Source]}``)
  into ``out_dir``. Returns the ingest report (also ``out_dir/ingest.json``), or None when it
  stopped after ``write_schema`` without ``yes``. ``ask(prompt) -> bool`` confirms an inferred
  schema (default: a terminal prompt; no terminal and no ``yes`` is an error).

  ``engine``: a runner of ``RUNNERS``: ``duckdb`` (out of core, ``workers`` processes,
  ``engine``), ``beam`` (an Apache Beam pipeline, ``beam_args`` its options, ``beam``) or
  ``memory`` (the whole log in memory: the reference the tests compare the others with).

  Explicit splits (``{split: [Source]}``) must follow each other in time (an earlier split's
  rows all at or before a later split's first request_ts) unless ``allow_overlap`` (a
  warning); one file given twice is an error."""
  if engine not in ENGINES:
    raise ValueError(f"engine={engine!r}; one of {ENGINES}")
  check_memory_limit(memory_limit, "--memory_limit")
  if workers is not None:
    check_workers(workers, "--workers")
  if records_per_chunk is not None and not 1 <= records_per_chunk <= records.MAX_RECORDS_PER_CHUNK:
    raise ValueError(f"--records_per_chunk={records_per_chunk} must be in "
                     f"[1, {records.MAX_RECORDS_PER_CHUNK}] (a random read decodes its chunk)")
  _check_distinct(sources)
  out_dir = os.path.realpath(out_dir)        # a link at --out stays; its target is written
  check_out(out_dir, sources, overwrite, yes, write_schema)
  clear_stale(out_dir, lambda m: print(f"{PROG}: warning: {m}", file=err or sys.stderr))
  tmp = staging_dir(out_dir)
  if os.path.exists(tmp):
    shutil.rmtree(tmp)
  try:
    return _run(sources, out_dir, tmp, spec, split=split, yes=yes, write_schema=write_schema,
                records_per_shard=records_per_shard,
                records_per_chunk=records_per_chunk or records.INGEST_RECORDS_PER_CHUNK,
                out=out, err=err, ask=ask, engine=engine,
                workers=workers or os.cpu_count() or 1, memory_limit=memory_limit,
                rows_per_bucket=rows_per_bucket or ROWS_PER_BUCKET,
                beam_args=beam_args or [], allow_overlap=allow_overlap)
  finally:
    if os.path.exists(tmp):
      shutil.rmtree(tmp, ignore_errors=True)


def _run(sources, out_dir, tmp, spec, *, split, yes, write_schema, records_per_shard,
         records_per_chunk, out, err, ask, engine, workers, memory_limit, rows_per_bucket,
         beam_args, allow_overlap):
  out, err = out or sys.stdout, err or sys.stderr
  say = lambda *a: print(*a, file=out, flush=True)
  warn = lambda m: print(f"{PROG}: warning: {m}", file=err, flush=True)
  explicit = None not in sources
  kind, vals = ("none", ()) if explicit else parse_split(split)
  split_names = [s for s in SPLITS if s in sources] + sorted(set(sources) - set(SPLITS))
  log = Coercions()
  cpu = {"start": time.process_time()}
  names = [s.name for ss in sources.values() for s in ss]
  keys = sorted(set(spec.hash_keys) | set(key_decision(sources, spec.columns)))
  spec = Spec(**{**spec.to_dict(), "hash_keys": keys})      # one decision per id column
  runner = RUNNERS[engine](tmp, spec, Options(workers, memory_limit, rows_per_bucket, beam_args,
                                              err))
  try:
    scan = _scan(sources, spec, log, runner, split_names, err)
    if explicit:
      _check_overlap(scan.split_ts, allow_overlap, warn)
    cpu["scan"] = time.process_time() - cpu.pop("start")
    proposal = _propose(scan, sources, spec, log, runner, say, warn)
    if not _confirm(proposal, spec, yes, write_schema, ask, say):
      return None
    schema, full, hashed_events, enc, shown, _ = proposal
    t1 = t2 = float("inf")
    if kind != "none":
      t1, t2 = runner.split_times(kind, vals)
    if kind == "ts" and t1 <= scan.ts[0]:
      raise ValueError(f"--split={split}: no train rows (the earliest request_ts is "
                       f"{utc(scan.ts[0])}, not before T1 {utc(t1)})")
    if explicit and "train" in sources and not sum(s.counted for s in sources["train"]):
      raise ValueError("--train: its files have no rows")
    if explicit:
      used = split_names
    else:
      used = ["train"] + (["valid"] if t2 > t1 else []) + (["eval"] if np.isfinite(t2) else [])
    c0 = time.process_time()
    ctx = {"schema": schema.to_dict(), "spec": full.to_dict(), "hashed_events": hashed_events,
           "plan": runner.plan, "sources": names, "explicit": explicit,
           "splits": split_names if explicit else ["train", "valid", "eval"], "used": used,
           "route": [t1, t2], "records_per_shard": records_per_shard,
           "records_per_chunk": records_per_chunk,
           "worker_memory": "512MB"}
    counts, pos, lab, manifest = runner.convert(sources, full, schema, ctx, log, cpu)
  finally:
    runner.close()
  for line in log.lines():                       # coercions only the conversion met
    if line not in shown:
      say(f"coercion: {line}")
  cpu["convert_parent"] = time.process_time() - c0 - cpu.get("partition", 0.0)
  report = {
      "inputs": names, "engine": engine, "spec": full.to_dict(), "cpu_s": cpu,
      "split": ({"kind": "explicit"} if explicit else
                {"kind": kind, "values": list(vals), "t1": t1, "t2": t2}),
      "label_delays": (label_delays(full.history, schema.task_names) if full.history else None),
      "coercions": log.lines(), "unknown_columns": sorted(scan.unknown),
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
  _summary(report, kind, (t1, t2), used, enc, out_dir, say)
  return report


def _check_distinct(sources: dict) -> None:
  """One input file given twice (in one split or two) is an error."""
  seen = {}
  for sname, srcs in sources.items():
    for s in srcs:
      if s.path is None:
        continue
      key = os.path.realpath(s.path)
      where = f"--{sname}" if sname else "--input"
      if key in seen:
        raise ValueError(f"{s.path} is given twice ({seen[key]} and {where}): each input once")
      seen[key] = where


def _check_overlap(split_ts: dict, allow: bool, warn) -> None:
  """Explicit split files must follow each other in time (train, valid, eval): a later split's
  rows in an earlier split's histories and statistics are leaked labels."""
  named = [s for s in SPLITS if split_ts.get(s, (None,))[0] is not None]
  for i, a in enumerate(named):
    for b in named[i + 1:]:
      if split_ts[a][1] > split_ts[b][0]:
        msg = (f"--{a} and --{b} overlap in time: {a}'s rows run to {utc(split_ts[a][1])}, "
               f"{b}'s start at {utc(split_ts[b][0])} (the {a} rows' histories and statistics "
               f"would hold {b} rows with their labels)")
        if not allow:
          raise ValueError(msg + "; pass --allow_overlap to accept it")
        warn(msg + " (--allow_overlap)")


def _scan(sources, spec, log, runner, split_names, err) -> Scan:
  """Pass 1: every batch of every source coerced (``layout.canonical``), scanned and staged by
  the runner; ``src.counted`` = its rows."""
  scan = Scan()
  src_i = 0
  for sname, srcs in sources.items():
    split_i = -1 if sname is None else split_names.index(sname)
    for src in srcs:
      prog = Progress(f"scan {src.name}", src.rows, err)
      for table, first, frac in src.batches():
        try:
          cols, facts = canonical(table, spec, log)
        except CoerceError as e:
          raise row_error(src, first, e) from None
        scan.add(cols, facts, src.name, sname)
        runner.stage(sname, split_i, src_i, src, first, cols)
        prog.add(table.num_rows, frac)
      prog.close()
      src.counted = prog.done
      src_i += 1
  ts_lo, ts_hi = scan.ts
  if ts_lo is None:
    raise ValueError("the input has no rows")
  if ts_hi > INT32_MAX or ts_lo < 0:
    raise ValueError(f"request_ts ranges over {ts_lo}..{ts_hi}, outside unix seconds "
                     "in int32; are the times in ms or us? pass --ts_unit ms|us")
  return scan


def _propose(scan, sources, spec, log, runner, say, warn):
  """The schema from the scan (and the runner's history plan), with its notes and warnings
  printed: ``(schema, full spec, hashed_events, encodings, coercion lines shown, schema
  sections)``."""
  hs = None
  if spec.history is not None:
    ev = [c for c in scan.order if role(c) == "events"]
    if ev:
      raise ValueError(f"--history builds the event streams, but the log also has {ev}")
    base, _, _ = propose(scan.stats, scan.surfaces, scan.order, spec)
    tasks = [t["name"] for t in base["tasks"]]
    delays = label_delays(spec.history, tasks)        # refused when one is not known
    stated = spec.history.get("label_delay") or {}
    say("label delays: " + ", ".join(
        f"{t} {records.show_duration(d)} ({'stated' if t in stated else 'default of the name'})"
        for t, d in delays.items()) + " (a row's label reaches later rows' histories and "
        "statistics this long after its event)")
    spec = Spec(**{**spec.to_dict(), "history": {**spec.history, "label_delay": {
        t: records.show_duration(d) for t, d in delays.items()}}})
    hs, extra = runner.history(scan, base["surfaces"], tasks, log,
                               sum(s.counted for ss in sources.values() for s in ss))
    scan.order += extra
  proposal, hashed_events, notes = propose(scan.stats, scan.surfaces, scan.order, spec, hs)
  if not proposal["sparse"] and not proposal["dense"]:
    raise ValueError("no sparse or dense feature: the model needs at least one context feature; "
                     "name columns sparse.<f> / dense.<f> (--rename), or pass --ids_as_features "
                     "(or --history_stats with --history)")
  schema = schema_from(proposal, "proposed schema" if len(spec.schema) < 5 else "--schema")
  full = Spec(**{**spec.to_dict(), "schema": proposal, "hashed_events": hashed_events})
  shown = set(log.lines())
  for line in log.lines():
    say(f"coercion: {line}")
  if scan.unknown:
    warn(f"columns with no role, not converted: {sorted(scan.unknown)} (rename them to a role "
         "with --rename or a 'columns' entry, or drop them)")
  if not spec.ids_as_features:
    say("note: user_id / ad_id are join keys only: the model never sees them; pass "
        "--ids_as_features to also feed them as sparse features")
  for n_ in notes:
    say(f"note: {n_}")
  if not schema.streams:
    say("note: no event streams: the model sees context features only (a flat interaction log? "
        "--history builds streams from each user's earlier rows)")
  enc = encodings(scan.stats, scan.order, schema, spec, scan.key_stats())
  for c, d in enc.items():
    if d.get("colliding_values"):
      warn(f"{c}: {d['colliding_values']} of its {d['distinct']} distinct values share a hash "
           f"row with another ({d['distinct'] - d['rows_used']} merged; vocab_size "
           f"{d['vocab_size']}); give it an exact vocabulary (vocab: {{{c.split('.', 1)[1]}: "
           "exact}) or a larger vocab_size")
  return schema, full, hashed_events, enc, shown, proposal


def _confirm(proposal, spec, yes, write_schema, ask, say) -> bool:
  """Shows an inferred spec, writes ``write_schema``, asks for confirmation; False: stop after
  ``write_schema`` (no ``yes``)."""
  _, full, _, _, _, sections = proposal
  inferred = [k for k in ("sparse", "dense", "streams", "surfaces", "tasks")
              if k not in spec.schema]
  if inferred:
    say(f"proposed spec (inferred: {', '.join(inferred)}):")
    shown_spec = full.to_dict()
    shown_spec["schema"] = {**sections, "sparse": [
        {**f, "vocab": display(f["vocab"])} if f.get("vocab") else f
        for f in sections["sparse"]]}
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
      return False
  if inferred and not yes:
    if ask is None and not sys.stdin.isatty():
      raise ValueError("the schema above was inferred: pass --yes to accept it, or "
                       "--write_schema FILE to edit it and pass it back with --schema FILE")
    ask = ask or (lambda p: input(p).strip().lower() in ("y", "yes"))
    if not ask("Write the dataset with this schema? [y/N] "):
      raise ValueError("not confirmed; nothing written")
  return True


def _summary(report, kind, cuts, used, enc, out_dir, say) -> None:
  counts = report["counts"]
  if kind in ("time", "ts"):
    say(f"split {kind}: train < {utc(cuts[0])} <= valid < {utc(cuts[1])} <= eval")
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
