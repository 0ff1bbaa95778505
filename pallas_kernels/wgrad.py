"""Weight gradients that sum over every row, a row scale taken where the rows are read (issue
38): ``dw_p = sum_n h_n^T g_p[n]`` with ``h = round(r x)`` (``r`` None: ``h = x``).

``x [N, d]``, ``r f32[N]`` (e.g. each row's RMS factor, written by the backward kernel that
computed it), ``gs``: P cotangents ``[N, C]`` -> P float32 ``[d, C]``. XLA fuses no elementwise
prologue into its GEMMs, so it needed ``h [N, d]`` written, and at prod's widths read once per
projection; the kernel reads ``x``, ``r`` and each ``g`` once (from L2 for the other output
tiles).

Grid ``(S, d / BM, P C / BN)``: a program accumulates one ``[BM, BN]`` output tile over a
``1/S`` share of the rows, ``BK`` rows a step, and stores it as a float32 partial; XLA sums the
``S`` partials, as its own split-K GEMMs do (``S`` from a roofline of the kernel, ``_split``).
``row_scaled_wgrad_xla`` is the twin. Triton on GPU, ``interpret=True`` on CPU. Rows of zeros (a
packed block's tail) add nothing. ``dense_pallas``: a bias-free dense layer ``x [..., K] @ w [K,
C]`` whose ``w`` gradient runs on the kernel (``dense_xla``, its twin, is autodiff's).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _poison, tuning
from pallas_kernels._common import dot, load_rows, load_vec

F32 = jnp.float32
WARPS = 8
BM = BN = 128          # output tile: 64 float32 accumulators a thread at 8 warps
BK = 64                # rows a step
PROGRAMS = 264         # programs to aim for: two per H100 / H200 SM


def row_scaled_wgrad_xla(x, r, gs, *, dtype=jnp.bfloat16):
  """The twin: ``h = (x r).astype(dtype)`` (``r`` None: ``x``), then ``h^T g`` per cotangent, in
  float32."""
  h = (x.astype(dtype) if r is None else
       (x.astype(F32) * jnp.asarray(r, F32)[:, None]).astype(dtype))
  return tuple(jnp.einsum("nd,nc->dc", h, g.astype(dtype), preferred_element_type=F32)
               for g in gs)


class _Cfg(NamedTuple):
  rows: int              # rows per split (a multiple of BK)
  bm: int
  bn: int
  tiles: int             # output column tiles per projection
  dtype: object
  interpret: bool
  scaled: bool           # an r operand (else h = x)


def _kernel(x_ref, *refs, cfg: _Cfg):
  r_ref, refs = (refs[0], refs[1:]) if cfg.scaled else (None, refs)
  g_refs, out_ref = refs[:-1], refs[-1]
  s, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  m0 = pl.multiple_of(i * cfg.bm, cfg.bm)
  c0 = pl.multiple_of((j % cfg.tiles) * cfg.bn, cfg.bn)
  base = s * cfg.rows

  for p, g_ref in enumerate(g_refs):
    @pl.when(j // cfg.tiles == p)
    def _(g_ref=g_ref):
      def step(k, acc):
        r0 = base + k * BK
        h = load_rows(x_ref, r0, BK, (m0, cfg.bm))
        if cfg.scaled:
          h = h.astype(F32) * load_vec(r_ref, r0, BK)[:, None]
        return acc + dot(h, load_rows(g_ref, r0, BK, (c0, cfg.bn)), cfg, trans_a=True)

      acc = lax.fori_loop(0, cfg.rows // BK, step, jnp.zeros((cfg.bm, cfg.bn), F32))
      plgpu.store(out_ref.at[s, pl.ds(m0, cfg.bm), pl.ds(j * cfg.bn, cfg.bn)], acc)


def _split(N: int, d: int, PC: int, tiles: int, itemsize: int = 2) -> tuple[int, int]:
  """``(S, rows per split)``: the fewest splits at the least roofline time of the kernel and the
  partials' sum, ``max(FLOPs / (busy SMs' share of the peak), bytes / bandwidth)`` with the
  bytes ``N (d + PC)`` values read plus ``S d PC`` float32 partials written and read; at most
  ``PROGRAMS`` programs over the ``tiles`` output tiles, partials no more than the bytes read,
  a split at least ``BK`` rows (a multiple of it). More splits keep more SMs busy and add
  partials (XLA's split-K GEMMs took 16 to 128 at mid's sizes, partials that outweighed the h
  this kernel saves)."""
  flops, read, part = 2.0 * N * d * PC, float(N * (d + PC) * itemsize), 8.0 * d * PC
  cost = lambda S: max(flops * tuning.SM_COUNT / (min(S * tiles, tuning.SM_COUNT)
                                                   * tuning.RIDGE), read + S * part)
  most = min(pl.cdiv(PROGRAMS, tiles), pl.cdiv(N, BK), int(read // (4 * d * PC)))
  S = min(range(1, max(1, most) + 1), key=cost)
  rows = pl.cdiv(pl.cdiv(N, S), BK) * BK
  return pl.cdiv(N, rows), rows


def _tile(n: int, most: int = BM) -> int:
  """The largest power of two <= ``most`` dividing ``n``."""
  return min(most, n & -n)


def _check(x, r, gs):
  if x.ndim != 2 or not gs:
    raise ValueError(f"row_scaled_wgrad: x {x.shape} must be [N, d] with at least one cotangent")
  N, d = x.shape
  if r is not None and r.shape != (N,):
    raise ValueError(f"row_scaled_wgrad: r {r.shape} must be [N] with N = {N}")
  C = gs[0].shape[-1]
  for g in gs:
    if g.shape != (N, C):
      raise ValueError(f"row_scaled_wgrad: every cotangent must be [N, C] = [{N}, {C}]; got "
                       f"{g.shape}")
  if not supported(d, C):
    raise ValueError(f"row_scaled_wgrad: d and C need a power-of-two factor >= 16; got d={d}, "
                     f"C={C}")
  return N, d, C


def row_scaled_wgrad_pallas(x, r, gs, *, dtype=jnp.bfloat16, interpret: bool = False,
                            joined: bool = False):
  """``row_scaled_wgrad_xla``'s values from the kernel (module docstring): P float32 ``[d, C]``
  (``joined``: one ``[d, P C]``, the P side by side). ``r`` None: ``h = x`` (a plain weight
  gradient ``sum_n x_n^T g_p[n]``, no scale operand)."""
  gs = tuple(gs)
  N, d, C = _check(x, r, gs)
  bm, bn = _tile(d, BM), _tile(C, BN)
  P, tiles = len(gs), C // bn
  b = jnp.dtype(dtype).itemsize
  S, rows = _split(N, d, P * C, (d // bm) * P * tiles, b)
  cfg = _Cfg(rows, bm, bn, tiles, jnp.dtype(dtype), bool(interpret), r is not None)
  rs = () if r is None else (jnp.asarray(r, F32),)
  _, stages = tuning.fit_smem(lambda _: (0, BK * (bm + bn) * b), None, copies=P,
                              what="row_scaled_wgrad")
  whole = pl.no_block_spec
  part = _poison.pallas_call(
      functools.partial(_kernel, cfg=cfg),
      (x.astype(dtype), *rs, *(g.astype(dtype) for g in gs)),
      out_shape=jax.ShapeDtypeStruct((S, d, P * C), F32), grid=(S, d // bm, P * tiles),
      in_specs=[whole] * (1 + len(rs) + P), out_specs=whole, interpret=cfg.interpret,
      name="row_scaled_wgrad", compiler_params=plgpu.CompilerParams(num_warps=WARPS,
                                                                    num_stages=stages))
  dw = jnp.sum(part, 0)
  if joined:
    return dw
  return tuple(dw[:, p * C:(p + 1) * C] for p in range(P))


def supported(d: int, C: int) -> bool:
  """Whether the kernel tiles ``x [N, d]`` and cotangents ``[N, C]``: both with a power-of-two
  factor of at least 16."""
  return _tile(d) >= 16 and _tile(C) >= 16


def memory_bound(d: int, C: int, itemsize: int = 2) -> bool:
  """Whether a weight gradient ``[d, C]`` over any number of rows is memory-bound on the target:
  ``2 d C / ((d + C) itemsize)`` FLOPs per byte read under the ridge. There XLA's split-K
  partials are a share of its bytes that the kernel's splits cut; a compute-bound one (prod's
  ``SumKronLinear``, 4,096 x 512) XLA's GEMM runs unsplit, and the kernel would only add its
  partials' sum."""
  return 2.0 * d * C / ((d + C) * itemsize) < tuning.RIDGE


# ------------------------------------------------------------------- a dense layer on the kernel

def dense_xla(x, w, *, dtype=jnp.bfloat16):
  """``dense_pallas``'s twin: ``x [..., K] @ w [K, C]`` with both operands in ``dtype`` (a bias-free
  ``flax.linen.Dense`` in ``dtype``), differentiated by autodiff."""
  return lax.dot_general(x.astype(dtype), w.astype(dtype), (((x.ndim - 1,), (0,)), ((), ())))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _dense(x, w, dtype, interpret):
  return dense_xla(x, w, dtype=dtype)


def _dense_fwd(x, w, dtype, interpret):
  return _dense(x, w, dtype, interpret), (x.astype(dtype), w, jnp.zeros((0,), x.dtype))


def _dense_bwd(dtype, interpret, res, dy):
  xd, w, x0 = res
  g = dy.astype(dtype)
  dx = lax.dot_general(g, w.astype(dtype), (((g.ndim - 1,), (1,)), ((), ())))
  (dw,) = row_scaled_wgrad_pallas(xd.reshape(-1, w.shape[0]), None, [g.reshape(-1, w.shape[1])],
                                  dtype=dtype, interpret=interpret)
  return dx.astype(x0.dtype), dw.astype(dtype).astype(w.dtype)


_dense.defvjp(_dense_fwd, _dense_bwd)


def dense_pallas(x, w, *, dtype=jnp.bfloat16, interpret: bool = False):
  """``dense_xla``'s values, and its gradients with ``w``'s (a sum over every row of ``x``) from
  the kernel: at mid b256 XLA's split-K GEMMs wrote 32 float32 partials of ``w``'s size for
  HSP's output map and 8 for ``SumKronLinear``'s second product, where the kernel's roofline
  (``_split``) picks 14 and 5."""
  if x.ndim < 2 or w.ndim != 2 or x.shape[-1] != w.shape[0]:
    raise ValueError(f"dense: x {x.shape} and w {w.shape} must be [..., K] and [K, C]")
  if not supported(*w.shape):
    raise ValueError(f"dense: w {w.shape}: K and C need a power-of-two factor >= 16")
  return _dense(x, w, jnp.dtype(dtype), bool(interpret))


def flops(N: int, d: int, C: int, P: int) -> float:
  """The kernel's FLOPs: ``2 N d C`` per cotangent."""
  return 2.0 * N * d * C * P
