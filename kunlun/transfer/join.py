"""As-of join of logged FM embeddings (LoopFM, spec g.3).

A log holds rows ``(user_id, ad_id, ts, emb[d])``: the FM embedding of (user, ad) computed at time
``ts`` (seconds). For a query ``(key, t)`` the join returns the most recent row of that key with
``ts <= t`` (never a row from the future), its age ``t - ts`` and a boolean ``present``. A query
with no such row (unknown key, only later rows, or older than ``max_age``) is *missing*:
``present=False`` and its embedding slot holds ``fill`` (0 by default). Consumers must use the mask
(``kunlun.transfer.loopfm`` swaps missing slots for a learned "missing" token).

Two join targets (``join_current``, ``join_events``):
  (a) the current example: key (user_id, ad_id) at request_ts;
  (b) each past event of a history stream: key (user_id, event item) (or user only) at the event
      time ``request_ts - age``; padded slots (>= length) are missing.

Everything is vectorised numpy: one lexsort at build time, one ``searchsorted`` per query batch.
"""

from __future__ import annotations

import numpy as np

from data.jagged import block_examples

_ID_BITS = 31  # ids are non-negative int32; (user << 31) | ad is an exact int64 key


def pair_key(user_id, ad_id) -> np.ndarray:
  """Exact int64 key of (user, ad) pairs; ids must lie in [0, 2**31)."""
  u = np.asarray(user_id, np.int64)
  a = np.asarray(ad_id, np.int64)
  for name, x in (("user_id", u), ("ad_id", a)):
    if x.size and (x.min() < 0 or x.max() >= 1 << _ID_BITS):
      raise ValueError(f"{name} must lie in [0, 2**31), got range [{x.min()}, {x.max()}]")
  return (u << _ID_BITS) | a


def event_times(request_ts, age) -> np.ndarray:
  """Event time in whole seconds, rounded *down*: floor(request_ts - age) (int64, shape of age).

  Rounding down guarantees a joined row is never later than the true event time.
  """
  t = np.asarray(request_ts, np.float64)[..., None] - np.asarray(age, np.float64)
  return np.floor(t).astype(np.int64)


class AsOfIndex:
  """Point-in-time index over logged embeddings, keyed by an int64 key.

  Args:
    keys: int64[N] (e.g. ``pair_key(user, ad)`` or plain user ids).
    ts: int[N] time each embedding was computed (seconds).
    emb: [N, d] embeddings (any float dtype; returned as float32).
  Rows with equal (key, ts) keep the last one given.
  """

  def __init__(self, keys, ts, emb):
    keys = np.asarray(keys, np.int64).reshape(-1)
    ts = np.asarray(ts, np.int64).reshape(-1)
    emb = np.asarray(emb)
    if emb.ndim != 2 or emb.shape[0] != keys.shape[0] or ts.shape != keys.shape:
      raise ValueError(f"AsOfIndex: need keys[N], ts[N], emb[N, d]; got {keys.shape}, {ts.shape}, "
                       f"{emb.shape}")
    self.dim = emb.shape[1]
    order = np.lexsort((np.arange(len(keys)), ts, keys))  # by key, then ts, then input order
    self._uniq, rank = np.unique(keys[order], return_inverse=True)
    self._ts = ts[order]
    self._emb = emb[order]
    self._rank = rank.astype(np.int64)
    self._t0 = int(self._ts.min()) if len(ts) else 0
    self._span = (int(self._ts.max()) - self._t0 + 2) if len(ts) else 2
    if len(self._uniq) * self._span >= 1 << 62:
      raise ValueError("AsOfIndex: key count x time span too large for an int64 composite key")
    self._comp = self._rank * self._span + (self._ts - self._t0)  # sorted ascending

  def __len__(self):
    return len(self._ts)

  def lookup(self, keys, t, *, max_age: float | None = None, fill: float = 0.0):
    """As-of lookup; keys and t broadcast to a common shape S.

    Returns ``(emb f32[*S, d], present bool[*S], age f32[*S])`` with ``age = t - ts`` of the
    joined row (0 where missing).
    """
    keys, t = np.broadcast_arrays(np.asarray(keys, np.int64), np.asarray(t, np.int64))
    shape = keys.shape
    k, t = keys.reshape(-1), t.reshape(-1)
    out = np.full((k.size, self.dim), fill, np.float32)
    if len(self) == 0 or k.size == 0:
      return out.reshape(*shape, self.dim), np.zeros(shape, bool), np.zeros(shape, np.float32)
    r = np.clip(np.searchsorted(self._uniq, k), 0, len(self._uniq) - 1)
    known = self._uniq[r] == k
    rel = np.clip(t - self._t0, -1, self._span - 2)  # -1: before every logged row
    idx = np.searchsorted(self._comp, r * self._span + rel, side="right") - 1
    idx_c = np.clip(idx, 0, None)
    present = known & (rel >= 0) & (idx >= 0) & (self._rank[idx_c] == r)
    age = np.where(present, t - self._ts[idx_c], 0)
    if max_age is not None:
      present &= age <= max_age
      age = np.where(present, age, 0)
    out[present] = self._emb[idx_c[present]].astype(np.float32)
    return (out.reshape(*shape, self.dim), present.reshape(shape),
            age.astype(np.float32).reshape(shape))


class EmbeddingLog:
  """Logged FM embeddings with as-of joins onto batches in the ``data/schema.py`` layout.

  Args:
    user_id, ad_id, ts: int[N] row keys and computation times (seconds).
    emb: [N, d] embeddings (dequantised floats; see ``export.dequantize``).
  """

  def __init__(self, user_id, ad_id, ts, emb):
    user_id = np.asarray(user_id, np.int64)
    self.pair = AsOfIndex(pair_key(user_id, ad_id), ts, emb)
    self.user = AsOfIndex(user_id, ts, emb)
    self.dim = self.pair.dim

  def join_current(self, batch, *, max_age=None, fill=0.0):
    """(a) FM embedding of the current (user, ad) as of request_ts.

    Returns ``(emb f32[B, d], present bool[B], age f32[B])``.
    """
    keys = pair_key(batch["user_id"], batch["ad_id"])
    return self.pair.lookup(keys, np.asarray(batch["request_ts"], np.int64), max_age=max_age,
                            fill=fill)

  def join_events(self, batch, stream: str, *, key: str = "user_item", max_age=None, fill=0.0):
    """(b) FM embedding of each event of ``stream`` as of the event's time.

    key: "user_item" joins on (user_id, event item) -- the embedding logged when the user met that
    item; "user" joins the user's most recent embedding (any ad) as of the event time.
    Returns ``(emb f32[B, T, d], present bool[B, T], age f32[B, T])``; padded slots are missing.
    A packed stream (``data/schema.py``: tokens ``[N]`` with ``seg``, one or more blocks) gives
    ``[N, d]``, ``[N]``, ``[N]`` rows aligned with its tokens; padding tokens are missing.
    """
    if stream not in batch["events"]:
      raise KeyError(f"join_events: stream {stream!r} not in batch (has {list(batch['events'])})")
    ev = batch["events"][stream]
    item = np.asarray(ev["item"])
    user_id = np.asarray(batch["user_id"], np.int64)
    if "seg" in ev:                            # packed, in S blocks (B: padding)
      B = len(user_id)
      example = block_examples(ev["seg"], B, len(ev["offsets"]) - B)
      valid, row = example < B, np.minimum(example, B - 1)
      t = event_times(np.asarray(batch["request_ts"])[row], np.asarray(ev["age"])[:, None])[:, 0]
      user = user_id[row]
    else:
      B, T = item.shape
      t = event_times(batch["request_ts"], ev["age"])
      valid = np.arange(T)[None, :] < np.asarray(ev["length"])[:, None]
      user = np.broadcast_to(user_id[:, None], (B, T))
    if key == "user_item":
      emb, present, age = self.pair.lookup(pair_key(user, item), t, max_age=max_age, fill=fill)
    elif key == "user":
      emb, present, age = self.user.lookup(user, t, max_age=max_age, fill=fill)
    else:
      raise ValueError(f"join_events: key must be 'user_item' or 'user', got {key!r}")
    emb[~valid] = fill
    return emb, present & valid, np.where(valid, age, 0).astype(np.float32)

  def join_batch(self, batch, streams=None, *, key="user_item", max_age=None):
    """Adds the LoopFM inputs to a copy of ``batch``: ``fm_ctx [B,d]``, ``fm_ctx_present [B]``,
    ``fm_ctx_age [B]``, ``fm_events {stream: [B,T,d]}``, ``fm_events_present {stream: [B,T]}``
    (a packed stream: ``[N, d]`` / ``[N]``, ``join_events``)."""
    out = dict(batch)
    out["fm_ctx"], out["fm_ctx_present"], out["fm_ctx_age"] = self.join_current(
        batch, max_age=max_age)
    out["fm_events"], out["fm_events_present"] = {}, {}
    for s in streams if streams is not None else batch["events"]:
      e, p, _ = self.join_events(batch, s, key=key, max_age=max_age)
      out["fm_events"][s], out["fm_events_present"][s] = e, p
    return out
