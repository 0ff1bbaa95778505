"""GDPA in Pallas (Triton lowering on GPU; ``interpret=True`` runs the same kernels on CPU);
``q, k, v [B, T, H, D]`` read in place. Notes: pallas_kernels/README.md, ``pallas_gdpa.py``."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _poison, activations, tuning
from pallas_kernels._common import precision
from pallas_kernels.api import shape_class
from pallas_kernels.reference import resolve_rows, score_clip_value

_F32 = jnp.float32
_E4M3_MAX = 448.0


class _Cfg(NamedTuple):
  """Static kernel configuration (hashable: a ``custom_vjp`` nondiff argument)."""
  acts: tuple[str, ...]
  scale: float
  out_scale: float
  window: int | None
  groups: int          # G = H_q / H_kv
  has_qi: bool         # q rows come through q_index
  has_ki: bool         # k/v rows come through kv_index
  bq: int
  bk: int
  bq_bwd: int
  bk_bwd: int
  interpret: bool
  num_warps: int | None = None
  num_stages: int | None = None
  score_clip: float | None = None   # clamp scores to [-c, c] before the activation; None: off
  fast: bool = False                # hardware tanh / sigmoid (16-bit inputs on a GPU)
  fp8: bool = False                 # forward only: fp8 q, k, v and a per-tensor q.k scale input

  def params(self):
    return plgpu.CompilerParams(num_warps=self.num_warps, num_stages=self.num_stages)


def _span(start, tile, other_tile, n_other, other_len, window):
  """Range ``[lo, hi)`` of tiles (size ``other_tile``) of the other axis that can be visible
  from the rows ``[start, start + tile)``: keys/queries below ``other_len`` and within window."""
  end = jnp.minimum(other_len, start + tile + window) if window is not None else other_len
  hi = jnp.minimum(lax.div(end + other_tile - 1, other_tile), n_other)
  lo = lax.div(jnp.maximum(start - window, 0), other_tile) if window is not None else 0
  return lo, jnp.maximum(hi, lo)


def _clip(s, c):
  """Scores clamped to ``[-c, c]`` (min/max: lowers to Triton; no ``lax.clamp`` rule needed)."""
  return s if c is None else jnp.minimum(jnp.maximum(s, -c), c)


def _clip_slope(slope, s, c):
  """Zero derivative where the raw score ``s`` lies outside ``[-c, c]`` (as ``jnp.clip``)."""
  return slope if c is None else jnp.where(jnp.abs(s) <= c, slope, 0.0)


def _load_rows(ref, batch, start, n, head, length):
  """Rows ``[start, start + n)`` of ``ref[batch, :, head, :]``; rows >= length read as zeros."""
  d = ref.shape[-1]
  valid = jnp.broadcast_to((start + jnp.arange(n) < length)[:, None], (n, d))
  return plgpu.load(ref.at[batch, pl.ds(start, n), head, :], mask=valid, other=0.0)


def _store_rows(ref, batch, start, head, x):
  """Stores ``x [n, D]`` into rows ``[start, start + n)`` of ``ref[batch, :, head, :]`` (rows
  beyond the array end are dropped)."""
  n, d = x.shape
  valid = jnp.broadcast_to((start + jnp.arange(n) < ref.shape[1])[:, None], (n, d))
  plgpu.store(ref.at[batch, pl.ds(start, n), head, :], x.astype(ref.dtype), mask=valid)


def _window_keep(rows, cols, window):
  return jnp.abs(rows[:, None] - cols[None, :]) <= window


def _unpack(refs, cfg: _Cfg):
  """(q_len, kv_len, q batch row, kv batch row, the remaining refs) of this program."""
  b = pl.program_id(0)
  ql_ref, kl_ref, *rest = refs
  qb = rest.pop(0)[0] if cfg.has_qi else b
  kb = rest.pop(0)[0] if cfg.has_ki else b
  return ql_ref[0], kl_ref[0], qb, kb, rest


# ----------------------------------------------------------------------------- kernels


def _fwd_kernel(*refs, cfg: _Cfg, nk: int):
  q_len, kv_len, qb, kb, rest = _unpack(refs, cfg)
  sc_ref = rest.pop(0) if cfg.fp8 else None
  q_ref, k_ref, v_ref, o_ref = rest
  b, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  hk = lax.div(h, cfg.groups)
  bq, bk = cfg.bq, cfg.bk
  q = _load_rows(q_ref, qb, i * bq, bq, h, q_len)
  lo, hi = _span(i * bq, bq, bk, nk, kv_len, cfg.window)
  hi = jnp.where(i * bq < q_len, hi, lo)
  prec = None if cfg.fp8 else precision(q.dtype)
  scale = cfg.scale * sc_ref[0] if cfg.fp8 else cfg.scale

  def body(j, acc):
    k = _load_rows(k_ref, kb, j * bk, bk, hk, kv_len)
    v = _load_rows(v_ref, kb, j * bk, bk, hk, kv_len)
    if cfg.fp8:
      v = v.astype(jnp.bfloat16)
    s = plgpu.dot(q, k, trans_b=True, precision=prec) * scale
    if cfg.window is not None:   # act(0) = 0: a zeroed score contributes nothing
      s = jnp.where(_window_keep(i * bq + jnp.arange(bq), j * bk + jnp.arange(bk), cfg.window),
                    s, 0.0)
    p = activations.in_kernel(_clip(s, cfg.score_clip), cfg.acts, h, fast=cfg.fast)
    return acc + plgpu.dot(p.astype(v.dtype), v, precision=prec)

  acc = lax.fori_loop(lo, hi, body, jnp.zeros((bq, q_ref.shape[-1]), _F32))
  _store_rows(o_ref, b, i * bq, h, acc * cfg.out_scale)


def _dq_kernel(*refs, cfg: _Cfg, nk: int):
  q_len, kv_len, qb, kb, (q_ref, k_ref, v_ref, do_ref, dq_ref) = _unpack(refs, cfg)
  b, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  hk = lax.div(h, cfg.groups)
  bq, bk = cfg.bq_bwd, cfg.bk_bwd
  q = _load_rows(q_ref, qb, i * bq, bq, h, q_len)
  do = _load_rows(do_ref, b, i * bq, bq, h, q_len)
  lo, hi = _span(i * bq, bq, bk, nk, kv_len, cfg.window)
  hi = jnp.where(i * bq < q_len, hi, lo)
  prec = precision(q.dtype)

  def body(j, dq):
    k = _load_rows(k_ref, kb, j * bk, bk, hk, kv_len)
    v = _load_rows(v_ref, kb, j * bk, bk, hk, kv_len)
    s = plgpu.dot(q, k, trans_b=True, precision=prec) * cfg.scale
    _, slope = activations.in_kernel(_clip(s, cfg.score_clip), cfg.acts, h, with_slope=True,
                                     fast=cfg.fast)
    ds = plgpu.dot(do, v, trans_b=True, precision=prec) * _clip_slope(slope, s, cfg.score_clip)
    if cfg.window is not None:
      ds = jnp.where(_window_keep(i * bq + jnp.arange(bq), j * bk + jnp.arange(bk), cfg.window),
                     ds, 0.0)
    return dq + plgpu.dot(ds.astype(k.dtype), k, precision=prec)

  dq = lax.fori_loop(lo, hi, body, jnp.zeros((bq, q_ref.shape[-1]), _F32))
  _store_rows(dq_ref, b, i * bq, h, dq * (cfg.scale * cfg.out_scale))


def _dkv_kernel(*refs, cfg: _Cfg, nq: int):
  q_len, kv_len, qb, kb, (q_ref, k_ref, v_ref, do_ref, dk_ref, dv_ref) = _unpack(refs, cfg)
  b, hk, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  bq, bk = cfg.bq_bwd, cfg.bk_bwd
  k = _load_rows(k_ref, kb, j * bk, bk, hk, kv_len)
  v = _load_rows(v_ref, kb, j * bk, bk, hk, kv_len)
  lo, hi = _span(j * bk, bk, bq, nq, q_len, cfg.window)
  hi = jnp.where(j * bk < kv_len, hi, lo)
  prec = precision(k.dtype)
  cols = j * bk + jnp.arange(bk)

  def head(g, carry):
    h = hk * cfg.groups + g

    def body(i, carry):
      dk, dv = carry
      q = _load_rows(q_ref, qb, i * bq, bq, h, q_len)
      do = _load_rows(do_ref, b, i * bq, bq, h, q_len)
      s_t = plgpu.dot(k, q, trans_b=True, precision=prec) * cfg.scale          # [bk, bq]
      keep = None
      if cfg.window is not None:
        keep = _window_keep(cols, i * bq + jnp.arange(bq), cfg.window)
        s_t = jnp.where(keep, s_t, 0.0)
      p_t, slope_t = activations.in_kernel(_clip(s_t, cfg.score_clip), cfg.acts, h,
                                           with_slope=True, fast=cfg.fast)
      dv = dv + plgpu.dot(p_t.astype(do.dtype), do, precision=prec)
      ds_t = (plgpu.dot(v, do, trans_b=True, precision=prec)
              * _clip_slope(slope_t, s_t, cfg.score_clip))
      if keep is not None:
        ds_t = jnp.where(keep, ds_t, 0.0)
      dk = dk + plgpu.dot(ds_t.astype(q.dtype), q, precision=prec)
      return dk, dv

    return lax.fori_loop(lo, hi, body, carry)

  zeros = jnp.zeros((bk, k_ref.shape[-1]), _F32)
  if cfg.groups == 1:
    dk, dv = head(0, (zeros, zeros))
  else:
    dk, dv = lax.fori_loop(0, cfg.groups, head, (zeros, zeros))
  _store_rows(dk_ref, b, j * bk, hk, dk * (cfg.scale * cfg.out_scale))
  _store_rows(dv_ref, b, j * bk, hk, dv * cfg.out_scale)


# ----------------------------------------------------------------------------- pallas_calls


def _scalar_spec():
  return pl.BlockSpec((1,), lambda b, h, i: (b,))


def _call(kernel, cfg: _Cfg, rows, ops, out_shape, grid, name):
  """``pallas_call`` with the per-row scalars (lengths, indices) blocked and q/k/v whole."""
  ql, kl, qi, ki = rows
  scalars = [ql, kl] + ([qi] if cfg.has_qi else []) + ([ki] if cfg.has_ki else [])
  n_out = len(out_shape) if isinstance(out_shape, tuple) else 1
  whole = pl.no_block_spec
  return _poison.pallas_call(
      kernel, (*scalars, *ops), out_shape=out_shape, grid=grid,
      in_specs=[_scalar_spec()] * len(scalars) + [whole] * len(ops),
      out_specs=(whole,) * n_out if n_out > 1 else whole, interpret=cfg.interpret, name=name,
      compiler_params=cfg.params())


def _fwd_call(cfg: _Cfg, q, k, v, rows, extra=()):
  B = rows[0].shape[0]
  Tq, Hq, D = q.shape[1:]
  nq, nk = pl.cdiv(Tq, cfg.bq), pl.cdiv(k.shape[1], cfg.bk)
  out_dtype = _F32 if cfg.fp8 else q.dtype
  return _call(functools.partial(_fwd_kernel, cfg=cfg, nk=nk), cfg, rows, (*extra, q, k, v),
               jax.ShapeDtypeStruct((B, Tq, Hq, D), out_dtype), (B, Hq, nq),
               "gdpa_fwd_fp8" if cfg.fp8 else "gdpa_fwd")


def _bwd_calls(cfg: _Cfg, q, k, v, rows, do):
  B = do.shape[0]
  Tq, Hq, D = q.shape[1:]
  Tk, Hkv = k.shape[1:3]
  nq, nk = pl.cdiv(Tq, cfg.bq_bwd), pl.cdiv(Tk, cfg.bk_bwd)
  dq_dtype = _F32 if cfg.has_qi else q.dtype      # per-output-row partials are summed after
  dkv_dtype = _F32 if cfg.has_ki else k.dtype
  dq = _call(functools.partial(_dq_kernel, cfg=cfg, nk=nk), cfg, rows, (q, k, v, do),
             jax.ShapeDtypeStruct((B, Tq, Hq, D), dq_dtype), (B, Hq, nq), "gdpa_bwd_dq")
  dk, dv = _call(functools.partial(_dkv_kernel, cfg=cfg, nq=nq), cfg, rows, (q, k, v, do),
                 (jax.ShapeDtypeStruct((B, Tk, Hkv, D), dkv_dtype),) * 2, (B, Hkv, nk),
                 "gdpa_bwd_dkv")
  return dq, dk, dv


def segment_rows(x_rows, index, shape, dtype):
  """Sums per-output-row partial gradients ``x_rows [B, ...]`` into the shared rows."""
  if index is None:
    return x_rows
  return jnp.zeros(shape, _F32).at[index].add(x_rows.astype(_F32)).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gdpa(cfg, q, k, v, rows):
  return _fwd_call(cfg, q, k, v, rows)


def _gdpa_fwd(cfg, q, k, v, rows):
  return _fwd_call(cfg, q, k, v, rows), (q, k, v, rows)


def _gdpa_bwd(cfg, res, do):
  q, k, v, rows = res
  dq, dk, dv = _bwd_calls(cfg, q, k, v, rows, do.astype(q.dtype))
  _, _, qi, ki = rows
  dq = segment_rows(dq, qi, q.shape, q.dtype)
  dk, dv = (segment_rows(x, ki, k.shape, k.dtype) for x in (dk, dv))
  return dq, dk, dv, jax.tree.map(lambda _: None, rows)


_gdpa.defvjp(_gdpa_fwd, _gdpa_bwd)


# ----------------------------------------------------------------------------- public


def _quantise(x):
  amax = jnp.max(jnp.abs(x.astype(_F32)))
  s = jnp.where(amax > 0, amax / _E4M3_MAX, 1.0)
  return (x.astype(_F32) / s).astype(jnp.float8_e4m3fn), s


def _zero_beyond(x, lengths):
  """``x [N, T, H, D]`` with rows at or beyond ``lengths[n]`` zeroed (fp8 amax, no NaN)."""
  keep = jnp.arange(x.shape[1])[None, :] < lengths[:, None]
  return jnp.where(keep[:, :, None, None], x, jnp.zeros_like(x))


def gdpa_pallas(q, k, v, *, activation="fast_gelu", scale=None, out_scale=1.0, q_lengths=None,
                kv_lengths=None, window=None, broadcast_q=False, q_index=None, kv_index=None,
                backend="pallas", interpret=False, score_clip=None, block_q=None, block_k=None,
                block_q_bwd=None, block_k_bwd=None, num_warps=None, num_stages=None, fp8=False):
  """Pallas GDPA; same semantics as ``reference.gdpa_reference`` (see there for shapes).

  Extra args: ``block_*`` tile sizes (powers of two >= 16; clipped to the sequence lengths;
  default: ``tuning.lookup``), ``num_warps`` / ``num_stages`` (GPU), ``fp8`` (forward-only
  float8_e4m3fn path, see the module docstring).
  """
  del backend
  r = resolve_rows(q, k, v, broadcast_q=broadcast_q, q_index=q_index, kv_index=kv_index,
                   q_lengths=q_lengths, kv_lengths=kv_lengths, window=window)
  Tq, Hq, D = q.shape[1:]
  Tk = k.shape[1]
  key = tuning.key(shape_class("gdpa", Tq, Tk), D, q.dtype)
  fq, fk, fw, fs = tuning.lookup("pallas", "fwd", key, q.dtype)
  bq_b, bk_b, bw, bs = tuning.lookup("pallas", "dkv", key, q.dtype)
  bq, bk = tuning.clamp_tile(block_q or fq, Tq), tuning.clamp_tile(block_k or fk, Tk)
  bq_b = tuning.clamp_tile(block_q_bwd or bq_b, Tq)
  bk_b = tuning.clamp_tile(block_k_bwd or bk_b, Tk)
  fast = not interpret and jnp.dtype(q.dtype) in (jnp.bfloat16, jnp.float16)
  cfg = _Cfg(activations.per_head(activation, Hq), D ** -0.5 if scale is None else float(scale),
             float(out_scale), None if window is None else int(window), r.groups,
             r.q_index is not None, r.kv_index is not None, bq, bk, bq_b, bk_b, bool(interpret),
             num_warps or fw, num_stages or fs, score_clip_value(score_clip), fast)
  rows = (r.q_len, r.kv_len, r.q_index, r.kv_index)
  if fp8:
    # Zero the rows no output row reads first, so they cannot set (or NaN) the amax.
    own = lambda x, idx, lens: _zero_beyond(x, lens if idx is None else jnp.zeros(
        (x.shape[0],), jnp.int32).at[idx].max(lens))
    (q8, sq), (k8, sk), (v8, sv) = (_quantise(own(q, r.q_index, r.q_len)),
                                    *(_quantise(own(x, r.kv_index, r.kv_len)) for x in (k, v)))
    sc = jnp.reshape(sq * sk, (1,)).astype(_F32)
    out = _fwd_call(cfg._replace(fp8=True), q8, k8, v8, rows, extra=(sc,))
    return (out * sv).astype(q.dtype)
  return _gdpa(cfg, q, k, v, rows)
