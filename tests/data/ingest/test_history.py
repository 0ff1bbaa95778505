"""data.ingest.history against an explicit loop: strictly earlier events only (no future leakage, no
same-second events), most recent max_len, oldest first; statistics from the same rows."""

import numpy as np

from data.ingest.history import HistoryIndex


def test_history_matches_loop():
  rng = np.random.default_rng(0)
  n = 400
  user = rng.integers(0, 12, n) * 1000 + 7           # sparse ids
  ts = rng.integers(0, 60, n) * 10                    # many ties
  item = rng.integers(0, 25, n)
  y = (rng.random(n) < 0.4).astype(float)
  valid = rng.random(n) < 0.8
  idx = HistoryIndex(user, ts, item, {"pos": y > 0.5, "all": None},
                     {"item": item, "row": np.arange(n)}, {"click": (y, valid)})
  rows = rng.permutation(n)[:150]
  L = 5
  lists = idx.lists(rows, L)
  stats = idx.stats(rows)
  full = idx.lengths(rows)
  for j, r in enumerate(rows):
    earlier = [k for k in range(n) if user[k] == user[r] and ts[k] < ts[r]]
    earlier.sort(key=lambda k: (ts[k], k))
    for name, sel in (("pos", [k for k in earlier if y[k] > 0.5]), ("all", earlier)):
      vals, offs = lists[name]
      got = vals["row"][offs[j]:offs[j + 1]].tolist()
      assert got == sel[-L:], (name, r)
      assert vals["item"][offs[j]:offs[j + 1]].tolist() == [item[k] for k in sel[-L:]]
      assert full[name][j] == len(sel)
      assert all(ts[k] < ts[r] for k in got)
    assert stats["user_count"][j] == len(earlier)
    pos = sum(1 for k in earlier if valid[k] and y[k] > 0.5)
    lab = sum(1 for k in earlier if valid[k])
    assert np.isclose(stats["user_click_rate"][j], (pos + 1) / (lab + 2))
    same_ad = [k for k in range(n) if item[k] == item[r] and ts[k] < ts[r]]
    assert stats["ad_count"][j] == len(same_ad)
    pos = sum(1 for k in same_ad if valid[k] and y[k] > 0.5)
    lab = sum(1 for k in same_ad if valid[k])
    assert np.isclose(stats["ad_click_rate"][j], (pos + 1) / (lab + 2))
