"""Packed ("jagged") event towers in the trunk (issue #28): ``Packed(value [N, ...], jag)``.

A packed tower's tokens ``[N, d]`` (B examples back to back, ``pallas_kernels.jagged.Jagged``)
run every sequence module per token; the cross-token ops go through the jagged kernels here
(``backend``: "xla" the XLA twins, "pallas" ``jagged_pallas``, "auto" Pallas on a GPU else XLA).
A batch packed in S blocks (``Jagged.shards``, one or more per batch shard of the mesh, and per
context shard under context parallelism): the cross-token ops reshape to ``[S, Ns, ...]`` and
``jax.vmap`` the kernels over the blocks, the blocks constrained to the logical ``blocks`` axis
(the batch's mesh axes, then the sequence's; Pallas: per device, ``sharding.packed``), so each
device computes whole examples; the per-token ops run on the flat ``[N, d]`` rows, ``as_rows`` /
``rowwise`` mask each block's tail. Per-example outputs ``[B, ...]`` (HSP / PMA summaries) leave
on the ``blocks`` axis; their callers constrain them to ``batch`` (under context parallelism an
all-gather of the summaries over the context devices). ``fused_qkv`` / ``fused_proj``: the
attention's and HSP's norm -> projections as one Pallas pass (``pallas_kernels.norm_qkv``),
row-wise, per device; ``fused_qkv_attention`` the same with the softmax attention after it, whose
backward is one kernel (``pallas_kernels.qkv_attention``), per block; ``fused_out`` the
attention's output projection and residual
(``pallas_kernels.proj_residual``), ``fused_norm_residual`` the PFFN's tail
(``pallas_kernels.norm_residual``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from kunlun.nn.time_encoding import rotary_inputs
from pallas_kernels import (
    event_mlp,
    jagged,
    jagged_pallas,
    norm_qkv,
    norm_residual,
    proj_residual,
    qkv_attention,
    wgrad,
)
from pallas_kernels.api import compile_platform
from sharding import shard
from sharding.packed import per_shard

F32 = jnp.float32


@struct.dataclass
class Packed:
  """One packed tower: ``value [N, ...]`` with ``jag`` (offsets / seg / pos). Why a wrapper and
  not ``[1, N, d]``: the modules dispatch on its type and the descriptor travels with the tokens
  (as ``kunlun.nn.rows.PerRequest`` does), so the layer's dicts of towers stay as they are."""
  value: Any
  jag: jagged.Jagged


def is_packed(v) -> bool:
  return isinstance(v, Packed)


def as_rows(x, jag: jagged.Jagged):
  """``(x [N, ...] as [S, Ns, ...], lengths i32[S] = each block's real tokens)``: the packed
  buffer as S padded rows (one per block), for the per-token ops that mask rows at or past a
  length (a block's real tokens lead it)."""
  return x.reshape((jag.shards, -1) + x.shape[1:]), jag.totals


def rowwise(fn, jag: jagged.Jagged, *xs):
  """``fn(*rows, lengths)`` on ``as_rows`` of each ``x [N, ...]`` -> back to ``[N, ...]``."""
  y = fn(*(as_rows(x, jag)[0] for x in xs), jag.totals)
  return shard_tokens(y.reshape((-1,) + y.shape[2:]))


def shard_tokens(x):
  """``x [N or B, ...]`` (tokens or examples of the blocks) constrained to the logical blocks."""
  return shard(x, ("blocks",) + (None,) * (x.ndim - 1))


def _per_block(kernel, jag: jagged.Jagged, args, blocked, pallas: bool):
  """``kernel(jag, *args)`` with ``jag.shards`` S > 1 blocks: every ``blocked`` argument (tokens
  ``[N, ...]`` or examples ``[B, ...]``) cut into ``[S, ., ...]`` on the logical ``blocks`` (as
  is the descriptor), the kernel vmapped over the blocks (Pallas: per device,
  ``sharding.packed.per_shard``); the output (leading ``[S, .]``) flattened back, on ``blocks``."""
  if jag.shards == 1:
    return kernel(jag, *args)
  S = jag.shards
  cut = lambda x: shard(x.reshape((S, -1) + x.shape[1:]), ("blocks",) + (None,) * x.ndim)
  args = [cut(a) if b else a for a, b in zip(args, blocked, strict=True)]
  fn = jax.vmap(kernel, in_axes=(0,) + tuple(0 if b else None for b in blocked))
  if pallas:
    fn = per_shard(fn, (True,) + tuple(blocked))
  jb = jag.blocks()
  y = fn(jagged.Jagged(*(shard(a, ("blocks", None)) for a in (jb.offsets, jb.seg, jb.pos))), *args)
  return jax.tree.map(lambda y: shard_tokens(y.reshape((-1,) + y.shape[2:])), y)


def pallas_backend(backend: str) -> bool:
  """Whether the project's Pallas kernels run for ``model.backend``: "pallas", or "auto" when
  compiling for a GPU; any other backend takes the XLA path (the padded modules' and MoWE's
  rule; packed towers also refuse backends with no jagged kernels, ``_use_pallas``)."""
  return backend == "pallas" or (backend == "auto" and compile_platform() == "gpu")


def interpret_kernels() -> bool:
  """Pallas kernels compiled for a CPU run in interpret mode (no CPU lowering)."""
  return compile_platform() != "gpu"


def wgrad_kernel(backend: str, K: int, C: int, dtype) -> bool:
  """Whether a dense layer's weight gradient ``[K, C]`` (a sum over every row) runs on
  ``pallas_kernels.wgrad`` (``dense_kernel``): the Pallas backend, widths the kernel tiles, and a
  memory-bound gradient (``wgrad.memory_bound``: XLA's split-K partials are then a share of its
  bytes; a compute-bound one XLA runs unsplit)."""
  return (pallas_backend(backend) and wgrad.supported(K, C)
          and wgrad.memory_bound(K, C, jnp.dtype(dtype).itemsize))


def dense_kernel(x, w, *, dtype):
  """``x [B, ..., K] @ w [K, C]`` in ``dtype`` (a bias-free ``flax.linen.Dense``), ``w``'s
  gradient on ``pallas_kernels.wgrad`` (``dense_pallas``, per device on its examples; where
  ``wgrad_kernel`` holds). Callers pass ``w`` cast to ``dtype``: the parameter's only use a cast,
  which the optimizer's 16-bit copy replaces (``kunlun.train.param_copies``; a cast inside the
  custom rule would launch). ``bench.profiling.roofline.record_kernels`` counts the kernel's
  FLOPs here."""
  interpret = interpret_kernels()
  op = lambda x, w: wgrad.dense_pallas(x, w, dtype=dtype, interpret=interpret)
  return per_shard(op, (True, False), "batch")(x, w)


def _use_pallas(backend: str) -> bool:
  if backend not in ("xla", "pallas", "auto"):
    raise ValueError(f"model.backend = {backend!r} has no jagged kernels (packed towers: xla, "
                     "pallas or auto)")
  return pallas_backend(backend)


def gdpa_cross(q, k, v, jag, *, backend: str, kv_lengths=None, through=False, **kw):
  """PFFN's GDPA: ``q [N, H, D]`` reads its example's ``k, v [B, n_kv, H, D]`` (keys below
  ``kv_lengths i32[B]``; None: all) -> ``[N, H, D]``; ``through`` (where
  ``gdpa_cross_through``): ``(that, q)``, q passed through for a second reader, whose cotangent
  the Pallas backward kernels add to dq (``jagged_pallas.jagged_gdpa_cross_pallas``).
  ``q_norm=eps`` in ``kw``: the queries are the LayerNorm of ``q``'s rows (the Pallas kernels
  compute it inside, forward and backward)."""
  pallas = _use_pallas(backend)
  if through and not pallas:
    raise ValueError("gdpa_cross: through=True runs on the Pallas kernels only "
                     "(ask gdpa_cross_through)")
  fn = jagged_pallas.jagged_gdpa_cross_pallas if pallas else jagged.jagged_gdpa_cross
  kw = dict(kw, interpret=interpret_kernels(), through=through) if pallas else kw
  op = lambda j, q, k, v, *kvl: fn(q, k, v, j, kv_lengths=kvl[0] if kvl else None, **kw)
  args = (q, k, v) + (() if kv_lengths is None else (kv_lengths,))
  with jax.named_scope("GDPA"):
    return _per_block(op, jag, args, (True,) * len(args), pallas)


def gdpa_cross_through(q, k, *, backend: str, **kw) -> bool:
  """Whether ``gdpa_cross(through=True)`` adds the pass-through's cotangent inside its backward
  kernels (``jagged_pallas.cross_through_fits``): the Pallas backend, where reading it keeps the
  kernels' tiles and stages. Elsewhere a caller keeps q for itself: on the XLA backend
  ``gdpa_cross`` refuses ``through``, and where the tile does not fit the kernels' plans XLA would
  add the two cotangents inside the GDPA op, the same pass in another scope."""
  return _use_pallas(backend) and jagged_pallas.cross_through_fits(
      q, k, interpret=interpret_kernels(), **kw)


def gdpa_pool(q, k, v, jag, *, backend: str, **kw):
  """HSP's GDPA: seeds ``q [S, H, D]`` pool ``k, v [N, H, D]`` per example -> ``[B, S, H, D]``."""
  pallas = _use_pallas(backend)
  fn = jagged_pallas.jagged_gdpa_pool_pallas if pallas else jagged.jagged_gdpa_pool
  kw = dict(kw, interpret=interpret_kernels()) if pallas else kw
  with jax.named_scope("GDPA"):
    return _per_block(lambda j, q, k, v: fn(q, k, v, j, **kw), jag, (q, k, v),
                      (False, True, True), pallas)


def gdpa_pool_proj(q, x, ws, jag, **kw):
  """HSP's keys, values and GDPA as one Pallas op: seeds ``q [S, H, D]`` pool the projections
  ``rms_norm(x) w_p`` of ``x [N, d]`` (``ws = (w_k, w_v)``, each ``[d, H, D]``) per example ->
  ``[B, S, H, D]``, the keys and values computed inside the pool's kernels
  (``pallas_kernels.jagged_pallas.jagged_gdpa_pool_proj_pallas``; where ``fusable``)."""
  fn = lambda j, q, x, wk, wv: jagged_pallas.jagged_gdpa_pool_proj_pallas(
      q, x, (wk, wv), j, interpret=interpret_kernels(), **kw)
  with jax.named_scope("GDPA"):
    return _per_block(fn, jag, (q, x, *ws), (False, True, False, False), True)


def softmax_pool(q, k, v, jag):
  """PMA's pooling: seeds ``q [S, H, D]`` softmax-pool ``k, v [N, H, D]`` per example ->
  ``[B, S, H, D]`` (``jagged.jagged_softmax_pool``; XLA on every backend)."""
  return _per_block(lambda j, q, k, v: jagged.jagged_softmax_pool(q, k, v, j), jag, (q, k, v),
                    (False, True, True), False)


def block_attention(q, k, v, jag, *, backend: str, **kw):
  """Attention within each example's blocks, ``q, k, v [N, H, D]`` (already rotated)."""
  pallas = _use_pallas(backend)
  fn = jagged_pallas.jagged_block_attention_pallas if pallas else jagged.jagged_block_attention
  kw = dict(kw, interpret=interpret_kernels()) if pallas else kw
  return _per_block(lambda j, q, k, v: fn(q, k, v, j, **kw), jag, (q, k, v), (True,) * 3, pallas)


def softmax_attention(q, k, v, jag, *, backend: str, window=None):
  """Softmax self-attention within each example (``window``: the band; None: full)."""
  pallas = _use_pallas(backend)
  fn = jagged_pallas.jagged_softmax_attention_pallas if pallas else jagged.jagged_softmax_attention
  kw = dict(window=window, interpret=interpret_kernels()) if pallas else dict(window=window)
  return _per_block(lambda j, q, k, v: fn(q, k, v, j, **kw), jag, (q, k, v), (True,) * 3, pallas)


def fusable(backend: str, d: int, heads: int, dtype) -> bool:
  """Whether a packed tower of width ``d`` in ``heads`` heads takes the fused norm -> projection
  kernels (``fused_qkv`` / ``fused_proj``): the Pallas backend and widths the kernels tile
  (``pallas_kernels.norm_qkv.supported``)."""
  return _use_pallas(backend) and norm_qkv.supported(d, heads, d // heads, dtype)


def fuse_tail(backend: str, d: int) -> bool:
  """Whether a packed tower of width ``d`` takes ``fused_norm_residual``: the Pallas backend and
  a width its kernels tile."""
  return _use_pallas(backend) and norm_residual.supported(d)


def fuse_out(backend: str, K: int, d: int) -> bool:
  """Whether a packed attention takes ``fused_out``: the Pallas backend, ``K = H D`` and width
  ``d`` its kernel tiles."""
  return _use_pallas(backend) and proj_residual.supported(K, d)


def fused_out(x, o, w, jag, *, dtype):
  """The attention's output side as one Pallas pass (``pallas_kernels.proj_residual``): ``x``
  (``fused_qkv``'s pass-through) ``+ o [N, H, D] w [H, D, d]``, each block's tail zero; ``x``'s
  cotangent unmasked (``fused_qkv``'s backward masks it). Row-wise, per device."""
  op = lambda x, o, valid, w: (proj_residual.proj_residual_pallas(
      x, o, w, valid, dtype=dtype, interpret=interpret_kernels()),)
  return _rowwise_kernel(op, jag, (x, o, jag.valid.astype(F32)), (w,))[0]


def fused_event_mlp(x, w1, b1, w2, b2, valid, *, dtype):
  """A packed stream's per-event MLP as one Pallas pass each way (``pallas_kernels.event_mlp``):
  ``x [S, Ns, K]`` (its blocks; ``valid bool[S, Ns]``), or a pair of ``[S, Ns, Ka]`` and ``[S,
  Ns, Kb]`` read as their concatenation, whose cotangents come back apart -> ``[S, Ns, D]``.
  Row-wise, per device on the blocks it holds."""
  pair = isinstance(x, tuple)
  xs = tuple(shard(p, ("blocks", None, None)) for p in (x if pair else (x,)))
  Ns = xs[0].shape[1]

  def per_device(xs, valid, w1, b1, w2, b2):
    s = xs[0].shape[0]
    rows = tuple(p.reshape(s * Ns, -1) for p in xs)
    y = event_mlp.event_mlp_pallas(rows if pair else rows[0], w1, b1, w2, b2,
                                   valid.reshape(-1).astype(F32), dtype=dtype,
                                   interpret=interpret_kernels())
    return y.reshape(s, Ns, -1)

  fn = per_shard(per_device, (True, True, False, False, False, False))
  return fn(xs, shard(valid, ("blocks", None)), w1, b1, w2, b2)


def fused_qkv(x, w, q_scale, k_scale, age, jag, *, t_scale: float, dtype):
  """The attention's input side as one Pallas pass (``pallas_kernels.norm_qkv``): ``x [N, d]``,
  ``w [d, 3, H, D]``, ``age f32[N]`` and the tokens' ``jag.pos`` -> ``q, k, v [N, H, D]``
  (q, k normalised and rotated), and ``x`` passed through for the residual
  (``kunlun.nn.fused.masked_residual_pass``): the backward kernel adds its cotangent, masked
  to the real tokens, to ``dx``. Row-wise, so per device on the blocks it holds."""
  tau, pos, omega = rotary_inputs(age, jag.pos, w.shape[-1], t_scale)

  def op(x, tau, pos, valid, w, qs, ks, omega):
    return norm_qkv.norm_qkv_pallas(x, w, qs, ks, tau, pos, omega, dtype=dtype,
                                    interpret=interpret_kernels(), valid=valid)
  return _rowwise_kernel(op, jag, (x, tau, pos, jag.valid.astype(F32)),
                         (w, q_scale, k_scale, omega))


def fuse_qkv_attention(backend: str, d: int, heads: int, dtype) -> bool:
  """Whether a packed softmax attention takes ``fused_qkv_attention``: ``fusable`` and widths
  its backward kernel takes (``pallas_kernels.qkv_attention.supported``)."""
  return fusable(backend, d, heads, dtype) and qkv_attention.supported(d, heads, d // heads,
                                                                       dtype)


def fused_qkv_attention(x, w, q_scale, k_scale, age, jag, *, window, t_scale: float, dtype):
  """``fused_qkv`` then ``softmax_attention`` as one op whose backward is one Pallas kernel
  (``pallas_kernels.qkv_attention``): ``x [N, d]`` -> ``(o [N, H, D], x)``, ``x`` passed
  through for the residual as ``fused_qkv`` passes it. Per block, as the attention."""
  tau, pos, omega = rotary_inputs(age, jag.pos, w.shape[-1], t_scale)

  def kernel(j, x, tau, pos, valid, w, qs, ks, omega):
    return qkv_attention.qkv_attention_pallas(x, w, qs, ks, tau, pos, omega, j, window=window,
                                              dtype=dtype, interpret=interpret_kernels(),
                                              valid=valid)
  return _per_block(kernel, jag, (x, tau, pos, jag.valid.astype(F32), w, q_scale, k_scale, omega),
                    (True,) * 4 + (False,) * 4, True)


def fused_proj(x, ws, jag, *, dtype):
  """``rms_norm(x) w_p`` for each projection ``w_p [d, H, D]`` of the tuple ``ws`` as one Pallas
  pass (``pallas_kernels.norm_qkv.norm_proj_pallas``; HSP's keys and values): ``P x [N, H,
  D]``."""
  op = lambda x, *ws: norm_qkv.norm_proj_pallas(x, tuple(ws), dtype=dtype,
                                                interpret=interpret_kernels())
  return _rowwise_kernel(op, jag, (x,), tuple(ws))


def fused_norm_residual(g, u, x, jag, *, eps: float, u_norm: float | None = None):
  """PFFN's tail ``kunlun.nn.fused.norm_residual`` on a packed tower as one Pallas pass each way
  (``pallas_kernels.norm_residual``): ``g, u, x [N, d]`` -> ``[N, d]`` in ``x.dtype``, each
  block's tail zero; ``u`` None: ``u = LayerNorm(x)`` (epsilon ``u_norm``) in the kernels."""
  if u is None:
    op = lambda g, x, valid: (norm_residual.norm_residual_pallas(
        g, None, x, valid, eps=eps, u_norm=u_norm, interpret=interpret_kernels()),)
    return _rowwise_kernel(op, jag, (g, x, jag.valid.astype(F32)), ())[0]
  op = lambda g, u, x, valid: (norm_residual.norm_residual_pallas(
      g, u, x, valid, eps=eps, interpret=interpret_kernels()),)
  return _rowwise_kernel(op, jag, (g, u, x, jag.valid.astype(F32)), ())[0]


def _rowwise_kernel(op, jag, tokens, shared):
  """``op(*tokens, *shared)`` (tokens ``[N, ...]``, outputs ``[N, ...]``) per device on the blocks
  it holds (``sharding.packed.per_shard``): a row-wise kernel needs no per-block vmap."""
  S = jag.shards
  cut = lambda a: shard(a.reshape((S, -1) + a.shape[1:]), ("blocks",) + (None,) * a.ndim)

  def per_device(*args):
    toks, rest = args[:len(tokens)], args[len(tokens):]
    lead = toks[0].shape[:2]
    outs = op(*(t.reshape((-1,) + t.shape[2:]) for t in toks), *rest)
    return tuple(o.reshape(lead + o.shape[1:]) for o in outs)

  fn = per_shard(per_device, (True,) * len(tokens) + (False,) * len(shared))
  outs = fn(*(cut(t) for t in tokens), *shared)
  return tuple(shard_tokens(o.reshape((-1,) + o.shape[2:])) for o in outs)
