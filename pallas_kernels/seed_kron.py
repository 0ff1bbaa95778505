"""HSP's seed side as one pass each way (issue 38): ``t = Z^T RMSNorm(a + e)`` per example.

``a [B, S, d]`` (the seeds' pooled values through the output projection), ``e f32[S, d]`` (the
learned seeds), ``z [R, S, M]`` (``SumKronLinear``'s ``Z`` in its own layout: rank, seeds,
summaries) -> ``t [B, M, R d]`` in ``dtype`` with ``t[b, m, r d + j] = sum_s z[r, s, m] h[b, s,
j]`` (the layout ``SumKronLinear``'s second product reads): ``h = RMSNorm(a + e)`` in float32
rounded to ``dtype`` (``kunlun.nn.fused.add_rms_norm``), ``z`` rounded to ``dtype``, the products
accumulated in float32.

``seed_kron_xla`` is the twin: the formula, differentiated by autodiff.
``seed_kron_pallas`` runs a forward kernel (reads ``a``, writes ``t``; XLA writes ``h`` and its
statistics and reads them back, three launches and a GEMM) and a backward kernel (reads ``a``
and ``dt``, recomputes ``h``, writes ``da`` and per-program partial sums of ``z``'s gradient;
``e``'s gradient is ``da`` summed over the examples: by XLA, or, in the wide kernels (below),
from per-program partial sums the kernel writes, so that XLA reads those instead of all of
``da``). ``z`` and its gradient stay in the parameter's layout: no transpose of either around
the kernels. A program takes ``EXAMPLES`` examples (the wide backward ``bwd_examples(B)``),
``ROWS`` seeds at a time; ``M`` is padded to a power of two (masked) inside them.
Triton on GPU, ``interpret=True`` on CPU.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _poison
from pallas_kernels._common import (
  MIN_PROGRAMS,
  dot,
  examples_per_program,
  is_tile,
  load_rows,
  pow2,
  round_to,
  store_rows,
)

F32 = jnp.float32
WARPS = 8
EXAMPLES = 2          # examples per program
ROWS = 16             # seeds per step (a row's norm needs only its own row)
MAX_ACC = 64 * 256    # K x d (K = R x M padded): the forward's float32 accumulator
MAX_WIDE_K = 256      # K past MAX_ACC // d: the backward's [ROWS, K] accumulator, DC >= 64


# ----------------------------------------------------------------------------------- twin

def seed_kron_xla(a, e, z, *, eps: float, dtype=jnp.bfloat16):
  """The twin: ``t [B, M, R d]`` in ``dtype`` (module docstring)."""
  t = a.astype(F32) + e.astype(F32)
  h = (t * lax.rsqrt(jnp.mean(t * t, -1, keepdims=True) + eps)).astype(dtype)
  R, _, M = z.shape
  t = jnp.einsum("rsm,bsd->bmrd", z.astype(dtype), h, preferred_element_type=F32)
  return t.reshape(a.shape[0], M, R * a.shape[2]).astype(dtype)


# ----------------------------------------------------------------------------------- kernels

class _Cfg(NamedTuple):
  B: int
  S: int
  R: int
  M: int
  d: int
  eps: float
  dtype: object
  interpret: bool

  @property
  def Mp(self) -> int:       # M padded to a power of two
    return pow2(self.M)

  @property
  def K(self) -> int:        # the kernels' contraction width: (rank, padded summary)
    return self.R * self.Mp


def _norm(a_ref, e_ref, b, s0, cfg: _Cfg):
  """Seeds ``s0 .. s0 + ROWS`` of example ``b``: ``(z, r)`` with ``z = t r`` the float32 norm of
  ``t = a + e`` and ``r = rsqrt(mean(t^2) + eps)`` (zero rows for an example past B)."""
  t = (load_rows(a_ref, b * cfg.S + s0, ROWS).astype(F32)
       + load_rows(e_ref, s0, ROWS).astype(F32))
  r = lax.rsqrt(jnp.mean(t * t, axis=1, keepdims=True) + cfg.eps)
  return t * r, r


def _z(z_ref, s0, cfg: _Cfg):
  """``z[:, s0:s0 + ROWS, :]`` of ``z_ref [R, S, M]`` as ``[ROWS, R Mp]``, columns in ``(r, m)``
  order, zero past M."""
  ok = jnp.arange(cfg.Mp) < cfg.M
  z = plgpu.load(z_ref.at[pl.ds(0, cfg.R), pl.ds(s0, ROWS), pl.ds(0, cfg.Mp)],
                 mask=jnp.broadcast_to(ok[None, None, :], (cfg.R, ROWS, cfg.Mp)), other=0.0)
  return jnp.transpose(z, (1, 0, 2)).reshape(ROWS, cfg.R * cfg.Mp)


def _summaries(cfg: _Cfg, b, width=None):
  """Example ``b``'s summary rows of a ``[B M, R, d]`` ref: ``(row0, mask [Mp, R, width or d])``
  (padding rows and rows past B off)."""
  m = jnp.arange(cfg.Mp)
  ok = (m < cfg.M) & (b * cfg.M + m < cfg.B * cfg.M)
  return b * cfg.M, jnp.broadcast_to(ok[:, None, None], (cfg.Mp, cfg.R, width or cfg.d))


def _fwd_kernel(a_ref, e_ref, z_ref, t_ref, *, cfg: _Cfg):
  zs = [_z(z_ref, s0, cfg) for s0 in range(0, cfg.S, ROWS)]
  p = pl.program_id(0)

  def one(i, carry):
    b = p * EXAMPLES + i
    acc = jnp.zeros((cfg.K, cfg.d), F32)                            # rows in (r, m) order
    for c, s0 in enumerate(range(0, cfg.S, ROWS)):
      h = _norm(a_ref, e_ref, b, s0, cfg)[0]
      acc += dot(zs[c], h, cfg, trans_a=True)                    # [K, ROWS] [ROWS, d]
    row0, mask = _summaries(cfg, b)
    t = jnp.transpose(acc.reshape(cfg.R, cfg.Mp, cfg.d), (1, 0, 2))   # [Mp, R, d]
    plgpu.store(t_ref.at[pl.ds(row0, cfg.Mp), pl.ds(0, cfg.R), pl.ds(0, cfg.d)],
                t.astype(t_ref.dtype), mask=mask)
    return carry

  lax.fori_loop(0, EXAMPLES, one, 0)


def _bwd_kernel(a_ref, e_ref, z_ref, dt_ref, da_ref, g_ref, *, cfg: _Cfg):
  chunks = list(range(0, cfg.S, ROWS))
  zs = [_z(z_ref, s0, cfg) for s0 in chunks]
  p = pl.program_id(0)

  def one(i, gz):
    b = p * EXAMPLES + i
    row0, mask = _summaries(cfg, b)
    dt = plgpu.load(dt_ref.at[pl.ds(row0, cfg.Mp), pl.ds(0, cfg.R), pl.ds(0, cfg.d)],
                    mask=mask, other=0.0).astype(F32)                # [Mp, R, d]
    dt = jnp.transpose(dt, (1, 0, 2)).reshape(cfg.K, cfg.d)          # rows in (r, m) order
    gz = list(gz)
    for c, s0 in enumerate(chunks):
      zn, r = _norm(a_ref, e_ref, b, s0, cfg)
      dh = round_to(dot(zs[c], dt, cfg), cfg.dtype)              # [ROWS, K] [K, d]
      da = r * (dh - zn * jnp.mean(dh * zn, axis=1, keepdims=True))
      store_rows(da_ref, b * cfg.S + s0, da)
      gz[c] = gz[c] + dot(round_to(zn, cfg.dtype), dt, cfg, trans_b=True)   # [ROWS, K]
    return tuple(gz)

  gz = lax.fori_loop(0, EXAMPLES, one, tuple(jnp.zeros((ROWS, cfg.K), F32) for _ in chunks))
  for c, s0 in enumerate(chunks):                 # [ROWS, (r, m)] -> rows (p, r), s0 + [0, ROWS)
    g = jnp.transpose(gz[c].reshape(ROWS, cfg.R, cfg.Mp), (1, 0, 2))
    plgpu.store(g_ref.at[pl.ds(p * cfg.R, cfg.R), pl.ds(s0, ROWS), pl.ds(0, cfg.Mp)], g)

# Wide shapes (``K d > MAX_ACC``: prod's 128 seeds, rank 8, 32 summaries, d 512) take the
# output's columns ``DC = MAX_ACC // K`` at a time: a row's norm statistic comes from one load of
# its whole row, its values again chunk by chunk. The backward goes seed chunk by seed chunk (one
# ``z`` gradient accumulator live), examples inside it for the norm's row sums and ``z``'s
# gradient (each example's ``r`` and row sum kept, ``[examples, ROWS]``), then column chunk by
# column chunk, examples inside it, for ``da`` and the sum of ``da`` over the program's examples
# (``e``'s gradient, one ``[ROWS, DC]`` accumulator live).

def _dc(cfg: _Cfg) -> int:
  """Output columns per chunk: all of ``d`` where the accumulator fits, else ``MAX_ACC // K``."""
  return min(cfg.d, MAX_ACC // cfg.K)


def _r(a_ref, e_ref, b, s0, cfg: _Cfg):
  """``rsqrt(mean(t^2) + eps)`` of seeds ``s0 .. s0 + ROWS`` of example ``b`` (``[ROWS, 1]``)."""
  return _norm(a_ref, e_ref, b, s0, cfg)[1]


def _cols(a_ref, e_ref, b, s0, c0, r, cfg: _Cfg):
  """Columns ``c0 .. c0 + DC`` of the normed rows: ``(t r)`` in float32."""
  cols = (c0, _dc(cfg))
  t = (load_rows(a_ref, b * cfg.S + s0, ROWS, cols).astype(F32)
       + load_rows(e_ref, s0, ROWS, cols).astype(F32))
  return t * r


def _dt_cols(dt_ref, b, c0, cfg: _Cfg):
  """Example ``b``'s ``dt`` columns ``c0 .. c0 + DC`` as ``[K, DC]`` float32, rows in ``(r, m)``
  order (zero for padding summaries and examples past B)."""
  dc = _dc(cfg)
  row0, mask = _summaries(cfg, b, dc)
  dt = plgpu.load(dt_ref.at[pl.ds(row0, cfg.Mp), pl.ds(0, cfg.R), pl.ds(c0, dc)],
                  mask=mask, other=0.0).astype(F32)
  return jnp.transpose(dt, (1, 0, 2)).reshape(cfg.K, dc)


def _fwd_wide_kernel(a_ref, e_ref, z_ref, t_ref, *, cfg: _Cfg):
  chunks, dc = list(range(0, cfg.S, ROWS)), _dc(cfg)
  p = pl.program_id(0)

  def one(i, carry):
    b = p * EXAMPLES + i
    rs = [_r(a_ref, e_ref, b, s0, cfg) for s0 in chunks]
    row0, mask = _summaries(cfg, b, dc)

    def cols(j, carry):                                            # a loop: a short program
      c0 = j * dc
      acc = jnp.zeros((cfg.K, dc), F32)                            # rows in (r, m) order
      for s0, r in zip(chunks, rs, strict=True):
        acc += dot(_z(z_ref, s0, cfg), _cols(a_ref, e_ref, b, s0, c0, r, cfg), cfg,
                   trans_a=True)                                   # [K, ROWS] [ROWS, DC]
      t = jnp.transpose(acc.reshape(cfg.R, cfg.Mp, dc), (1, 0, 2))   # [Mp, R, DC]
      plgpu.store(t_ref.at[pl.ds(row0, cfg.Mp), pl.ds(0, cfg.R), pl.ds(c0, dc)],
                  t.astype(t_ref.dtype), mask=mask)
      return carry

    return lax.fori_loop(0, cfg.d // dc, cols, carry)

  lax.fori_loop(0, EXAMPLES, one, 0)


def _bwd_wide_kernel(a_ref, e_ref, z_ref, dt_ref, da_ref, g_ref, ge_ref, *, cfg: _Cfg,
                     examples: int):
  dc = _dc(cfg)
  p = pl.program_id(0)
  ex = jnp.arange(examples)[:, None]

  def seeds(c, carry):                             # loops, not unrolled: a short program
    s0 = c * ROWS
    zc = _z(z_ref, s0, cfg)

    def chunk(b, j, r):
      dt, zn = _dt_cols(dt_ref, b, j * dc, cfg), _cols(a_ref, e_ref, b, s0, j * dc, r, cfg)
      return dt, zn, round_to(dot(zc, dt, cfg), cfg.dtype)         # dh: [ROWS, K] [K, DC]

    def one(i, acc):                               # per example: r, rowsum(dh zn), gz
      gz, rs, sums = acc
      b = p * examples + i
      r = _r(a_ref, e_ref, b, s0, cfg)

      def col_sums(j, acc):
        dot_sum, gz = acc
        dt, zn, dh = chunk(b, j, r)
        return (dot_sum + jnp.sum(dh * zn, axis=1, keepdims=True),
                gz + dot(round_to(zn, cfg.dtype), dt, cfg, trans_b=True))   # [ROWS, K]

      dot_sum, gz = lax.fori_loop(0, cfg.d // dc, col_sums, (jnp.zeros((ROWS, 1), F32), gz))
      mine = ex == i                                               # [examples, 1]
      return (gz, jnp.where(mine, r.reshape(1, ROWS), rs),
              jnp.where(mine, dot_sum.reshape(1, ROWS), sums))

    gz, rs, sums = lax.fori_loop(
        0, examples, one, (jnp.zeros((ROWS, cfg.K), F32),
                           jnp.zeros((examples, ROWS), F32), jnp.zeros((examples, ROWS), F32)))

    def cols(j, carry):                            # da, column chunk by column chunk, and e's
      def da(i, ge):                               # gradient over the program's examples
        b = p * examples + i
        mine = ex == i
        r = jnp.sum(jnp.where(mine, rs, 0.0), axis=0).reshape(ROWS, 1)
        dot_sum = jnp.sum(jnp.where(mine, sums, 0.0), axis=0).reshape(ROWS, 1)
        _, zn, dh = chunk(b, j, r)
        d_a = round_to(r * (dh - zn * (dot_sum / cfg.d)), da_ref.dtype)
        store_rows(da_ref, b * cfg.S + s0, d_a, j * dc)
        return ge + d_a                            # zero for an example past B (dt is zero)

      ge = lax.fori_loop(0, examples, da, jnp.zeros((ROWS, dc), F32))
      store_rows(ge_ref, p * cfg.S + s0, ge, j * dc)
      return carry

    lax.fori_loop(0, cfg.d // dc, cols, 0)
    g = jnp.transpose(gz.reshape(ROWS, cfg.R, cfg.Mp), (1, 0, 2))
    plgpu.store(g_ref.at[pl.ds(p * cfg.R, cfg.R), pl.ds(s0, ROWS), pl.ds(0, cfg.Mp)], g)
    return carry

  lax.fori_loop(0, cfg.S // ROWS, seeds, 0)


def bwd_examples(B: int) -> int:
  """Examples per program of the wide backward kernel: the most of 2, 4, 8 that leaves at least
  ``MIN_PROGRAMS`` full programs (2 where none does). Its per-program partial sums of ``z``'s and
  ``e``'s gradients shrink with it: at prod (B 1024) 8 examples write a quarter of what 2 do."""
  return examples_per_program(B, EXAMPLES, MIN_PROGRAMS, most=8)


def _call(kernel, args, outs, cfg: _Cfg, name, examples: int = EXAMPLES):
  whole = pl.no_block_spec
  return _poison.pallas_call(
      kernel, args, out_shape=outs,
      grid=(pl.cdiv(cfg.B, examples),), in_specs=[whole] * len(args),
      out_specs=(whole,) * len(outs), interpret=cfg.interpret, name=name,
      compiler_params=plgpu.CompilerParams(num_warps=WARPS, num_stages=1))


def _cfg(a, z, eps, dtype, interpret):
  B, S, d = a.shape
  return _Cfg(B, S, z.shape[0], z.shape[2], d, float(eps), jnp.dtype(dtype), bool(interpret))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _fused(a, e, z, eps, dtype, interpret):
  cfg = _cfg(a, z, eps, dtype, interpret)
  out = (jax.ShapeDtypeStruct((cfg.B * cfg.M, cfg.R, cfg.d), cfg.dtype),)
  kernel = _fwd_kernel if _dc(cfg) == cfg.d else _fwd_wide_kernel
  t = _call(functools.partial(kernel, cfg=cfg), (a.reshape(cfg.B * cfg.S, cfg.d), e, z), out,
            cfg, "seed_kron_fwd")[0]
  return t.reshape(cfg.B, cfg.M, cfg.R * cfg.d)


def _vjp_fwd(a, e, z, eps, dtype, interpret):
  return _fused(a, e, z, eps, dtype, interpret), (a, e, z)


def _vjp_bwd(eps, dtype, interpret, res, dt):
  a, e, z = res
  cfg = _cfg(a, z, eps, dtype, interpret)
  args = (a.reshape(cfg.B * cfg.S, cfg.d), e, z, dt.reshape(cfg.B * cfg.M, cfg.R, cfg.d))
  da_shape = jax.ShapeDtypeStruct((cfg.B * cfg.S, cfg.d), a.dtype)
  if _dc(cfg) == cfg.d:
    T = pl.cdiv(cfg.B, EXAMPLES)
    outs = (da_shape, jax.ShapeDtypeStruct((T * cfg.R, cfg.S, cfg.Mp), F32))
    (da, gz), ge = _call(functools.partial(_bwd_kernel, cfg=cfg), args, outs, cfg,
                         "seed_kron_bwd"), None
  else:                                           # wide: e's partial sums from the kernel
    n = bwd_examples(cfg.B)
    T = pl.cdiv(cfg.B, n)
    outs = (da_shape, jax.ShapeDtypeStruct((T * cfg.R, cfg.S, cfg.Mp), F32),
            jax.ShapeDtypeStruct((T * cfg.S, cfg.d), F32))
    da, gz, ge = _call(functools.partial(_bwd_wide_kernel, cfg=cfg, examples=n), args, outs,
                       cfg, "seed_kron_bwd", n)
  da = da.reshape(a.shape)
  # e's gradient: a's as rounded, summed over the examples (or the wide kernel's partial sums)
  de = jnp.sum(da.astype(F32), 0) if ge is None else jnp.sum(ge.reshape(T, cfg.S, cfg.d), 0)
  gz = jnp.sum(gz.reshape(T, cfg.R, cfg.S, cfg.Mp), 0)[..., :cfg.M]
  return da, de.astype(e.dtype), gz.astype(z.dtype)


_fused.defvjp(_vjp_fwd, _vjp_bwd)


def supported(S: int, R: int, M: int, d: int) -> bool:
  """Whether the kernels take ``S`` seeds, ``R`` ranks, ``M`` summaries and width ``d``: ``S``,
  ``d`` and ``K = R Mp`` powers of two >= 16 (``Mp``: ``M`` padded to a power of two), ``S`` a
  multiple of ``ROWS``, and the forward's accumulator ``K x d`` at most ``MAX_ACC`` or, taken in
  column chunks (wide), ``K`` at most ``MAX_WIDE_K``."""
  K = R * pow2(max(M, 1))
  return (is_tile(S) and is_tile(d) and is_tile(K) and S % ROWS == 0 and M >= 1
          and (K * d <= MAX_ACC or K <= MAX_WIDE_K))


def seed_kron_pallas(a, e, z, *, eps: float, dtype=jnp.bfloat16, interpret: bool = False):
  """``seed_kron_xla``'s values and gradients from the Pallas kernels (module docstring)."""
  if a.ndim != 3 or e.shape != a.shape[1:] or z.ndim != 3 or z.shape[1] != a.shape[1]:
    raise ValueError(f"seed_kron: a {a.shape}, e {e.shape}, z {z.shape} must be [B, S, d], "
                     "[S, d] and [R, S, M]")
  if not supported(a.shape[1], z.shape[0], z.shape[2], a.shape[2]):
    raise ValueError(f"seed_kron: no kernel for S={a.shape[1]}, R={z.shape[0]}, M={z.shape[2]}, "
                     f"d={a.shape[2]} (supported())")
  return _fused(a, e.astype(F32), z.astype(F32), float(eps), jnp.dtype(dtype), bool(interpret))
