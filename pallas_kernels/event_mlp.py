"""An event stream's per-event MLP over its rows as one pass each way (issue 38):
``y = valid * (gelu(x w1 + b1) w2 + b2)`` (``kunlun.nn.inputs.EventEmbed``).

``x [N, K]`` (the concatenated embeddings; ``K`` a multiple of 16, ``width``: the caller pads it
with zero columns and ``w1`` with zero rows up to one), or a pair ``([N, Ka], [N, Kb])`` read as
their concatenation (each width a multiple of 16), whose gradient comes back as a pair: the
backward kernel writes ``dx``'s two column ranges as two arrays, so an item table's row gradients
are a buffer of their own, not a slice of one ``dx`` that XLA copies out for the optimizer),
``w1 [K, F]``, ``b1 [F]``, ``w2 [F,
D]``, ``b2 [D]``, ``valid f32[N]`` -> ``y [N, D]`` in ``dtype``. Each layer is accumulated in
float32 and rounded to ``dtype`` after its bias, the GELU (tanh) rounded too, as
``flax.linen.Dense`` in ``dtype``. Widths: ``K`` up to 1024, read in power-of-two column chunks
(mid's impression stream: 224 as 128, 64 and 32; no column of padding), ``F`` and ``D`` powers
of two up to 512 (prod's click / conversion streams: 896, 512, 512); a row tile's hidden layer is
computed a chunk of columns at a time (``_tiles``).

``event_mlp_xla`` is the twin. ``event_mlp_pallas``: the forward kernel reads ``x`` and writes
``y`` (XLA wrote both layers' outputs and the GELU's input and read them back); the backward
kernel reads ``x`` and ``dy``, recomputes the hidden layer, and writes ``dx``, the masked hidden
activations ``valid * h`` and the hidden pre-activation's cotangent ``dz`` for the two weight
gradients over all rows (``dw2 = (valid h)^T dy``, ``dw1 = x^T dz``: ``pallas_kernels.wgrad``),
and per-program partial sums of the bias gradients. Triton on GPU, ``interpret=True`` on CPU.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _poison, activations, wgrad
from pallas_kernels._common import (
    is_tile,
    load_rows,
    load_vec,
    loop_spans,
    precision,
    round_to,
    spans,
    store_rows,
    tile_spans,
)

F32 = jnp.float32
WARPS = 8
CHUNK = 128              # columns of x, dx and y (rows of w1, columns of w2) per GEMM step
# (forward rows, backward rows, hidden chunk): a row tile's hidden layer is computed a chunk of
# columns at a time. Up to 256 hidden columns (mid) in one chunk, unrolled; past that (prod's
# 512), WIDE: chunks of 128, and the K and output column chunks run as loops, unpipelined
# (Triton's 3 stages ask for 475 KB of shared memory). ptxas sm_90 at prod's K 1024 / 512 / 512:
# no spills either way (241 registers backward, 174 forward); unrolled, the forward spilled
# 1,656 bytes on 64 rows and 16-row backward tiles were needed, and ptxas took 12 s
NARROW, WIDE = (64, 32, 256), (64, 64, 128)
MAX_WIDTH = {"K": 1024, "F": 512, "D": 512}
_GELU = activations.kernel_fn("gelu_tanh")                      # jax.nn.gelu(approximate=True)
_GELU_SLOPE = activations.kernel_fn("gelu_tanh", with_slope=True)


def event_mlp_xla(x, w1, b1, w2, b2, valid, *, dtype=jnp.bfloat16):
  """The twin: ``y [N, D]`` in ``dtype`` (module docstring; ``x`` an array or a pair)."""
  x = _joined(x)
  dense = lambda a, w, b: (jnp.dot(a.astype(dtype), w.astype(dtype), preferred_element_type=F32)
                           .astype(dtype) + b.astype(dtype))
  h = jax.nn.gelu(dense(x, w1, b1), approximate=True)
  y = dense(h, w2, b2)
  return jnp.where(jnp.asarray(valid)[:, None] > 0, y, 0).astype(dtype)


class _Cfg(NamedTuple):
  dtype: object
  rows: int
  hidden: int          # hidden columns per chunk
  interpret: bool
  loop: bool           # WIDE: the K and output column chunks run as loops
  split: int = 0       # dx written as columns [0, split) and [split, K) apart (0: one array)


def _over(n, cfg: _Cfg, body, carry):
  """``body((start, width), carry)`` over ``n``'s chunks (``tile_spans``: ``CHUNK`` columns, then
  the rest's powers of two): under ``cfg.loop`` the whole ``CHUNK``s as a loop with a traced
  start, the rest unrolled; else all unrolled with static starts."""
  chunks = tile_spans(n, CHUNK)
  whole = n // CHUNK * CHUNK
  if cfg.loop and whole > CHUNK:
    carry = loop_spans(whole, CHUNK, body, carry)
    chunks = [ch for ch in chunks if ch[0] >= whole]
  for ch in chunks:
    carry = body(ch, carry)
  return carry


def _dot(a, b, cfg: _Cfg, **kw):
  if cfg.interpret:          # XLA:CPU has no 16-bit dot into float32; the products are exact
    a, b = a.astype(F32), b.astype(F32)
  return plgpu.dot(a, b, precision=precision(a.dtype), **kw)


def _w(ref, rows, cols=None):
  """A block of a weight: ``rows``, ``cols`` ``(start, width)`` or None (all)."""
  (r0, rn), (c0, cn) = rows or (0, ref.shape[0]), cols or (0, ref.shape[1])
  return plgpu.load(ref.at[pl.ds(r0, rn), pl.ds(c0, cn)])


def _hidden(x_ref, r0, w1_ref, b1_ref, fc, cfg: _Cfg):
  """``z`` (rounded to dtype, as float32) of a row tile's hidden columns ``fc`` (a static
  ``(start, width)``), ``x w1`` accumulated over ``K``'s chunks."""
  z = _over(x_ref.shape[1], cfg, lambda ch, z: z + _dot(
      load_rows(x_ref, r0, cfg.rows, ch).astype(cfg.dtype), _w(w1_ref, ch, fc), cfg),
      jnp.zeros((cfg.rows, fc[1]), F32))
  b1 = plgpu.load(b1_ref.at[pl.ds(*fc)]).astype(cfg.dtype).astype(F32)
  return round_to(round_to(z, cfg.dtype) + b1[None], cfg.dtype)


def _fwd_kernel(x_ref, w1_ref, b1_ref, w2_ref, b2_ref, v_ref, y_ref, *, cfg: _Cfg):
  r0 = pl.program_id(0) * cfg.rows
  fcs = spans(w1_ref.shape[1], cfg.hidden)
  hs = [round_to(_GELU(_hidden(x_ref, r0, w1_ref, b1_ref, fc, cfg)), cfg.dtype).astype(cfg.dtype)
        for fc in fcs]
  valid = load_vec(v_ref, r0, cfg.rows)[:, None]

  def out(ch, carry):
    b2 = plgpu.load(b2_ref.at[pl.ds(*ch)]).astype(cfg.dtype).astype(F32)
    acc = sum(_dot(h, _w(w2_ref, fc, ch), cfg) for h, fc in zip(hs, fcs, strict=True))
    y = round_to(acc, cfg.dtype) + b2[None]
    store_rows(y_ref, r0, jnp.where(valid > 0, y, 0.0), ch[0])
    return carry
  _over(w2_ref.shape[1], cfg, out, 0)


def _bwd_kernel(x_ref, w1_ref, b1_ref, w2_ref, v_ref, dy_ref, *refs, cfg: _Cfg):
  dx_refs, (hm_ref, dz_ref, db1_ref, db2_ref) = refs[:-4], refs[-4:]
  i = pl.program_id(0)
  r0 = i * cfg.rows
  valid = load_vec(v_ref, r0, cfg.rows)[:, None]
  fcs = spans(w1_ref.shape[1], cfg.hidden)
  dzs = []
  for fc in fcs:                               # the hidden layer, a chunk of its columns at a time
    z = _hidden(x_ref, r0, w1_ref, b1_ref, fc, cfg)

    def back(ch, dh, fc=fc):                   # the second layer's output cotangent, masked
      dy = round_to(jnp.where(valid > 0, load_rows(dy_ref, r0, cfg.rows, ch).astype(F32), 0.0),
                    cfg.dtype)
      dh = dh + _dot(dy.astype(cfg.dtype), _w(w2_ref, fc, ch), cfg, trans_b=True)
      if fc[0] == 0:
        plgpu.store(db2_ref.at[i, pl.ds(*ch)], jnp.sum(dy, axis=0))
      return dh
    dh = _over(dy_ref.shape[1], cfg, back, jnp.zeros(z.shape, F32))
    h, slope = _GELU_SLOPE(z)
    dz = round_to(round_to(dh, cfg.dtype) * slope, cfg.dtype)
    store_rows(hm_ref, r0, jnp.where(valid > 0, h, 0.0), fc[0])
    store_rows(dz_ref, r0, dz, fc[0])
    plgpu.store(db1_ref.at[i, pl.ds(*fc)], jnp.sum(dz, axis=0))
    dzs.append(dz.astype(cfg.dtype))

  def dx(ch, carry, ref, off):                 # columns off + ch of dx, at ch in ref
    store_rows(ref, r0, sum(_dot(dz, _w(w1_ref, (off + ch[0], ch[1]), fc), cfg, trans_b=True)
                            for dz, fc in zip(dzs, fcs, strict=True)), ch[0])
    return carry
  for ref, (off, n) in zip(dx_refs, _pieces(x_ref.shape[1], cfg.split), strict=True):
    _over(n, cfg, functools.partial(dx, ref=ref, off=off), 0)


def _pieces(K: int, split: int) -> list[tuple[int, int]]:
  """``(start, width)`` of the column ranges ``dx`` is written as."""
  return [(0, split), (split, K - split)] if split else [(0, K)]


def _joined(x):
  """An input given as a pair, concatenated (an array as it is)."""
  return jnp.concatenate(x, axis=-1) if isinstance(x, tuple | list) else x


def _check(x, w1, b1, w2, b2, valid):
  if isinstance(x, tuple | list):
    if (len(x) != 2 or any(p.ndim != 2 or p.shape[1] % 16 for p in x)
        or x[0].shape[0] != x[1].shape[0] or x[0].dtype != x[1].dtype):
      raise ValueError(f"event_mlp: a pair x must be [N, Ka], [N, Kb] of one dtype, Ka and Kb "
                       f"multiples of 16; got {[(p.shape, str(p.dtype)) for p in x]}")
    x = jax.ShapeDtypeStruct((x[0].shape[0], x[0].shape[1] + x[1].shape[1]), x[0].dtype)
  N, K = x.shape
  if (w1.ndim != 2 or w1.shape[0] != K or b1.shape != w1.shape[1:] or w2.ndim != 2
      or w2.shape[0] != w1.shape[1] or b2.shape != w2.shape[1:] or valid.shape != (N,)):
    raise ValueError(f"event_mlp: x {x.shape}, w1 {w1.shape}, b1 {b1.shape}, w2 {w2.shape}, "
                     f"b2 {b2.shape}, valid {valid.shape} must be [N, K], [K, F], [F], [F, D], "
                     "[D], [N]")
  if not supported(K, w1.shape[1], w2.shape[1]):
    raise ValueError(f"event_mlp: the kernels need K a multiple of 16 and F, D powers of two, "
                     f"from 16 to {MAX_WIDTH}; got {K}, {w1.shape[1]}, {w2.shape[1]}")


def supported(K: int, F: int, D: int) -> bool:
  """Whether the kernels take these widths: ``K`` a multiple of 16 (read in power-of-two column
  chunks, ``tile_spans``), ``F`` and ``D`` powers of two, each from 16 to ``MAX_WIDTH``'s."""
  return (16 <= K <= MAX_WIDTH["K"] and K % 16 == 0
          and all(is_tile(n) and n <= MAX_WIDTH[k] for k, n in zip("FD", (F, D), strict=True)))


def width(K: int) -> int:
  """The kernels' input width for ``K`` concatenated columns: ``K`` rounded up to a multiple of
  16 (the caller adds zero columns to ``x`` and zero rows to ``w1`` up to it)."""
  return max(16, -(-K // 16) * 16)


def _tiles(F: int) -> tuple[int, int, int]:
  """(forward rows, backward rows, hidden chunk) at hidden width ``F``."""
  return NARROW if F <= NARROW[2] else WIDE


def _cfg(dtype, F, interpret, backward: bool, split: int = 0) -> _Cfg:
  """The forward's or the backward's tiling at hidden width ``F``."""
  fwd_rows, bwd_rows, chunk = _tiles(F)
  return _Cfg(dtype, bwd_rows if backward else fwd_rows, chunk, interpret, loop=F > NARROW[2],
              split=split)


def _call(kernel, args, outs, cfg: _Cfg, name):
  whole = pl.no_block_spec
  return _poison.pallas_call(
      functools.partial(kernel, cfg=cfg), args, out_shape=outs,
      grid=(pl.cdiv(args[0].shape[0], cfg.rows),), in_specs=[whole] * len(args),
      out_specs=tuple(whole for _ in outs) if isinstance(outs, tuple) else whole,
      interpret=cfg.interpret, name=name, compiler_params=plgpu.CompilerParams(
          num_warps=WARPS, num_stages=1 if cfg.loop else None))


def _forward(x, w1, b1, w2, b2, valid, dtype, interpret):
  """The forward kernel on the whole input ``x [N, K]``."""
  cfg = _cfg(dtype, w1.shape[1], interpret, backward=False)
  args = (x, w1.astype(dtype), b1, w2.astype(dtype), b2, valid)
  return _call(_fwd_kernel, args, jax.ShapeDtypeStruct((x.shape[0], w2.shape[1]), dtype),
               cfg, "event_mlp_fwd")


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _fused(xs, w1, b1, w2, b2, valid, split, dtype, interpret):
  # xs: one array, or two split at column `split` (their dx come back apart)
  return _forward(_joined(xs), w1, b1, w2, b2, valid, dtype, interpret)


def _vjp_fwd(xs, w1, b1, w2, b2, valid, split, dtype, interpret):
  x = _joined(xs)                          # concatenated once: the kernel's input and residual
  return _forward(x, w1, b1, w2, b2, valid, dtype, interpret), (x, w1, b1, w2, b2, valid)


def _vjp_bwd(split, dtype, interpret, res, dy):
  x, w1, b1, w2, b2, valid = res
  N, K = x.shape
  F, D = w2.shape
  cfg = _cfg(dtype, F, interpret, backward=True, split=split)
  T = pl.cdiv(N, cfg.rows)
  outs = (*(jax.ShapeDtypeStruct((N, n), x.dtype) for _, n in _pieces(K, split)),
          jax.ShapeDtypeStruct((N, F), dtype), jax.ShapeDtypeStruct((N, F), dtype),
          jax.ShapeDtypeStruct((T, F), F32), jax.ShapeDtypeStruct((T, D), F32))
  *dx, hm, dz, db1, db2 = _call(_bwd_kernel, (x, w1.astype(dtype), b1, w2.astype(dtype), valid,
                                              dy), outs, cfg, "event_mlp_bwd")
  # the weight gradients sum over every row: pallas_kernels.wgrad, whose splits weigh the SMs
  # kept busy against float32 partials (XLA's GEMMs wrote 64 to 128 of them at mid); dy's masked
  # rows meet hm's zeros, dz is zero there
  (dw1,) = wgrad.row_scaled_wgrad_pallas(x, None, [dz], dtype=dtype, interpret=interpret)
  (dw2,) = wgrad.row_scaled_wgrad_pallas(hm, None, [dy], dtype=dtype, interpret=interpret)
  dw1, dw2 = dw1.astype(dtype), dw2.astype(dtype)
  return (tuple(dx), dw1.astype(w1.dtype), jnp.sum(db1, 0).astype(b1.dtype),
          dw2.astype(w2.dtype), jnp.sum(db2, 0).astype(b2.dtype), jnp.zeros_like(valid))


_fused.defvjp(_vjp_fwd, _vjp_bwd)


def event_mlp_pallas(x, w1, b1, w2, b2, valid, *, dtype=jnp.bfloat16, interpret: bool = False):
  """``event_mlp_xla``'s values and gradients from the Pallas kernels (module docstring; ``x``
  an array or a pair, whose gradient is a pair)."""
  valid = jnp.asarray(valid, F32)
  _check(x, w1, b1, w2, b2, valid)
  xs = tuple(x) if isinstance(x, tuple | list) else (x,)
  split = xs[0].shape[1] if len(xs) == 2 else 0
  return _fused(xs, w1, b1, w2, b2, valid, split, jnp.dtype(dtype), bool(interpret))
