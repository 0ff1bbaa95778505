"""Packed (jagged) blocks per process on a mesh (batch x context shards): how many, and the
capacity plumbing's checks."""

import jax
import ml_collections
import numpy as np
import pytest

from data import jagged
from kunlun.train import capacity
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
  assert capacity.local_blocks(mesh, R.get_rules(preset)) == blocks


def test_auto_capacity_is_per_block(capsys):
  lens = {"click": np.random.default_rng(0).integers(0, 40, 500)}
  got = capacity.capacity_from_lengths(lens, 64, 4)["click"]
  per_block = -(-jagged.capacity_for(lens["click"], 16) // 64) * 64
  assert got == 4 * per_block and per_block % 64 == 0
  assert "per process batch of 64 (4 blocks of 16 examples)" in capsys.readouterr().out


@pytest.mark.parametrize("n,most,want", [
    (0, 0, 64), (320, 10**6, 320), (4095, 10**6, 4096), (6080, 10**6, 6144),
    (43904, 10**6, 44032), (140928, 10**6, 141312), (163008, 10**6, 163840),
    (163008, 163000, 163008), (5000, 5000, 5056)])
def test_aligned_capacity(n, most, want):
  """A block's auto capacity: a multiple of 64 x the largest power of two (<= 2048) whose 64
  multiples still fit n (so the slack stays under 1/32 of n), capped at the block's most tokens
  rounded up to 64 (mid's H200 split-K tiles want 44032, 141312 for 43904, 140928)."""
  got = capacity.aligned_capacity(n, most)
  assert got == want and got - n <= max(64, n / 32)


def test_auto_capacity_buckets(capsys):
  lens = {"click": np.random.default_rng(0).integers(0, 40, 500)}
  got = capacity.capacity_from_lengths(lens, 64, 2, buckets=3)["click"]
  want = [2 * -(-jagged.capacity_for(lens["click"], 32, q) // 64) * 64
          for q in jagged.BUCKET_QUANTILES[3]]
  assert list(got) == want and want[0] < want[-1]
  assert "in 3 buckets" in capsys.readouterr().out
  for cfg, count, words in [(dict(jagged_capacity="click=256", jagged_buckets=2), 1,
                             "data.jagged_buckets = 2 needs data.jagged_capacity=auto"),
                            (dict(jagged_capacity="", jagged_buckets=3), 1,   # without packing
                             "data.jagged_buckets = 3 needs data.jagged_capacity=auto"),
                            (dict(jagged_capacity="auto", jagged_buckets=2), 2, "one process")]:
    c = ml_collections.ConfigDict(dict(batch_size=64, **cfg))
    with pytest.raises(FatalError, match=words) as e:
      capacity.jagged_capacity(c, "unused", "train", {"click": 8}, count, 1)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("batch_size,value,shards,words", [
    (64, "click=192", 2, "multiple of 64 x the 2 blocks"),
    (66, "click=256", 4, "does not split into 4 blocks")])
def test_capacity_shard_errors(batch_size, value, shards, words):
  cfg = ml_collections.ConfigDict(dict(batch_size=batch_size, jagged_capacity=value))
  with pytest.raises(FatalError, match=words) as e:
    capacity.jagged_capacity(cfg, "unused", "train", {"click": 8}, 1, shards)
  assert "\n" not in str(e.value)


@pytest.mark.parametrize("value,kept,shards,ok,words", [
    ("views=64", 8, 1, False, "data.jagged_capacity: unknown stream(s) ['views']; the data's "
                              "streams are ['click', 'impression']"),
    # hand-written bounds: a process batch of 64 examples x 8 kept events holds 512 tokens
    ("click=512", 8, 1, True, ""),
    ("click=576", 8, 1, False, "data.jagged_capacity click=576: more tokens than a process batch "
                               "holds (64 examples x kept_len 8 = 512); at most 512"),
    ("click=576", 9, 1, True, ""),                # 576 tokens: a multiple of 64 already
    ("click=640", 9, 1, False, "at most 576"),
    ("click=448", 7, 1, True, ""),
    ("click=512", 7, 1, False, "at most 448"),
    ("click=512", 8, 2, True, ""),                # 2 blocks of 32 x 8 = 256 tokens
    ("click=640", 8, 2, False, "at most 512"),
    ("click=384", 5, 2, True, ""),                # 2 blocks of 32 x 5 = 160 -> 192 tokens
    ("click=512", 5, 2, False, "at most 384"),
    ("click=1099511627776", 8, 1, False, "at most 512")])
def test_fixed_capacity_streams_and_upper_bound(value, kept, shards, ok, words):
  """A fixed ``data.jagged_capacity`` names streams of the data and asks for no more tokens than
  a process batch can hold, per block rounded up to 64 (before: an unknown stream was a
  traceback in train.py's set-up, and 2**40 tokens an allocation)."""
  cfg = ml_collections.ConfigDict(dict(batch_size=64, jagged_capacity=value))
  lens = {"click": kept, "impression": 8}
  if ok:
    assert capacity.jagged_capacity(cfg, "unused", "train", lens, 1, shards) == {
        "click": int(value.split("=")[1])}
    return
  with pytest.raises(FatalError) as e:
    capacity.jagged_capacity(cfg, "unused", "train", lens, 1, shards)
  assert words in str(e.value) and "\n" not in str(e.value), str(e.value)
