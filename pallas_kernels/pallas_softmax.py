"""Softmax (flash) attention in Pallas, full or banded (Triton lowering; ``interpret=True`` on CPU);
``q, k, v [B, T, H, D]`` read in place. Notes: pallas_kernels/README.md, ``pallas_softmax.py``."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _poison, tuning
from pallas_kernels._common import precision
from pallas_kernels.api import softmax_class
from pallas_kernels.pallas_gdpa import _store_rows, segment_rows
from pallas_kernels.reference import check_q_offset, kv_start_rows, resolve_rows

_F32 = jnp.float32
_NEG = -1e30          # masked score: finite, so max / exp never see inf - inf


class _Cfg(NamedTuple):
  """Static kernel configuration (hashable: a ``custom_vjp`` nondiff argument)."""
  scale: float
  window: int | None
  q_offset: int        # query row i sits at key position i + q_offset
  groups: int          # G = H_q / H_kv
  has_qi: bool
  has_ki: bool
  bq: int
  bk: int
  bq_bwd: int
  bk_bwd: int
  interpret: bool
  num_warps: int | None = None      # forward
  num_stages: int | None = None
  num_warps_bwd: int | None = None  # dq and dk/dv
  num_stages_bwd: int | None = None

  def params(self, bwd=False):
    if bwd:
      return plgpu.CompilerParams(num_warps=self.num_warps_bwd, num_stages=self.num_stages_bwd)
    return plgpu.CompilerParams(num_warps=self.num_warps, num_stages=self.num_stages)


def _key_span(start, bq, bk, nk, kv_lo, kv_hi, window, q_offset):
  """Tiles ``[lo, hi)`` of size ``bk`` holding keys visible from query rows ``[start, start +
  bq)``: keys in ``[kv_lo, kv_hi)`` and, with a window, within ``window`` of a row's position."""
  lo_key, hi_key = kv_lo, kv_hi
  if window is not None:
    lo_key = jnp.maximum(lo_key, start + q_offset - window)
    hi_key = jnp.minimum(hi_key, start + bq + q_offset + window)
  lo = lax.div(jnp.maximum(lo_key, 0), bk)
  hi = jnp.minimum(lax.div(hi_key + bk - 1, bk), nk)
  return lo, jnp.maximum(hi, lo)


def _query_span(start, bk, bq, nq, q_len, window, q_offset):
  """Tiles ``[lo, hi)`` of size ``bq`` holding valid query rows that see a key of ``[start,
  start + bk)`` (all valid rows without a window)."""
  lo_row, hi_row = jnp.int32(0), q_len
  if window is not None:
    lo_row = jnp.maximum(start - q_offset - window, 0)
    hi_row = jnp.minimum(q_len, start + bk - q_offset + window)
  lo = lax.div(lo_row, bq)
  hi = jnp.minimum(lax.div(hi_row + bq - 1, bq), nq)
  return lo, jnp.maximum(hi, lo)


def _keep(rows, cols, kv_lo, kv_hi, cfg: _Cfg):
  """Visible (query row, key) pairs of a ``[len(rows), len(cols)]`` tile."""
  keep = ((cols >= kv_lo) & (cols < kv_hi))[None, :]
  if cfg.window is not None:
    keep = keep & (jnp.abs(rows[:, None] + cfg.q_offset - cols[None, :]) <= cfg.window)
  return keep


def _load_rows(ref, batch, start, n, head, lo, hi):
  """Rows ``[start, start + n)`` of ``ref[batch, :, head, :]``; rows outside ``[lo, hi)`` read as
  zeros (so NaN/Inf stored there never reaches a result: ``0 * NaN`` in P.V would)."""
  d = ref.shape[-1]
  r = start + jnp.arange(n)
  valid = jnp.broadcast_to(((r >= lo) & (r < hi))[:, None], (n, d))
  return plgpu.load(ref.at[batch, pl.ds(start, n), head, :], mask=valid, other=0.0)


def _load_vec(ref, batch, head, start, n, length):
  """``ref[batch, head, start:start + n]`` (an fp32 ``[B, H, T]`` row statistic); entries at
  or beyond ``length`` read as zero."""
  return plgpu.load(ref.at[batch, head, pl.ds(start, n)], mask=start + jnp.arange(n) < length,
                    other=0.0)


def _store_vec(ref, batch, head, start, x):
  n = x.shape[0]
  plgpu.store(ref.at[batch, head, pl.ds(start, n)], x,
              mask=start + jnp.arange(n) < ref.shape[2])


def _unpack(refs, cfg: _Cfg):
  """(q_len, kv_lo, kv_hi, q batch row, kv batch row, the remaining refs) of this program."""
  b = pl.program_id(0)
  ql_ref, lo_ref, hi_ref, *rest = refs
  qb = rest.pop(0)[0] if cfg.has_qi else b
  kb = rest.pop(0)[0] if cfg.has_ki else b
  return ql_ref[0], lo_ref[0], hi_ref[0], qb, kb, rest


# ----------------------------------------------------------------------------- kernels


def _fwd_kernel(*refs, cfg: _Cfg, nk: int):
  q_len, kv_lo, kv_hi, qb, kb, (q_ref, k_ref, v_ref, o_ref, lse_ref) = _unpack(refs, cfg)
  b, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  hk = lax.div(h, cfg.groups)
  bq, bk = cfg.bq, cfg.bk
  rows = i * bq + jnp.arange(bq)
  q = _load_rows(q_ref, qb, i * bq, bq, h, 0, q_len)
  lo, hi = _key_span(i * bq, bq, bk, nk, kv_lo, kv_hi, cfg.window, cfg.q_offset)
  hi = jnp.where(i * bq < q_len, hi, lo)
  prec = precision(q.dtype)

  def body(j, carry):
    acc, m, l = carry
    k = _load_rows(k_ref, kb, j * bk, bk, hk, kv_lo, kv_hi)
    v = _load_rows(v_ref, kb, j * bk, bk, hk, kv_lo, kv_hi)
    keep = _keep(rows, j * bk + jnp.arange(bk), kv_lo, kv_hi, cfg)
    s = jnp.where(keep, plgpu.dot(q, k, trans_b=True, precision=prec) * cfg.scale, _NEG)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(keep, jnp.exp(s - m_new[:, None]), 0.0)
    acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v, precision=prec)
    return acc, m_new, l * alpha + jnp.sum(p, axis=1)

  d = q_ref.shape[-1]
  init = (jnp.zeros((bq, d), _F32), jnp.full((bq,), _NEG, _F32), jnp.zeros((bq,), _F32))
  acc, m, l = lax.fori_loop(lo, hi, body, init)
  seen = (l > 0) & (rows < q_len)
  o = jnp.where(seen[:, None], acc / jnp.where(seen, l, 1.0)[:, None], 0.0)
  _store_rows(o_ref, b, i * bq, h, o)
  _store_vec(lse_ref, b, h, i * bq, jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), 0.0))


def _dq_kernel(*refs, cfg: _Cfg, nk: int):
  q_len, kv_lo, kv_hi, qb, kb, rest = _unpack(refs, cfg)
  q_ref, k_ref, v_ref, o_ref, lse_ref, do_ref, dq_ref, delta_ref = rest
  b, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  hk = lax.div(h, cfg.groups)
  bq, bk = cfg.bq_bwd, cfg.bk_bwd
  rows = i * bq + jnp.arange(bq)
  q = _load_rows(q_ref, qb, i * bq, bq, h, 0, q_len)
  do = _load_rows(do_ref, b, i * bq, bq, h, 0, q_len)
  o = _load_rows(o_ref, b, i * bq, bq, h, 0, q_len)
  lse = _load_vec(lse_ref, b, h, i * bq, bq, q_len)
  delta = jnp.sum(do.astype(_F32) * o.astype(_F32), axis=1)
  _store_vec(delta_ref, b, h, i * bq, delta)
  lo, hi = _key_span(i * bq, bq, bk, nk, kv_lo, kv_hi, cfg.window, cfg.q_offset)
  hi = jnp.where(i * bq < q_len, hi, lo)
  prec = precision(q.dtype)

  def body(j, dq):
    k = _load_rows(k_ref, kb, j * bk, bk, hk, kv_lo, kv_hi)
    v = _load_rows(v_ref, kb, j * bk, bk, hk, kv_lo, kv_hi)
    keep = _keep(rows, j * bk + jnp.arange(bk), kv_lo, kv_hi, cfg) & (rows < q_len)[:, None]
    s = plgpu.dot(q, k, trans_b=True, precision=prec) * cfg.scale
    p = jnp.where(keep, jnp.exp(s - lse[:, None]), 0.0)
    ds = p * (plgpu.dot(do, v, trans_b=True, precision=prec) - delta[:, None])
    return dq + plgpu.dot(ds.astype(k.dtype), k, precision=prec)

  dq = lax.fori_loop(lo, hi, body, jnp.zeros((bq, q_ref.shape[-1]), _F32))
  _store_rows(dq_ref, b, i * bq, h, dq * cfg.scale)


def _dkv_kernel(*refs, cfg: _Cfg, nq: int):
  q_len, kv_lo, kv_hi, qb, kb, rest = _unpack(refs, cfg)
  q_ref, k_ref, v_ref, lse_ref, delta_ref, do_ref, dk_ref, dv_ref = rest
  b, hk, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  bq, bk = cfg.bq_bwd, cfg.bk_bwd
  cols = j * bk + jnp.arange(bk)
  k = _load_rows(k_ref, kb, j * bk, bk, hk, kv_lo, kv_hi)
  v = _load_rows(v_ref, kb, j * bk, bk, hk, kv_lo, kv_hi)
  lo, hi = _query_span(j * bk, bk, bq, nq, q_len, cfg.window, cfg.q_offset)
  hi = jnp.where((j * bk < kv_hi) & (j * bk + bk > kv_lo), hi, lo)
  prec = precision(k.dtype)

  def head(g, carry):
    h = hk * cfg.groups + g

    def body(i, carry):
      dk, dv = carry
      rows = i * bq + jnp.arange(bq)
      q = _load_rows(q_ref, qb, i * bq, bq, h, 0, q_len)
      do = _load_rows(do_ref, b, i * bq, bq, h, 0, q_len)
      lse = _load_vec(lse_ref, b, h, i * bq, bq, q_len)
      delta = _load_vec(delta_ref, b, h, i * bq, bq, q_len)
      keep_t = _keep(rows, cols, kv_lo, kv_hi, cfg).T & (rows < q_len)[None, :]   # [bk, bq]
      s_t = plgpu.dot(k, q, trans_b=True, precision=prec) * cfg.scale
      p_t = jnp.where(keep_t, jnp.exp(s_t - lse[None, :]), 0.0)
      dv = dv + plgpu.dot(p_t.astype(do.dtype), do, precision=prec)
      ds_t = p_t * (plgpu.dot(v, do, trans_b=True, precision=prec) - delta[None, :])
      dk = dk + plgpu.dot(ds_t.astype(q.dtype), q, precision=prec)
      return dk, dv

    return lax.fori_loop(lo, hi, body, carry)

  zeros = jnp.zeros((bk, k_ref.shape[-1]), _F32)
  if cfg.groups == 1:
    dk, dv = head(0, (zeros, zeros))
  else:
    dk, dv = lax.fori_loop(0, cfg.groups, head, (zeros, zeros))
  _store_rows(dk_ref, b, j * bk, hk, dk * cfg.scale)
  _store_rows(dv_ref, b, j * bk, hk, dv)


# ----------------------------------------------------------------------------- pallas_calls


def _call(kernel, cfg: _Cfg, rows, ops, out_shape, grid, name, bwd=False):
  """``pallas_call`` with the per-row scalars (lengths, key start, indices) blocked and the
  arrays whole."""
  ql, lo, hi, qi, ki = rows
  scalars = [ql, lo, hi] + ([qi] if cfg.has_qi else []) + ([ki] if cfg.has_ki else [])
  n_out = len(out_shape) if isinstance(out_shape, tuple) else 1
  whole = pl.no_block_spec
  return _poison.pallas_call(
      kernel, (*scalars, *ops), out_shape=out_shape, grid=grid,
      in_specs=[pl.BlockSpec((1,), lambda b, h, i: (b,))] * len(scalars) + [whole] * len(ops),
      out_specs=(whole,) * n_out if n_out > 1 else whole, interpret=cfg.interpret, name=name,
      compiler_params=cfg.params(bwd))


def _fwd_call(cfg: _Cfg, q, k, v, rows):
  B = rows[0].shape[0]
  Tq, Hq, D = q.shape[1:]
  nq, nk = pl.cdiv(Tq, cfg.bq), pl.cdiv(k.shape[1], cfg.bk)
  return _call(functools.partial(_fwd_kernel, cfg=cfg, nk=nk), cfg, rows, (q, k, v),
               (jax.ShapeDtypeStruct((B, Tq, Hq, D), q.dtype),
                jax.ShapeDtypeStruct((B, Hq, Tq), _F32)), (B, Hq, nq), "softmax_attention_fwd")


def _bwd_calls(cfg: _Cfg, q, k, v, rows, o, lse, do):
  B = do.shape[0]
  Tq, Hq, D = q.shape[1:]
  Tk, Hkv = k.shape[1:3]
  nq, nk = pl.cdiv(Tq, cfg.bq_bwd), pl.cdiv(Tk, cfg.bk_bwd)
  dq_dtype = _F32 if cfg.has_qi else q.dtype      # per-output-row partials are summed after
  dkv_dtype = _F32 if cfg.has_ki else k.dtype
  dq, delta = _call(functools.partial(_dq_kernel, cfg=cfg, nk=nk), cfg, rows,
                    (q, k, v, o, lse, do),
                    (jax.ShapeDtypeStruct((B, Tq, Hq, D), dq_dtype),
                     jax.ShapeDtypeStruct((B, Hq, Tq), _F32)), (B, Hq, nq),
                    "softmax_attention_bwd_dq", bwd=True)
  dk, dv = _call(functools.partial(_dkv_kernel, cfg=cfg, nq=nq), cfg, rows,
                 (q, k, v, lse, delta, do),
                 (jax.ShapeDtypeStruct((B, Tk, Hkv, D), dkv_dtype),) * 2, (B, Hkv, nk),
                 "softmax_attention_bwd_dkv", bwd=True)
  return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(cfg, q, k, v, rows):
  return _fwd_call(cfg, q, k, v, rows)[0]


def _attention_fwd(cfg, q, k, v, rows):
  o, lse = _fwd_call(cfg, q, k, v, rows)
  return o, (q, k, v, rows, o, lse)


def _attention_bwd(cfg, res, do):
  q, k, v, rows, o, lse = res
  dq, dk, dv = _bwd_calls(cfg, q, k, v, rows, o, lse, do.astype(q.dtype))
  qi, ki = rows[3], rows[4]
  dq = segment_rows(dq, qi, q.shape, q.dtype)
  dk, dv = (segment_rows(x, ki, k.shape, k.dtype) for x in (dk, dv))
  return dq, dk, dv, jax.tree.map(lambda _: None, rows)


_attention.defvjp(_attention_fwd, _attention_bwd)


def hbm_bytes(B, Tq, Tk, Hq, Hkv, D, dtype, *, backward=True) -> dict:
  """Compulsory HBM traffic of the kernels (each operand read once, each result written once;
  re-reads of a key tile by the q tiles of its band are assumed to hit L2): ``{"fwd": bytes,
  "bwd": bytes, "total": bytes}``. Forward: q, k, v in; o, lse (fp32) out. Backward: dq kernel
  q, k, v, o, dO, lse in, dq, delta out; dk/dv kernel q, k, v, dO, lse, delta in, dk, dv out."""
  s = jnp.dtype(dtype).itemsize
  q, kv, stat = B * Tq * Hq * D * s, B * Tk * Hkv * D * s, B * Hq * Tq * 4
  fwd = q + 2 * kv + q + stat
  bwd = (q + 2 * kv + 2 * q + stat + q + stat) + (q + 2 * kv + q + 2 * stat + 2 * kv)
  return {"fwd": fwd, "bwd": bwd if backward else 0, "total": fwd + (bwd if backward else 0)}


def tiles(tq, tk, head_dim, dtype, window=None, block_q=None, block_k=None, block_q_bwd=None,
          block_k_bwd=None):
  """``(bq, bk, bq_bwd, bk_bwd, (fwd warps, stages), (bwd warps, stages))`` at this shape:
  explicit tiles, else ``tuning.lookup`` (shape class "swa" / "full", defaults
  ``tuning.SOFTMAX_DEFAULTS``)."""
  cls = softmax_class(window)
  key = tuning.key(cls, head_dim, dtype)
  look = lambda kern: tuning.lookup("pallas", kern, key, dtype,
                                    defaults=tuning.softmax_defaults(cls))
  fq, fk, fw, fs = look("fwd")
  bq_b, bk_b, bw, bs = look("dkv")
  return (tuning.clamp_tile(block_q or fq, tq), tuning.clamp_tile(block_k or fk, tk),
          tuning.clamp_tile(block_q_bwd or bq_b, tq), tuning.clamp_tile(block_k_bwd or bk_b, tk),
          (fw, fs), (bw, bs))


def softmax_attention_pallas(q, k, v, *, window=None, scale=None, q_lengths=None,
                             kv_lengths=None, kv_start=None, q_offset=0, q_index=None,
                             kv_index=None, backend="pallas", interpret=False, block_q=None,
                             block_k=None, block_q_bwd=None, block_k_bwd=None, num_warps=None,
                             num_stages=None, num_warps_bwd=None, num_stages_bwd=None):
  """Pallas softmax attention; semantics of ``reference.softmax_attention_reference``.

  Extra args: ``block_*`` tile sizes (powers of two >= 16, clipped to the sequence lengths;
  default ``tiles``), ``num_warps`` / ``num_stages`` (GPU; forward) and ``num_warps_bwd`` /
  ``num_stages_bwd`` (the dq and dk/dv kernels).
  """
  del backend
  r = resolve_rows(q, k, v, q_index=q_index, kv_index=kv_index, q_lengths=q_lengths,
                   kv_lengths=kv_lengths, window=window)
  Tq, Hq, D = q.shape[1:]
  Tk = k.shape[1]
  kv_lo = kv_start_rows(kv_start, k.shape[0], Tk)
  kv_lo = kv_lo if r.kv_index is None else kv_lo[r.kv_index]
  bq, bk, bq_b, bk_b, (nw, ns), (bw, bs) = tiles(Tq, Tk, D, q.dtype, window, block_q, block_k,
                                                 block_q_bwd, block_k_bwd)
  cfg = _Cfg(D ** -0.5 if scale is None else float(scale),
             None if window is None else int(window), check_q_offset(q_offset), r.groups,
             r.q_index is not None, r.kv_index is not None, bq, bk, bq_b, bk_b, bool(interpret),
             num_warps or nw, num_stages or ns, num_warps_bwd or bw, num_stages_bwd or bs)
  return _attention(cfg, q, k, v, (r.q_len, kv_lo, r.kv_len, r.q_index, r.kv_index))
