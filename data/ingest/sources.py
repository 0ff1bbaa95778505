"""The ingestion's inputs: ``Source`` (a Parquet / CSV file or an in-memory table, read as
``(table, first_row, fraction_read)`` batches) and ``Progress`` (rows, rate, ETA on stderr)."""

from __future__ import annotations

import os
import sys
import time

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv
import pyarrow.parquet as pq

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
        first = 0
        for b in pq.ParquetFile(self.path).iter_batches(batch_size=self.batch_rows):
          yield pa.Table.from_batches([b]), first, None
          first += b.num_rows
        return
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


def _key_arrays(src: Source, col: str):
  """The values of column ``col`` of ``src`` (nothing, or nulls, when it has no such column;
  the scan reports it): Parquet row
  group statistics where they have both bounds, else the column read alone."""
  if src.kind == "table":
    if col in src.table.column_names:
      yield from src.table.column(col).chunks
    return
  try:
    if src.kind == "parquet":
      f = pq.ParquetFile(src.path)
      if col not in f.schema_arrow.names:
        return
      j = f.schema_arrow.names.index(col)
      t = f.schema_arrow.field(j).type
      for g in range(f.metadata.num_row_groups):
        st = f.metadata.row_group(g).column(j).statistics if pa.types.is_integer(t) else None
        if st is not None and st.has_min_max:
          yield pa.array([st.min, st.max], t)
        else:
          yield from f.read_row_group(g, columns=[col]).column(0).chunks
      return
    with open(src.path, "rb") as fh:
      reader = pcsv.open_csv(fh, read_options=pcsv.ReadOptions(block_size=64 << 20),
                             parse_options=pcsv.ParseOptions(delimiter=src.delimiter),
                             convert_options=pcsv.ConvertOptions(include_columns=[col],
                                                                 include_missing_columns=True))
      for b in reader:
        yield b.column(0)
  except (pa.ArrowInvalid, pa.ArrowTypeError, KeyError) as e:
    raise ValueError(f"{src.name}: unreadable: {str(e).splitlines()[0]}") from None


def _hashed_ids(a: pa.Array) -> bool:
  """True when ``a`` holds ids that ``coerce.keys`` hashes: strings, or integers outside
  [0, 2**31) (a missing column's nulls: no)."""
  if pa.types.is_null(a.type) or len(a) == a.null_count:
    return False
  if not pa.types.is_integer(a.type):
    return True
  return pc.min(a).as_py() < 0 or pc.max(a).as_py() > 2**31 - 1


def key_decision(sources: dict, columns: dict) -> list[str]:
  """The join keys (``user_id``, ``ad_id``) to hash in every row: a first pass over their
  columns (renamed by ``columns``) in every input; a column with an id outside [0, 2**31) or a
  string anywhere is hashed everywhere, so one column never mixes hashed and raw ids."""
  out = []
  for r in ("user_id", "ad_id"):
    col = columns.get(r, r)
    for s in (s for ss in sources.values() for s in ss):
      if any(map(_hashed_ids, _key_arrays(s, col))):
        out.append(r)
        break
  return out


def row_error(src, first, e):
  """A CoerceError of a batch -> one-line ValueError naming file and row."""
  where = f"{src.name}: row {first + e.row}: " if e.row is not None else f"{src.name}: "
  return ValueError(where + e.msg)
