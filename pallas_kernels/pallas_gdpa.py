"""GDPA in Pallas (Triton-style ``pallas_call`` with BlockSpecs; ``interpret=True`` runs on CPU).

Forward: grid ``(B, H, Tq / bq)``; each program keeps one q tile and walks the kv tiles that can
hold a visible key (lengths and window bound the loop, so fully masked tiles are never touched).
Backward (``jax.custom_vjp``, no softmax state; scores are recomputed): a dq kernel with the same
grid and loop, and a dk/dv kernel with grid ``(B, H, Tk / bk)`` walking the q tiles.

``score_clip`` clamps ``scale * q.k`` to ``[-c, c]`` before the activation in every kernel; the
backward kernels zero the score gradient where the raw score lies outside (spec h-13).

Numerics: dots accumulate in float32 (``plgpu.dot``); ``act(s)`` is cast to the value dtype before
the second dot (bf16 inputs -> bf16 P, as flash attention does). Padded or masked rows are zeroed
on load, so NaN/Inf stored beyond the lengths never reaches a valid output or gradient.

fp8 (``fp8=True``, forward only): q, k, v are quantised to float8_e4m3fn with one scale per tensor
(amax / 448); q.k runs in fp8 with f32 accumulation and the scales are folded into ``scale`` /
``out_scale``; P.V runs in bf16 (v upcast from fp8), since act(s) has no bounded range.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _poison, activations
from pallas_kernels.reference import check_gdpa_args, score_clip_value

_F32 = jnp.float32
_E4M3_MAX = 448.0


class _Cfg(NamedTuple):
  """Static kernel configuration (hashable: a ``custom_vjp`` nondiff argument)."""
  acts: tuple[str, ...]
  scale: float
  out_scale: float
  window: int | None
  broadcast_q: bool
  bq: int
  bk: int
  bq_bwd: int
  bk_bwd: int
  interpret: bool
  num_warps: int | None = None
  num_stages: int | None = None
  score_clip: float | None = None   # clamp scores to [-c, c] before the activation; None: off

  def params(self):
    return plgpu.CompilerParams(num_warps=self.num_warps, num_stages=self.num_stages)


def _tile(n: int, block: int) -> int:
  """A power-of-two tile <= block covering small n (>= 16, Triton's minimum dot size)."""
  return min(block, max(16, pl.next_power_of_2(n)))


def _precision(dtype):
  return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _span(start, tile, other_tile, n_other, other_len, window):
  """Range ``[lo, hi)`` of tiles (size ``other_tile``) of the other axis that can be visible
  from the rows ``[start, start + tile)``: keys/queries below ``other_len`` and within window."""
  end = jnp.minimum(other_len, start + tile + window) if window is not None else other_len
  hi = jnp.minimum(lax.div(end + other_tile - 1, other_tile), n_other)
  lo = lax.div(jnp.maximum(start - window, 0), other_tile) if window is not None else 0
  return lo, jnp.maximum(hi, lo)


def _mask(rows, cols, q_len, kv_len, window):
  m = (rows < q_len)[:, None] & (cols < kv_len)[None, :]
  if window is not None:
    m = m & (jnp.abs(rows[:, None] - cols[None, :]) <= window)
  return m


def _zero_rows(x, valid):
  return jnp.where(valid[:, None], x, jnp.zeros_like(x))


def _clip(s, c):
  """Scores clamped to ``[-c, c]`` (min/max: lowers to Triton; no ``lax.clamp`` rule needed)."""
  return s if c is None else jnp.minimum(jnp.maximum(s, -c), c)


def _clip_slope(slope, s, c):
  """Zero derivative where the raw score ``s`` lies outside ``[-c, c]`` (as ``jnp.clip``)."""
  return slope if c is None else jnp.where(jnp.abs(s) <= c, slope, 0.0)


# ----------------------------------------------------------------------------- kernels


def _fwd_kernel(ql_ref, kl_ref, q_ref, k_ref, v_ref, o_ref, *, cfg: _Cfg, nk: int):
  h, i = pl.program_id(1), pl.program_id(2)
  q_len, kv_len = ql_ref[0], kl_ref[0]
  bq, bk = cfg.bq, cfg.bk
  rows = i * bq + jnp.arange(bq)
  q = _zero_rows(q_ref[...], rows < q_len)
  lo, hi = _span(i * bq, bq, bk, nk, kv_len, cfg.window)
  hi = jnp.where(i * bq < q_len, hi, lo)

  def body(j, acc):
    cols = j * bk + jnp.arange(bk)
    k = _zero_rows(k_ref[pl.ds(j * bk, bk), :], cols < kv_len)
    v = _zero_rows(v_ref[pl.ds(j * bk, bk), :], cols < kv_len)
    s = plgpu.dot(q, k, trans_b=True, precision=_precision(q.dtype)) * cfg.scale
    p = activations.in_kernel(_clip(s, cfg.score_clip), cfg.acts, h)
    p = jnp.where(_mask(rows, cols, q_len, kv_len, cfg.window), p, 0.0)
    return acc + plgpu.dot(p.astype(v.dtype), v, precision=_precision(v.dtype))

  acc = lax.fori_loop(lo, hi, body, jnp.zeros((bq, q_ref.shape[-1]), _F32))
  o_ref[...] = (acc * cfg.out_scale).astype(o_ref.dtype)


def _dq_kernel(ql_ref, kl_ref, q_ref, k_ref, v_ref, do_ref, dq_ref, *, cfg: _Cfg, nk: int):
  h, i = pl.program_id(1), pl.program_id(2)
  q_len, kv_len = ql_ref[0], kl_ref[0]
  bq, bk = cfg.bq_bwd, cfg.bk_bwd
  rows = i * bq + jnp.arange(bq)
  q = _zero_rows(q_ref[...], rows < q_len)
  do = _zero_rows(do_ref[...], rows < q_len)
  lo, hi = _span(i * bq, bq, bk, nk, kv_len, cfg.window)
  hi = jnp.where(i * bq < q_len, hi, lo)
  prec = _precision(q.dtype)

  def body(j, dq):
    cols = j * bk + jnp.arange(bk)
    k = _zero_rows(k_ref[pl.ds(j * bk, bk), :], cols < kv_len)
    v = _zero_rows(v_ref[pl.ds(j * bk, bk), :], cols < kv_len)
    s = plgpu.dot(q, k, trans_b=True, precision=prec) * cfg.scale
    _, slope = activations.in_kernel(_clip(s, cfg.score_clip), cfg.acts, h, with_slope=True)
    slope = _clip_slope(slope, s, cfg.score_clip)
    dp = plgpu.dot(do, v, trans_b=True, precision=prec) * cfg.out_scale
    ds = jnp.where(_mask(rows, cols, q_len, kv_len, cfg.window), dp * slope, 0.0) * cfg.scale
    return dq + plgpu.dot(ds.astype(k.dtype), k, precision=prec)

  dq = lax.fori_loop(lo, hi, body, jnp.zeros((bq, q_ref.shape[-1]), _F32))
  dq_ref[...] = dq.astype(dq_ref.dtype)


def _dkv_kernel(ql_ref, kl_ref, q_ref, k_ref, v_ref, do_ref, dk_ref, dv_ref, *, cfg: _Cfg,
                nq: int):
  h, j = pl.program_id(1), pl.program_id(2)
  q_len, kv_len = ql_ref[0], kl_ref[0]
  bq, bk = cfg.bq_bwd, cfg.bk_bwd
  cols = j * bk + jnp.arange(bk)
  k = _zero_rows(k_ref[...], cols < kv_len)
  v = _zero_rows(v_ref[...], cols < kv_len)
  lo, hi = _span(j * bk, bk, bq, nq, q_len, cfg.window)
  hi = jnp.where(j * bk < kv_len, hi, lo)
  prec = _precision(k.dtype)

  def body(i, carry):
    dk, dv = carry
    rows = i * bq + jnp.arange(bq)
    q = _zero_rows(q_ref[pl.ds(i * bq, bq), :], rows < q_len)
    do = _zero_rows(do_ref[pl.ds(i * bq, bq), :], rows < q_len)
    s = plgpu.dot(q, k, trans_b=True, precision=prec) * cfg.scale
    p, slope = activations.in_kernel(_clip(s, cfg.score_clip), cfg.acts, h, with_slope=True)
    slope = _clip_slope(slope, s, cfg.score_clip)
    m = _mask(rows, cols, q_len, kv_len, cfg.window)
    p = jnp.where(m, p, 0.0) * cfg.out_scale
    dv = dv + plgpu.dot(p.astype(do.dtype), do, trans_a=True, precision=prec)
    dp = plgpu.dot(do, v, trans_b=True, precision=prec) * cfg.out_scale
    ds = jnp.where(m, dp * slope, 0.0) * cfg.scale
    dk = dk + plgpu.dot(ds.astype(q.dtype), q, trans_a=True, precision=prec)
    return dk, dv

  zeros = jnp.zeros((bk, k_ref.shape[-1]), _F32)
  dk, dv = lax.fori_loop(lo, hi, body, (zeros, zeros))
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


# ----------------------------------------------------------------------------- pallas_calls


def _len_spec():
  return pl.BlockSpec((1,), lambda b, h, i: (b,))


def _row_spec(tile, d, batch0=False):
  """Tile ``i`` of the sequence axis of a ``[B, T, H, D]`` array (batch 0 when broadcast)."""
  return pl.BlockSpec((None, tile, None, d), lambda b, h, i: (0 if batch0 else b, i, h, 0))


def _full_spec(t, d, batch0=False):
  """The whole sequence of one (batch, head) of a ``[B, T, H, D]`` array."""
  return pl.BlockSpec((None, t, None, d), lambda b, h, i: (0 if batch0 else b, 0, h, 0))


def _fwd_call(cfg: _Cfg, q, k, v, q_len, kv_len):
  B, Tk, H, D = k.shape
  Tq = q.shape[1]
  nq, nk = Tq // cfg.bq, Tk // cfg.bk
  return _poison.pallas_call(
      functools.partial(_fwd_kernel, cfg=cfg, nk=nk), (q_len, kv_len, q, k, v),
      out_shape=jax.ShapeDtypeStruct((B, Tq, H, D), q.dtype), grid=(B, H, nq),
      in_specs=[_len_spec(), _len_spec(), _row_spec(cfg.bq, D, cfg.broadcast_q),
                _full_spec(Tk, D), _full_spec(Tk, D)],
      out_specs=_row_spec(cfg.bq, D), interpret=cfg.interpret, name="gdpa_fwd",
      compiler_params=cfg.params())


def _bwd_calls(cfg: _Cfg, q, k, v, q_len, kv_len, do):
  B, Tk, H, D = k.shape
  Tq = q.shape[1]
  nq, nk = Tq // cfg.bq_bwd, Tk // cfg.bk_bwd
  bcast = cfg.broadcast_q
  dq_dtype = _F32 if bcast else q.dtype  # per-example dq is summed over the batch afterwards
  dq = _poison.pallas_call(
      functools.partial(_dq_kernel, cfg=cfg, nk=nk), (q_len, kv_len, q, k, v, do),
      out_shape=jax.ShapeDtypeStruct((B, Tq, H, D), dq_dtype),
      grid=(B, H, nq),
      in_specs=[_len_spec(), _len_spec(), _row_spec(cfg.bq_bwd, D, bcast), _full_spec(Tk, D),
                _full_spec(Tk, D), _row_spec(cfg.bq_bwd, D)],
      out_specs=_row_spec(cfg.bq_bwd, D), interpret=cfg.interpret, name="gdpa_bwd_dq",
      compiler_params=cfg.params())
  if bcast:
    dq = dq.sum(0, keepdims=True).astype(q.dtype)
  dk, dv = _poison.pallas_call(
      functools.partial(_dkv_kernel, cfg=cfg, nq=nq), (q_len, kv_len, q, k, v, do),
      out_shape=(jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)),
      grid=(B, H, nk),
      in_specs=[_len_spec(), _len_spec(), _full_spec(Tq, D, bcast), _row_spec(cfg.bk_bwd, D),
                _row_spec(cfg.bk_bwd, D), _full_spec(Tq, D)],
      out_specs=(_row_spec(cfg.bk_bwd, D), _row_spec(cfg.bk_bwd, D)),
      interpret=cfg.interpret, name="gdpa_bwd_dkv", compiler_params=cfg.params())
  return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gdpa_padded(cfg, q, k, v, q_len, kv_len):
  return _fwd_call(cfg, q, k, v, q_len, kv_len)


def _gdpa_padded_fwd(cfg, q, k, v, q_len, kv_len):
  return _fwd_call(cfg, q, k, v, q_len, kv_len), (q, k, v, q_len, kv_len)


def _gdpa_padded_bwd(cfg, res, do):
  q, k, v, q_len, kv_len = res
  dq, dk, dv = _bwd_calls(cfg, q, k, v, q_len, kv_len, do.astype(q.dtype))
  return dq, dk, dv, None, None


_gdpa_padded.defvjp(_gdpa_padded_fwd, _gdpa_padded_bwd)


# ----------------------------------------------------------------------------- public


def _pad_seq(x, n):
  return x if x.shape[1] == n else jnp.pad(x, ((0, 0), (0, n - x.shape[1]), (0, 0), (0, 0)))


def _lengths(lengths, batch, t):
  if lengths is None:
    return jnp.full((batch,), t, jnp.int32)
  lengths = jnp.asarray(lengths, jnp.int32)
  if lengths.shape != (batch,):
    raise ValueError(f"lengths must have shape ({batch},), got {lengths.shape}")
  return jnp.clip(lengths, 0, t)


def _quantise(x):
  amax = jnp.max(jnp.abs(x.astype(_F32)))
  s = jnp.where(amax > 0, amax / _E4M3_MAX, 1.0)
  return (x.astype(_F32) / s).astype(jnp.float8_e4m3fn), s


def gdpa_pallas(q, k, v, *, activation="fast_gelu", scale=None, out_scale=1.0, q_lengths=None,
                kv_lengths=None, window=None, broadcast_q=False, backend="pallas",
                interpret=False, score_clip=None, block_q=64, block_k=64, block_q_bwd=32,
                block_k_bwd=32, num_warps=None, num_stages=None, fp8=False):
  """Pallas GDPA; same semantics as ``reference.gdpa_reference`` (see there for shapes).

  Extra args: ``block_*`` tile sizes (powers of two; clipped to the sequence lengths),
  ``fp8`` (forward-only float8_e4m3fn path, see the module docstring).
  """
  del backend
  check_gdpa_args(q, k, v, broadcast_q)
  B, Tk, H, D = k.shape
  Tq = q.shape[1]
  if window is not None and window < 0:
    raise ValueError(f"window must be >= 0, got {window}")
  bq, bk = _tile(Tq, block_q), _tile(Tk, block_k)
  bq_b, bk_b = _tile(Tq, block_q_bwd), _tile(Tk, block_k_bwd)
  tq_pad = pl.cdiv(Tq, max(bq, bq_b)) * max(bq, bq_b)
  tk_pad = pl.cdiv(Tk, max(bk, bk_b)) * max(bk, bk_b)
  q_len = _lengths(q_lengths, B, Tq)
  kv_len = _lengths(kv_lengths, B, Tk)
  scale = D ** -0.5 if scale is None else float(scale)
  cfg = _Cfg(activations.per_head(activation, H), scale, float(out_scale),
             None if window is None else int(window), bool(broadcast_q), bq, bk, bq_b, bk_b,
             bool(interpret), num_warps, num_stages, score_clip_value(score_clip))
  qp, kp, vp = _pad_seq(q, tq_pad), _pad_seq(k, tk_pad), _pad_seq(v, tk_pad)
  if fp8:  # zero the rows beyond the lengths first so they cannot set (or NaN) the amax
    qv = jnp.arange(tq_pad)[None, :] < (q_len[:, None] if not broadcast_q else Tq)
    kv = (jnp.arange(tk_pad)[None, :] < kv_len[:, None])[:, :, None, None]
    qp = jnp.where(qv[:, :, None, None], qp, 0)
    (qp, sq), (kp, sk), (vp, sv) = (_quantise(qp), _quantise(jnp.where(kv, kp, 0)),
                                    _quantise(jnp.where(kv, vp, 0)))
    return _fp8_forward(cfg, qp, kp, vp, sq * sk, sv, q_len, kv_len)[:, :Tq].astype(q.dtype)
  return _gdpa_padded(cfg, qp, kp, vp, q_len, kv_len)[:, :Tq]


def _fp8_forward(cfg, q8, k8, v8, qk_scale, v_scale, q_len, kv_len):
  """fp8 forward: the per-tensor scale of q.k must be applied before the activation, so it is
  passed to the kernel as data (a [1] f32 input) rather than folded into the static config."""
  B, Tk, H, D = k8.shape
  Tq = q8.shape[1]
  nq, nk = Tq // cfg.bq, Tk // cfg.bk

  def kernel(ql_ref, kl_ref, sc_ref, q_ref, k_ref, v_ref, o_ref):
    h, i = pl.program_id(1), pl.program_id(2)
    q_len_, kv_len_ = ql_ref[0], kl_ref[0]
    s_qk = sc_ref[0] * cfg.scale
    rows = i * cfg.bq + jnp.arange(cfg.bq)
    q = q_ref[...]
    lo, hi = _span(i * cfg.bq, cfg.bq, cfg.bk, nk, kv_len_, cfg.window)
    hi = jnp.where(i * cfg.bq < q_len_, hi, lo)

    def body(j, acc):
      cols = j * cfg.bk + jnp.arange(cfg.bk)
      k = k_ref[pl.ds(j * cfg.bk, cfg.bk), :]
      v = v_ref[pl.ds(j * cfg.bk, cfg.bk), :].astype(jnp.bfloat16)
      v = _zero_rows(v, cols < kv_len_)
      s = plgpu.dot(q, k, trans_b=True) * s_qk
      m = _mask(rows, cols, q_len_, kv_len_, cfg.window)
      p = jnp.where(m, activations.in_kernel(_clip(s, cfg.score_clip), cfg.acts, h), 0.0)
      return acc + plgpu.dot(p.astype(jnp.bfloat16), v)

    acc = lax.fori_loop(lo, hi, body, jnp.zeros((cfg.bq, D), _F32))
    o_ref[...] = (acc * cfg.out_scale).astype(o_ref.dtype)

  out = _poison.pallas_call(
      kernel, (q_len, kv_len, jnp.reshape(qk_scale, (1,)).astype(_F32), q8, k8, v8),
      out_shape=jax.ShapeDtypeStruct((B, Tq, H, D), jnp.float32), grid=(B, H, nq),
      in_specs=[_len_spec(), _len_spec(), pl.BlockSpec((1,), lambda b, h, i: (0,)),
                _row_spec(cfg.bq, D, cfg.broadcast_q), _full_spec(Tk, D), _full_spec(Tk, D)],
      out_specs=_row_spec(cfg.bq, D), interpret=cfg.interpret, name="gdpa_fwd_fp8",
      compiler_params=cfg.params())
  return out * v_scale
