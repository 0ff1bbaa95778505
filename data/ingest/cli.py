"""Your logs -> a kunlun dataset, without code: Parquet / CSV -> ArrayRecord + schema.json.

  python -m data.ingest --input logs.parquet --out data/mine \
      --rename request_ts=time,ad_id=item,label.click=clicked --ids_as_features --yes

The command line of ``driver.run`` (flags -> a ``Spec`` and ``Source`` lists); ``run_cli``: bad
input is one line ``<prog>: error: ...`` and status 2. Column layout and examples: data/README.md.
"""

from __future__ import annotations

import argparse
import sys

from data import records
from data.ingest.driver import run
from data.ingest.infer import Spec
from data.ingest.output import check_paths
from data.ingest.sources import PROG, Source
from data.ingest.splits import SPLITS


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
  if args.label_delay:
    if not d.get("history"):
      raise ValueError("--label_delay applies to built histories: give --history too")
    delays = dict(d["history"].get("label_delay") or {})
    for part in args.label_delay.split(","):
      t, sep, v = part.partition("=")
      if not sep or not t.strip():
        raise ValueError(f"--label_delay={args.label_delay}: expected task=duration,... (e.g. "
                         "click=0s,conversion=1d)")
      delays[t.strip()] = v.strip()
    d["history"] = {**d["history"], "label_delay": delays}
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
  p.add_argument("--label_delay", help="task=duration,... how long after its event a label "
                 "becomes visible to later requests in built histories and --history_stats "
                 "(e.g. click=immediate,cvr=1d; at most 365d). Every task of a built history "
                 "needs one; only click (immediate) and conversion (1d) have a default")
  p.add_argument("--history_action", help="integer column used as the event action "
                 "(default: the row's labels as bits)")
  p.add_argument("--allow_overlap", action="store_true",
                 help="accept --train / --valid / --eval files that overlap in time (a warning)")
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
    check_paths(args.out, args.write_schema, sources, args.schema)     # the --schema file too
    run(sources, args.out, spec, split=args.split, yes=args.yes, write_schema=args.write_schema,
        overwrite=args.overwrite, records_per_shard=args.records_per_shard,
        records_per_chunk=args.records_per_chunk, engine=args.runner,
        workers=args.workers, memory_limit=args.memory_limit, beam_args=rest,
        allow_overlap=args.allow_overlap)
  return run_cli(PROG, go)
