"""What every runner (``memory``, ``engine``: DuckDB, ``beam``) implements for ``driver.run``:
``stage`` each scanned batch, plan the ``history``, find the ``split_times``, ``convert`` the
staged log into the staging folder, ``close``."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Options:
  """The runner-specific settings of ``driver.run`` (unused ones are ignored)."""
  workers: int = 1                 # processes converting buckets (DuckDB)
  memory_limit: str = "1GB"        # DuckDB's, spilling beyond
  rows_per_bucket: int | None = None   # rows per user bucket (DuckDB)
  beam_args: list = dataclasses.field(default_factory=list)
  err: object = None               # progress and warnings


class Runner:
  """Base of the runners: ``tmp`` is the staging dataset folder, ``spec`` the ingest spec."""

  name = "?"
  plan = None        # the history plan the bucket converters follow (``sql.history_plan``)

  def __init__(self, tmp: str, spec, opts: Options):
    self.tmp, self.spec, self.opts = tmp, spec, opts

  def stage(self, sname, split_i: int, src_i: int, src, first: int, cols: dict) -> None:
    """Keeps what the later passes need of one canonical batch of ``src`` (rows from
    ``first``); ``split_i``: the index of its explicit split, -1 when split by time."""
    raise NotImplementedError

  def history(self, scan, surfaces, tasks, log, rows: int) -> tuple[dict, list[str]]:
    """``--history``: the streams' schema facts ``{stream: {max_len, item_vocab,
    action_vocab}}`` and the dense statistic columns it adds."""
    raise NotImplementedError

  def split_times(self, kind: str, vals) -> tuple[float, float]:
    """The cuts (t1, t2): train ts < t1 <= valid < t2 <= eval."""
    raise NotImplementedError

  def convert(self, sources, full, schema, ctx: dict, log, cpu: dict):
    """Writes the records, ``schema.json`` and ``manifest.json`` into ``self.tmp``; returns
    ``(counts, pos, lab, manifest)``."""
    raise NotImplementedError

  def close(self) -> None:
    pass
