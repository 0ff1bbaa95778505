"""Checks a dataset directory against its manifest and schema, file by file.

  python -m data.verify DIR [--deep] [--split train,eval] [--json OUT] [--update_manifest]

Every shard listed in ``manifest.json``:
  * exists and has the recorded byte size and SHA-256 (``data.shards``; manifests written before
    these fields existed have neither, which the report says);
  * opens as an ArrayRecord file holding the recorded number of records;
  * ``--deep``: every chunk is read (Riegeli checks each chunk's hash; a damaged chunk is reported
    with its record range) and every record is decoded and validated against the schema
    (``data.validate.BatchValidator``, the rules the pipeline applies), counted per kind.

A progress bar (bytes hashed, records read) goes to stderr; the report is one line per file,
then a summary. ``--update_manifest`` adds sizes and checksums to an older manifest after a clean
``--deep`` pass. Exit status 0: every file is intact; 1: some file is not; 2: bad usage.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

from data import records, shards
from data.schema import Schema
from data.validate import BatchValidator

_BATCH = 1024      # records per read / validation batch
_SHOW = 3          # messages kept per file and kind of problem


class Bar:
  """A progress bar on stderr: redrawn in place on a terminal, else a line every 10 s."""

  def __init__(self, total: int, unit: str, label: str, stream=None):
    self.total, self.unit, self.label, self.n = max(int(total), 1), unit, label, 0
    self.stream = stream or sys.stderr
    self.tty = self.stream.isatty()
    self.t0 = self._last = time.perf_counter()

  def update(self, n: int) -> None:
    self.n += n
    now = time.perf_counter()
    if now - self._last >= (0.1 if self.tty else 10.0) or self.n >= self.total:
      self._last = now
      self._draw(now)

  def _draw(self, now):
    f = min(self.n / self.total, 1.0)
    rate = self.n / max(now - self.t0, 1e-9)
    eta = (self.total - self.n) / rate if rate > 0 else 0.0
    scale, unit = (1 << 20, "MB") if self.unit == "bytes" else (1, self.unit)
    line = (f"{self.label} [{'#' * int(30 * f):<30}] {100 * f:5.1f}% "
            f"{self.n / scale:,.0f}/{self.total / scale:,.0f} {unit}, "
            f"{rate / scale:,.0f} {unit}/s, ETA {eta:.0f}s")
    if self.tty:
      self.stream.write("\r" + line)
    else:
      self.stream.write(line + "\n")
    self.stream.flush()

  def close(self) -> None:
    if self.tty:
      self.stream.write("\n")
      self.stream.flush()


def _check_storage(e: dict, bar: Bar) -> dict:
  """Size, SHA-256, opening and record count of one manifest entry -> its report."""
  path, count = e["path"], int(e["count"])
  rep = {"file": e["file"], "count": count, "problems": [], "size": "not recorded",
         "sha256": "not recorded", "opens": False, "damaged": [], "invalid": {}}
  try:
    shards.check_entry(path, e)
  except shards.DataFileError as err:
    rep["problems"].append(str(err))
    rep["size"] = "missing" if not os.path.exists(path) else "mismatch"
    rep["sha256"] = "not checked" if "sha256" in e else rep["sha256"]
    bar.update(int(e.get("bytes", 0)))
    return rep
  if "bytes" in e:
    rep["size"] = "ok"
  if "sha256" in e:
    got = shards.sha256_file(path, bar.update)
    rep["sha256"] = "ok" if got == e["sha256"] else "mismatch"
    if got != e["sha256"]:
      rep["problems"].append(f"{path}: SHA-256 {got[:12]}.. differs from the manifest's "
                             f"{e['sha256'][:12]}.. (bytes changed)")
  try:
    shards.open_reader(path, count).close()
    rep["opens"] = True
  except shards.DataFileError as err:
    rep["problems"].append(str(err))
  return rep


def _scan_records(e: dict, rep: dict, surface: int, validator: BatchValidator, bar: Bar) -> None:
  """Reads every record of an entry (damaged chunks) and validates it; fills ``rep``."""
  path, count = e["path"], int(e["count"])
  src = records.RecordSource([(path, count)])
  damaged, invalid = {}, {}
  for lo in range(0, count, _BATCH):
    idx = np.arange(lo, min(lo + _BATCH, count))
    bad = []
    _, _, raws = src.read_many(idx, damaged=bad)
    for _, err in bad:
      damaged.setdefault((err.first, err.last), err.reason)
    keep = sorted(set(range(len(idx))) - {n for n, _ in bad})
    if keep:
      _, _, errors = validator([raws[n] for n in keep], np.full(len(keep), surface, np.int64),
                               lambda n, keep=keep, idx=idx: (path, int(idx[keep[n]])))
      for _, err in errors:
        n, msgs = invalid.setdefault(err.kind, [0, []])
        invalid[err.kind][0] += 1
        if len(msgs) < _SHOW:
          msgs.append(str(err))
    bar.update(len(idx))
  rep["damaged"] = [[a, b] for a, b in damaged]
  rep["invalid"] = {k: v[0] for k, v in invalid.items()}
  if damaged:
    n_bad = sum(b - a + 1 for a, b in damaged)
    ranges = ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in list(damaged)[:_SHOW])
    more = f" (+{len(damaged) - _SHOW} more)" if len(damaged) > _SHOW else ""
    rep["problems"].append(f"{path}: {n_bad} record(s) in {len(damaged)} damaged chunk(s) cannot "
                           f"be read: records {ranges}{more} ({next(iter(damaged.values()))})")
  for kind, (n, msgs) in invalid.items():
    rep["problems"].append(f"{n} invalid record(s) of kind {kind}, e.g. {msgs[0]}")


def verify(data_dir: str, deep: bool = False, splits=None, stream=None, bar_stream=None) -> dict:
  """Checks ``data_dir``; prints the per-file report to ``stream`` and returns it as a dict
  ``{"data_dir", "deep", "sized", "files": [...], "ok"}``."""
  stream = stream or sys.stdout
  schema = Schema.load(data_dir)
  m = records.load_manifest(data_dir)
  splits = list(splits or m["splits"])
  unknown = sorted(set(splits) - set(m["splits"]))
  if unknown:
    raise ValueError(f"unknown split(s) {unknown}; the manifest has {sorted(m['splits'])}")
  entries = [(split, s, e) for split in splits
             for s, es in records.split_entries(data_dir, split, schema, check=False).items()
             for e in es]
  sized = all("bytes" in e and "sha256" in e for *_, e in entries)
  if not sized:
    print(f"note: {data_dir}/manifest.json records no byte sizes / checksums for some files "
          "(written by an older version): those are checked for existence, opening and record "
          "count" + (", and every chunk and record is read (--deep)" if deep else
                     " only; --deep also reads every chunk and record"), file=stream)
  bar = Bar(sum(int(e.get("bytes", 0)) for *_, e in entries if "sha256" in e), "bytes",
            "checksums", bar_stream)
  reps = [_check_storage(e, bar) for *_, e in entries]
  bar.close()
  if deep:
    validator = BatchValidator(schema, {s.name: s.max_len for s in schema.streams})
    bar = Bar(sum(int(e["count"]) for *_, e in entries), "records", "records", bar_stream)
    for (_, s, e), rep in zip(entries, reps, strict=True):
      if rep["opens"]:
        _scan_records(e, rep, schema.surfaces.index(s), validator, bar)
      else:
        bar.update(int(e["count"]))
    bar.close()
  files = [dict(r, split=split, surface=s) for (split, s, _), r in zip(entries, reps, strict=True)]
  _print_report(files, deep, stream)
  return {"data_dir": data_dir, "deep": deep, "sized": sized, "files": files,
          "ok": not any(f["problems"] for f in files)}


def _print_report(files, deep, stream):
  w = max([len(f["file"]) for f in files] + [4])
  head = f"{'file':<{w}} {'records':>8} {'size':>12} {'sha256':>12} " + \
      ("{:>9} {:>8}  ".format("unreadable", "invalid") if deep else "") + "status"
  print(head, file=stream)
  print("-" * len(head), file=stream)
  for f in files:
    cells = f"{f['file']:<{w}} {f['count']:>8} {f['size']:>12} {f['sha256']:>12} "
    if deep:
      n_dmg = sum(b - a + 1 for a, b in f["damaged"])
      cells += f"{n_dmg:>10} {sum(f['invalid'].values()):>8}  "
    print(cells + ("DAMAGED" if f["problems"] else "ok"), file=stream)
  bad = [f for f in files if f["problems"]]
  for f in bad:
    for p in f["problems"]:
      print(f"  {f['file']}: {p}" if not p.startswith("/") else f"  {p}", file=stream)
  n = len(files)
  print(f"{n - len(bad)}/{n} files intact" + ("" if deep else " (files only; --deep reads "
                                                                 "every chunk and record)"),
        file=stream)


def update_manifest(data_dir: str) -> int:
  """Adds ``bytes`` / ``sha256`` to the manifest entries without them; returns how many."""
  path = os.path.join(data_dir, "manifest.json")
  m = records.load_manifest(data_dir)
  n = 0
  for split in m["splits"].values():
    for entries in split.values():
      for i, e in enumerate(entries):
        if "bytes" not in e or "sha256" not in e:
          entries[i] = dict(e, **{k: v for k, v in shards.file_entry(
              data_dir, e["file"], e["count"]).items() if k in ("bytes", "sha256")})
          n += 1
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(m, f, indent=1)
  os.replace(tmp, path)
  return n


def main(argv=None) -> int:
  import argparse
  prog = "python -m data.verify"
  ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
  ap.add_argument("data_dir")
  ap.add_argument("--deep", action="store_true",
                  help="read every chunk and validate every record against the schema")
  ap.add_argument("--split", default=None, help="comma-separated splits (default: all)")
  ap.add_argument("--json", default=None, help="also write the report as JSON here")
  ap.add_argument("--update_manifest", action="store_true",
                  help="after a clean --deep pass, add missing sizes / checksums to the manifest")
  a = ap.parse_args(argv)
  if a.update_manifest and not a.deep:
    ap.error("--update_manifest needs --deep (checksums are recorded only for verified files)")
  if a.json and not os.path.isdir(os.path.dirname(os.path.abspath(a.json))):
    ap.error(f"--json={a.json}: no such directory for the report")
  try:
    if not os.path.isdir(a.data_dir):
      raise FileNotFoundError(f"{a.data_dir}: " + (
          "not a directory" if os.path.exists(a.data_dir) else "no such directory"))
    rep = verify(a.data_dir, a.deep, a.split.split(",") if a.split else None)
    if a.json:
      with open(a.json, "w") as f:
        json.dump(rep, f, indent=1)
  except (OSError, ValueError) as e:
    print(f"{prog}: error: {' '.join(str(e).split())}", file=sys.stderr)
    return 2
  if a.update_manifest and rep["ok"] and not rep["sized"]:
    print(f"recorded sizes and checksums of {update_manifest(a.data_dir)} files in "
          f"{a.data_dir}/manifest.json")
  elif a.update_manifest and not rep["ok"]:
    print("manifest not updated: some files are damaged", file=sys.stderr)
  return 0 if rep["ok"] else 1


if __name__ == "__main__":
  sys.exit(main())
