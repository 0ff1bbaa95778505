"""Packed (jagged) tower capacities: the blocks a process packs (its devices' batch shards x
the context shards of each), ``data.jagged_capacity`` checked or resolved (``auto``: from a
sample of the split's kept lengths, aligned for the backward's split-K tiles, in
``data.jagged_buckets`` buckets). Problems are one-line FatalErrors."""

from __future__ import annotations

import itertools

import numpy as np

from data import jagged, pipeline
from kunlun.configs.fields import parse_capacity
from kunlun.train.startup import fail
from sharding import partition
from sharding.packed import blocks_per_batch_shard


def auto_capacity_sample(batch: int) -> int:
  """Examples whose kept lengths set ``data.jagged_capacity=auto`` for a process batch of
  ``batch``: 16 batches, 4,096 to 65,536. The rare long histories set the tail of a batch's total;
  on mid's lengths at batch 1024, 4,096 examples (4 batches) gave capacities that 0.1% to 2.9% of
  fresh batches overflowed (four samples; the three towers together), 16,384 gave 0.1% to 0.6%."""
  return min(max(4096, 16 * int(batch)), 65536)


def local_batch_shards(batch_sharding) -> int:
  """Batch shards held by this process's devices under ``batch_sharding`` (a NamedSharding of the
  leading axis): the packed (jagged) blocks this process packs."""
  n = batch_sharding.mesh.size                     # a multiple of the batch shard count
  starts = {idx[0].indices(n)[0]
            for idx in batch_sharding.addressable_devices_indices_map((n,)).values()}
  return len(starts)


def local_blocks(mesh, rules) -> int:
  """Packed (jagged) blocks this process packs: its devices' batch shards x the blocks each batch
  shard is cut into (its context shards under context parallelism,
  ``sharding.packed.blocks_per_batch_shard``), so that every device holds whole blocks."""
  try:
    per = blocks_per_batch_shard(mesh, rules)
  except ValueError as e:
    fail(f"config.sharding.rules: {e}")
  return local_batch_shards(partition.batch_sharding(mesh, rules)) * per


def jagged_capacity(data_cfg, data_dir: str, split: str, seq_lens: dict[str, int],
                    shard_count: int, blocks: int = 1) -> dict[str, int] | None:
  """``data_cfg.jagged_capacity`` resolved for ``pipeline.make_dataset``: None (padded) or
  {stream: N} per process batch, packed in ``blocks`` blocks (``local_blocks``) of N / blocks
  tokens. "auto": every stream, N / blocks = ``data.jagged.capacity_for`` (P(overflow) <= 0.001)
  of a block's batch over the kept lengths of up to ``auto_capacity_sample`` examples of ``split``,
  rounded up to a multiple of 64. A block holds whole examples, so a history longer than a
  block's capacity keeps only its most recent events (counted drops, ``data.jagged``): the limit
  of packing per block, tighter with more blocks per batch. Problems are FatalErrors."""
  try:
    value = parse_capacity(data_cfg.get("jagged_capacity", ""))
  except ValueError as e:
    fail(str(e))
  B = int(data_cfg.batch_size) // shard_count
  buckets = int(data_cfg.get("jagged_buckets", 1))
  if value:
    try:
      jagged.check_shards(blocks, B)
    except ValueError as e:
      fail(f"data.jagged_capacity with {blocks} packed blocks per process (its batch x context "
           f"shards): {e}")
  if buckets != 1:
    if value != "auto":
      fail(f"data.jagged_buckets = {buckets} needs data.jagged_capacity=auto (it sets the "
           f"buckets' capacities; data.jagged_capacity = {value or ''!r})")
    if shard_count > 1:
      fail(f"data.jagged_buckets = {buckets} runs on one process only: every process would pick "
           "its own bucket, and all must run the same program")
  if value != "auto":
    _check_fixed_capacity(value or {}, seq_lens, B, blocks)
    return value
  ds = pipeline.make_dataset(data_cfg, data_dir, split, seq_lens, train=False, shard_index=0,
                             shard_count=1)
  lens = {s: [] for s in seq_lens}
  n = 0
  for batch in itertools.islice(iter(ds), -(-auto_capacity_sample(B) // int(data_cfg.batch_size))):
    real = np.asarray(batch["example_mask"]) > 0
    for s in lens:
      lens[s].append(np.asarray(batch["events"][s]["length"])[real])
    n += int(real.sum())
  if not n:
    fail(f"data.jagged_capacity=auto: split {split!r} in {data_dir} has no examples")
  return capacity_from_lengths({s: np.concatenate(v) for s, v in lens.items()}, B, blocks,
                               buckets)


def _check_fixed_capacity(value: dict, seq_lens: dict[str, int], B: int, blocks: int) -> None:
  """A fixed ``data.jagged_capacity`` {stream: N}: streams of the data, N a multiple of 64 x
  ``blocks`` and no more than a process batch of ``B`` examples can hold (each block's
  ``B / blocks`` examples x the stream's kept length, rounded up to 64); FatalErrors."""
  unknown = sorted(set(value) - set(seq_lens))
  if unknown:
    fail(f"data.jagged_capacity: unknown stream(s) {unknown}; the data's streams are "
         f"{sorted(seq_lens)}")
  bad = {s: n for s, n in value.items() if n % (64 * blocks)}
  if bad:
    fail(f"data.jagged_capacity {bad}: N must be a multiple of 64 x the {blocks} blocks of a "
         "process (its batch x context shards; 64 tokens a block)")
  for s, n in value.items():
    T = int(seq_lens[s])
    most = blocks * -(-(B // blocks) * T // 64) * 64
    if n > most:
      fail(f"data.jagged_capacity {s}={n}: more tokens than a process batch holds ({B} examples "
           f"x kept_len {T} = {B * T}); at most {most}"
           + (f" ({blocks} blocks of {B // blocks} examples, each rounded up to 64)"
              if blocks > 1 else ""))


def aligned_capacity(n: int, most: int) -> int:
  """A block's ``auto`` capacity for ``n`` tokens: at least 64, rounded up to 64 x a power of two
  (up to 2048) that adds less than 1/32 of ``n``, and no more than ``most`` (the block's examples
  x their longest history) rounded up to 64. Why: the backward's weight gradients contract over
  the tokens, and XLA:GPU splits that dimension (split-K) into tiles whose multiple a capacity of
  a plain multiple of 64 rarely is: it then pads (copies) every operand, 10.3 of mid's 149 GB at
  batch 1024 on the H200 program."""
  m = 64
  while m < 2048 and 64 * m <= n:
    m *= 2
  up = lambda k, m: -(-k // m) * m
  return max(64, min(up(n, m), up(most, 64)))


def capacity_from_lengths(lens: dict, batch_size: int, shards: int = 1, buckets: int = 1
                          ) -> dict:
  """``data.jagged_capacity=auto`` from a sample of kept lengths ``{stream: i[n]}``: per stream
  ``shards`` x ``data.jagged.capacity_for`` (P(overflow) <= 0.001) of a block's batch
  ``batch_size / shards``, aligned (``aligned_capacity``: at least 64); printed. ``buckets`` K >
  1 (``data.jagged_buckets``): per stream a tuple of K such capacities
  (``data.jagged.capacity_buckets``), the last the one above."""
  Bs = batch_size // shards
  out = {s: tuple(shards * aligned_capacity(n, Bs * int(np.max(v, initial=0)))
                  for n in jagged.capacity_buckets(v, Bs, buckets)) for s, v in lens.items()}
  n = len(next(iter(lens.values()), ()))
  per = "" if shards == 1 else f" ({shards} blocks of {Bs} examples)"
  what = "" if buckets == 1 else f" in {buckets} buckets (a batch takes the smallest that fits)"
  caps = ",".join(f"{s}=" + "/".join(map(str, c)) for s, c in out.items())
  print(f"data.jagged_capacity=auto: {caps} tokens per process batch of {batch_size}{per}{what} "
        f"(from {n} examples)", flush=True)
  return {s: c[0] for s, c in out.items()} if buckets == 1 else out
