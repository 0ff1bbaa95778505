"""Pass 1 of an ingest, the same for every runner: per canonical batch, the column statistics the
schema is inferred from (``infer.ColumnStats``), the surfaces, the columns with no role, the
(lo, hi) ranges of time, ad and action, and the distinct hashed join keys."""

from __future__ import annotations

import numpy as np

from data.ingest.infer import ColumnStats, role

KEY_CAP = 1 << 22            # distinct join keys counted exactly up to this many


def _widen(rng: tuple, x: np.ndarray) -> tuple:
  lo, hi = int(x.min()), int(x.max())
  return (lo, hi) if rng[0] is None else (min(rng[0], lo), max(rng[1], hi))


class Scan:
  """What pass 1 learnt: ``stats`` / ``order`` (columns in first-seen order), ``surfaces``,
  ``unknown`` (column -> first file), ``ts`` / ``ad`` / ``act`` ranges (``split_ts``: per
  explicit split), ``first_cols``."""

  def __init__(self):
    self.stats, self.order, self.surfaces, self.unknown = {}, [], set(), {}
    self.ts = self.ad = self.act = (None, None)
    self.first_cols, self.key_sets = None, {}
    self.split_ts = {}                 # explicit split -> its (lo, hi) request_ts

  def add(self, cols: dict, facts: dict, src_name: str, split=None) -> None:
    self._columns(cols, facts, src_name)
    ts = cols["request_ts"].to_numpy(zero_copy_only=False)
    if len(ts):
      self.ts = _widen(self.ts, ts)
      if split is not None:
        self.split_ts[split] = _widen(self.split_ts.get(split, (None, None)), ts)
      self.ad = _widen(self.ad, cols["_ad_feature"].to_numpy(zero_copy_only=False))
      if "_action" in cols:
        self.act = _widen(self.act, cols["_action"].to_numpy(zero_copy_only=False))
    for k in facts.get("hashed_keys", ()):
      sset = self.key_sets.setdefault(k, set())
      if sset is not None:
        sset.update(np.unique(cols[k].to_numpy(zero_copy_only=False)).tolist())
        if len(sset) > KEY_CAP:
          self.key_sets[k] = None
    self.first_cols = self.first_cols or cols

  def key_stats(self) -> dict:
    """Distinct values per hashed join key (those counted exactly)."""
    return {k: len(v) for k, v in self.key_sets.items() if v is not None}

  def _columns(self, cols, facts, src_name):
    for c, a in cols.items():
      r = role(c)
      if r in (None, "true_prob") or c.startswith("_"):
        continue
      if c not in self.stats:
        self.stats[c] = ColumnStats()
        self.order.append(c)
      st = self.stats[c]
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
    self.surfaces.update(cols["surface"].unique().to_pylist())
    for u in facts["unknown"]:
      self.unknown.setdefault(u, src_name)
