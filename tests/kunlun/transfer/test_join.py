"""As-of join: compared with a brute-force loop; never returns a future embedding."""

import numpy as np
import pytest

from kunlun.transfer import join


def _random_log(rng, n=400, users=6, ads=5, t_max=1000, d=3):
  u = rng.integers(0, users, n)
  a = rng.integers(0, ads, n)
  ts = rng.integers(100, t_max, n)
  emb = rng.normal(size=(n, d)).astype(np.float32)
  return u, a, ts, emb


def _brute(u, a, ts, emb, qu, qa, qt, max_age=None):
  """Loop reference: latest row of (qu, qa) with ts <= qt (later input row wins ties)."""
  best = None
  for i in range(len(ts)):
    if u[i] == qu and (qa is None or a[i] == qa) and ts[i] <= qt:
      if best is None or ts[i] >= ts[best]:
        best = i
  if best is not None and max_age is not None and qt - ts[best] > max_age:
    best = None
  return best


@pytest.mark.parametrize("max_age", [None, 150])
def test_lookup_matches_bruteforce(max_age):
  rng = np.random.default_rng(0)
  u, a, ts, emb = _random_log(rng)
  log = join.EmbeddingLog(u, a, ts, emb)
  qu, qa = rng.integers(0, 8, 300), rng.integers(0, 7, 300)  # some keys never logged
  qt = rng.integers(0, 1200, 300)  # some before / after every row
  got, present, age = log.pair.lookup(join.pair_key(qu, qa), qt, max_age=max_age)
  n_present = 0
  for j in range(300):
    i = _brute(u, a, ts, emb, qu[j], qa[j], qt[j], max_age)
    assert present[j] == (i is not None)
    if i is None:
      np.testing.assert_array_equal(got[j], 0.0)
      assert age[j] == 0
    else:
      n_present += 1
      np.testing.assert_array_equal(got[j], emb[i])
      assert age[j] == qt[j] - ts[i]
  assert 30 < n_present < 290  # both cases exercised


def _batch(rng, B=16, T=10, users=6, items=5):
  length = rng.integers(0, T + 1, B)
  age = np.sort(rng.integers(0, 600, (B, T)), axis=1)[:, ::-1].astype(np.float32)
  valid = np.arange(T)[None] < length[:, None]
  return {
      "user_id": rng.integers(0, users, B).astype(np.int32),
      "ad_id": rng.integers(0, items, B).astype(np.int32),
      "request_ts": rng.integers(500, 1100, B).astype(np.int32),
      "events": {"click": {
          "item": np.where(valid, rng.integers(0, items, (B, T)), 0).astype(np.int32),
          "age": np.where(valid, age + rng.uniform(0, 1, (B, T)), 0).astype(np.float32),
          "length": length.astype(np.int32)}},
  }


@pytest.mark.parametrize("key", ["user_item", "user"])
def test_join_events_never_from_future(key):
  rng = np.random.default_rng(1)
  u, a, ts, emb = _random_log(rng)
  log = join.EmbeddingLog(u, a, ts, emb)
  b = _batch(rng)
  got, present, age = log.join_events(b, "click", key=key)
  ev = b["events"]["click"]
  B, T = ev["item"].shape
  n_present = 0
  for i in range(B):
    for t in range(T):
      if t >= ev["length"][i]:
        assert not present[i, t]
        np.testing.assert_array_equal(got[i, t], 0.0)
        continue
      event_time = float(b["request_ts"][i]) - float(ev["age"][i, t])  # real-valued
      qa = ev["item"][i, t] if key == "user_item" else None
      j = _brute(u, a, ts, emb, b["user_id"][i], qa, np.floor(event_time))
      assert present[i, t] == (j is not None)
      if j is not None:
        n_present += 1
        assert ts[j] <= event_time  # computed at or before the event, never after
        np.testing.assert_array_equal(got[i, t], emb[j])
  assert n_present > 10


def test_event_at_exact_log_time_is_joined_and_one_second_earlier_is_not():
  log = join.EmbeddingLog([3], [7], [1000], np.ones((1, 2)))
  b = {"user_id": np.array([3, 3]), "ad_id": np.array([7, 7]), "request_ts": np.array([1500, 1500]),
       "events": {"s": {"item": np.array([[7], [7]]), "age": np.array([[500.0], [501.0]]),
                        "length": np.array([1, 1])}}}
  _, present, age = log.join_events(b, "s")
  np.testing.assert_array_equal(present[:, 0], [True, False])
  assert age[0, 0] == 0
  # the current example at request time sees the row; one logged later is invisible
  log2 = join.EmbeddingLog([3, 3], [7, 7], [1000, 1600], np.stack([np.ones(2), 2 * np.ones(2)]))
  e, p, a = log2.join_current(b)
  np.testing.assert_array_equal(e, np.ones((2, 2)))
  np.testing.assert_array_equal(a, [500, 500])


def test_missing_is_masked_and_fill_is_visible():
  log = join.EmbeddingLog([1], [1], [10], np.ones((1, 4)))
  b = {"user_id": np.array([1, 2]), "ad_id": np.array([1, 1]), "request_ts": np.array([20, 20])}
  e, p, _ = log.join_current(b, fill=np.nan)
  np.testing.assert_array_equal(p, [True, False])
  assert np.isnan(e[1]).all() and (e[0] == 1).all()
  out = log.join_batch({**b, "events": {}}, streams=[])
  np.testing.assert_array_equal(out["fm_ctx_present"], [True, False])


def test_bad_ids_raise():
  with pytest.raises(ValueError, match="user_id"):
    join.pair_key([-1], [0])
  with pytest.raises(ValueError, match="emb"):
    join.AsOfIndex([1, 2], [1, 2], np.ones((3, 2)))


@pytest.mark.parametrize("key", ["user_item", "user"])
def test_as_of_boundaries_are_exact(key):
  """Rows logged at t = 1000 and t + 1: events at t - 0.6, t - 0.4, t, t + 0.6 s see the row
  of t only from t on (rounding to the nearest second would join t - 0.4 to row t and t + 0.6 to
  row t + 1, both logged after the event); an age exactly max_age is still joined, one second
  more is not."""
  t = 1000
  log = join.EmbeddingLog([3, 3], [7, 7], [t, t + 1], np.array([[1.0], [2.0]]))
  req = 1500
  offsets = np.array([-0.6, -0.4, 0.0, 0.6])
  b = {"user_id": np.array([3]), "ad_id": np.array([7]), "request_ts": np.array([req]),
       "events": {"s": {"item": np.full((1, 4), 7), "age": (req - (t + offsets))[None]
                        .astype(np.float32), "length": np.array([4])}}}
  emb, present, age = log.join_events(b, "s", key=key)
  np.testing.assert_array_equal(present[0], [False, False, True, True])
  np.testing.assert_array_equal(emb[0, :, 0], [0.0, 0.0, 1.0, 1.0])
  np.testing.assert_array_equal(age[0], [0, 0, 0, 0])
  # max_age: events 5 s and 6 s after the row at t + 1 (no later row), max_age = 5
  b["events"]["s"]["age"] = np.array([[req - (t + 6), req - (t + 7), req - (t + 6.5), 0]],
                                     np.float32)
  _, present, age = log.join_events(b, "s", key=key, max_age=5)
  np.testing.assert_array_equal(present[0, :3], [True, False, True])
  np.testing.assert_array_equal(age[0, :3], [5, 0, 5])
  # the current example (pair key) at request time: same boundary
  cur = {"user_id": np.array([3, 3, 3]), "ad_id": np.array([7, 7, 7]),
         "request_ts": np.array([t - 1, t, t + 6])}
  e, p, a = log.join_current(cur, max_age=5)
  np.testing.assert_array_equal(p, [False, True, True])
  np.testing.assert_array_equal(a, [0, 0, 5])
  np.testing.assert_array_equal(e[:, 0], [0, 1, 2])
