"""Random batches in the pipeline's layout (see ``data.schema``), for model tests only."""

from __future__ import annotations

import numpy as np

from data.schema import EventField, EventStream, Schema, SparseFeature, Task


def random_batch(schema: Schema, batch_size: int, seq_lens: dict[str, int] | None = None,
                 seed: int = 0, min_len: int = 0) -> dict:
  """A batch of random, valid inputs. ``seq_lens[stream]`` is the static kept length T."""
  rng = np.random.default_rng(seed)
  B = batch_size
  out = {
      "dense": rng.lognormal(size=(B, len(schema.dense))).astype(np.float32),
      "sparse": {},
      "surface": rng.integers(0, len(schema.surfaces), B).astype(np.int32),
      "events": {},
      "user_id": rng.integers(0, 1 << 30, B).astype(np.int32),
      "ad_id": rng.integers(0, 1 << 30, B).astype(np.int32),
      "request_ts": rng.integers(1 << 20, 1 << 28, B).astype(np.int32),
  }
  for f in schema.sparse:
    ids = rng.integers(0, f.vocab_size, (B, f.max_len)).astype(np.int32)
    n = rng.integers(1, f.max_len + 1, B)
    ids[np.arange(f.max_len)[None, :] >= n[:, None]] = -1
    out["sparse"][f.name] = ids
  for s in schema.streams:
    T = (seq_lens or {}).get(s.name, s.max_len)
    length = rng.integers(min(min_len, T), T + 1, B).astype(np.int32)
    valid = np.arange(T)[None, :] < length[:, None]
    ev = {
        "item": rng.integers(0, s.item_vocab, (B, T)),
        "action": rng.integers(0, s.action_vocab, (B, T)),
        "surface": rng.integers(0, len(schema.surfaces), (B, T)),
    }
    for e in s.extra_fields:
      ev[e.name] = rng.integers(0, e.vocab_size, (B, T))
    ev = {k: np.where(valid, v, 0).astype(np.int32) for k, v in ev.items()}
    # oldest first: ages decrease along the valid prefix
    age = np.sort(rng.exponential(3600.0 * 24, (B, T)), axis=1)[:, ::-1]
    ev["age"] = np.where(valid, age, 0.0).astype(np.float32)
    ev["length"] = length
    out["events"][s.name] = ev
  K = len(schema.tasks)
  p = rng.uniform(0.01, 0.5, (B, K)).astype(np.float32)
  out["true_prob"] = p
  out["labels"] = (rng.uniform(size=(B, K)) < p).astype(np.float32)
  mask = np.ones((B, K), np.float32)
  for k, t in enumerate(schema.tasks):
    if not t.always_valid:
      mask[:, k] = rng.uniform(size=B) < 0.3
  out["label_mask"] = mask
  return out


def tiny_schema() -> Schema:
  """A small schema used by unit tests (mirrors the synthetic ``tiny`` preset's structure)."""
  return Schema(
      sparse=(SparseFeature("user_segment", 50), SparseFeature("ad_category", 20),
              SparseFeature("ad_id_hash", 1000, hashed=True),
              SparseFeature("user_interests", 30, max_len=4)),
      dense=("user_age_days", "ad_bid", "hour_of_day"),
      streams=(EventStream("click", 64, item_vocab=500, action_vocab=3,
                           extra_fields=(EventField("category", 20),)),
               EventStream("impression", 128, item_vocab=500, action_vocab=2)),
      surfaces=("feed", "stories", "reels"),
      tasks=(Task("click"), Task("conversion", always_valid=False)),
  )
