"""The engine's SQL and Arrow IPC helpers, shared by the DuckDB runner (``engine``), its bucket
workers (``bucket``) and the Beam runner: a DuckDB connection, the history plan (``history_plan``:
streams, statistics, vocabularies), the ad-side statistics (``ad_sql``) and a bucket's row order
(``bucket_sql``)."""

from __future__ import annotations

import os
import re

import pyarrow as pa

from data.ingest.coerce import CoerceError
from data.ingest.infer import Spec, label_delays


def _q(name: str) -> str:
  return '"' + name.replace('"', '""') + '"'


MEMORY_LIMIT = re.compile(r"\d+(\.\d+)?\s*([KMGT]i?B|B|bytes|%)", re.IGNORECASE)
MAX_THREADS = 4 * (os.cpu_count() or 1)      # the most threads / worker processes asked for


def check_memory_limit(value: str, where: str = "memory_limit") -> str:
  """``value`` if it is a size (``1GB``, ``512MiB``, ``80%``), else a one-line ValueError."""
  if not isinstance(value, str) or not MEMORY_LIMIT.fullmatch(value.strip()):
    raise ValueError(f"{where}={value!r}: expected a size such as 1GB, 512MB or 80%")
  return value.strip()


def check_workers(value: int, where: str = "workers") -> int:
  if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_THREADS:
    raise ValueError(f"{where}={value!r} must be an integer in [1, {MAX_THREADS}] (4 x the "
                     "cores of this machine)")
  return value


def connect(work_dir: str, threads: int, memory_limit: str):
  """A DuckDB connection with its settings given through the configuration API (never
  formatted into SQL): ``threads`` and ``memory_limit`` checked, the spill folder inside
  ``work_dir`` (any characters)."""
  import duckdb
  check_workers(threads, "threads")
  memory_limit = check_memory_limit(memory_limit)
  tmp = os.path.join(work_dir, "duckdb_tmp")
  os.makedirs(tmp, exist_ok=True)
  return duckdb.connect(config={"threads": threads, "memory_limit": memory_limit,
                                "temp_directory": tmp, "preserve_insertion_order": False})


def write_ipc(t: pa.Table, path: str) -> None:
  with pa.OSFile(path, "wb") as f, pa.ipc.new_file(f, t.schema) as w:
    w.write_table(t)


def read_ipc(files) -> pa.Table:
  """The rows of Arrow IPC files, in order."""
  parts = []
  for p in files:
    with pa.memory_map(p) as f:
      parts.append(pa.ipc.open_file(f).read_all())
  return pa.concat_tables(parts, promote_options="permissive") if len(parts) != 1 else parts[0]


# ---- the history plan: what the streams are, in the schema's terms ---------------------------

def stat_names(tasks) -> list[str]:
  """The dense statistics ``--history_stats`` adds, in order (as ``data.ingest.history.stats``)."""
  return [n for side in ("user", "ad") for n in
          [f"{side}_count"] + [f"{side}_{t}_rate" for t in tasks]]


def _sel(sel: str) -> str:
  """SQL: true when the row is an event of a stream with selector column ``sel``."""
  return f"(coalesce({_q(sel)}, 0) > 0.5)"


def _valid(t) -> str:
  return f"({_q('label.' + t)} IS NOT NULL)::BIGINT"


def _pos(t) -> str:
  return f"(coalesce({_q('label.' + t)}, 0) > 0.5)::BIGINT"


_BITS = 40                        # per count packed into a HUGEINT sum (3 per sum)
_AD = "PARTITION BY _ad_feature ORDER BY request_ts"
_EARLIER = f"({_AD} RANGE BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW EXCLUDE GROUP)"


def ad_counts(plan: dict) -> list[tuple[str, str, int]]:
  """``[(column, SQL 0/1 of a row, label delay)]``: the ad-side counts summed over the rows
  whose label a row sees (``e + delay < r``; delay 0: strictly earlier); a task with no delay
  whose labels the scan found never null has its valid count equal to ``_ad_count`` (not
  computed)."""
  d = plan.get("delays", {})
  out = [(f"_ap.{t}", _pos(t), d.get(t, 0)) for t in plan["tasks"]]
  return out + [(f"_av.{t}", _valid(t), d.get(t, 0)) for t in plan["tasks"]
                if d.get(t, 0) or t not in plan.get("null_free", ())]


def _frame(delay: int) -> str:
  """The window of the rows of the same ad seen ``delay`` seconds late (integer seconds:
  ``e + delay < r`` is ``e <= r - delay - 1``)."""
  if not delay:
    return _EARLIER
  return f"({_AD} RANGE BETWEEN UNBOUNDED PRECEDING AND {int(delay) + 1} PRECEDING)"


def ad_sql(plan: dict, src: str, keep: list[str]) -> str:
  """SQL: ``keep`` and the ad-side statistic counts of every row of ``src``: ``_ad_count`` =
  the same ad's rows with a strictly earlier request_ts (``rank() - 1``), and ``ad_counts``
  summed over them (a window frame that ends before the row's peers: ``EXCLUDE GROUP``).
  With ``plan["pack"]`` three counts share one window: ``_BITS``-bit fields of a HUGEINT sum
  (exact while an ad has fewer than 2**40 rows; ``pack`` is set only for logs that small)."""
  counts = ad_counts(plan)
  step = 3 if plan.get("pack") else 1
  inner, outer, packs = [f"rank() OVER ({_AD}) - 1 AS _ad_count"], [], []
  groups = []                                  # counts of one delay share windows
  for delay in sorted({c[2] for c in counts}):
    same = [c for c in counts if c[2] == delay]
    groups += [same[g:g + step] for g in range(0, len(same), step)]
  for g, part in enumerate(groups):
    frame = _frame(part[0][2])
    if step == 1:
      inner.append(f"coalesce(sum({part[0][1]}) OVER {frame}, 0)::BIGINT AS {_q(part[0][0])}")
      continue
    packed = " + ".join(f"({e}::HUGEINT << {_BITS * i})" for i, (_, e, _) in enumerate(part))
    inner.append(f"coalesce(sum({packed}) OVER {frame}, 0::HUGEINT) AS _s{g}")
    packs.append(f"_s{g}")
    mask = (1 << _BITS) - 1
    outer += [f"((_s{g} >> {_BITS * i}) & {mask})::BIGINT AS {_q(c)}"
              for i, (c, _, _) in enumerate(part)]
  sql = f"SELECT {', '.join(list(keep) + inner)} FROM {src}"
  if packs:
    sql = f"SELECT * EXCLUDE ({', '.join(packs)}), {', '.join(outer)} FROM ({sql})"
  return sql


ORDER = "ORDER BY user_id, request_ts, _src, _row"


def bucket_sql(src: str, plan: dict, key: str, keep: list[str]) -> str:
  """The order of one bucket's rows by (user, time, input, row) (``ORDER``): per row, in that
  order, ``keep`` (where the row is stored), ``_key`` (split and input) and what the histories
  need from the engine: ``_earlier`` = the number of the same user's rows with a strictly earlier
  request_ts (``rank() - 1``: in this order, the rows just before the row's own second) and,
  per stream with a selector, ``_keep.<s>`` (the row is an event of the stream). A narrow
  result: numpy then gathers the rows, counts and copies (``data.ingest.bucket.HistoryColumns``)."""
  cols = keep + [f"{key} AS _key",
                 "rank() OVER (PARTITION BY user_id ORDER BY request_ts) - 1 AS _earlier"]
  cols += [f"{_sel(sel)} AS {_q('_keep.' + s)}" for s, sel in plan["streams"].items()
           if sel is not None]
  return f"SELECT {', '.join(cols)} FROM {src} {ORDER}"


def history_plan(spec: Spec, first_cols: dict, tasks, ad_range, act_range, log,
                  null_free=(), rows: int = 0) -> dict:
  """The engine's history configuration (as data.ingest.history.FlatLogHistories decides it).
  ``null_free``: the tasks whose labels the scan found never null (their valid counts are the
  row counts); ``rows``: the log's size (``pack``: counts fit 40 bits, ``ad_sql``)."""
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
  delays = label_delays(h, tasks)
  stream_delays = {name: delays.get(sel.split(".", 1)[1], 0) if sel else 0
                   for name, sel in streams.items()}
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
          "null_free": [t for t in tasks if t in null_free], "pack": rows < 1 << 40,
          "delays": delays, "stream_delays": stream_delays}
