"""The packed softmax attention with its input side, whose backward is one kernel (issue 38):
``rms_norm(x) -> q / k / v -> QK-norm -> rotary -> jagged softmax attention``.

``x [N, d]``, ``w [d, 3, H, D]``, the QK-norm scales ``[D]``, the angles' inputs (``tau,
positions f32[N]``, ``omega f32[D/2]``: ``pallas_kernels.norm_qkv``) and a ``Jagged`` -> ``o [N,
H, D]`` in ``dtype`` (with ``valid f32[N]``: ``(o, x)``, ``x`` passed through for the residual,
its cotangent masked by ``valid``).

``qkv_attention_xla`` is the twin: ``norm_qkv.norm_qkv_xla`` then
``jagged.jagged_softmax_attention``. ``qkv_attention_pallas``: the forward is the two kernels it
composes (``norm_qkv``'s, then ``jagged_pallas``'s flash attention); the backward is one kernel
where those two took one each. A program takes a tile of token rows through every head: the
tile's dq as queries over their key tiles and its dk / dv as keys over the query tiles that see
them (the pairs are symmetric, ``jagged_pallas.key_ranges``), then, while they are in
registers, the QK-norm and rotary backward from the projections it recomputes from ``x``, and
``dx`` summed over the heads. dq, dk and dv are never written: the kernel writes ``dx``, the
rotated projections' pre-norm cotangents ``dy_q, dy_k``, v's cotangent and each row's RMS factor
for ``pallas_kernels.wgrad``'s weight GEMM, and the scales' per-program partials for
``pallas_kernels.partials``. Each value is rounded to ``dtype`` where the two kernels' interface
rounded it, so the results are theirs (the two kernels' helpers are shared, not copied).
Triton on GPU, ``interpret=True`` on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _poison, jagged, jagged_pallas, norm_qkv, tuning, wgrad
from pallas_kernels._common import load_vec, round_to, store_vec
from pallas_kernels.jagged_pallas import _dot, _own, _partners, _row_stat
from pallas_kernels.norm_qkv import _cos_sin, _head_bwd, _put, _tile
from pallas_kernels.partials import Piece, sum_split_pallas

F32 = jnp.float32
EPS = norm_qkv.EPS
KV_TILE = 64         # partner rows per inner step (the attention kernels' block_k)
FWD_TILE = 64        # query rows per program of the attention's forward kernel (its block_q)
COLS = 128           # columns of x (rows of w) per step of the input side's GEMMs
WARPS = 8
# Token rows per program, and the widest d the backward takes. ptxas (deviceless H200, 8 warps)
# spills nothing at 16 rows and d 128 / 256 (mid's towers, 250-255 registers); 32 rows spill 0.8
# to 1.5 KB per thread there (the [rows, d] float32 dx sum lives through the head loop beside the
# attention's tiles). At d 512 (prod, D 128) 16 rows still spill: about 1 KB of stores a thread
# with x and w whole, 0.56 KB in 128-column chunks (COLS), 0.44 KB in 64; 32 key rows a step and
# one pipeline stage no better, 4 warps worse. At d 256 in 2 heads of 128 (prod's impression
# tower) about 50 bytes (30 in 64-column chunks or 32 key rows a step). Wider towers and heads
# keep norm_qkv's and the attention's backward kernels.
ROWS = 16
MAX_WIDTH, MAX_HEAD_DIM = 256, 64


# ----------------------------------------------------------------------------------- twin

@jax.custom_vjp
def _masked_pass(x, valid):
  return x


def _masked_pass_fwd(x, valid):
  return x, valid


def _masked_pass_bwd(valid, g):
  return (g * valid[:, None].astype(g.dtype)).astype(g.dtype), jnp.zeros_like(valid)


_masked_pass.defvjp(_masked_pass_fwd, _masked_pass_bwd)


def qkv_attention_xla(x, w, q_scale, k_scale, tau, positions, omega, jag, *, window=None,
                      scale=None, eps: float = EPS, dtype=jnp.bfloat16, valid=None):
  """The twin (module docstring): the formulas of the two ops, differentiated by autodiff."""
  q, k, v = norm_qkv.norm_qkv_xla(x, w, q_scale, k_scale, tau, positions, omega, eps=eps,
                                  dtype=dtype)
  o = jagged.jagged_softmax_attention(q, k, v, jag, window=window, scale=scale)
  return o if valid is None else (o, _masked_pass(x, jnp.asarray(valid, F32)))


# ----------------------------------------------------------------------------------- kernel

def _half(ref, start, n, head, half, valid):
  """``ref[start:start + n, head, half]`` of a ``[N, H, D]`` ref: ``[n, D/2]``, zero where
  ``valid`` is False (and past N)."""
  hd = ref.shape[-1] // 2
  return plgpu.load(ref.at[pl.ds(start, n), head, pl.ds(half * hd, hd)],
                    mask=jnp.broadcast_to(valid[:, None], (n, hd)), other=0.0)


def _halves_of(refs, start, n, head, valid):
  """Both halves of each ref's rows: ``(a1, a2, b1, b2, ...)``."""
  return tuple(_half(r, start, n, head, s, valid) for r in refs for s in (0, 1))


def _delta(do1, do2, o1, o2):
  """``rowsum(dO * O)`` of a row tile (float32)."""
  f = lambda a: a.astype(F32)
  return jnp.sum(f(do1) * f(o1), axis=1) + jnp.sum(f(do2) * f(o2), axis=1)


def _bwd_kernel(lo_ref, hi_ref, seg_ref, x_ref, w_ref, qs_ref, ks_ref, tau_ref, pos_ref, om_ref,
                q_ref, k_ref, v_ref, o_ref, do_ref, lse_ref, *refs, acfg, ncfg, B):
  if ncfg.res:
    (gr_ref, valid_ref), refs = refs[:2], refs[2:]
  dx_ref, dyq_ref, dyk_ref, dv_ref, r_ref, ds_ref = refs
  T, H, D, dt = acfg.tile, ncfg.heads, ncfg.head_dim, ncfg.dtype
  hd, sc = D // 2, acfg.scale
  d = x_ref.shape[1]
  C = min(d, COLS)
  cols = [pl.ds(c * C, C) for c in range(d // C)]      # x, dx and w's rows in column chunks
  r0, rows, seg = _own(seg_ref, acfg, B)
  xc = lambda c: _tile(x_ref, r0, T, (c,)).astype(F32)
  real = seg < B
  r = lax.rsqrt(sum(jnp.sum(xc(c) ** 2, axis=1, keepdims=True) for c in cols) / d + ncfg.eps)
  store_vec(r_ref, r0, jnp.sum(r, axis=1))           # for the weight GEMM (h = r x where it reads)
  tau, pos = load_vec(tau_ref, r0, T), load_vec(pos_ref, r0, T)
  omega = plgpu.load(om_ref.at[:])
  lo, hi = pl.ds(0, hd), pl.ds(hd, hd)
  scales = tuple(plgpu.load(s.at[h]) for s in (qs_ref, ks_ref) for h in (lo, hi))
  # w [d, 3 H D]: projection p's head j, half s, rows of chunk c
  wc = lambda p, j, s, c: plgpu.load(w_ref.at[c, pl.ds((p * H + j) * D + s * hd, hd)])
  ndot = lambda a, b, **kw: norm_qkv._dot(a, b, ncfg, **kw)
  dot2 = lambda a1, a2, b1, b2: (_dot(a1, b1, trans_b=True) + _dot(a2, b2, trans_b=True))

  def back(dh, g, p, j, s):
    """``dh`` (chunks) plus the cotangent ``g [T, D/2]`` of half ``s`` through ``w``."""
    g = g.astype(dt)
    return tuple(a + ndot(g, wc(p, j, s, c), trans_b=True) for a, c in zip(dh, cols, strict=True))

  def head(j, carry):
    dh, parts = carry
    # --- attention: the tile's rows as queries (dq), then as keys (dk, dv); D in two halves
    q1, q2, o1, o2, do1, do2 = _halves_of((q_ref, o_ref, do_ref), r0, T, j, real)
    lse, delta = _row_stat(lse_ref, j, r0, T), _delta(do1, do2, o1, o2)

    def dq_step(start, inside, keep, acc):       # dS = P (dO V^T - delta), P = exp(s - lse)
      k1, k2, v1, v2 = _halves_of((k_ref, v_ref), start, acfg.kv_tile, j, inside)
      p = jnp.where(keep, jnp.exp(dot2(q1, q2, k1, k2) * sc - lse[:, None]), 0.0)
      ds = p * (dot2(do1, do2, v1, v2) - delta[:, None])
      return acc[0] + _dot(ds, k1), acc[1] + _dot(ds, k2)

    zeros = jnp.zeros((T, hd), F32)
    dq = _partners(lo_ref, hi_ref, seg_ref, rows, seg, acfg, dq_step, (zeros, zeros))
    k1, k2, v1, v2 = _halves_of((k_ref, v_ref), r0, T, j, real)

    def kv_step(start, inside, keep_t, acc):
      qq1, qq2, oo1, oo2, dd1, dd2 = _halves_of((q_ref, o_ref, do_ref), start, acfg.kv_tile, j,
                                                inside)
      lse_t = _row_stat(lse_ref, j, start, acfg.kv_tile)
      p_t = jnp.where(keep_t, jnp.exp(dot2(k1, k2, qq1, qq2) * sc - lse_t[None, :]), 0.0)
      ds_t = p_t * (dot2(v1, v2, dd1, dd2) - _delta(dd1, dd2, oo1, oo2)[None, :])
      return (acc[0] + _dot(ds_t, qq1), acc[1] + _dot(ds_t, qq2), acc[2] + _dot(p_t, dd1),
              acc[3] + _dot(p_t, dd2))

    dk1, dk2, dv1, dv2 = _partners(lo_ref, hi_ref, seg_ref, rows, seg, acfg, kv_step,
                                   (zeros,) * 4)
    # the attention kernel's outputs were rounded to dtype (q.dtype); so are these
    g = {0: (round_to(dq[0] * sc, dt), round_to(dq[1] * sc, dt)),
         1: (round_to(dk1 * sc, dt), round_to(dk2 * sc, dt))}
    # --- the input side's backward for the head (norm_qkv's backward kernel, per head), x and
    # the weights in column chunks; h = r x reloaded: not live through the attention's loops
    h = [(xc(c) * r).astype(dt) for c in cols]
    angles = _cos_sin(tau, pos, omega, j, ncfg)
    new = []
    for p, out in ((0, dyq_ref), (1, dyk_ref)):
      y1, y2 = (round_to(sum(ndot(a, wc(p, j, s, c)) for a, c in zip(h, cols, strict=True)), dt)
                for s in (0, 1))
      dy1, dy2, sums = _head_bwd(y1, y2, lambda p=p: g[p], scales[2 * p], scales[2 * p + 1],
                                 lambda: angles, ncfg)
      _put(out, r0, dy1, (j, lo))
      _put(out, r0, dy2, (j, hi))
      dh = back(back(dh, dy1, p, j, 0), dy2, p, j, 1)
      new += [a + e for a, e in zip(parts[2 * p:2 * p + 2], sums(), strict=True)]
    gv1, gv2 = round_to(dv1, dt), round_to(dv2, dt)
    _put(dv_ref, r0, gv1, (j, lo))
    _put(dv_ref, r0, gv2, (j, hi))
    return back(back(dh, gv1, 2, j, 0), gv2, 2, j, 1), tuple(new)

  zero = jnp.zeros((hd,), F32)
  dh0 = tuple(jnp.zeros((T, C), F32) for _ in cols)
  dh, parts = lax.fori_loop(0, H, head, (dh0, (zero,) * 4))
  dh = [round_to(a, dt) for a in dh]
  hn = [xc(c) * r for c in cols]
  m = sum(jnp.sum(a * b, axis=1, keepdims=True) for a, b in zip(dh, hn, strict=True)) / d
  if ncfg.res:
    keep = load_vec(valid_ref, r0, T)[:, None]
  for a, b, c in zip(dh, hn, cols, strict=True):
    dx = r * (a - b * m)
    if ncfg.res:          # the residual's cotangent, masked to the real rows
      dx = dx + keep * _tile(gr_ref, r0, T, (c,)).astype(F32)
    _put(dx_ref, r0, dx, (c,))
  i = pl.program_id(0)
  for p in range(2):
    plgpu.store(ds_ref.at[i, jnp.int32(p), lo], parts[2 * p])
    plgpu.store(ds_ref.at[i, jnp.int32(p), hi], parts[2 * p + 1])


def _smem(rows, d, D, itemsize) -> tuple[int, int]:
  """(resident, streamed) shared memory of a program: the tile's q, O, dO (then k, v) and its
  ``[rows, d]`` x tile with a head's two ``[d, D/2]`` weight halves; per stage, partner rows
  of q, O, dO (or k, v), their segment ids and log-sum-exp."""
  r = D * itemsize
  return (3 * rows * r + norm_qkv._smem(rows, d, D, itemsize), KV_TILE * (3 * r + 8))


def _stages(rows, d, D, itemsize) -> int:
  return tuning.fit_smem(lambda _: _smem(rows, d, D, itemsize), None,
                         what="qkv_attention_bwd")[1]


def supported(d: int, heads: int, head_dim: int, dtype=jnp.bfloat16) -> bool:
  """Whether the kernels take these widths: ``norm_qkv``'s up to ``MAX_WIDTH`` and
  ``MAX_HEAD_DIM``, the fused backward's tiles within the GPU's shared memory at one stage
  (``tuning.smem_limit``); callers fall back to the two ops."""
  if d > MAX_WIDTH or head_dim > MAX_HEAD_DIM or not norm_qkv.supported(d, heads, head_dim,
                                                                         dtype):
    return False
  need = _smem(ROWS, d, head_dim, jnp.dtype(dtype).itemsize)
  return tuning.smem_estimate(*need, 1, 1) <= tuning.smem_limit()


# ----------------------------------------------------------------------------------- op

def _cfgs(x, w, window, scale, eps, dtype, interpret, rows, res=False):
  N, d, H, D, P = norm_qkv._check(x, w, 3)
  ncfg = norm_qkv._Cfg(H, D, eps, dtype, rows, interpret, P, 2, res=res)
  acfg = jagged_pallas._Cfg(None, D ** -0.5 if scale is None else scale, 1.0, rows, KV_TILE,
                            interpret, window=window)
  return ncfg, acfg, (N, d, H, D)


def _forward(x, w, sc, tau, pos, omega, jag, window, scale, eps, dtype, interpret):
  """``(q, k, v, o, lse)`` from the two forward kernels."""
  ncfg, acfg, shape = _cfgs(x, w, window, scale, eps, dtype, interpret,
                            norm_qkv._rows(norm_qkv.FWD_ROWS, x.shape[1]))
  ops = norm_qkv._operands(norm_qkv._weights(w, dtype, x.shape[1]), sc, tau, pos, omega)
  q, k, v = norm_qkv._fwd(x, ops, ncfg, shape)
  o, lse = jagged_pallas._softmax_fwd(acfg._replace(tile=FWD_TILE), q, k, v, jag)
  return q, k, v, o, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11, 12))
def _op(x, w, sc, tau, pos, omega, valid, jag, window, scale, eps, dtype, interpret):
  o = _forward(x, w, sc, tau, pos, omega, jag, window, scale, eps, dtype, interpret)[3]
  return o if valid is None else (o, x)


def _op_fwd(x, w, sc, tau, pos, omega, valid, jag, window, scale, eps, dtype, interpret):
  q, k, v, o, lse = _forward(x, w, sc, tau, pos, omega, jag, window, scale, eps, dtype, interpret)
  return (o if valid is None else (o, x)), (x, w, sc, tau, pos, omega, valid, jag, q, k, v, o, lse)


def _op_bwd(window, scale, eps, dtype, interpret, res, g):
  x, w, sc, tau, pos, omega, valid, jag, q, k, v, o, lse = res
  d = x.shape[1]
  ncfg, acfg, (N, _, H, D) = _cfgs(x, w, window, scale, eps, dtype, interpret, ROWS,
                                   res=valid is not None)
  do = (g if valid is None else g[0]).astype(q.dtype)
  extra = () if valid is None else (g[1], valid)
  lo, hi = jagged_pallas.key_ranges(jag, ROWS, window)
  nt = lo.shape[0]
  outs = (jax.ShapeDtypeStruct((N, d), x.dtype),
          *(jax.ShapeDtypeStruct((N, H, D), dtype),) * 3,
          jax.ShapeDtypeStruct((N,), F32), jax.ShapeDtypeStruct((nt, 2, D), F32))
  ops = (jag.seg, x, *norm_qkv._weights(w, dtype, d), *sc, tau, pos, omega, q, k, v, o, do, lse,
         *extra)
  spec = pl.BlockSpec((1,), lambda i: (i,))
  whole = pl.no_block_spec
  dx, dyq, dyk, dv, r, ds = _poison.pallas_call(
      functools.partial(_bwd_kernel, acfg=acfg, ncfg=ncfg, B=jag.batch), (lo, hi, *ops),
      out_shape=outs, grid=(nt,), in_specs=[spec, spec] + [whole] * len(ops),
      out_specs=(whole,) * len(outs), interpret=interpret, name="qkv_attention_bwd",
      compiler_params=plgpu.CompilerParams(
          num_warps=WARPS, num_stages=_stages(ROWS, d, D, jnp.dtype(dtype).itemsize)))
  # dw_p = h^T dy_p, h = r x taken where the weight GEMM reads x (as norm_qkv's backward)
  dw = wgrad.row_scaled_wgrad_pallas(x, r, [a.reshape(N, H * D) for a in (dyq, dyk, dv)],
                                     dtype=dtype, interpret=interpret, joined=True)
  dw = dw.reshape(d, 3, H, D).astype(dtype).astype(w.dtype)
  dsc = sum_split_pallas(ds, [Piece((p, p + 1), (0, D), s.dtype) for p, s in enumerate(sc)],
                         interpret=interpret, name="qkv_attention_scale_sums")
  z = lambda a: None if a is None else jnp.zeros_like(a)
  return (dx, dw, tuple(a.reshape(-1) for a in dsc), z(tau), z(pos), z(omega), z(valid),
          jax.tree.map(lambda _: None, jag))


_op.defvjp(_op_fwd, _op_bwd)


def qkv_attention_pallas(x, w, q_scale, k_scale, tau, positions, omega, jag, *, window=None,
                         scale=None, eps: float = EPS, dtype=jnp.bfloat16,
                         interpret: bool = False, valid=None):
  """``qkv_attention_xla``'s values and gradients from the Pallas kernels (module docstring).
  ``valid f32[N]``: the outputs are ``(o, x)``, ``x`` passed through; the backward kernel adds
  its cotangent, masked by ``valid``, to ``dx``."""
  N, d, H, D, _ = norm_qkv._check(x, w, 3)
  jagged.check_tokens(jag, x[:, None, :])
  if window is not None and window < 0:
    raise ValueError(f"window must be >= 0, got {window}")
  if not supported(d, H, D, dtype):
    raise ValueError(f"qkv_attention: no kernel tiles width {d} in {H} heads of {D} "
                     f"({jnp.dtype(dtype).name}; see qkv_attention.supported)")
  tau, pos, omega = (jnp.asarray(a, F32) for a in (tau, positions, omega))
  sc = (jnp.asarray(q_scale, F32), jnp.asarray(k_scale, F32))
  valid = None if valid is None else jnp.asarray(valid, F32)
  if valid is not None and valid.shape != (N,):
    raise ValueError(f"qkv_attention: valid {valid.shape} must be [N] with N = {N}")
  return _op(x, w, sc, tau, pos, omega, valid, jag, None if window is None else int(window),
             None if scale is None else float(scale), float(eps), jnp.dtype(dtype),
             bool(interpret))
