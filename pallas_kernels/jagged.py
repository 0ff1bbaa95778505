"""The packed ("jagged") event layout of issue #28: descriptor, pack / unpack, XLA twins.

Tokens ``[N, H, D]`` of B examples at a static capacity N with ``Jagged(offsets i32[B+1], seg
i32[N], pos i32[N])`` (pallas_kernels/README.md); ops ``jagged_gdpa_cross`` (PFFN),
``jagged_gdpa_pool`` (HSP), ``jagged_block_attention``, ``jagged_softmax_attention``;
``jagged_softmax_pool`` (PMA; XLA only).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.activations import apply_per_head, per_head
from pallas_kernels.reference import (
    block_attention_reference,
    clip_scores,
    layer_norm,
    layer_norm_held,
    masked_softmax_attention,
)

_F32 = jnp.float32
TILE_RANGE = (8, 64)   # token tiles of the XLA twins' (tile, example) work list (pallas: own)
BAND_MIN = 8           # least query chunk of the banded twin (the padded reference's: 16)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class Jagged:
  """Where each example's tokens sit in a packed buffer of ``capacity`` tokens.

  ``offsets i32[B+1]``: example b owns tokens ``[offsets[b], offsets[b+1])``; ``seg i32[N]``:
  the example of each token (``B`` for padding); ``pos i32[N]``: its position in the example's
  padded row (0 for padding).

  ``shards`` S > 1 (static): the buffer is S consecutive blocks, block s a complete buffer of
  ``Ns = N / S`` tokens for examples ``[s Bs, (s + 1) Bs)`` (``Bs = B / S``): ``offsets
  i32[S (Bs+1)]`` and ``seg`` are local to their block (``Bs`` for padding). The kernels here
  take one block (S = 1); ``blocks()`` gives the descriptor to ``jax.vmap`` over.
  """
  offsets: jax.Array
  seg: jax.Array
  pos: jax.Array
  shards: int = dataclasses.field(default=1, metadata=dict(static=True))

  @property
  def batch(self) -> int:
    """All examples, ``B = S Bs``."""
    return self.offsets.shape[0] - self.shards

  @property
  def capacity(self) -> int:
    return self.seg.shape[0]

  @property
  def block_batch(self) -> int:
    return self.batch // self.shards

  @property
  def lengths(self) -> jax.Array:
    o = self.offsets.reshape(self.shards, -1)
    return (o[:, 1:] - o[:, :-1]).reshape(-1)

  @property
  def total(self) -> jax.Array:
    """Number of real tokens, ``offsets[B]`` (summed over the blocks)."""
    return self.offsets[-1] if self.shards == 1 else jnp.sum(self.totals)

  @property
  def totals(self) -> jax.Array:
    """``i32[S]``: real tokens of each block (they lead it: ``[s Ns, s Ns + totals[s])``)."""
    return self.offsets.reshape(self.shards, -1)[:, -1]

  @property
  def valid(self) -> jax.Array:
    """``bool[N]``: real (not padding) tokens."""
    return self.seg < self.block_batch

  def per_token(self, x):
    """``x [B, ...]`` (per example) -> ``[N, ...]``: each token's example's row (0 for padding),
    gathered within each block."""
    S = self.shards
    xb = x.reshape((S, self.block_batch) + x.shape[1:])
    xb = jnp.concatenate([xb, jnp.zeros((S, 1) + x.shape[1:], x.dtype)], axis=1)
    seg = self.seg.reshape((S, -1) + (1,) * (x.ndim - 1))
    return jnp.take_along_axis(xb, seg, axis=1).reshape((self.capacity,) + x.shape[1:])

  def shifted(self, x):
    """``x [N, ...]`` moved one token later within each block (``out[n] = x[n - 1]``, a block's
    first token keeps its own): each token's predecessor, never across blocks."""
    xb = x.reshape((self.shards, -1) + x.shape[1:])
    return jnp.concatenate([xb[:, :1], xb[:, :-1]], axis=1).reshape(x.shape)

  def blocks(self) -> "Jagged":
    """The S blocks as one descriptor with leaves ``[S, ...]`` (``shards`` 1): ``jax.vmap``
    the kernels over it."""
    S = self.shards
    return Jagged(self.offsets.reshape(S, -1), self.seg.reshape(S, -1), self.pos.reshape(S, -1))


def sharded(offsets, seg, pos, batch: int) -> Jagged:
  """The descriptor of a packed batch of ``batch`` examples (``data/schema.py``), its shard count
  read off the shapes: ``S = len(offsets) - batch``; a one-line ValueError unless S >= 1 divides
  the batch and the capacity."""
  S, N = offsets.shape[0] - batch, seg.shape[0]
  if S < 1 or batch % S or N % S or pos.shape != seg.shape:
    raise ValueError(f"packed (jagged) layout: offsets [{offsets.shape[0]}], seg [{N}], pos "
                     f"{list(pos.shape)} for {batch} examples: expected S >= 1 blocks with "
                     f"offsets [B + S] = [S (B/S + 1)], S dividing B={batch} and N={N}")
  return Jagged(offsets, seg, pos, S)


def from_lengths(lengths, capacity: int) -> Jagged:
  """The descriptor of examples with ``lengths i32[B]`` (sum <= capacity) packed in order."""
  lengths = jnp.asarray(lengths, jnp.int32)
  offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(lengths, dtype=jnp.int32)])
  n = jnp.arange(capacity, dtype=jnp.int32)
  seg = jnp.searchsorted(offsets[1:], n, side="right").astype(jnp.int32)   # B past the end
  pos = jnp.where(seg < lengths.shape[0], n - offsets[jnp.minimum(seg, lengths.shape[0])], 0)
  return Jagged(offsets, seg, pos.astype(jnp.int32))


def kept_lengths(lengths, capacity: int, max_len: int):
  """``(kept i32[B], dropped i32[])``: lengths after the overflow rule (drop the oldest events of
  the longest histories first): the largest cap c with ``sum(min(len, c)) <= capacity``, then
  the leftover room one event each to the longest clipped examples (ties: lower index)."""
  lengths = jnp.clip(jnp.asarray(lengths, jnp.int32), 0, max_len)
  fits = lambda c: jnp.sum(jnp.minimum(lengths, c)) <= capacity

  def search(_, lohi):                       # invariant: fits(lo), not fits(hi) unless hi = max
    lo, hi = lohi
    mid = (lo + hi + 1) // 2
    return jnp.where(fits(mid), mid, lo), jnp.where(fits(mid), hi, mid - 1)

  c, _ = lax.fori_loop(0, max(int(max_len), 1).bit_length() + 1, search,
                       (jnp.int32(0), jnp.int32(max_len)))
  kept = jnp.minimum(lengths, c)
  room = capacity - jnp.sum(kept)
  order = jnp.argsort(-lengths, stable=True)                 # longest first, ties: lower index
  rank = jnp.zeros_like(lengths).at[order].set(jnp.arange(lengths.shape[0], dtype=jnp.int32))
  kept = kept + ((lengths > c) & (rank < room)).astype(jnp.int32)
  return kept, jnp.sum(lengths) - jnp.sum(kept)


def pack(x, lengths, capacity: int):
  """``x [B, T, ...]`` with ``lengths i32[B]`` -> ``(tokens [N, ...], Jagged, dropped i32[])``.

  On overflow (``sum(lengths) > capacity``) the oldest events of the longest histories are
  dropped (``kept_lengths``): an example keeps its most recent events, repositioned from 0, as
  if its padded row had been truncated. ``dropped`` counts them. Padding tokens are zero.
  """
  if x.ndim < 2:
    raise ValueError(f"pack expects x [B, T, ...], got shape {x.shape}")
  B, T = x.shape[:2]
  if B < 1 or T < 1:
    raise ValueError(f"pack expects x [B >= 1, T >= 1, ...], got shape {x.shape}")
  if capacity < 1:
    raise ValueError(f"capacity must be >= 1, got {capacity}")
  if jnp.shape(lengths) != (B,):
    raise ValueError(f"lengths must have shape ({B},), got {jnp.shape(lengths)}")
  full = jnp.clip(jnp.asarray(lengths, jnp.int32), 0, T)
  kept, dropped = kept_lengths(full, capacity, T)
  jag = from_lengths(kept, capacity)
  b = jnp.minimum(jag.seg, B - 1)
  src = full[b] - kept[b] + jag.pos                          # the most recent kept[b] events
  tok = x[b, jnp.clip(src, 0, T - 1)]
  return _zero_padding(tok, jag), jag, dropped


def unpack(tokens, jagged: Jagged, T: int):
  """``tokens [N, ...]`` -> ``[B, T, ...]``, zeros at and past each example's length (positions
  ``>= T`` are cut)."""
  t = jnp.arange(T, dtype=jnp.int32)
  idx = jagged.offsets[:-1, None] + t[None, :]
  keep = t[None, :] < jagged.lengths[:, None]
  out = tokens[jnp.clip(idx, 0, jagged.capacity - 1)]
  return jnp.where(keep.reshape(keep.shape + (1,) * (tokens.ndim - 1)), out, 0).astype(
      tokens.dtype)


def _zero_padding(x, jagged: Jagged):
  valid = jagged.valid.reshape((-1,) + (1,) * (x.ndim - 1))
  return jnp.where(valid, x, jnp.zeros_like(x))


def _check_one_block(jagged: Jagged):
  if jagged.shards != 1:
    raise ValueError(f"the jagged kernels take one block; got {jagged.shards} shards (vmap over "
                     "Jagged.blocks(), as kunlun.nn.packed does)")


def check_tokens(jagged: Jagged, *xs):
  _check_one_block(jagged)
  for x in xs:
    if x.ndim != 3 or x.shape[0] != jagged.capacity:
      raise ValueError(f"jagged tokens must be [N={jagged.capacity}, H, D], got {x.shape}")
  if any(x.shape != xs[0].shape for x in xs):
    raise ValueError(f"jagged q/k/v must have equal shapes, got {[x.shape for x in xs]}")


def check_example_kv(k, v, jagged: Jagged, q):
  _check_one_block(jagged)
  if k.ndim != 4 or k.shape != v.shape or k.shape[0] != jagged.batch or k.shape[2:] != q.shape[1:]:
    raise ValueError(f"k {k.shape} / v {v.shape} must be [B={jagged.batch}, n_kv, "
                     f"{q.shape[1]}, {q.shape[2]}]")


# ----------------------------------------------------------------------------- the work list


def tile_examples(jagged: Jagged, tile: int):
  """``(lo, hi) i32[ceil(N / tile)]``: the first and last example with tokens in each token
  tile; ``hi = lo - 1`` for a tile past ``offsets[B]`` (no work)."""
  N = jagged.capacity
  nt = -(-N // tile)
  starts = jnp.arange(nt, dtype=jnp.int32) * tile
  lo = jagged.seg[starts]
  last = jnp.clip(jnp.minimum(starts + tile, jagged.total) - 1, 0, N - 1)
  return lo, jnp.where(starts < jagged.total, jagged.seg[last], lo - 1)


def work_tile(jagged: Jagged) -> int:
  """The work list's token tile: half the mean capacity per example, as a power of 2 in
  ``TILE_RANGE``. A pair computes a whole tile, so the list covers about ``N + B * tile`` rows:
  tile 64 on tiny (22 tokens per example) computed 3.9x the real tokens; a tile below 8 makes the
  per-pair gathers dominate (CPU fwd+bwd, scripts/jagged_speed.py)."""
  half = max(jagged.capacity // (2 * max(jagged.batch, 1)), 1)
  lo, hi = TILE_RANGE
  return min(hi, max(lo, 1 << (half.bit_length() - 1)))


def tile_pairs(jagged: Jagged, tile: int):
  """The (token tile, example) pairs that hold real tokens: ``(tile i32[P], example i32[P])``
  with ``P = ceil(N / tile) + B`` slots (consecutive tiles share at most one example, so the
  pairs never exceed it); unused slots point at example ``B`` (matches no token)."""
  lo, hi = tile_examples(jagged, tile)
  nt, B = lo.shape[0], jagged.batch
  cum = jnp.cumsum(hi - lo + 1)
  slot = jnp.arange(nt + B, dtype=jnp.int32)
  t = jnp.minimum(jnp.searchsorted(cum, slot, side="right"), nt - 1).astype(jnp.int32)
  b = lo[t] + slot - (cum[t] - (hi[t] - lo[t] + 1))
  return t, jnp.where(slot < cum[-1], b, B).astype(jnp.int32)


def _tiles(x, tile):
  """``x [N, ...]`` -> ``[ceil(N / tile), tile, ...]`` (zero-padded)."""
  nt = -(-x.shape[0] // tile)
  x = jnp.pad(x, ((0, nt * tile - x.shape[0]),) + ((0, 0),) * (x.ndim - 1))
  return x.reshape((nt, tile) + x.shape[1:])


def _pair_rows(jagged: Jagged, tile):
  """(tile, tile index, example index, ``bool[P, tile]`` token-of-that-example) of every pair;
  ``tile`` None: ``work_tile``."""
  tile = work_tile(jagged) if tile is None else int(tile)
  t, b = tile_pairs(jagged, tile)
  seg = jnp.pad(jagged.seg, (0, -jagged.capacity % tile), constant_values=jagged.batch)
  return tile, t, b, seg.reshape(-1, tile)[t] == b[:, None]


def _token_rows(jagged: Jagged, tile):
  """``i32[N]``: the row of each token in the work list's ``[P * tile]`` outputs (its tile's
  pair with its own example; padding tokens: their tile's first pair, masked by the caller)."""
  lo, hi = tile_examples(jagged, tile)
  first = jnp.cumsum(hi - lo + 1) - (hi - lo + 1)            # each tile's first pair
  n = jnp.arange(jagged.capacity, dtype=jnp.int32)
  tt = n // tile
  pair = first[tt] + jnp.where(jagged.valid, jagged.seg - lo[tt], 0)
  return pair * tile + n % tile


def _kv_keep(kv_lengths, b, n_kv):
  """``bool[P, n_kv]``: keys below the example's ``kv_lengths`` (all when None)."""
  if kv_lengths is None:
    return jnp.ones((b.shape[0], n_kv), bool)
  lens = jnp.concatenate([jnp.asarray(kv_lengths, jnp.int32), jnp.zeros((1,), jnp.int32)])
  return jnp.arange(n_kv)[None, :] < lens[b][:, None]


# ----------------------------------------------------------------------------- GDPA


_SCORES = {"hpqd": "hpqk", "hqd": "hpkq"}   # shared seeds: XLA scores all keys at once, keys first


def _pair_scores(q, k, qs, scale, score_clip, acts):
  """``z = clip(scale q.k)`` per pair in float32 (``[P, H, Tq, Tk]``) and ``act(z)``'s VJP."""
  ss = _SCORES[qs]
  z = jnp.einsum(f"{qs},hpkd->{ss}", q, k, preferred_element_type=_F32) * scale
  return jax.vjp(lambda z: apply_per_head(clip_scores(z, score_clip), acts, head_axis=0), z)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _pair_gdpa(q, k, v, qs, scale, score_clip, acts):
  """GDPA of each work-list pair, ``o[:, p] = act(clip(scale q.k[:, p])) v[:, p]`` in float32,
  head-major (the matmuls' batch dimensions lead: no transposes of the pairs' tensors): ``q`` is
  ``[H, P, Tq, D]`` (``qs`` "hpqd") or shared ``[H, Tq, D]`` ("hqd"), ``k, v [H, P, Tk, D]``.
  The backward recomputes the scores (flash-attention style): its score-sized tensors are the
  f32 scores and dp, then p and ds rounded to the operands' dtype for the three matmuls."""
  p, _ = _pair_scores(q, k, qs, scale, score_clip, acts)
  return jnp.einsum(f"{_SCORES[qs]},hpkd->hpqd", p.astype(v.dtype), v, preferred_element_type=_F32)


def _pair_gdpa_fwd(q, k, v, qs, scale, score_clip, acts):
  return _pair_gdpa(q, k, v, qs, scale, score_clip, acts), (q, k, v)


def _pair_gdpa_bwd(qs, scale, score_clip, acts, res, do):
  q, k, v = res
  ss = _SCORES[qs]
  p, act_vjp = _pair_scores(q, k, qs, scale, score_clip, acts)
  do = do.astype(v.dtype)
  dp = jnp.einsum(f"hpqd,hpkd->{ss}", do, v, preferred_element_type=_F32)
  ds = (act_vjp(dp)[0] * scale).astype(k.dtype)
  dq = jnp.einsum(f"{ss},hpkd->{qs}", ds, k, preferred_element_type=_F32)
  dk = jnp.einsum(f"{ss},{qs}->hpkd", ds, q.astype(k.dtype), preferred_element_type=_F32)
  dv = jnp.einsum(f"{ss},hpqd->hpkd", p.astype(v.dtype), do, preferred_element_type=_F32)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_pair_gdpa.defvjp(_pair_gdpa_fwd, _pair_gdpa_bwd)


def jagged_gdpa_cross(q, k, v, jagged: Jagged, *, activation="fast_gelu", scale=None,
                      out_scale=1.0, kv_lengths=None, score_clip=None, tile=None, q_norm=None,
                      ln_split=False):
  """PFFN's GDPA: each token's query attends to its own example's keys, ``o_n = out_scale *
  sum_j act(clip(scale q_n.k[seg_n, j])) v[seg_n, j]``.

  ``q [N, H, D]``, ``k, v [B, n_kv, H, D]``, ``kv_lengths i32[B]`` (keys at or beyond are
  ignored) -> ``[N, H, D]`` in q's dtype; padding tokens give 0. ``q_norm`` (an epsilon): the
  queries are the LayerNorm of each token's row over all its heads (``reference.layer_norm``:
  the PFFN's, which the Pallas kernels compute inside); with ``ln_split`` differentiated with
  the rows' statistics held (``reference.layer_norm_held``: q's cotangent ``r dq``, the rest of
  the norm's backward left to the tokens' pass-through, ``reference.ln_through``).
  Why a (tile, example) work list: a per-token gather of K moves ``n_kv`` times q's bytes and
  ``lax.ragged_dot`` lowers on CPU to a one-hot over all B groups; measured (CPU, fwd+bwd, B 64,
  N 4096, H 4, D 64, n_kv 64): work list 228 ms, gather 1557 ms, ragged_dot 4400 ms.
  Bytes: operands stay in their dtype (float32 accumulation), masked keys are zeroed in the
  gathered ``v`` (no mask over the scores), and each token gathers its own pair's row back
  (no scatter-add over the other examples' rows).
  """
  check_tokens(jagged, q)
  check_example_kv(k, v, jagged, q)
  if q_norm is not None:
    norm = layer_norm_held if ln_split else layer_norm
    q = norm(q.reshape(q.shape[0], -1), float(q_norm)).reshape(q.shape)
  elif ln_split:
    raise ValueError("jagged_gdpa_cross: ln_split needs q_norm")
  H, D = q.shape[1:]
  acts = per_head(activation, H)
  scale = D ** -0.5 if scale is None else scale
  tile = work_tile(jagged) if tile is None else int(tile)
  t, b = tile_pairs(jagged, tile)
  bk = jnp.minimum(b, jagged.batch - 1)
  keep = _kv_keep(kv_lengths, b, k.shape[1])[None, :, :, None]
  heads = lambda x: jnp.moveaxis(x, -2, 0)                                 # [..., H, D] -> [H, ...]
  vk = jnp.where(keep, heads(v)[:, bk], jnp.zeros((), v.dtype))            # [H, P, n_kv, D]
  qt = jnp.moveaxis(_tiles(q, tile), 2, 0)[:, t]                           # [H, P, tile, D]
  o = _pair_gdpa(qt, heads(k)[:, bk], vk, "hpqd", scale, score_clip, acts)
  o = (o * out_scale).astype(q.dtype).reshape(H, -1, D)[:, _token_rows(jagged, tile)]
  return _zero_padding(jnp.moveaxis(o, 0, 1), jagged)


def jagged_gdpa_pool(q, k, v, jagged: Jagged, *, activation="fast_gelu", scale=None,
                     out_scale=1.0, score_clip=None, tile=None):
  """HSP's GDPA: shared seeds attend to each example's tokens, ``o[b, s] = out_scale * sum_{n in
  b} act(clip(scale q_s.k_n)) v_n``.

  ``q [S, H, D]`` (shared), ``k, v [N, H, D]`` -> ``[B, S, H, D]`` in q's dtype; an empty
  history gives 0. Same (tile, example) work list as ``jagged_gdpa_cross`` (measured 3.1x faster
  than a segment_sum of per-token outer products, CPU fwd+bwd, N 4096, S 32); a pair's tokens
  of other examples are zeroed in its gathered ``v`` (no mask over the scores).
  """
  check_tokens(jagged, k, v)
  if q.ndim != 3 or q.shape[1:] != k.shape[1:]:
    raise ValueError(f"jagged_gdpa_pool: q must be [S, {k.shape[1]}, {k.shape[2]}], got {q.shape}")
  B = jagged.batch
  H, D = k.shape[1:]
  acts = per_head(activation, H)
  scale = D ** -0.5 if scale is None else scale
  tile, t, b, rows = _pair_rows(jagged, tile)
  tiles = lambda x: jnp.moveaxis(_tiles(x, tile), 2, 0)[:, t]             # [H, P, tile, D]
  vt = jnp.where(rows[None, :, :, None], tiles(v), jnp.zeros((), v.dtype))
  o = _pair_gdpa(jnp.moveaxis(q, 1, 0), tiles(k), vt, "hqd", scale, score_clip, acts)
  o = jnp.zeros((H, B + 1) + o.shape[2:], o.dtype).at[:, b].add(o, indices_are_sorted=True)
  o = jnp.moveaxis(o[:, :B], 0, 2)                                          # [B, S, H, D]
  return (o * out_scale).astype(q.dtype)


def jagged_softmax_pool(q, k, v, jagged: Jagged, *, scale=None, tile=None):
  """PMA's pooling: shared queries softmax-attend to each example's tokens, ``o[b, s] =
  sum_{n in b} softmax_n(scale q_s.k_n) v_n`` (scores and softmax in float32).

  ``q [S, H, D]`` (shared), ``k, v [N, H, D]`` -> ``[B, S, H, D]`` in q's dtype; an empty
  history gives 0 (as ``masked_softmax_attention``'s rows without a key). Exact per example:
  the work list of ``jagged_gdpa_pool`` scores each (tile, example) pair, the example's max is a
  max over its pairs, and the exponentials' sums and ``e @ v`` are added per example.
  """
  check_tokens(jagged, k, v)
  if q.ndim != 3 or q.shape[1:] != k.shape[1:]:
    raise ValueError(f"jagged_softmax_pool: q must be [S, {k.shape[1]}, {k.shape[2]}], got "
                     f"{q.shape}")
  B, (H, D) = jagged.batch, k.shape[1:]
  scale = D ** -0.5 if scale is None else scale
  tile, t, b, rows = _pair_rows(jagged, tile)
  tiles = lambda x: jnp.moveaxis(_tiles(x, tile), 2, 0)[:, t]             # [H, P, tile, D]
  z = jnp.einsum("hqd,hpkd->hpqk", jnp.moveaxis(q, 1, 0), tiles(k),
                 preferred_element_type=_F32) * scale                      # [H, P, S, tile]
  keep = rows[None, :, None, :]
  per_example = lambda x, fill: jnp.full((H, B + 1) + x.shape[2:], fill, x.dtype)
  mx = jnp.max(jnp.where(keep, z, -jnp.inf), axis=-1)                       # [H, P, S]
  mx = per_example(mx, -jnp.inf).at[:, b].max(mx, indices_are_sorted=True)
  mx = lax.stop_gradient(jnp.where(jnp.isfinite(mx), mx, 0.0))             # softmax: shift-free
  e = jnp.where(keep, jnp.exp(jnp.where(keep, z - mx[:, b, :, None], 0.0)), 0.0)
  den = per_example(mx, 0.0).at[:, b].add(jnp.sum(e, axis=-1), indices_are_sorted=True)
  o = jnp.einsum("hpqk,hpkd->hpqd", e.astype(v.dtype), tiles(v), preferred_element_type=_F32)
  o = per_example(o, 0.0).at[:, b].add(o, indices_are_sorted=True)[:, :B]  # [H, B, S, D]
  o = o / jnp.where(den > 0, den, 1.0)[:, :B, :, None]
  return jnp.moveaxis(o, 0, 2).astype(q.dtype)


# ----------------------------------------------------------------------------- self-attention


def _three(x, c: int, fill=0):
  """``x [H, nb c, D]`` -> ``[H, nb, 3c, D]``: the rows ``[(n - 1) c, (n + 2) c)`` around chunk
  ``n`` (``fill`` beyond the ends)."""
  H, M, D = x.shape
  z = jnp.full((H, c, D), fill, x.dtype)
  x = jnp.concatenate([z, x, z], axis=1).reshape(H, M // c + 2, c, D)
  return jnp.concatenate([x[:, :-2], x[:, 1:-1], x[:, 2:]], axis=2)


def _three_t(g, c: int):
  """The transpose of ``_three``: ``[H, nb, 3c, D]`` -> ``[H, nb c, D]`` (each row's three
  copies summed)."""
  H, nb, _, D = g.shape
  z = jnp.zeros((H, 1, c, D), g.dtype)
  prev, own, nxt = g[:, :, :c], g[:, :, c:2 * c], g[:, :, 2 * c:]
  g = own + jnp.concatenate([prev[:, 1:], z], axis=1) + jnp.concatenate([z, nxt[:, :-1]], axis=1)
  return g.reshape(H, nb * c, D)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _band_core(q, k, v, keep, c, scale):
  """Chunked banded softmax attention, head-major: ``q, k, v [H, nb c, D]``, ``keep bool[nb, c,
  3c]`` (query row of chunk n, key row ``(n - 1) c + j``) -> ``[H, nb c, D]``."""
  return _band_fwd(q, k, v, keep, c, scale)[0]


def _band_fwd(q, k, v, keep, c, scale):
  H, M, D = q.shape
  s = jnp.einsum("hnqd,hnkd->hnqk", q.reshape(H, M // c, c, D), _three(k, c),
                 preferred_element_type=_F32) * scale
  s = jnp.where(keep, s, -jnp.inf)
  mx = jnp.max(s, axis=-1, keepdims=True)
  # Unnormalised probabilities in the operands' dtype, kept for the backward (the barrier stops
  # XLA from recomputing them there out of the f32 scores); 1 / row sum applied to the outputs.
  e = lax.optimization_barrier(jnp.exp(s - jnp.where(jnp.isfinite(mx), mx, 0.0)).astype(q.dtype))
  den = jnp.sum(e.astype(_F32), axis=-1)
  inv = jnp.where(den > 0, 1.0 / jnp.where(den > 0, den, 1.0), 0.0)              # [H, nb, c]
  o = jnp.einsum("hnqk,hnkd->hnqd", e, _three(v, c), preferred_element_type=_F32)
  o = (o * inv[..., None]).reshape(H, M, D).astype(q.dtype)
  return o, (q, k, v, e, inv, o)


def _band_bwd(c, scale, res, do):
  q, k, v, e, inv, o = res
  H, M, D = q.shape
  do = do.reshape(H, M // c, c, D)
  dof = do.astype(_F32)
  delta = jnp.sum(dof * o.reshape(do.shape).astype(_F32), axis=-1)             # rowsum(p dp)
  dp = jnp.einsum("hnqd,hnkd->hnqk", do, _three(v, c), preferred_element_type=_F32)
  ds = (e.astype(_F32) * (dp - delta[..., None]) * (inv * scale)[..., None]).astype(q.dtype)
  dq = jnp.einsum("hnqk,hnkd->hnqd", ds, _three(k, c), preferred_element_type=_F32)
  # The key-side gradients leave the matmuls in the operands' dtype (f32 stays f32): each row's
  # three copies are summed after, and f32 copies would double the band's largest tensors.
  dk = jnp.einsum("hnqk,hnqd->hnkd", ds, q.reshape(do.shape), preferred_element_type=q.dtype)
  dv = jnp.einsum("hnqk,hnqd->hnkd", e, (dof * inv[..., None]).astype(q.dtype),
                  preferred_element_type=q.dtype)
  return (dq.reshape(H, M, D).astype(q.dtype), _three_t(dk, c).astype(k.dtype),
          _three_t(dv, c).astype(v.dtype), None)


_band_core.defvjp(_band_fwd, _band_bwd)


def _banded(q, k, v, jagged: Jagged, window: int, scale: float):
  """Softmax self-attention over token pairs of one example with ``|i - j| <= window`` (inside an
  example positions and buffer indices differ by the same amount), ``O(N * 3c)``: chunks of ``c
  = max(window, BAND_MIN)`` queries against the ``3c`` buffer rows around them (window 8: 24
  keys a query, where the padded reference's 16-row chunks take 48). Its own VJP (flash
  attention's: the row sums of ``do * o``, the probabilities kept in the operands' dtype)."""
  N, H, D = q.shape
  B, c = jagged.batch, max(int(window), BAND_MIN)
  nb = -(-N // c)
  M = nb * c
  seg = jnp.concatenate([jagged.seg, jnp.full((M - N,), B, jagged.seg.dtype)])
  sk = _three(seg[None, :, None], c, fill=B)[0, :, :, 0]                        # [nb, 3c]
  sq = seg.reshape(nb, c)
  qi = jnp.arange(M).reshape(nb, c)
  kj = (jnp.arange(nb)[:, None] - 1) * c + jnp.arange(3 * c)[None, :]
  keep = ((sq[:, :, None] == sk[:, None, :]) & (sq[:, :, None] < B)
          & (jnp.abs(qi[:, :, None] - kj[:, None, :]) <= window))
  heads = lambda x: jnp.pad(jnp.moveaxis(_zero_padding(x, jagged), 1, 0),
                            ((0, 0), (0, M - N), (0, 0)))                        # [H, M, D]
  o = _band_core(heads(q), heads(k), heads(v), keep, c, scale)
  return jnp.moveaxis(o[:, :N], 0, 1)


def block_table(jagged: Jagged, block_size: int):
  """The blocks' work list: ``(start, n_store, n_valid) i32[ceil(N / bs) + B]`` slots. Each
  real block of each example (``start = offsets[b] + m * bs``, ``n_valid`` tokens), then
  zero-writing blocks over the padding tail (``n_valid = 0``), then empty slots (``n_store =
  0``)."""
  B, N, bs = jagged.batch, jagged.capacity, block_size
  nblk = -(-jagged.lengths // bs)
  cum = jnp.cumsum(nblk)
  real = cum[-1]
  slot = jnp.arange(-(-N // bs) + B, dtype=jnp.int32)
  b = jnp.minimum(jnp.searchsorted(cum, slot, side="right"), B - 1)
  m = slot - (cum[b] - nblk[b])
  pad_start = jagged.total + (slot - real) * bs
  is_real = slot < real
  start = jnp.where(is_real, jagged.offsets[b] + m * bs, jnp.minimum(pad_start, N))
  n_valid = jnp.where(is_real, jnp.minimum(jagged.lengths[b] - m * bs, bs), 0)
  n_store = jnp.where(is_real, n_valid, jnp.clip(N - pad_start, 0, bs))
  return tuple(x.astype(jnp.int32) for x in (start, n_store, n_valid))


def jagged_block_attention(q, k, v, jagged: Jagged, *, block_size=64, activation="softmax",
                           score_clip=None):
  """Attention within the ``block_size`` blocks of each example: token i sees token j iff both
  belong to one example and ``pos_i // block_size == pos_j // block_size`` (the padded
  kernel's blocks). Softmax with scale ``1/sqrt(D)``, or a GDPA activation ``act(clip(q.k /
  sqrt(D))) / block_size``. ``q, k, v [N, H, D]`` -> ``[N, H, D]``; padding tokens give 0.
  Rotary: rotate q and k before the call. The blocks of ``block_table`` are gathered into
  ``[N / bs + B, bs, H, D]`` and run through ``block_attention_reference`` (one block each).
  """
  check_tokens(jagged, q, k, v)
  if block_size < 1:
    raise ValueError(f"block_size must be >= 1, got {block_size}")
  N, bs = jagged.capacity, block_size
  start, _, n_valid = block_table(jagged, bs)
  rows = jnp.clip(start[:, None] + jnp.arange(bs)[None, :], 0, N - 1)
  o = block_attention_reference(q[rows], k[rows], v[rows], block_size=bs, activation=activation,
                                lengths=n_valid, score_clip=score_clip)   # [slots, bs, H, D]
  nblk = -(-jagged.lengths // bs)
  first = jnp.concatenate([jnp.cumsum(nblk) - nblk, jnp.zeros((1,), nblk.dtype)])
  slot = first[jagged.seg] + jagged.pos // bs                # each token's block slot
  return _zero_padding(o[jnp.clip(slot, 0, o.shape[0] - 1), jagged.pos % bs], jagged)


def jagged_softmax_attention(q, k, v, jagged: Jagged, *, window=None, scale=None):
  """Softmax self-attention within each example (``softmax_attention_reference`` per example):
  keys of the same example with ``|pos_i - pos_j| <= window`` (None: all of them).
  ``q, k, v [N, H, D]`` -> ``[N, H, D]``; padding tokens give 0. With a window the cost is
  ``O(N * 3 max(window, BAND_MIN))``; without, one masked ``[N, N]`` (the Pallas kernel visits only
  the key tiles of the examples a query tile overlaps).
  """
  check_tokens(jagged, q, k, v)
  if window is not None and window < 0:
    raise ValueError(f"window must be >= 0, got {window}")
  if window is None:
    seg = jagged.seg
    mask = (seg[:, None] == seg[None, :]) & jagged.valid[:, None]
    q, k, v = (_zero_padding(x, jagged) for x in (q, k, v))
    return masked_softmax_attention(q, k, v, mask, scale)
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  return _banded(q, k, v, jagged, int(window), scale)
