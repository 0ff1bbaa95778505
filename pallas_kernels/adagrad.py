"""Row-wise Adagrad over many tables in one pass (issue 38): the embedding tables that the
optimizer updates densely (the small ones a sparse step sums into table-shaped gradients, and
tables read some other way) in one launch instead of three per table.

``gs``: the gradient sources, each ``[V, D]`` (a group of tables of one width shares one: its
table-shaped gradient, each member a range of its rows); ``leaves``: per table ``(source, first
row)``; ``ps [V_i, D_i]`` the tables and ``accs f32[V_i]`` their accumulators. Per row ``r`` of
a table, as ``kunlun.train.optim.rowwise_adagrad``::

  acc'_r = acc_r + mean_d g_rd^2;   p'_rd = p_rd + (-lr g_rd / (sqrt(acc'_r) + eps))

``rowwise_adagrad_pallas`` returns the new tables and accumulators (written over the old ones'
buffers) and the float32 sum of the squares of the gradients of the tables ``sq`` names (per
program partials, summed by XLA; no such output where it names none). Grid: one program per
``rows(D)`` rows of a table (about ``BLOCK`` elements), each inside one table.
``rowwise_adagrad_xla`` is the twin. Triton on GPU (as ``adamw.py``: masked vector loads at any
row), ``interpret=True`` on CPU.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _poison
from pallas_kernels._common import pad_pow2

F32 = jnp.float32
BLOCK = 1024           # elements a program: 8 a thread at 4 warps
WARPS = 4
EPS = 1e-8


def rowwise_adagrad_xla(gs, leaves, ps, accs, *, lr: float, eps: float = EPS, sq=None,
                        interpret=None):
  """The twin (same signature): ``kunlun.train.optim.rowwise_adagrad_leaf`` per table, then
  ``optax.apply_updates``'s sum; the squares' sum over the tables ``sq`` names."""
  del interpret
  new_p, new_acc, total = [], [], jnp.zeros((), F32)
  for i, ((k, r0), p, acc) in enumerate(zip(leaves, ps, accs, strict=True)):
    g = gs[k][r0:r0 + p.shape[0]].astype(p.dtype)
    a = acc + jnp.mean(jnp.square(g.astype(F32)), axis=-1)
    u = (-lr * g / (jnp.sqrt(a)[..., None] + eps)).astype(g.dtype)
    new_p.append((p + u).astype(p.dtype))
    new_acc.append(a)
    if sq is not None and sq[i]:
      total = total + jnp.sum(jnp.square(g.astype(F32)))
  return tuple(new_p), tuple(new_acc), total


class _Cfg(NamedTuple):
  leaves: tuple          # per table: (source, first row, rows V, width D)
  starts: tuple          # per table: its first program
  sq: tuple              # per table: whether its squares count
  lr: float
  eps: float


def rows(D: int) -> int:
  """Table rows a program takes: ``BLOCK`` elements of a row padded to a power of two."""
  return max(1, BLOCK // pad_pow2(D))


def _programs(leaves) -> tuple[tuple[int, ...], int]:
  starts, n = [], 0
  for _, _, V, D in leaves:
    starts.append(n)
    n += pl.cdiv(V, rows(D))
  return tuple(starts), n


def _kernel(*refs, cfg: _Cfg):
  n_src = 1 + max(k for k, *_ in cfg.leaves)
  P = len(cfg.leaves)
  g_refs, p_refs, a_refs = refs[:n_src], refs[n_src:n_src + P], refs[n_src + P:n_src + 2 * P]
  outs = refs[n_src + 2 * P:]
  p_outs, a_outs, sq_out = outs[:P], outs[P:2 * P], outs[2 * P:]
  pid = pl.program_id(0)
  for i, ((k, g0, V, D), s0) in enumerate(zip(cfg.leaves, cfg.starts, strict=True)):
    R, Dp = rows(D), pad_pow2(D)

    @pl.when((pid >= s0) & (pid < s0 + pl.cdiv(V, R)))
    def _(i=i, k=k, g0=g0, V=V, D=D, s0=s0, R=R, Dp=Dp):
      r0 = pl.multiple_of((pid - s0) * R, R)
      row_ok = r0 + jnp.arange(R) < V
      ok = row_ok[:, None] & (jnp.arange(Dp) < D)[None, :]
      cols = pl.ds(0, Dp)
      g = plgpu.load(g_refs[k].at[pl.ds(g0 + r0, R), cols], mask=ok, other=0.0).astype(F32)
      p = plgpu.load(p_refs[i].at[pl.ds(r0, R), cols], mask=ok, other=0.0).astype(F32)
      acc = plgpu.load(a_refs[i].at[pl.ds(r0, R)], mask=row_ok, other=0.0)
      g2 = g * g
      acc = acc + jnp.sum(g2, axis=1) / D
      p = p + (-cfg.lr) * g / (jnp.sqrt(acc)[:, None] + cfg.eps)
      plgpu.store(p_outs[i].at[pl.ds(r0, R), cols], p.astype(p_outs[i].dtype), mask=ok)
      plgpu.store(a_outs[i].at[pl.ds(r0, R)], acc, mask=row_ok)
      if sq_out:
        sq_out[0][pid] = jnp.sum(g2) if cfg.sq[i] else jnp.zeros((), F32)


def _check(gs, leaves, ps, accs, sq):
  if not ps:
    raise ValueError("rowwise_adagrad: no tables")
  if len(leaves) != len(ps) or len(accs) != len(ps) or (sq is not None and len(sq) != len(ps)):
    raise ValueError("rowwise_adagrad: leaves, ps, accs (and sq) need one entry per table")
  for (k, r0), p, a in zip(leaves, ps, accs, strict=True):
    if p.ndim != 2 or a.shape != p.shape[:1]:
      raise ValueError(f"rowwise_adagrad: a table must be [V, D] with its accumulator f32[V]; "
                       f"got {p.shape} and {a.shape}")
    if not 0 <= k < len(gs) or gs[k].ndim != 2 or gs[k].shape[1] != p.shape[1] or not (
        0 <= r0 and r0 + p.shape[0] <= gs[k].shape[0]):
      raise ValueError(f"rowwise_adagrad: table {p.shape}'s gradient rows [{r0}, "
                       f"{r0 + p.shape[0]}) of source {k} are not in it")


def rowwise_adagrad_pallas(gs, leaves, ps, accs, *, lr: float, eps: float = EPS, sq=None,
                           interpret: bool = False):
  """``(new tables, new accumulators, squares' sum)`` (module docstring); ``sq``: per table,
  whether its gradient's squares count (None: none do). The new tables and accumulators are
  written over the old ones' buffers (aliased)."""
  gs, ps, accs = tuple(gs), tuple(ps), tuple(accs)
  _check(gs, leaves, ps, accs, sq)
  info = tuple((int(k), int(r0), int(p.shape[0]), int(p.shape[1]))
               for (k, r0), p in zip(leaves, ps, strict=True))
  starts, n = _programs(info)
  cfg = _Cfg(info, starts, tuple(bool(s) for s in sq) if sq is not None else (False,) * len(ps),
             float(lr), float(eps))
  used = sorted({k for k, *_ in info})
  if used != list(range(len(gs))):
    raise ValueError(f"rowwise_adagrad: every gradient source must be read; sources {used} of "
                     f"{len(gs)}")
  P = len(ps)
  outs = ([jax.ShapeDtypeStruct(p.shape, p.dtype) for p in ps]
          + [jax.ShapeDtypeStruct(a.shape, F32) for a in accs]
          + ([jax.ShapeDtypeStruct((n,), F32)] if any(cfg.sq) else []))
  args = [*gs, *ps, *(jnp.asarray(a, F32) for a in accs)]
  whole = pl.no_block_spec
  kw = dict(grid=(n,), in_specs=[whole] * len(args), out_specs=tuple(whole for _ in outs),
            interpret=interpret, name="rowwise_adagrad",
            compiler_params=plgpu.CompilerParams(num_warps=WARPS, num_stages=1))
  kernel = functools.partial(_kernel, cfg=cfg)
  if _poison.active():          # (the tests' NaN-filled outputs, not aliased)
    res = _poison.pallas_call(kernel, args, out_shape=tuple(outs), **kw)
  else:
    alias = {len(gs) + j: j for j in range(2 * P)}
    res = pl.pallas_call(kernel, out_shape=tuple(outs), input_output_aliases=alias,
                         **kw)(*args)
  return (tuple(res[:P]), tuple(res[P:2 * P]),
          jnp.sum(res[-1]) if any(cfg.sq) else jnp.zeros((), F32))
