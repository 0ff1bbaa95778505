import collections
import json

import grain
import jax
import ml_collections
import numpy as np
import pytest

from data import elastic, records, verify
from data.pipeline import invalid_counts, make_dataset

LENS = {"click": 4, "impression": 4}


def _cfg(**kw):
  d = dict(batch_size=32, surface_weights={"feed": 0.5, "stories": 0.3, "reels": 0.2},
           shuffle_seed=3, num_threads=2, prefetch=3, skip_invalid=False, length_balance=False)
  return ml_collections.ConfigDict({**d, **kw})


def _it(d, k, K, **kw):
  return iter(make_dataset(_cfg(**kw), d, "train", LENS, train=True, shard_index=k,
                           shard_count=K))


def _keys(b):
  return [(int(t), int(u), int(a)) for t, u, a, m in
          zip(b["request_ts"], b["user_id"], b["ad_id"], b["example_mask"], strict=True) if m]


def _concat(batches):
  return jax.tree.map(lambda *x: np.concatenate(x), *batches)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 65, 1000, 4099])
def test_permute_is_a_bijection(n):
  p = elastic.permute(np.arange(n), n, key=np.uint64(12345))
  assert sorted(p.tolist()) == list(range(n))
  if n >= 64:                                  # keyed: another key gives another order
    assert (p != elastic.permute(np.arange(n), n, key=np.uint64(54321))).mean() > 0.5


def test_one_epoch_reads_every_record_once(tiny_dir):
  feed = [r for _, _, r in verify.read_split(tiny_dir, "train") if r["surface"] == 0]
  want = collections.Counter((int(r["request_ts"]), int(r["user_id"]), int(r["ad_id"]))
                             for r in feed)
  n = len(feed) // 32
  it = _it(tiny_dir, 0, 1, surface_weights={"feed": 1.0})
  got = collections.Counter(k for _ in range(n) for k in _keys(next(it)))
  assert sum(got.values()) == n * 32 and not got - want and max(got.values()) == 1


def _uninterrupted(d, steps, **kw):
  it = _it(d, 0, 1, **kw)
  return [next(it) for _ in range(steps)]


@pytest.mark.parametrize("before,after", [(2, 1), (1, 2), (2, 4), (2, 2)])
def test_elastic_resume_changes_process_count(tiny_dir, before, after):
  """Save after 3 steps with ``before`` processes, resume with ``after``: every global batch
  equals the uninterrupted single-process run's (bound: 0 repeated, 0 skipped examples)."""
  want = _uninterrupted(tiny_dir, 6)
  its = [_it(tiny_dir, k, before) for k in range(before)]
  got = [_concat([next(it) for it in its]) for _ in range(3)]
  states = [it.get_state() for it in its]
  assert all(s["plan"] == states[0]["plan"] for s in states)   # global: any process's file
  its = [_it(tiny_dir, k, after) for k in range(after)]
  for it in its:
    it.set_state(json.loads(json.dumps(states[0])))
  got += [_concat([next(it) for it in its]) for _ in range(3)]
  for a, b in zip(want, got, strict=True):
    jax.tree.map(np.testing.assert_array_equal, a, b)
  multiset = lambda bs: collections.Counter(k for b in bs for k in _keys(b))
  assert multiset(want) == multiset(got)


def test_resume_with_other_global_batch_size(tiny_dir):
  want = _concat(_uninterrupted(tiny_dir, 4, batch_size=16))       # positions 0..63
  it = _it(tiny_dir, 0, 1, batch_size=32)
  first = next(it)
  it2 = _it(tiny_dir, 0, 1, batch_size=16)
  it2.set_state(it.get_state())
  got = _concat([first, next(it2), next(it2)])
  jax.tree.map(np.testing.assert_array_equal, want, got)


def test_elastic_checkpoint_restore_other_process_count(tiny_dir, tmp_path, monkeypatch):
  """orbax + ``elastic.CheckpointSave/Restore``: written as process 0 of 2, restored by the
  single process of a 1-process run (no ``process_0-of-1.json`` exists)."""
  import orbax.checkpoint as ocp
  from grain._src.core import sharding
  its = [_it(tiny_dir, k, 2) for k in range(2)]
  for _ in range(2):
    for it in its:
      next(it)
  monkeypatch.setattr(sharding, "get_process_index_and_count", lambda: (0, 2))
  with ocp.CheckpointManager(str(tmp_path), item_names=("data_iter",)) as mngr:
    mngr.save(2, args=ocp.args.Composite(data_iter=elastic.CheckpointSave(its[0])))
    mngr.wait_until_finished()
  monkeypatch.setattr(sharding, "get_process_index_and_count", lambda: (0, 1))
  assert [p.name for p in (tmp_path / "2" / "data_iter").glob("*.json")] == ["process_0-of-2.json"]
  want = _concat([next(it) for it in its])
  it1 = _it(tiny_dir, 0, 1)
  with ocp.CheckpointManager(str(tmp_path), item_names=("data_iter",)) as mngr:
    mngr.restore(2, args=ocp.args.Composite(data_iter=elastic.CheckpointRestore(it1)))
  jax.tree.map(np.testing.assert_array_equal, want, next(it1))


def test_mp_prefetch_same_stream_and_resume(tiny_dir):
  from absl import flags
  flags.FLAGS.mark_as_parsed()
  want = _uninterrupted(tiny_dir, 5)
  mp = grain.MultiprocessingOptions(num_workers=2, per_worker_buffer_size=1)
  ds = make_dataset(_cfg(), tiny_dir, "train", LENS, train=True, shard_index=0, shard_count=1)
  it = iter(ds.mp_prefetch(mp))
  for b in want[:3]:
    jax.tree.map(np.testing.assert_array_equal, b, next(it))
  state = json.loads(json.dumps(it.get_state()))
  for b in want[3:]:
    jax.tree.map(np.testing.assert_array_equal, b, next(it))
  it.set_state(state)                            # back to step 3 (the workers get their states)
  for b in want[3:]:
    jax.tree.map(np.testing.assert_array_equal, b, next(it))
  it.close()
  plain = iter(ds)                               # another worker count: via elastic.global_state
  plain.set_state(elastic.global_state(state))
  for b in want[3:]:
    jax.tree.map(np.testing.assert_array_equal, b, next(plain))


def test_mp_prefetch_skip_counts_reach_the_parent(tmp_path):
  """Known bad records (one of each kind) in an eval split read by 2 worker processes."""
  from absl import flags

  from tests.data.test_verify import _write_mixed
  flags.FLAGS.mark_as_parsed()
  bad = _write_mixed(tmp_path, n_good=5)
  want = collections.Counter(kind for kind, _, _ in bad)
  cfg = _cfg(batch_size=4, surface_weights={"feed": 1.0}, skip_invalid=True)
  ds = make_dataset(cfg, str(tmp_path), "eval", {}, train=False, shard_index=0, shard_count=1)
  it = iter(ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=2,
                                                         per_worker_buffer_size=1)))
  batches = list(it)
  assert len(batches) == 5                      # 20 records, every row kept (bad rows masked)
  assert sum(b["example_mask"].sum() for b in batches) == 5
  assert invalid_counts(it) == dict(want) and sum(want.values()) == 15
  assert ds.invalid_counter.total == 0          # the parent's own counter saw nothing
  it.close()
  it1 = iter(ds)                                # in-process: the counter and the state agree
  list(it1)
  assert invalid_counts(it1) == ds.invalid_counter.counts == dict(want)


def test_skipped_rows_are_padding_in_train(tmp_path):
  from tests.data.test_records import _example
  from tests.data.test_verify import SCHEMA, _bad
  w = records.DatasetWriter(str(tmp_path), SCHEMA)
  rng = np.random.default_rng(0)
  good = [records.encode(_example(SCHEMA, rng, 0)) for _ in range(6)]
  w.write("train", "feed", good[:3] + [_bad("nan")[2], _bad("label")[2]] + good[3:])
  w.close(("train",))
  it = iter(make_dataset(_cfg(batch_size=8, surface_weights={"feed": 1.0}, skip_invalid=True),
                         str(tmp_path), "train", {}, train=True, shard_index=0, shard_count=1))
  masks = [next(it)["example_mask"] for _ in range(4)]        # 32 rows = 4 epochs of 8 records
  assert sum(m.sum() for m in masks) == 4 * 6
  assert invalid_counts(it) == {"non_finite": 4, "label": 4}


def test_permute_per_element_sizes_and_keys():
  n = np.array([10] * 10 + [7] * 7 + [10] * 10)
  key = np.array([1] * 17 + [2] * 10, np.uint64)
  i = np.concatenate([np.arange(10), np.arange(7), np.arange(10)])
  p = elastic.permute(i, n, key)
  for sl in (slice(0, 10), slice(10, 17), slice(17, 27)):
    assert sorted(p[sl].tolist()) == list(range(len(p[sl])))
    np.testing.assert_array_equal(p[sl], elastic.permute(i[sl], n[sl][0], key[sl][0]))
  big = 2**40 + 1                                # sizes past 2**32 (a few ids only)
  q = elastic.permute(np.array([0, 1, big - 1]), big, np.uint64(9))
  assert len(set(q.tolist())) == 3 and (q < big).all() and (q >= 0).all()


def test_foreign_state_is_a_clear_error(tiny_dir):
  it = _it(tiny_dir, 0, 1)
  with pytest.raises(ValueError, match="does not fit this pipeline"):
    it.set_state({"parents": {}, "next_index": 3})       # e.g. a plain grain mix state
  ev = iter(make_dataset(_cfg(), tiny_dir, "eval", LENS, train=False, shard_index=0,
                         shard_count=1))
  with pytest.raises(ValueError, match="TrainPlan"):
    it.set_state(ev.get_state())


def test_new_weights_continue_each_surface_stream(tiny_dir):
  """feed only for 2 steps, then feed + stories: feed's rows go on through the same epoch
  permutation (no feed record repeats before the epoch ends)."""
  it = _it(tiny_dir, 0, 1, surface_weights={"feed": 1.0})
  first = [k for _ in range(2) for k in _keys(next(it))]
  it2 = _it(tiny_dir, 0, 1, surface_weights={"feed": 0.5, "stories": 0.5})
  it2.set_state(it.get_state())
  later = [b for b in (next(it2) for _ in range(6))]
  feed = [k for b in later for k, s in zip(_keys(b), b["surface"], strict=True) if s == 0]
  assert 60 < len(feed) < 132 and (np.concatenate([b["surface"] for b in later]) == 1).any()
  assert len(set(first + feed)) == len(first) + len(feed)
  assert it2.get_state()["plan"]["consumed"]["feed"] == 64 + len(feed)


def test_train_checkpointer_restores_iterator_under_another_process_count(tiny_dir, tmp_path,
                                                                            monkeypatch):
  """``kunlun.train.checkpoint.Checkpointer`` (train.py's): saved by process 1 of 2, restored
  by a 1-process run."""
  from grain._src.core import sharding

  from kunlun.train import checkpoint
  its = [_it(tiny_dir, k, 2) for k in range(2)]
  for it in its:
    next(it)
  params, opt = {"w": jax.numpy.arange(3.0)}, {"m": jax.numpy.zeros(3)}
  rng = jax.random.key(0)
  monkeypatch.setattr(sharding, "get_process_index_and_count", lambda: (1, 2))
  ckpt = checkpoint.Checkpointer(str(tmp_path / "ck"), keep=1)
  ckpt.save(1, params, opt, rng, its[1])
  ckpt.close()
  monkeypatch.setattr(sharding, "get_process_index_and_count", lambda: (0, 1))
  want = _concat([next(it) for it in its])
  it1 = _it(tiny_dir, 0, 1)
  ckpt = checkpoint.Checkpointer(str(tmp_path / "ck"), keep=1)
  step, p, _, _ = ckpt.restore(checkpoint.abstract_like(params), checkpoint.abstract_like(opt),
                               it1)
  ckpt.close()
  assert step == 1
  np.testing.assert_array_equal(p["w"], params["w"])
  jax.tree.map(np.testing.assert_array_equal, want, next(it1))


def test_zero_weight_surface_in_the_middle_is_never_picked():
  """Weights {feed 0.5, stories 0, reels 0.5}: every row comes from feed or reels, about half
  each, and stories never; the per-surface counts in the state match the rows (an independent
  count). Picking an index among the active surfaces only (not mapped back to all surfaces)
  would train on stories and never on reels."""
  plan = elastic.TrainPlan({"feed": 1000, "stories": 500, "reels": 800},
                           {"feed": 0.5, "stories": 0.0, "reels": 0.5}, seed=5,
                           global_batch=256, shard_index=0, shard_count=1)
  st, src = plan.initial_state(), []
  for _ in range(8):
    rows, st = plan.step(st)
    src.append(rows.source)
  src = np.concatenate(src)
  counts = collections.Counter(src.tolist())
  assert set(counts) == {0, 2} and counts[1] == 0
  assert 0.4 < counts[0] / len(src) < 0.6
  assert st["consumed"] == {"feed": counts[0], "stories": 0, "reels": counts[2]}
