"""The attention's input side as one pass over packed tokens (issue 38): RMSNorm -> q / k / v
projection -> QK-norm -> rotary, a GEMM with a prologue and an epilogue.

``x [N, d]``, ``w [d, 3, H, D]`` -> ``q, k, v [N, H, D]`` in ``dtype``, per token:
``h = rms_norm(x)``, ``y_p = h w[:, p]``, ``v = y_v``; for ``p`` in q, k:
``rotary(rms_norm_D(y_p) * scale_p)``, heads ``[0, ceil(H/2))`` rotated by ``tau * omega``, the
rest by ``positions * omega`` (``tau, positions f32[N]``, ``omega f32[D/2]``: the model's
``kunlun.nn.time_encoding.rotary_inputs``), the angles laid over the whole head (``[a, a]``).
Each step is rounded to ``dtype`` where the model's XLA path rounds it
(``kunlun.nn.attention.SeqAttention``).

``norm_qkv_xla`` is the twin: the formulas, differentiated by autodiff. ``norm_qkv_pallas`` runs
a forward kernel (reads ``x``, writes q, k, v) and a backward kernel (reads ``x`` and the three
cotangents, recomputes the projections, writes ``dx``, the rotated projections' pre-norm
cotangents ``dy_q, dy_k [N, H, D]`` and each row's RMS factor ``r f32[N]``);
``pallas_kernels.wgrad`` computes ``dw_p = h^T dy_p`` with ``h = r x`` taken where it reads
``x`` (v's cotangent as it comes). ``norm_proj_pallas``: the same, nothing normalised or rotated
(HSP's keys and values). Triton on GPU, ``interpret=True`` on CPU. Rows of zeros (a packed
block's tail) map to zeros.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _poison, tuning, wgrad
from pallas_kernels._common import is_tile, load_vec, precision, round_to, store_vec
from pallas_kernels.partials import Piece, sum_split_pallas
from pallas_kernels.reference import layer_norm_project, layer_norm_stats

F32 = jnp.float32
EPS = 1e-6
WARPS = 8
# Token rows per program, by width d: the most at which ptxas (deviceless H200 compile, 8 warps)
# spills no or few registers at mid's and prod's widths (the backward holds a [rows, d] float32
# sum). Every program reads all of w (from L2): fewer rows, more of those reads.
FWD_ROWS = {128: 64, 256: 64, 512: 16}
BWD_ROWS = {128: 64, 256: 32, 512: 16}


# ----------------------------------------------------------------------------------- twin

def norm_qkv_xla(x, w, q_scale, k_scale, tau, positions, omega, *, eps: float = EPS,
                 dtype=jnp.bfloat16):
  """The twin: ``(q, k, v) [N, H, D]`` in ``dtype`` (module docstring)."""
  _, _, H, D = w.shape
  tau, pos, omega = (jnp.asarray(a, F32) for a in (tau, positions, omega))
  xf = x.astype(F32)
  h = (xf * lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + eps)).astype(dtype)
  wd = w.astype(dtype)
  proj = [jnp.einsum("nd,dhc->nhc", h, wd[:, p]) for p in range(3)]
  n_time = (H + 1) // 2
  a = jnp.where(jnp.arange(H)[None, :] < n_time, tau[:, None], pos[:, None])[..., None] * omega
  a = jnp.concatenate([a, a], -1)                                       # [N, H, D]

  def prep(y, s):
    y = y.astype(F32)
    n = (y * lax.rsqrt(jnp.mean(y * y, -1, keepdims=True) + eps) * s).astype(dtype).astype(F32)
    n1, n2 = jnp.split(n, 2, -1)
    return (n * jnp.cos(a) + jnp.concatenate([-n2, n1], -1) * jnp.sin(a)).astype(dtype)

  return prep(proj[0], q_scale), prep(proj[1], k_scale), proj[2]


# ----------------------------------------------------------------------------------- kernels

class _Cfg(NamedTuple):
  heads: int
  head_dim: int
  eps: float
  dtype: object
  rows: int
  interpret: bool
  proj: int = 3          # projections P
  rot: int = 2           # the first ``rot`` of them QK-normalised and rotated
  res: bool = False      # x passed through; the backward adds its masked cotangent to dx
  split: bool = False    # the weights as P operands [d, H D] (else one [d, P H D])
  ln_eps: float | None = None   # two more cotangents of x's pass-throughs (_add_through)


def _refs(refs, cfg: _Cfg):
  """A kernel's operands after ``x``: ``(w_refs, sc_refs, tau, pos, omega, rest)``: the weights
  (one, or P with ``split``), then, where projections are rotated, one scale ``[D]`` per rotated
  projection and the angles' inputs (absent without rotation)."""
  nw = cfg.proj if cfg.split else 1
  w_refs, refs = refs[:nw], refs[nw:]
  if not cfg.rot:
    return w_refs, (), None, None, None, refs
  sc_refs, (tau, pos, om), rest = refs[:cfg.rot], refs[cfg.rot:cfg.rot + 3], refs[cfg.rot + 3:]
  return w_refs, sc_refs, tau, pos, om, rest


def _tile(ref, r0, rows, idx=()):
  """``ref[r0:r0 + rows, *idx]`` as ``[rows, c]`` (``idx``: indices of the other axes, the last a
  slice), zero past the ref's rows."""
  idx = tuple(jnp.int32(i) if isinstance(i, int) else i for i in idx)
  c = ref.shape[-1] if not idx or isinstance(idx[-1], slice) else idx[-1].size
  ok = jnp.broadcast_to(((r0 + jnp.arange(rows)) < ref.shape[0])[:, None], (rows, c))
  return plgpu.load(ref.at[(pl.ds(r0, rows),) + (idx or (slice(None),))], mask=ok, other=0.0)


def _put(ref, r0, x, idx=()):
  """Stores ``x [rows, c]`` at rows ``r0 + [0, rows)`` of ``ref[:, *idx]`` (rows past its end
  dropped)."""
  rows, c = x.shape
  ok = jnp.broadcast_to(((r0 + jnp.arange(rows)) < ref.shape[0])[:, None], (rows, c))
  idx = tuple(jnp.int32(i) if isinstance(i, int) else i for i in idx)
  plgpu.store(ref.at[(pl.ds(r0, rows),) + idx], x.astype(ref.dtype), mask=ok)


def _w(w_refs, p, j, half, cfg: _Cfg):
  """``w[:, p, j, half]`` of the weights (``[d, P H D]``, or P ``[d, H D]``): ``[d, D/2]``."""
  D, hd = cfg.head_dim, cfg.head_dim // 2
  if cfg.split:
    return plgpu.load(w_refs[p].at[:, pl.ds(j * D + half * hd, hd)])
  return plgpu.load(w_refs[0].at[:, pl.ds((p * cfg.heads + j) * D + half * hd, hd)])


def _norm_rows(xf, eps):
  return lax.rsqrt(jnp.mean(xf * xf, axis=1, keepdims=True) + eps)


def _cos_sin(tau, pos, omega, j, cfg: _Cfg):
  """``cos, sin [rows, D/2]`` of head ``j``'s angles."""
  t = jnp.where(j < (cfg.heads + 1) // 2, tau, pos)
  a = t[:, None] * omega[None, :]
  return jnp.cos(a), jnp.sin(a)


def _dot(a, b, cfg: _Cfg, **kw):
  """``a b`` (``trans_b``) accumulated in float32 (interpret mode: float32 operands, as XLA:CPU
  has no 16-bit dot into float32; the products of 16-bit values are exact in float32)."""
  if cfg.interpret:
    a, b = a.astype(F32), b.astype(F32)
  return plgpu.dot(a, b, precision=precision(a.dtype), **kw)


def _halves(h, w_refs, p, j, cfg: _Cfg):
  """The head's projection ``h w[:, p, j]`` as two ``[rows, D/2]`` halves, rounded to dtype."""
  return tuple(round_to(_dot(h, _w(w_refs, p, j, s, cfg), cfg), cfg.dtype) for s in (0, 1))


def _head_stats(y1, y2, cfg: _Cfg):
  return lax.rsqrt((jnp.sum(y1 * y1, 1, keepdims=True) + jnp.sum(y2 * y2, 1, keepdims=True))
                   / cfg.head_dim + cfg.eps)


def _head_bwd(y1, y2, grads, s1, s2, angles, cfg: _Cfg):
  """One head of a rotated projection, backward: its recomputed projection's halves ``y1, y2``,
  ``grads()`` the cotangents of its rotated halves, the scale's halves and ``angles()`` the
  rotation's ``cos, sin`` -> ``(dy1, dy2, scale_grads)``: the pre-norm cotangents (rounded to
  dtype) and a function giving the scale halves' gradients summed over the rows. The operands
  are loaded, and the sums taken, where the caller calls ``grads``, ``angles`` and
  ``scale_grads``: after the head's norm and after the head's back-projection, the order in which
  ptxas spills least at prod's widths."""
  a = _head_stats(y1, y2, cfg)
  z1, z2 = y1 * a, y2 * a
  g1, g2 = grads()
  c, s = angles()
  dn1, dn2 = round_to(g1 * c + g2 * s, cfg.dtype), round_to(g2 * c - g1 * s, cfg.dtype)
  dz1, dz2 = dn1 * s1[None], dn2 * s2[None]
  m = (jnp.sum(dz1 * z1, 1, keepdims=True) + jnp.sum(dz2 * z2, 1, keepdims=True)) / cfg.head_dim
  dy1, dy2 = round_to(a * (dz1 - z1 * m), cfg.dtype), round_to(a * (dz2 - z2 * m), cfg.dtype)
  return dy1, dy2, lambda: (jnp.sum(dn1 * z1, 0), jnp.sum(dn2 * z2, 0))


def _fwd_kernel(x_ref, *refs, cfg: _Cfg):
  w_refs, sc_refs, tau_ref, pos_ref, om_ref, out_refs = _refs(refs, cfg)
  r0, hd = pl.program_id(0) * cfg.rows, cfg.head_dim // 2
  xf = _tile(x_ref, r0, cfg.rows).astype(F32)
  h = (xf * _norm_rows(xf, cfg.eps)).astype(cfg.dtype)
  if cfg.rot:
    tau, pos = load_vec(tau_ref, r0, cfg.rows), load_vec(pos_ref, r0, cfg.rows)
    omega = plgpu.load(om_ref.at[:])
  lo, hi = pl.ds(0, hd), pl.ds(hd, hd)
  for p, out in enumerate(out_refs[:cfg.rot]):
    s1, s2 = plgpu.load(sc_refs[p].at[lo]), plgpu.load(sc_refs[p].at[hi])

    def head(j, carry, p=p, out=out, s1=s1, s2=s2):
      y1, y2 = _halves(h, w_refs, p, j, cfg)
      a = _head_stats(y1, y2, cfg)
      n1, n2 = round_to(y1 * a * s1[None], cfg.dtype), round_to(y2 * a * s2[None], cfg.dtype)
      c, s = _cos_sin(tau, pos, omega, j, cfg)
      _put(out, r0, n1 * c - n2 * s, (j, lo))
      _put(out, r0, n2 * c + n1 * s, (j, hi))
      return carry

    lax.fori_loop(0, cfg.heads, head, 0)

  for p in range(cfg.rot, cfg.proj):
    def plain(j, carry, p=p):
      y1, y2 = _halves(h, w_refs, p, j, cfg)
      _put(out_refs[p], r0, y1, (j, lo))
      _put(out_refs[p], r0, y2, (j, hi))
      return carry

    lax.fori_loop(0, cfg.heads, plain, 0)


def _bwd_kernel(x_ref, *refs, cfg: _Cfg):
  w_refs, sc_refs, tau_ref, pos_ref, om_ref, refs = _refs(refs, cfg)
  g_refs, refs = refs[:cfg.proj], refs[cfg.proj:]
  if cfg.res:
    (gr_ref, valid_ref), refs = refs[:2], refs[2:]
  if cfg.ln_eps is not None:
    (gl_ref, gi_ref), refs = refs[:2], refs[2:]
  dx_ref, dy_refs, r_ref, ds_ref = refs[0], refs[1:1 + cfg.rot], refs[-2], refs[-1]
  i, hd = pl.program_id(0), cfg.head_dim // 2
  r0 = i * cfg.rows
  xf = _tile(x_ref, r0, cfg.rows).astype(F32)
  r = _norm_rows(xf, cfg.eps)
  # the rows' r, for the weight-gradient kernel (h = r x where it reads x)
  store_vec(r_ref, r0, jnp.sum(r, axis=1))                         # [rows, 1] -> [rows]
  h = (xf * r).astype(cfg.dtype)
  if cfg.rot:
    tau, pos = load_vec(tau_ref, r0, cfg.rows), load_vec(pos_ref, r0, cfg.rows)
    omega = plgpu.load(om_ref.at[:])
  lo, hi = pl.ds(0, hd), pl.ds(hd, hd)
  back = lambda g, p, j, s: _dot(g.astype(cfg.dtype), _w(w_refs, p, j, s, cfg), cfg, trans_b=True)
  dh = jnp.zeros(xf.shape, F32)
  for p, g_ref in enumerate(g_refs[:cfg.rot]):
    s1, s2 = plgpu.load(sc_refs[p].at[lo]), plgpu.load(sc_refs[p].at[hi])

    def head(j, carry, p=p, g_ref=g_ref, s1=s1, s2=s2):
      dh, ds1, ds2 = carry
      y1, y2 = _halves(h, w_refs, p, j, cfg)
      grads = lambda: tuple(_tile(g_ref, r0, cfg.rows, (j, x)).astype(F32) for x in (lo, hi))
      dy1, dy2, sums = _head_bwd(y1, y2, grads, s1, s2,
                                 lambda: _cos_sin(tau, pos, omega, j, cfg), cfg)
      _put(dy_refs[p], r0, dy1, (j, lo))
      _put(dy_refs[p], r0, dy2, (j, hi))
      dh = dh + back(dy1, p, j, 0) + back(dy2, p, j, 1)
      e1, e2 = sums()
      return dh, ds1 + e1, ds2 + e2

    zero = jnp.zeros((hd,), F32)
    dh, ds1, ds2 = lax.fori_loop(0, cfg.heads, head, (dh, zero, zero))
    plgpu.store(ds_ref.at[i, jnp.int32(p), lo], ds1)
    plgpu.store(ds_ref.at[i, jnp.int32(p), hi], ds2)

  for p in range(cfg.rot, cfg.proj):
    def plain(j, dh, p=p):
      g1 = _tile(g_refs[p], r0, cfg.rows, (j, lo)).astype(F32)
      g2 = _tile(g_refs[p], r0, cfg.rows, (j, hi)).astype(F32)
      return dh + back(g1, p, j, 0) + back(g2, p, j, 1)

    dh = lax.fori_loop(0, cfg.heads, plain, dh)
  dh = round_to(dh, cfg.dtype)
  hn = _tile(x_ref, r0, cfg.rows).astype(F32) * r     # reloaded: not live through the loops
  dx = r * (dh - hn * jnp.mean(dh * hn, axis=1, keepdims=True))
  if cfg.res:           # the residual's cotangent, masked to the real rows
    dx = dx + load_vec(valid_ref, r0, cfg.rows)[:, None] * _tile(gr_ref, r0, cfg.rows).astype(F32)
  if cfg.ln_eps is not None:
    dx = _add_through(dx, x_ref, gl_ref, gi_ref, r0, cfg)
  _put(dx_ref, r0, dx)


def _add_through(dx, x_ref, gl_ref, gi_ref, r0, cfg: _Cfg):
  """``dx`` plus the cotangents of x's two pass-throughs (``norm_proj_grads``' ``ln``): the first
  through the LayerNorm's statistics (``reference.ln_through``: ``g - mean(g) - y mean(g y)``,
  ``y`` the rows' LayerNorm, epsilon ``cfg.ln_eps``), the second as it is."""
  dx = dx + _tile(gi_ref, r0, cfg.rows).astype(F32)
  xf, mu, r = layer_norm_stats(_tile(x_ref, r0, cfg.rows), cfg.ln_eps)
  return dx + layer_norm_project((xf - mu) * r, _tile(gl_ref, r0, cfg.rows).astype(F32))


def _rows(table, d):
  return table.get(d, 16)


def _smem(rows, d, D, itemsize) -> int:
  """Shared memory of a program: its ``[rows, d]`` token tile and a head's two ``[d, D/2]``
  weight halves (above the compiled figure at mid's and prod's shapes,
  ``tests/pallas_kernels/test_jagged_smem.py``)."""
  return rows * d * itemsize + 2 * d * (D // 2) * itemsize


def _params(rows, d, D, itemsize):
  _, stages = tuning.fit_smem(lambda _: (_smem(rows, d, D, itemsize), 0), None, stages=1,
                              what="norm_qkv")
  return plgpu.CompilerParams(num_warps=WARPS, num_stages=stages)


def _check(x, w, proj=None):
  """``(N, d, H, D, P)`` of ``x [N, d]`` and the weights: ``w [d, P, H, D]``, or a tuple of P
  ``[d, H, D]`` (one operand per projection)."""
  N, d = x.shape
  if isinstance(w, tuple):            # P operands [d, H, D], checked as the stacked shape
    got = [a.shape for a in w]
    one = got[0] if got and all(s == got[0] for s in got) else ()
    shape = (one[0], len(w), *one[1:]) if len(one) == 3 else ()
  else:
    got = shape = w.shape
  if len(shape) != 4 or shape[0] != d or (proj is not None and shape[1] != proj):
    raise ValueError(f"norm_qkv: w {got} must be [d, {proj or 'P'}, H, D] or {proj or 'P'} x "
                     f"[d, H, D] with d = {d}")
  _, P, H, D = shape
  if not (is_tile(d) and is_tile(D // 2)):
    raise ValueError(f"norm_qkv: the kernels need d and D/2 powers of two >= 16; got d={d}, D={D}")
  return N, d, H, D, P


def _operands(ws, sc, tau, pos, omega):
  """The operands after ``x``, as ``_refs`` reads them."""
  return (*ws, *sc, tau, pos, omega) if sc else tuple(ws)


def _fwd(x, ops, cfg: _Cfg, shape):
  N, d, H, D = shape
  out = jax.ShapeDtypeStruct((N, H, D), cfg.dtype)
  b = jnp.dtype(cfg.dtype).itemsize
  whole = pl.no_block_spec
  return _poison.pallas_call(
      functools.partial(_fwd_kernel, cfg=cfg), (x, *ops),
      out_shape=(out,) * cfg.proj, grid=(pl.cdiv(N, cfg.rows),), in_specs=[whole] * (1 + len(ops)),
      out_specs=(whole,) * cfg.proj, interpret=cfg.interpret, name=f"{_name(cfg)}_fwd",
      compiler_params=_params(cfg.rows, d, D, b))


def _bwd(x, ops, gs, cfg: _Cfg, shape):
  """``gs``: the projections' cotangents, then (``cfg.res``) the residual's and ``valid``, then
  (``cfg.ln_eps``) the two pass-throughs' (``_add_through``)."""
  N, d, H, D = shape
  T = pl.cdiv(N, cfg.rows)
  b = jnp.dtype(cfg.dtype).itemsize
  outs = (jax.ShapeDtypeStruct((N, d), x.dtype),
          *(jax.ShapeDtypeStruct((N, H, D), cfg.dtype),) * cfg.rot,
          jax.ShapeDtypeStruct((N,), F32),
          jax.ShapeDtypeStruct((T, max(cfg.rot, 1), D), F32))
  whole = pl.no_block_spec
  return _poison.pallas_call(
      functools.partial(_bwd_kernel, cfg=cfg), (x, *ops, *gs),
      out_shape=outs, grid=(T,), in_specs=[whole] * (1 + len(ops) + len(gs)),
      out_specs=(whole,) * len(outs), interpret=cfg.interpret, name=f"{_name(cfg)}_bwd",
      compiler_params=_params(cfg.rows, d, D, b))


def _name(cfg: _Cfg) -> str:
  return "norm_qkv" if cfg.rot else "norm_proj"


def _weights(w, dtype, d):
  """The weight operands in ``dtype``: ``[d, P H D]``, or each of a tuple as ``[d, H D]``."""
  return tuple(a.astype(dtype).reshape(d, -1) for a in (w if isinstance(w, tuple) else (w,)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def _fused(x, w, sc, tau, pos, omega, valid, eps, dtype, interpret, rot):
  """The projections; with ``valid`` (not None) also ``x`` itself, whose cotangent the
  backward kernel masks by ``valid`` and adds to ``dx``. ``sc``: the rotated projections'
  scales; ``tau, pos, omega``: None without rotation."""
  N, d, H, D, P = _check(x, w)
  cfg = _Cfg(H, D, eps, dtype, _rows(FWD_ROWS, d), interpret, P, rot,
             split=isinstance(w, tuple))
  outs = _fwd(x, _operands(_weights(w, dtype, d), sc, tau, pos, omega), cfg, (N, d, H, D))
  return outs if valid is None else (*outs, x)


def _vjp_fwd(x, w, sc, tau, pos, omega, valid, eps, dtype, interpret, rot):
  out = _fused(x, w, sc, tau, pos, omega, valid, eps, dtype, interpret, rot)
  return out, (x, w, sc, tau, pos, omega, valid)


def _vjp_bwd(eps, dtype, interpret, rot, res, g, ln=None):
  """``ln``: ``norm_proj_grads``' (two more cotangents of x and an epsilon)."""
  x, w, sc, tau, pos, omega, valid = res
  N, d, H, D, P = _check(x, w)
  split = isinstance(w, tuple)
  cfg = _Cfg(H, D, eps, dtype, _rows(BWD_ROWS, d), interpret, P, rot,
             res=valid is not None, split=split, ln_eps=None if ln is None else float(ln[2]))
  gs = tuple(g[:P]) + (() if valid is None else (g[-1], valid)) + (() if ln is None else
                                                                  tuple(ln[:2]))
  dx, *dys, r, ds = _bwd(x, _operands(_weights(w, dtype, d), sc, tau, pos, omega), gs, cfg,
                         (N, d, H, D))
  # dw_p = h^T dy_p with h = r x (r: the rows' RMS factor) taken where pallas_kernels.wgrad reads
  # x, so no [N, d] h (nor r dy) is written and read back; dy_p: the rotated projections'
  # pre-norm cotangents from the backward kernel, then the others' as they come
  cots = [a.reshape(N, H * D) for a in (*dys, *g[rot:P])]
  dw = wgrad.row_scaled_wgrad_pallas(x, r, cots, dtype=dtype, interpret=interpret, joined=True)
  dw = dw.reshape(d, P, H, D).astype(dtype)                                   # as the twin's
  dw = (tuple(dw[:, p].astype(a.dtype) for p, a in enumerate(w)) if split
        else dw.astype(w.dtype))
  # the scales' per-program partials summed and cut in one launch (XLA: a reduction, a slice each)
  dsc = (sum_split_pallas(ds, [Piece((p, p + 1), (0, D), s.dtype) for p, s in enumerate(sc)],
                          interpret=interpret, name=f"{_name(cfg)}_scale_sums") if sc else ())
  z = lambda a: None if a is None else jnp.zeros_like(a)
  return (dx, dw, tuple(a.reshape(-1) for a in dsc), z(tau), z(pos), z(omega), z(valid))


_fused.defvjp(_vjp_fwd, _vjp_bwd)


def norm_qkv_pallas(x, w, q_scale, k_scale, tau, positions, omega, *, eps: float = EPS,
                    dtype=jnp.bfloat16, interpret: bool = False, valid=None):
  """``norm_qkv_xla``'s values and gradients from the Pallas kernels (module docstring).

  ``valid f32[N]`` (1 for a real row, 0 for a packed block's tail): the outputs are then
  ``(q, k, v, x)``, ``x`` passed through for the residual; the backward kernel adds its
  cotangent, masked by ``valid``, to ``dx`` (no separate pass summing the two)."""
  _check(x, w, 3)
  tau, pos, omega = (jnp.asarray(a, F32) for a in (tau, positions, omega))
  sc = (jnp.asarray(q_scale, F32), jnp.asarray(k_scale, F32))   # two operands: no stacking pass
  valid = None if valid is None else jnp.asarray(valid, F32)
  if valid is not None and valid.shape != x.shape[:1]:
    raise ValueError(f"norm_qkv: valid {valid.shape} must be [N] with N = {x.shape[0]}")
  return _fused(x, w, sc, tau, pos, omega, valid, float(eps), jnp.dtype(dtype), bool(interpret),
                2)


def norm_proj_xla(x, w, *, eps: float = EPS, dtype=jnp.bfloat16):
  """The twin of ``norm_proj_pallas``: ``rms_norm(x) w_p`` for each of the P projections (``w
  [d, P, H, D]``, or a tuple of P ``[d, H, D]``; HSP's keys and values), each ``[N, H, D]`` in
  ``dtype``."""
  xf = x.astype(F32)
  h = (xf * lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + eps)).astype(dtype)
  ws = w if isinstance(w, tuple) else tuple(w[:, p] for p in range(w.shape[1]))
  return tuple(jnp.einsum("nd,dhc->nhc", h, a.astype(dtype)) for a in ws)


def norm_proj_pallas(x, w, *, eps: float = EPS, dtype=jnp.bfloat16, interpret: bool = False):
  """``norm_proj_xla``'s values and gradients from the same kernels, no projection normalised
  or rotated (no scale or angle operands). A tuple ``w`` is read as P operands (no stacking
  pass); its gradients come back per operand."""
  _check(x, w)
  return _fused(x, w, (), None, None, None, None, float(eps), jnp.dtype(dtype), bool(interpret),
                0)


def norm_proj_grads(x, w, gs, *, eps: float = EPS, dtype=jnp.bfloat16, interpret: bool = False,
                    ln=None):
  """``(dx, dw)`` of ``norm_proj_pallas(x, w)`` for the outputs' cotangents ``gs`` (one per
  projection), from its backward kernel and weight GEMM: for a kernel that computes the
  projections itself (``jagged_pallas.jagged_gdpa_pool_proj_pallas``). ``ln = (g_ln, g_id,
  ln_eps)``: the cotangents ``[N, d]`` of two pass-throughs of x, ``reference.ln_through(x,
  ln_eps)``'s and x's own, which the kernel adds to dx where it reads x's rows."""
  _check(x, w)
  if ln is not None and any(a.shape != x.shape for a in ln[:2]):
    raise ValueError(f"norm_proj_grads: ln's cotangents {[a.shape for a in ln[:2]]} must be x's "
                     f"{x.shape}")
  dx, dw, *_ = _vjp_bwd(float(eps), jnp.dtype(dtype), bool(interpret), 0,
                        (x, w, (), None, None, None, None), tuple(gs), ln)
  return dx, dw


def supported(d: int, heads: int, head_dim: int, dtype=jnp.bfloat16) -> bool:
  """Whether the kernels take these widths: ``d`` and ``head_dim / 2`` powers of two >= 16 whose
  tiles fit the GPU's shared memory (``tuning.smem_limit``; the callers fall back to XLA)."""
  if heads < 1 or head_dim % 2 or not (is_tile(d) and is_tile(head_dim // 2)):
    return False
  b = jnp.dtype(dtype).itemsize
  return all(_smem(_rows(t, d), d, head_dim, b) <= tuning.smem_limit()
             for t in (FWD_ROWS, BWD_ROWS))
