"""Softmax attention through cuDNN flash attention (semantics of
``reference.softmax_attention_reference``), ``q, k, v [B, T, H, D]``.
Notes: pallas_kernels/README.md, ``cudnn_softmax.py``."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.api import compile_platform
from pallas_kernels.reference import check_q_offset, resolve_rows

_F32 = jnp.float32


class _Cfg(NamedTuple):
  window: int
  scale: float
  interpret: bool     # XLA stand-in for the cuDNN calls


# ---- one causal left-window half: cuDNN, or its XLA stand-in ---------------------------------


def _fa():
  from jax._src.cudnn import fused_attention_stablehlo as fa
  return fa


def _half_fwd_cudnn(q, k, v, q_len, kv_len, scale, span):
  """Causal attention of query t over keys ``(t - span, t]`` below ``kv_len``: ``(o [B, T, H,
  D], lse f32 [B, H, T])`` (cuDNN's softmax statistics)."""
  fa = _fa()
  o, lse = fa.dot_product_attention(q, k, v, q_seqlen=q_len, kv_seqlen=kv_len, scale=scale,
                                    mask_type=fa.MaskType.PADDING_CAUSAL,
                                    sliding_window_length=span, return_residual=True)
  return o, lse.astype(_F32)


def _half_bwd_cudnn(q, k, v, q_len, kv_len, scale, span, o, lse, do):
  """dq, dk, dv of one half given the merged ``o`` and ``lse`` (cuDNN's backward primitive)."""
  fa = _fa()
  none = jnp.zeros(0, q.dtype)
  grads = fa._dot_product_attention_bwd_p_wrapper.bind(
      q, k, v, none, q_len, kv_len, none, none, none, none, lse, o, do, scale=scale, seed=42,
      dropout_rate=0.0, variadic_args=(False, False), mask_type=fa.MaskType.PADDING_CAUSAL,
      layout=fa.AttentionLayout.BTNH.value, sliding_window_length=span)
  return tuple(grads[:3])


def _half_mask(T, q_len, kv_len, span):
  t = jnp.arange(T)
  m = (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - span)              # [T, T]
  return (m[None] & (t[None, :, None] < q_len[:, None, None])
          & (t[None, None, :] < kv_len[:, None, None]))[:, None]                  # [B,1,T,T]


def _grouped(k, v, hq):
  g = hq // k.shape[2]
  return (k, v) if g == 1 else tuple(jnp.repeat(x, g, axis=2) for x in (k, v))


def _half_fwd_xla(q, k, v, q_len, kv_len, scale, span):
  """XLA stand-in of ``_half_fwd_cudnn`` (same signature and results; dense, for tests)."""
  T, H = q.shape[1], q.shape[2]
  k, v = _grouped(k, v, H)
  m = _half_mask(T, q_len, kv_len, span)
  s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(_F32), k.astype(_F32)) * scale
  s = jnp.where(m, s, -jnp.inf)
  mx = jnp.max(s, axis=-1, keepdims=True)
  mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
  den = jnp.sum(jnp.where(m, jnp.exp(s - mx), 0.0), axis=-1)
  lse = jnp.where(den > 0, mx[..., 0] + jnp.log(jnp.where(den > 0, den, 1.0)), -jnp.inf)
  p = jnp.where(m, jnp.exp(s - jnp.where(den > 0, lse, 0.0)[..., None]), 0.0)
  return jnp.einsum("bhqk,bkhd->bqhd", p, v.astype(_F32)).astype(q.dtype), lse


def _half_bwd_xla(q, k, v, q_len, kv_len, scale, span, o, lse, do):
  """XLA stand-in of ``_half_bwd_cudnn``: FlashAttention-2's backward from the given o, lse."""
  T, H = q.shape[1], q.shape[2]
  hk = k.shape[2]
  kg, vg = _grouped(k, v, H)
  m = _half_mask(T, q_len, kv_len, span)
  f = lambda x: x.astype(_F32)
  s = jnp.einsum("bqhd,bkhd->bhqk", f(q), f(kg)) * scale
  p = jnp.where(m, jnp.exp(s - lse[..., None]), 0.0)
  delta = jnp.einsum("bqhd,bqhd->bhq", f(do), f(o))
  ds = p * (jnp.einsum("bqhd,bkhd->bhqk", f(do), f(vg)) - delta[..., None])
  dq = jnp.einsum("bhqk,bkhd->bqhd", ds, f(kg)) * scale
  dk = jnp.einsum("bhqk,bqhd->bkhd", ds, f(q)) * scale
  dv = jnp.einsum("bhqk,bqhd->bkhd", p, f(do))
  fold = lambda x: x.reshape(*x.shape[:2], hk, H // hk, x.shape[-1]).sum(3)     # GQA: sum groups
  return dq.astype(q.dtype), fold(dk).astype(k.dtype), fold(dv).astype(v.dtype)


def _halves(cfg: _Cfg):
  return (_half_fwd_xla, _half_bwd_xla) if cfg.interpret else (_half_fwd_cudnn, _half_bwd_cudnn)


# ---- the band: left half + reversed right half, merged by the log-sum-exp --------------------


def _gather_rows(x, idx):
  """``x[b, idx[b, t]]`` for ``x [B, T, ...]``, ``idx i32[B, T]``."""
  return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)


def _plan(T, q_len, kv_len, w):
  """Index maps and validity of the two halves (see the module docstring)."""
  t = jnp.arange(T)[None, :]
  L = kv_len[:, None]
  pq, pk = (L - 2 - t) % T, (L - 1 - t) % T                     # involutions of [0, T)
  row = t < q_len[:, None]
  v_left = row & (L > 0) & (t - w < L)
  v_right = row & (t <= L - 2) if w > 0 else jnp.zeros_like(row)
  lens_l = (q_len, jnp.maximum(kv_len, 1))                      # cuDNN: no empty key set
  lens_r = (jnp.maximum(kv_len - 1, 1), jnp.maximum(kv_len, 1))
  return pq, pk, v_left, v_right, lens_l, lens_r


def _merge(o_l, lse_l, o_r, lse_r, v_l, v_r):
  """``o`` of the union of two disjoint key sets from each one's ``o`` and ``lse [B, H, T]``."""
  vl, vr = v_l[:, None, :], v_r[:, None, :]
  a = jnp.where(vl, lse_l, -jnp.inf)
  b = jnp.where(vr, lse_r, -jnp.inf)
  seen = vl | vr
  lse = jnp.where(seen, jnp.logaddexp(a, b), 0.0)
  wl = jnp.where(vl, jnp.exp(a - lse), 0.0)
  wr = jnp.where(vr, jnp.exp(b - lse), 0.0)
  t = lambda x: jnp.swapaxes(x, 1, 2)[..., None]                  # [B, H, T] -> [B, T, H, 1]
  # where, not 0 * x: cuDNN leaves rows outside its lengths undefined
  o = (jnp.where(t(vl), t(wl) * o_l.astype(_F32), 0.0)
       + jnp.where(t(vr), t(wr) * o_r.astype(_F32), 0.0))
  return o, lse


def _band_fwd(cfg: _Cfg, q, k, v, q_len, kv_len):
  fwd, _ = _halves(cfg)
  T, w = q.shape[1], cfg.window
  pq, pk, v_l, v_r, lens_l, lens_r = _plan(T, q_len, kv_len, w)
  o_l, lse_l = fwd(q, k, v, *lens_l, cfg.scale, w + 1)
  if w > 0:
    o_r, lse_r = fwd(_gather_rows(q, pq), _gather_rows(k, pk), _gather_rows(v, pk), *lens_r,
                     cfg.scale, w)
    o_r = _gather_rows(o_r, pq)
    lse_r = jnp.take_along_axis(lse_r, pq[:, None, :], axis=2)
  else:
    o_r, lse_r = o_l, lse_l
  o, lse = _merge(o_l, lse_l, o_r, lse_r, v_l, v_r)
  return o.astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _band(cfg, q, k, v, q_len, kv_len):
  return _band_fwd(cfg, q, k, v, q_len, kv_len)[0]


def _band_vjp_fwd(cfg, q, k, v, q_len, kv_len):
  o, lse = _band_fwd(cfg, q, k, v, q_len, kv_len)
  return o, (q, k, v, q_len, kv_len, o, lse)


def _band_vjp_bwd(cfg, res, do):
  _, bwd = _halves(cfg)
  q, k, v, q_len, kv_len, o, lse = res
  T, w = q.shape[1], cfg.window
  pq, pk, v_l, v_r, lens_l, lens_r = _plan(T, q_len, kv_len, w)
  do = jnp.where((v_l | v_r)[:, :, None, None], do, 0).astype(q.dtype)
  t = jnp.arange(T)[None, :]
  ok = [v_l | v_r, t < kv_len[:, None], t < kv_len[:, None]]     # rows of dq, dk, dv
  keep = lambda x, n: jnp.where(ok[n][:, :, None, None], x.astype(_F32), 0.0)
  grads = [keep(x, n) for n, x in enumerate(bwd(q, k, v, *lens_l, cfg.scale, w + 1, o, lse, do))]
  if w > 0:
    g = bwd(_gather_rows(q, pq), _gather_rows(k, pk), _gather_rows(v, pk), *lens_r, cfg.scale,
            w, _gather_rows(o, pq), jnp.take_along_axis(lse, pq[:, None, :], axis=2),
            _gather_rows(do, pq))
    ok[0] = v_r
    for n, (x, idx) in enumerate(zip(g, (pq, pk, pk), strict=True)):
      grads[n] = grads[n] + keep(_gather_rows(x, idx), n)
  return (*(x.astype(y.dtype) for x, y in zip(grads, (q, k, v), strict=True)), None, None)


_band.defvjp(_band_vjp_fwd, _band_vjp_bwd)


def _full(q, k, v, q_len, kv_len, scale, interpret):
  o = jax.nn.dot_product_attention(q, k, v, scale=scale, query_seq_lengths=q_len,
                                   key_value_seq_lengths=jnp.maximum(kv_len, 1),
                                   implementation="xla" if interpret else "cudnn")
  keep = (jnp.arange(q.shape[1])[None, :] < q_len[:, None]) & (kv_len[:, None] > 0)
  return jnp.where(keep[:, :, None, None], o, 0).astype(q.dtype)


def softmax_attention_cudnn(q, k, v, *, window=None, scale=None, q_lengths=None,
                            kv_lengths=None, kv_start=None, q_offset=0, q_index=None,
                            kv_index=None, backend="cudnn", interpret=False):
  """cuDNN softmax attention; semantics of ``reference.softmax_attention_reference`` (without
  ``kv_start`` / ``q_offset``). ``interpret=True`` runs the same computation with the XLA
  stand-in for the cuDNN calls (for CPU tests); without it the backend needs a GPU."""
  del backend
  if kv_start is not None or check_q_offset(q_offset):
    raise ValueError("softmax_attention backend 'cudnn' takes no kv_start / q_offset (the "
                     "context-parallel halo path); use 'pallas' or 'xla'")
  if not interpret and compile_platform() != "gpu":
    raise ValueError("softmax_attention backend 'cudnn' needs a GPU (interpret=True runs its "
                     "XLA stand-in)")
  r = resolve_rows(q, k, v, q_index=q_index, kv_index=kv_index, q_lengths=q_lengths,
                   kv_lengths=kv_lengths, window=window)
  take = lambda x, idx: x if idx is None else jnp.take(x, idx, axis=0)    # AD: scatter-add
  q, k, v = take(q, r.q_index), take(k, r.kv_index), take(v, r.kv_index)
  T = q.shape[1]
  if window is not None and k.shape[1] != T:
    raise ValueError(f"softmax_attention backend 'cudnn' with a window needs Tq == Tk, got "
                     f"{T} and {k.shape[1]}")
  # zero the padding rows: NaN/Inf stored there must not reach the result (0 * NaN in P.V)
  zero = lambda x, n: jnp.where((jnp.arange(x.shape[1])[None, :] < n[:, None])[..., None, None],
                                x, 0).astype(x.dtype)
  q, k, v = zero(q, r.q_len), zero(k, r.kv_len), zero(v, r.kv_len)
  scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
  if window is None:
    return _full(q, k, v, r.q_len, r.kv_len, scale, interpret)
  return _band(_Cfg(int(window), scale, bool(interpret)), q, k, v, r.q_len, r.kv_len)
