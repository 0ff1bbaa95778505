"""User histories from a flat interaction log held in memory, with no future leakage: a row's
history is the same user's rows strictly earlier in time. ``HistoryIndex`` (events sorted once,
any subset of rows answered by binary searches), ``FlatLogHistories`` (``--history`` in the spec's
terms): the reference the DuckDB and Beam runners are tested against. Rules: data/README.md.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

import data.ingest.coerce as coerce
from data.ingest.coerce import CoerceError, Coercions
from data.ingest.infer import label_delays


def _ranks(x: np.ndarray) -> np.ndarray:
  """Dense ranks of an integer array (same value -> same rank)."""
  _, inv = np.unique(x, return_inverse=True)
  return inv.astype(np.int64)


class _Sorted:
  """Events of one filter, sorted by (key, ts, row): ``comb`` = key * span + (ts - t0)."""

  def __init__(self, key_n, ts_n, sel_n, t0, span):
    idx = np.flatnonzero(sel_n)
    order = np.lexsort((idx, ts_n[idx], key_n[idx]))
    self.rows = idx[order]                      # original row of each sorted event
    self.comb = key_n[self.rows] * span + (ts_n[self.rows] - t0)
    self.span, self.t0 = span, t0

  def bounds(self, key, ts, delay: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``[lo, hi)`` of the sorted events with the same key and a ts earlier than
    ``ts - delay`` (strictly)."""
    lo = np.searchsorted(self.comb, key * self.span, side="left")
    hi = np.searchsorted(self.comb, key * self.span + np.maximum(ts - delay - self.t0, 0),
                         side="left")
    return lo, hi


class HistoryIndex:
  """Per-row histories and statistics over a flat log of N rows.

  user_n, item_n: integer ids (any range); ts_n: i64 seconds (or any monotone unit);
  streams: ``{name: bool[N] or None}`` (None: every row is an event of that stream);
  columns: ``{column: int array[N]}`` the per-event values to return (e.g. item, action,
  surface, ts); labels: ``{task: (y f[N] 0/1, valid bool[N])}`` for the statistics.
  ``delays`` / ``stream_delays``: seconds after its event a row counts for a task's
  statistics (``{task: d}``) / for a stream (``{stream: d}``): a request at r sees it when
  ``e + d < r``.
  """

  def __init__(self, user_n, ts_n, item_n, streams: dict, columns: dict,
               labels: dict | None = None, delays: dict | None = None,
               stream_delays: dict | None = None):
    ts = np.asarray(ts_n, np.int64)
    self.n = len(ts)
    self.t0 = int(ts.min()) if self.n else 0
    span = int(ts.max()) - self.t0 + 2 if self.n else 2
    self.user, self.item = _ranks(np.asarray(user_n)), _ranks(np.asarray(item_n))
    if self.n and max(self.user.max(), self.item.max()) + 1 > np.iinfo(np.int64).max // span:
      raise ValueError("history index: too many users x time span for an int64 sort key")
    self.ts, self.span = ts, span
    self.columns = {k: np.asarray(v) for k, v in columns.items()}
    self._streams = {name: _Sorted(self.user, ts, np.ones(self.n, bool) if sel is None
                                   else np.asarray(sel, bool), self.t0, span)
                     for name, sel in streams.items()}
    self.labels = labels or {}
    self.delays, self.stream_delays = delays or {}, stream_delays or {}
    self._stats = {}
    for side, key in (("user", self.user), ("ad", self.item)):
      self._stats[side] = {"all": _Sorted(key, ts, np.ones(self.n, bool), self.t0, span)}
      for task, (y, valid) in self.labels.items():
        self._stats[side][f"valid:{task}"] = _Sorted(key, ts, np.asarray(valid, bool), self.t0,
                                                     span)
        self._stats[side][f"pos:{task}"] = _Sorted(
            key, ts, np.asarray(valid, bool) & (np.asarray(y) > 0.5), self.t0, span)

  def lengths(self, rows: np.ndarray) -> dict[str, np.ndarray]:
    """Untruncated history length per row, per stream."""
    rows = np.asarray(rows, np.int64)
    out = {}
    for name, s in self._streams.items():
      lo, hi = s.bounds(self.user[rows], self.ts[rows], self.stream_delays.get(name, 0))
      out[name] = hi - lo
    return out

  def lists(self, rows: np.ndarray, max_len: int) -> dict[str, tuple[dict, np.ndarray]]:
    """``{stream: ({column: values[E]}, offsets i64[len(rows) + 1])}`` for ``rows``; each row's
    events are the most recent ``max_len`` strictly earlier ones, oldest first."""
    rows = np.asarray(rows, np.int64)
    out = {}
    for name, s in self._streams.items():
      lo, hi = s.bounds(self.user[rows], self.ts[rows], self.stream_delays.get(name, 0))
      start = np.maximum(lo, hi - max_len)
      lens = hi - start
      offs = np.concatenate([[0], np.cumsum(lens)])
      take = np.arange(offs[-1]) + np.repeat(start - offs[:-1], lens)
      src = s.rows[take]
      out[name] = ({k: v[src] for k, v in self.columns.items()}, offs)
    return out

  def stats(self, rows: np.ndarray) -> dict[str, np.ndarray]:
    """Dense statistics f32[len(rows)] from strictly earlier rows: ``user_count``,
    ``user_<task>_rate``, ``ad_count``, ``ad_<task>_rate`` (rate = (pos + 1) / (valid + 2), of
    the rows whose label is visible: ``delays``)."""
    rows = np.asarray(rows, np.int64)
    out = {}
    for side, key in (("user", self.user), ("ad", self.item)):
      q = (key[rows], self.ts[rows])
      n = lambda k, d=0, q=q, side=side: np.subtract(*self._stats[side][k].bounds(*q, d)[::-1])
      out[f"{side}_count"] = n("all").astype(np.float32)
      for task in self.labels:
        d = self.delays.get(task, 0)
        out[f"{side}_{task}_rate"] = ((n(f"pos:{task}", d) + 1.0) / (n(f"valid:{task}", d) + 2.0)
                                      ).astype(np.float32)
    return out


# ---- in data.ingest's terms ---------------------------------------------------------------

def _keep_last(vals: dict, offs: np.ndarray, k: int):
  """Per row, the last ``k`` of the values in ``[offs[i], offs[i+1])``."""
  lens = np.diff(offs)
  keep = np.minimum(lens, k)
  new = np.concatenate([[0], np.cumsum(keep)])
  take = np.arange(new[-1]) + np.repeat(offs[1:] - keep - new[:-1], keep)
  return {c: v[take] for c, v in vals.items()}, new


def hide_labels(action: np.ndarray, ev_ts: np.ndarray, req_ts: np.ndarray, delays: list) -> None:
  """Clears, in place, bit k of each event's label-bits ``action`` where the event's label is
  not yet visible to its request (``ev_ts + delays[k] >= req_ts``)."""
  gap = np.asarray(req_ts, np.int64) - np.asarray(ev_ts, np.int64)
  for k, d in enumerate(delays):
    if d > 0:
      action[gap <= d] &= ~(1 << k)


def label_bits(cols: dict, tasks) -> np.ndarray:
  """Per row: bit k set when task k's label is 1 (the event action of built histories)."""
  bits = np.zeros(len(cols["request_ts"]), np.int64)
  for k, t in enumerate(tasks):
    y = cols[f"label.{t}"].fill_null(0).to_numpy(zero_copy_only=False)
    bits |= (y > 0.5).astype(np.int64) << k
  return bits


class FlatLogHistories:
  """``data.ingest.history`` over the whole (canonical) flat log, in the spec's terms."""

  """``HistoryIndex`` over a whole flat log given as role columns (``layout.canonical``),
  configured by an ingest spec's ``history`` section."""

  def __init__(self, parts: list[dict], spec, surfaces, tasks, log: Coercions):
    h = spec.history
    cat = lambda k: np.concatenate([p[k].to_numpy(zero_copy_only=False) for p in parts])
    user, ts, ad = cat("user_id"), cat("request_ts"), cat("_ad_feature")
    sidx = {s: i for i, s in enumerate(surfaces)}
    surf = np.concatenate([np.array([sidx[x] for x in p["surface"].to_pylist()], np.int64)
                           for p in parts])
    if h.get("action"):
      col = h["action"]
      if "_action" not in parts[0]:
        raise CoerceError(f"history.action: no column {col!r} (after renaming)")
      action = np.concatenate([p["_action"].to_numpy(zero_copy_only=False)
                               for p in parts]).astype(np.int64)
      if len(action) and action.min() < 0:
        raise CoerceError(f"history.action: column {col!r} has negative values")
      self.action_vocab = int(action.max()) + 1 if len(action) else 1
    else:
      action = np.concatenate([label_bits(p, tasks) for p in parts])
      self.action_vocab = 1 << len(tasks)
    self.item_vocab = int(ad.max()) + 1 if len(ad) else 1
    item = ad
    if self.item_vocab > 1 << 22 or (len(ad) and ad.min() < 0):
      self.item_vocab = 1 << 22
      item = coerce.hash_mod(ad, self.item_vocab)
      log.add("history", f"ad ids hashed into [0, {self.item_vocab}) as event items")
    streams = {}
    for name, sel in h["streams"].items():
      if sel == "all":
        streams[name] = None
      else:
        if sel not in parts[0]:
          raise CoerceError(f"history.streams.{name}: no column {sel!r}")
        streams[name] = np.concatenate([p[sel].fill_null(0).to_numpy(zero_copy_only=False)
                                        for p in parts]) > 0.5
    delays = label_delays(h, tasks)
    self.bit_delays = None if h.get("action") else [delays[t] for t in tasks]
    stream_delays = {name: delays.get(sel.split(".", 1)[1], 0)
                     for name, sel in h["streams"].items() if sel != "all"}
    labels = {}
    if h.get("stats", False):
      for t in tasks:
        y = np.concatenate([p[f"label.{t}"].fill_null(0).to_numpy(zero_copy_only=False)
                            for p in parts])
        valid = np.concatenate([~coerce._nulls(p[f"label.{t}"]) for p in parts])
        labels[t] = (y, valid)
    self.max_len = int(h.get("max_len", 50))
    self.index = HistoryIndex(user, ts, ad, streams,
                              {"item": item, "action": action, "surface": surf, "ts": ts},
                              labels, delays, stream_delays)
    self.stats = bool(h.get("stats", False))
    self.observed_len = {k: int(v.max(initial=0))
                         for k, v in self.index.lengths(np.arange(len(ts))).items()}
    self.n = len(ts)

  def columns(self, rows: np.ndarray, max_lens: dict[str, int]) -> dict:
    """The built ``events.<s>.*`` (and ``dense.*`` statistics) columns of ``rows``."""
    out = {}
    for s, (vals, offs) in self.index.lists(rows, max(max_lens.values(), default=1)).items():
      if s not in max_lens:
        continue
      vals, offs = _keep_last(vals, offs, max_lens[s])
      if self.bit_delays and any(self.bit_delays):
        vals["action"] = vals["action"].copy()
        hide_labels(vals["action"], vals["ts"], np.repeat(self.index.ts[rows], np.diff(offs)),
                    self.bit_delays)
      for col in ("item", "action", "surface", "ts"):
        out[f"events.{s}.{col}"] = pa.LargeListArray.from_arrays(offs, pa.array(vals[col],
                                                                                pa.int64()))
    if self.stats:
      out.update({f"dense.{k}": pa.array(v.astype(np.float64))
                  for k, v in self.index.stats(rows).items()})
    return out
