"""Packed (jagged) blocks per process on a mesh (batch x context shards): how many, and the
capacity plumbing's checks."""

import jax
import ml_collections
import numpy as np
import pytest

from data import jagged
from kunlun.train import runtime
from kunlun.train.startup import FatalError
from sharding import mesh as M
from sharding import rules as R


@pytest.mark.parametrize("sizes,preset,blocks", [
    ({"fsdp": 8}, "fsdp", 8), ({"data": 2, "fsdp": 2}, "dp", 4),
    ({"fsdp": 2, "tensor": 2}, "fsdp_tp", 2),      # heads over tensor: 2 batch shards
    ({"tensor": 4}, "fsdp_tp", 1),
    ({"fsdp": 2, "context": 2}, "fsdp_cp", 4),     # 2 batch shards x 2 context shards
    ({"data": 2, "context": 2, "tensor": 2}, "5d", 4)])
def test_local_blocks(sizes, preset, blocks):
  n = int(np.prod(list(sizes.values())))
  mesh = M.make_mesh(sizes, devices=jax.devices()[:n])
  assert runtime.local_blocks(mesh, R.get_rules(preset)) == blocks


def test_auto_capacity_is_per_block(capsys):
  lens = {"click": np.random.default_rng(0).integers(0, 40, 500)}
  got = runtime.capacity_from_lengths(lens, 64, 4)["click"]
  per_block = -(-jagged.capacity_for(lens["click"], 16) // 64) * 64
  assert got == 4 * per_block and per_block % 64 == 0
  assert "per process batch of 64 (4 blocks of 16 examples)" in capsys.readouterr().out


def test_auto_capacity_buckets(capsys):
  lens = {"click": np.random.default_rng(0).integers(0, 40, 500)}
  got = runtime.capacity_from_lengths(lens, 64, 2, buckets=3)["click"]
  want = [2 * -(-jagged.capacity_for(lens["click"], 32, q) // 64) * 64
          for q in jagged.BUCKET_QUANTILES[3]]
  assert list(got) == want and want[0] < want[-1]
  assert "in 3 buckets" in capsys.readouterr().out
  for cfg, count, words in [(dict(jagged_capacity="click=256", jagged_buckets=2), 1,
                             "needs data.jagged_capacity=auto"),
                            (dict(jagged_capacity="auto", jagged_buckets=2), 2, "one process")]:
    c = ml_collections.ConfigDict(dict(batch_size=64, **cfg))
    with pytest.raises(FatalError, match=words) as e:
      runtime.jagged_capacity(c, "unused", "train", {"click": 8}, count, 1)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("batch_size,value,shards,words", [
    (64, "click=192", 2, "multiple of 64 x the 2 blocks"),
    (66, "click=256", 4, "does not split into 4 blocks")])
def test_capacity_shard_errors(batch_size, value, shards, words):
  cfg = ml_collections.ConfigDict(dict(batch_size=batch_size, jagged_capacity=value))
  with pytest.raises(FatalError, match=words) as e:
    runtime.jagged_capacity(cfg, "unused", "train", {"click": 8}, 1, shards)
  assert "\n" not in str(e.value)
