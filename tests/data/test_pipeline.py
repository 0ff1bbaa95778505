import collections

import grain
import jax
import ml_collections
import numpy as np
import pytest

from data import records, verify
from data.pipeline import balance_order, device_put_batch, make_dataset
from data.schema import Schema

SEQ = {"click": 8, "impression": 16}


def _cfg(**kw):
  d = dict(batch_size=32, surface_weights={"feed": 0.5, "stories": 0.3, "reels": 0.2},
           shuffle_seed=0, num_threads=2, prefetch=4, skip_invalid=False, length_balance=False,
           length_balance_groups=0)
  return ml_collections.ConfigDict({**d, **kw})


def _key(batch, i):
  return (int(batch["request_ts"][i]), int(batch["user_id"][i]), int(batch["ad_id"][i]))


def _hash(x, vocab):   # independent big-int version of the documented multiplicative hash
  return ((int(x) * 0x9E3779B97F4A7C15) % 2**64 >> 29) % vocab


def test_eval_batches_match_records(tiny_dir):
  schema = Schema.load(tiny_dir)
  recs = [r for _, _, r in verify.read_split(tiny_dir, "eval", schema)]
  ds = make_dataset(_cfg(), tiny_dir, "eval", SEQ, train=False, shard_index=0, shard_count=1)
  batches = list(ds)
  assert len(batches) == -(-len(recs) // 32)
  rows = [(b, i) for b in batches for i in range(32)]
  for (b, i), r in zip(rows[:len(recs)], recs, strict=True):   # each record once, in order
    assert b["example_mask"][i] == 1
    np.testing.assert_array_equal(b["dense"][i], r["dense"])
    np.testing.assert_array_equal(b["labels"][i], r["labels"])
    assert b["surface"][i] == r["surface"] and b["request_ts"][i] == r["request_ts"]
    for f in schema.sparse:
      ids = r[f"sparse/{f.name}"]
      want = [(_hash(x, f.vocab_size) if f.hashed else x) for x in ids]
      want += [-1] * (f.max_len - len(ids))
      assert b["sparse"][f.name][i].tolist() == want
    for s in schema.streams:
      T, ev, got = SEQ[s.name], r[f"events/{s.name}"], b["events"][s.name]
      kept = ev[max(0, len(ev) - T):]                # most recent T, oldest first
      n = len(kept)
      assert got["length"][i] == n
      for c, name in enumerate(records.event_columns(s)):
        if name == "ts":
          want_age = [float(r["request_ts"]) - t for t in kept[:, 3]] + [0.0] * (T - n)
          np.testing.assert_allclose(got["age"][i], want_age)
        else:
          assert got[name][i].tolist() == kept[:, c].tolist() + [0] * (T - n)
  for b, i in rows[len(recs):]:                 # padding rows of the last batch
    assert b["example_mask"][i] == 0 and b["label_mask"][i].sum() == 0
    assert all(b["events"][s]["length"][i] == 0 for s in SEQ)


def _surface_counts(it, n_batches):
  c = collections.Counter()
  for _ in range(n_batches):
    c.update(next(it)["surface"].tolist())
  return c


def _check_props(counts, weights, n):
  w = np.array([weights[s] for s in ("feed", "stories", "reels")])
  w = w / w.sum()
  for k, p in enumerate(w):
    tol = 4 * np.sqrt(n * p * (1 - p)) + 1
    assert abs(counts[k] - n * p) <= tol, (counts, w)


def test_mixing_proportions_and_new_weights_on_resume(tiny_dir):
  cfg = _cfg(batch_size=100)
  it = iter(make_dataset(cfg, tiny_dir, "train", {"click": 2, "impression": 2}, train=True,
                         shard_index=0, shard_count=1))
  _check_props(_surface_counts(it, 100), cfg.surface_weights, 10_000)
  state = it.get_state()
  new_w = {"feed": 0.2, "stories": 0.2, "reels": 0.6}
  it2 = iter(make_dataset(_cfg(batch_size=100, surface_weights=new_w), tiny_dir, "train",
                          {"click": 2, "impression": 2}, train=True, shard_index=0,
                          shard_count=1))
  it2.set_state(state)
  _check_props(_surface_counts(it2, 40), new_w, 4_000)


def test_exact_resume_get_set_state(tiny_dir):
  mk = lambda: iter(make_dataset(_cfg(), tiny_dir, "train", SEQ, train=True, shard_index=0,
                                 shard_count=1))
  it = mk()
  for _ in range(7):
    next(it)
  state = it.get_state()
  want = [next(it) for _ in range(4)]
  it2 = mk()
  it2.set_state(state)
  for a in want:
    jax.tree.map(np.testing.assert_array_equal, a, next(it2))


def test_exact_resume_grain_checkpoint(tiny_dir, tmp_path):
  import orbax.checkpoint as ocp
  mk = lambda: iter(make_dataset(_cfg(), tiny_dir, "train", SEQ, train=True, shard_index=0,
                                 shard_count=1))
  it = mk()
  for _ in range(3):
    next(it)
  with ocp.CheckpointManager(str(tmp_path / "ckpt"), item_names=("data_iter",)) as mngr:
    mngr.save(3, args=ocp.args.Composite(data_iter=grain.checkpoint.CheckpointSave(it)))
    mngr.wait_until_finished()
  want = [next(it) for _ in range(3)]
  it2 = mk()
  with ocp.CheckpointManager(str(tmp_path / "ckpt"), item_names=("data_iter",)) as mngr:
    mngr.restore(3, args=ocp.args.Composite(data_iter=grain.checkpoint.CheckpointRestore(it2)))
  for a in want:
    jax.tree.map(np.testing.assert_array_equal, a, next(it2))


def test_train_shards_disjoint_across_processes(tiny_dir):
  n_feed = sum(c for _, c in records.split_files(tiny_dir, "train", Schema.load(tiny_dir))["feed"])
  keys = []
  for p in range(2):
    it = iter(make_dataset(_cfg(batch_size=32, surface_weights={"feed": 1.0}), tiny_dir,
                           "train", {"click": 1, "impression": 1}, train=True, shard_index=p,
                           shard_count=2))
    ks = []
    while len(ks) + 16 <= n_feed // 2:           # within one epoch of this process's shard
      b = next(it)
      assert b["surface"].shape == (16,) and (b["surface"] == 0).all()
      ks += [_key(b, i) for i in range(16)]
    assert len(set(ks)) == len(ks)
    keys.append(set(ks))
  assert not keys[0] & keys[1]


def test_eval_shards_partition_the_split(tiny_dir):
  got = []
  n_batches = []
  for p in range(2):
    bs = list(make_dataset(_cfg(batch_size=64), tiny_dir, "eval", {"click": 1, "impression": 1},
                           train=False, shard_index=p, shard_count=2))
    n_batches.append(len(bs))
    got.append([_key(b, i) for b in bs for i in range(32) if b["example_mask"][i]])
  assert n_batches[0] == n_batches[1]
  all_recs = [(int(r["request_ts"]), int(r["user_id"]), int(r["ad_id"]))
              for _, _, r in verify.read_split(tiny_dir, "eval")]
  assert got[0] == all_recs[0::2] and got[1] == all_recs[1::2]


def test_balance_order():
  rng = np.random.default_rng(0)
  tot = rng.pareto(1.0, 64) * 100
  order = balance_order(tot, 8)
  assert sorted(order.tolist()) == list(range(64))
  per_group = tot[order].reshape(8, 8).sum(1)
  naive = tot.reshape(8, 8).sum(1)
  assert per_group.max() - per_group.min() <= naive.max() - naive.min()
  # snake dealing: group g gets ranks g, 15-g, 16+g, 31-g, ...
  ranks = np.argsort(np.argsort(-tot, kind="stable"), kind="stable")
  assert sorted(ranks[order[:8]].tolist()) == [0, 15, 16, 31, 32, 47, 48, 63]


def test_length_balance_permutes_within_batch(tiny_dir):
  mk = lambda lb: iter(make_dataset(_cfg(length_balance=lb, length_balance_groups=4), tiny_dir,
                                    "train", SEQ, train=True, shard_index=0, shard_count=1))
  a, b = next(mk(False)), next(mk(True))
  ka, kb = [_key(a, i) for i in range(32)], [_key(b, i) for i in range(32)]
  assert sorted(ka) == sorted(kb) and ka != kb
  tot = sum(b["events"][s]["length"] for s in SEQ).reshape(4, 8).sum(1)
  tot_a = sum(a["events"][s]["length"] for s in SEQ).reshape(4, 8).sum(1)
  assert np.ptp(tot) <= np.ptp(tot_a)


def test_config_errors(tiny_dir):
  with pytest.raises(ValueError, match="multiple of the process count 3"):
    make_dataset(_cfg(), tiny_dir, "train", SEQ, train=True, shard_index=0, shard_count=3)
  with pytest.raises(ValueError, match="unknown surface.*'ads'"):
    make_dataset(_cfg(surface_weights={"ads": 1.0}), tiny_dir, "train", SEQ, train=True,
                 shard_index=0, shard_count=1)
  with pytest.raises(ValueError, match="seq_lens"):
    make_dataset(_cfg(), tiny_dir, "train", {"click": 1000}, train=True, shard_index=0,
                 shard_count=1)


def test_device_put_batch(tiny_dir):
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P
  mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
  b = next(iter(make_dataset(_cfg(), tiny_dir, "train", SEQ, train=True, shard_index=0,
                             shard_count=1)))
  g = device_put_batch(b, NamedSharding(mesh, P("data")))
  assert g["events"]["click"]["item"].shape == (32, 8)
  assert len(g["dense"].sharding.device_set) == 8
  jax.tree.map(np.testing.assert_array_equal, b, jax.device_get(g))
