import ml_collections
import numpy as np
import pytest

from data import jagged
from data.pipeline import Collate, dropped_events, make_dataset
from data.schema import Schema

SEQ = {"click": 8, "impression": 16}


# ---- independent oracle: one event at a time, plain Python ------------------------------------

def oracle_keep(lengths, N):
  """Drops one oldest event at a time from the longest kept history (ties: the shorter original
  history, then the higher index) until the batch fits."""
  keep = [int(x) for x in lengths]
  while sum(keep) > N:
    b = max(range(len(keep)), key=lambda i: (keep[i], -int(lengths[i]), i))
    keep[b] -= 1
  return keep


def oracle_pack(events, lengths, N):
  B = len(lengths)
  keep = oracle_keep(lengths, N)
  packed = {k: [] for k in events}
  seg, pos, offsets = [], [], [0]
  for b in range(B):
    first = int(lengths[b]) - keep[b]                   # the oldest kept event
    for j in range(keep[b]):
      for k, v in events.items():
        packed[k].append(v[b][first + j])
      seg.append(b)
      pos.append(j)
    offsets.append(offsets[-1] + keep[b])
  n = len(seg)
  out = {}
  for k, v in events.items():
    pad = np.zeros((N - n,) + np.shape(v)[2:], np.asarray(v).dtype)
    out[k] = np.concatenate([np.array(packed[k], pad.dtype).reshape((n,) + pad.shape[1:]), pad])
  return (out, np.array(offsets), np.array(seg + [B] * (N - n)), np.array(pos + [0] * (N - n)),
          sum(int(x) for x in lengths) - sum(keep))


def oracle_blocks(events, lengths, N, S):
  """``oracle_pack`` of each batch shard's examples into its N / S tokens, concatenated."""
  Bs = len(lengths) // S
  parts = [oracle_pack({k: v[s * Bs:(s + 1) * Bs] for k, v in events.items()},
                       lengths[s * Bs:(s + 1) * Bs], N // S) for s in range(S)]
  return ({k: np.concatenate([p[0][k] for p in parts]) for k in events},
          *(np.concatenate([p[i] for p in parts]) for i in (1, 2, 3)), sum(p[4] for p in parts))


def _events(rng, lengths, T):
  B = len(lengths)
  valid = np.arange(T)[None, :] < np.asarray(lengths)[:, None]
  ev = {"item": rng.integers(1, 1000, (B, T)).astype(np.int32),
        "age": rng.uniform(1, 1e5, (B, T)).astype(np.float32),
        "pair": rng.integers(1, 9, (B, T, 2)).astype(np.int32)}
  return {k: np.where(valid.reshape(valid.shape + (1,) * (v.ndim - 2)), v, 0).astype(v.dtype)
          for k, v in ev.items()}


CASES = {   # name: (lengths, T, N)
    "ragged": ([3, 0, 7, 1, 5, 2], 8, 64),
    "empty_histories": ([0, 4, 0, 0, 6, 0], 8, 64),
    "all_empty": ([0, 0, 0, 0], 8, 64),
    "one_fills_capacity": ([0, 64, 0], 64, 64),
    "exact_fit": ([30, 2, 32], 32, 64),
    "overflow_by_one": ([30, 3, 32], 32, 64),
    "heavy_overflow": ([60, 5, 64, 33, 0, 64, 17, 64], 64, 64),
    "ties": ([40, 40, 40, 40], 40, 64),
}


@pytest.mark.parametrize("name", list(CASES))
def test_pack_matches_oracle_and_round_trips(name):
  lengths, T, N = CASES[name]
  lengths = np.array(lengths, np.int64)
  ev = _events(np.random.default_rng(len(name)), lengths, T)
  packed, offsets, seg, pos, dropped = jagged.pack_events(ev, lengths, N)
  want, w_off, w_seg, w_pos, w_dropped = oracle_pack(ev, lengths, N)
  assert dropped == w_dropped
  np.testing.assert_array_equal(offsets, w_off)
  np.testing.assert_array_equal(seg, w_seg)
  np.testing.assert_array_equal(pos, w_pos)
  assert offsets.dtype == seg.dtype == pos.dtype == np.int32
  for k in ev:
    assert packed[k].dtype == ev[k].dtype
    np.testing.assert_array_equal(packed[k], want[k])
  # back to [B, T]: each row truncated to its most recent kept events, re-indexed from 0
  rows, kept = jagged.unpack_events(packed, offsets, T)
  np.testing.assert_array_equal(kept, np.diff(w_off))
  for b, L in enumerate(lengths.tolist()):
    k = int(kept[b])
    for f in ev:
      np.testing.assert_array_equal(rows[f][b, :k], ev[f][b, L - k:L])
      assert not rows[f][b, k:].any()


def test_drop_keeps_most_recent_and_counts_exactly():
  lengths = np.array([10, 3, 12], np.int64)               # 25 events into 16 slots
  ev = {"t": np.tile(np.arange(12), (3, 1)) * (np.arange(12)[None] < lengths[:, None])}
  packed, offsets, seg, pos, dropped = jagged.pack_events(ev, lengths, 16)
  assert dropped == 9 and offsets.tolist() == [0, 6, 9, 16]   # cap 6: 6 + 3 + 6, one more: 12
  assert packed["t"][:6].tolist() == [4, 5, 6, 7, 8, 9]      # the 6 most recent of 10
  assert packed["t"][6:9].tolist() == [0, 1, 2]
  assert packed["t"][9:16].tolist() == [5, 6, 7, 8, 9, 10, 11]
  assert pos[:16].tolist() == list(range(6)) + list(range(3)) + list(range(7))


def test_pack_blocks_against_a_loop_over_shards():
  """Three batch shards of two examples: one block empty, one overflowing, one ragged."""
  lengths, T, S = np.array([0, 0, 64, 33, 3, 17], np.int64), 64, 3
  ev = _events(np.random.default_rng(7), lengths, T)
  got = jagged.pack_blocks(ev, lengths, S * 64, S)
  want = oracle_blocks(ev, lengths, S * 64, S)
  for k in ev:
    np.testing.assert_array_equal(got[0][k], want[0][k])
  for g, w in zip(got[1:4], want[1:4], strict=True):
    assert g.dtype == np.int32
    np.testing.assert_array_equal(g, w)
  assert got[4] == want[4] == 33
  ex = jagged.block_examples(got[2], len(lengths), S)
  loop = [s * 2 + int(g) if g < 2 else len(lengths)
          for s in range(S) for g in got[2][s * 64:(s + 1) * 64]]
  assert ex.tolist() == loop
  with pytest.raises(ValueError, match="does not split into 4 blocks"):
    jagged.pack_blocks(ev, lengths, 4 * 64, 4)
  with pytest.raises(ValueError, match="shards must be an int >= 1"):
    jagged.pack_blocks(ev, lengths, 64, 0)


def test_fit_lengths_random_against_oracle():
  rng = np.random.default_rng(0)
  for _ in range(200):
    B = int(rng.integers(1, 12))
    L = rng.integers(0, 20, B)
    N = int(rng.integers(0, 80))
    assert jagged.fit_lengths(L, N).tolist() == oracle_keep(L, N)


def test_bad_input_one_line_errors():
  ev = {"a": np.zeros((2, 4), np.int32)}
  with pytest.raises(ValueError, match=r"lengths must be in \[0, 4\]"):
    jagged.pack_events(ev, np.array([1, 5]), 64)
  with pytest.raises(ValueError, match="3 lengths for a batch of 2"):
    jagged.pack_events(ev, np.array([1, 1, 1]), 64)
  with pytest.raises(ValueError, match="share the leading"):
    jagged.pack_events({**ev, "b": np.zeros((2, 5))}, np.array([1, 1]), 64)
  with pytest.raises(ValueError, match="capacity must be an int"):
    jagged.pack_events(ev, np.array([1, 1]), -64)


# ---- capacity ---------------------------------------------------------------------------------

def _sample(rng, n):
  return np.minimum(np.floor(rng.lognormal(np.log(30), 1.0, n)), 200).astype(np.int64)


def test_capacity_against_simulation():
  rng = np.random.default_rng(1)
  sample, B = _sample(rng, 20_000), 64
  sums = np.concatenate([sample[rng.integers(0, len(sample), (20_000, B))].sum(1)
                         for _ in range(5)])               # brute force: 100k random batches
  grid = np.arange(0, B * 200 + 1, 64)
  rate = np.mean(sums[:, None] > grid[None, :], axis=0)   # simulated overflow rate per capacity
  for q in (0.9, 0.95, 0.98, 0.99, 0.995, 0.999):
    N = jagged.capacity_for(sample, B, q)
    tol = 4 * np.sqrt(q * (1 - q) / len(sums))
    lo = grid[np.argmax(rate <= 1 - q + tol)]              # brute-force capacity, within noise
    hi = grid[np.argmax(rate <= 1 - q - tol)]
    assert N % 64 == 0 and lo <= N <= hi, (q, N, lo, hi)
  # the whole distribution of the batch sum (DKW: sup error < 0.01 with prob > 0.999)
  surv = jagged.batch_sum_survival(sample, B)
  grid = np.arange(0, len(surv), 7)
  sim = np.mean(sums[:, None] > grid[None, :], axis=0)
  assert np.abs(surv[grid] - sim).max() < 0.01


def test_capacity_buckets_against_simulation():
  """Each bucket holds its quantile of random batches (brute force, within noise); the last is
  the overflow bound; a batch takes the smallest bucket every stream's every block fits."""
  rng = np.random.default_rng(2)
  sample, B = _sample(rng, 20_000), 64
  sums = sample[rng.integers(0, len(sample), (40_000, B))].sum(1)
  for K, qs in jagged.BUCKET_QUANTILES.items():
    caps = jagged.capacity_buckets(sample, B, K)
    assert list(caps) == sorted(caps) and caps[-1] == jagged.capacity_for(sample, B)
    for n, q in zip(caps, qs, strict=True):
      assert np.mean(sums <= n) >= q - 4 * np.sqrt(q * (1 - q) / len(sums)), (K, n, q)
      assert np.mean(sums <= n - 64) < q + 4 * np.sqrt(q * (1 - q) / len(sums)), (K, n, q)
  with pytest.raises(ValueError, match="one of"):
    jagged.capacity_buckets(sample, B, 5)
  buckets = {"a": (128, 256, 384), "b": (64, 64, 128)}       # 2 blocks: 64, 128, 192 / 32, 32, 64
  pick = lambda a, b: jagged.pick_bucket({"a": np.array(a), "b": np.array(b)}, buckets, 2)
  assert pick([30, 34, 64, 0], [0, 32, 32, 0]) == 0
  assert pick([30, 35, 64, 0], [0, 32, 32, 0]) == 1          # a's first block holds 65 > 64
  assert pick([0, 0, 0, 0], [33, 0, 0, 0]) == 2              # b's first block: 33 > 32
  assert pick([500, 0, 0, 0], [0, 0, 0, 0]) == 2             # fits none: the largest (drops)


def test_capacity_never_above_batch_times_max_len():
  sample = np.array([37, 37, 0, 5], np.int64)
  assert jagged.capacity_for(sample, 3, quantile=1.0) == 3 * 37
  assert jagged.capacity_for(np.zeros(5, np.int64), 8) == 0
  with pytest.raises(ValueError, match="quantile must be in"):
    jagged.capacity_for(sample, 3, quantile=1.5)


# ---- Collate --------------------------------------------------------------------------------

def _cfg():   # prefetch 0: the in-process counter sees exactly the batches produced
  return ml_collections.ConfigDict(dict(
      batch_size=32, surface_weights={"feed": 0.5, "stories": 0.3, "reels": 0.2}, shuffle_seed=0,
      num_threads=2, prefetch=0, skip_invalid=False, length_balance=False))


def _bucket_of(pad, cap, shards):
  """Independently of data.jagged: ({stream: N}, index) of the smallest bucket (one index for
  every stream) at which each stream's every block fits, else the largest; an int is one bucket."""
  caps = {s: c if isinstance(c, tuple) else (c,) for s, c in cap.items()}
  Bs = len(pad["surface"]) // shards
  block_max = {s: max(int(pad["events"][s]["length"][b * Bs:(b + 1) * Bs].sum())
                      for b in range(shards)) for s in caps}
  K = len(next(iter(caps.values())))
  i = next((i for i in range(K) if all(block_max[s] <= caps[s][i] // shards for s in caps)), K - 1)
  return {s: c[i] for s, c in caps.items()}, i


@pytest.mark.parametrize("cap,shards", [({"click": 256, "impression": 512}, 1), ({"click": 128}, 1),
                                         ({"click": 128}, 2),
                                         ({"click": (256, 256, 320), "impression": (448, 512, 576)},
                                          1)])
def test_collate_packed_batch_equals_packing_padded_batch(tiny_dir, cap, shards):
  mk = lambda c: make_dataset(_cfg(), tiny_dir, "train", SEQ, train=True, shard_index=0,
                              shard_count=1, jagged_capacity=c, jagged_shards=shards)
  ds = mk(cap)
  padded_it, packed_it = iter(mk(None)), iter(ds)
  want_drop, used = {}, set()
  for _ in range(4):
    pad, got = next(padded_it), next(packed_it)
    n_of, bucket = _bucket_of(pad, cap, shards)
    used.add(bucket)
    for k in pad:
      if k != "events":
        np.testing.assert_equal(got[k], pad[k])
    for s, ev in pad["events"].items():
      if s not in cap:
        np.testing.assert_equal(got["events"][s], ev)
        continue
      fields = {k: v for k, v in ev.items() if k != "length"}
      want, offsets, seg, pos, dropped = oracle_blocks(fields, ev["length"], n_of[s], shards)
      g = got["events"][s]
      assert sorted(g) == sorted(list(fields) + ["length", "offsets", "seg", "pos"])
      for k in fields:
        assert g[k].dtype == ev[k].dtype
        np.testing.assert_array_equal(g[k], want[k])
      np.testing.assert_array_equal(g["offsets"], offsets)
      np.testing.assert_array_equal(g["seg"], seg)
      np.testing.assert_array_equal(g["pos"], pos)
      np.testing.assert_array_equal(g["length"], np.diff(offsets.reshape(shards, -1)).ravel())
      assert g["length"].dtype == np.int32
      if dropped:
        want_drop[s] = want_drop.get(s, 0) + dropped
  assert dropped_events(packed_it) == want_drop
  assert ds.dropped_counter.counts == want_drop
  restored = iter(mk(cap))                               # the counts travel with the state
  restored.set_state(packed_it.get_state())
  assert dropped_events(restored) == want_drop
  if cap == {"click": 128}:
    assert want_drop["click"] > 0                        # the tight capacity did overflow
  if isinstance(cap["click"], tuple):
    assert len(used) > 1, used                           # the batches took different buckets


def test_collate_capacity_errors(tiny_dir):
  schema = Schema.load(tiny_dir)
  with pytest.raises(ValueError, match="unknown event stream 'video'"):
    Collate(schema, SEQ, jagged_capacity={"video": 64})
  with pytest.raises(ValueError, match="positive multiple of 64"):
    Collate(schema, SEQ, jagged_capacity={"click": 100})
  with pytest.raises(ValueError, match=r"multiple of 64 x 2 batch shards"):
    Collate(schema, SEQ, jagged_capacity={"click": 192}, jagged_shards=2)
