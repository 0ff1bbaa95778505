"""Clipped AdamW over many leaves in one pass (issue 38): a group's gradients, values and moments
read once, its values, 16-bit copies and moments written once.

``leaves`` are P parameters (any shapes) laid out in a flat float32 buffer ``[L]`` at offsets
that are multiples of ``BLOCK`` (``kunlun.train.flat``); ``mu, nu f32[L]`` are the group's moments
in it (zero between the leaves). ``adamw_pallas(gs, ps, mu, nu, scalars, ...)`` returns the new
values (each leaf's shape and dtype), their 16-bit copies (where ``copy_dtypes`` names one) and
the new moments; ``sq_norm_pallas(gs, ...)`` the float32 sum of the gradients' squares (per
program partials, summed by XLA). ``scalars f32[5]``: ``(norm, 1 - b1^t, 1 - b2^t, lr,
trigger)`` with ``trigger`` 1.0 where ``norm < clip``. Per element, as ``kunlun.train.optim``
(optax's clip-by-global-norm and AdamW, weight decay on leaves of 2 or more dimensions)::

  g = g if trigger else g / norm * clip
  mu' = (1 - b1) g + b1 mu;  nu' = (1 - b2) g^2 + b2 nu
  u = (mu' / (1 - b1^t)) / (sqrt(nu' / (1 - b2^t)) + eps) [+ wd p];  p' = p - lr u

XLA writes a group's concatenated gradients before its moments' pass and reads the new moments
back in each leaf's pass; the kernel reads each value once. Grid: one program per ``BLOCK``
elements of the buffer, each inside one leaf (the offsets are aligned). ``adamw_xla`` and
``sq_norm_xla`` are the twins. Triton on GPU (a leaf's blocks are masked vector loads at any
offset; Mosaic GPU's copies need tiles of static shape), ``interpret=True`` on CPU.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _poison

F32 = jnp.float32
BLOCK = 1024           # elements a program: 8 a thread at 4 warps
WARPS = 4
EPS = 1e-8


class Hyper(NamedTuple):
  """The update's constants: Adam's ``b1``, ``b2``, the weight decay and the clipping norm."""
  b1: float
  b2: float
  wd: float
  clip: float


class _Cfg(NamedTuple):
  sizes: tuple           # per leaf: its elements
  starts: tuple          # per leaf: its first block (offset / BLOCK)
  decay: tuple           # per leaf: weight decay on (2 or more dimensions)
  copies: tuple          # per leaf: the copy's dtype name or None
  hyper: Hyper
  olds: bool = False     # the old copies are inputs (aliased to the new ones, never read)


def offsets(sizes) -> tuple[tuple[int, ...], int]:
  """Each leaf's offset in the buffer (a multiple of ``BLOCK``) and the buffer's length."""
  out, off = [], 0
  for n in sizes:
    out.append(off)
    off += pl.cdiv(int(n), BLOCK) * BLOCK
  return tuple(out), off


def _leaf_blocks(cfg: _Cfg):
  """``(leaf, first block, blocks)`` per leaf."""
  return [(i, b0, pl.cdiv(n, BLOCK))
          for i, (n, b0) in enumerate(zip(cfg.sizes, cfg.starts, strict=True))]


def _load(ref, s, n):
  return plgpu.load(ref.at[pl.ds(s, BLOCK)], mask=s + jnp.arange(BLOCK) < n, other=0.0)


def _store(ref, s, n, x):
  plgpu.store(ref.at[pl.ds(s, BLOCK)], x.astype(ref.dtype), mask=s + jnp.arange(BLOCK) < n)


def _update(g, p, mu, nu, sc, decay, h: Hyper):
  """The element-wise update (``kunlun.train.optim``'s operations, in its order); ``decay``: a
  bool, or a bool array of ``p``'s shape (the twin's packed leaves)."""
  norm, bc1, bc2, lr, trigger = (sc[k] for k in range(5))
  g = jnp.where(trigger > 0, g, (g / norm) * h.clip)
  mu = (1 - h.b1) * g + h.b1 * mu
  nu = (1 - h.b2) * (g * g) + h.b2 * nu
  u = (mu / bc1) / (jnp.sqrt(nu / bc2) + EPS)
  if decay is True:
    u = u + h.wd * p
  elif decay is not False:
    u = jnp.where(decay, u + h.wd * p, u)
  return p + u * (-lr), mu, nu


def _adamw_kernel(sc_ref, mu_ref, nu_ref, *refs, cfg: _Cfg):
  P = len(cfg.sizes)
  k = sum(c is not None for c in cfg.copies)
  gs, ps, outs = refs[:P], refs[P:2 * P], refs[2 * P + (k if cfg.olds else 0):]
  new_ps, rest = outs[:P], outs[P:]
  copy_refs, (mu_out, nu_out) = rest[:k], rest[k:]
  copied = [i for i, c in enumerate(cfg.copies) if c is not None]
  copy_of = dict(zip(copied, copy_refs, strict=True))
  pid = pl.program_id(0)
  sc = [sc_ref[j] for j in range(5)]
  for i, b0, nb in _leaf_blocks(cfg):
    @pl.when((pid >= b0) & (pid < b0 + nb))
    def _(i=i, b0=b0):
      s = pl.multiple_of((pid - b0) * BLOCK, BLOCK)
      f = pl.multiple_of(pid * BLOCK, BLOCK)
      n = cfg.sizes[i]
      g = _load(gs[i], s, n).astype(F32)
      p = _load(ps[i], s, n).astype(F32)
      mu, nu = mu_ref[pl.ds(f, BLOCK)], nu_ref[pl.ds(f, BLOCK)]
      p, mu, nu = _update(g, p, mu, nu, sc, cfg.decay[i], cfg.hyper)
      mu_out[pl.ds(f, BLOCK)] = mu        # zero past the leaf: its g, mu and nu are zero there
      nu_out[pl.ds(f, BLOCK)] = nu
      _store(new_ps[i], s, n, p)
      if i in copy_of:
        _store(copy_of[i], s, n, p)


def _sq_kernel(*refs, cfg: _Cfg):
  gs, out = refs[:-1], refs[-1]
  pid = pl.program_id(0)
  for i, b0, nb in _leaf_blocks(cfg):
    @pl.when((pid >= b0) & (pid < b0 + nb))
    def _(i=i, b0=b0):
      g = _load(gs[i], pl.multiple_of((pid - b0) * BLOCK, BLOCK), cfg.sizes[i]).astype(F32)
      out[pid] = jnp.sum(g * g)


def _cfg(gs, ps, copy_dtypes, hyper) -> _Cfg:
  sizes = tuple(int(g.size) for g in gs)
  offs, _ = offsets(sizes)
  return _Cfg(sizes, tuple(o // BLOCK for o in offs),
              tuple(p.ndim >= 2 for p in ps) if ps is not None else (False,) * len(gs),
              tuple(None if d is None else jnp.dtype(d).name for d in copy_dtypes)
              if copy_dtypes is not None else (None,) * len(gs), hyper)


def _check(gs, ps, mu, nu):
  if not gs:
    raise ValueError("adamw: no leaves")
  if ps is not None:
    if len(ps) != len(gs) or any(p.shape != g.shape for p, g in zip(ps, gs, strict=True)):
      raise ValueError("adamw: every value needs its gradient, of its shape")
  _, L = offsets([g.size for g in gs])
  for x in (mu, nu):
    if x is not None and x.shape != (L,):
      raise ValueError(f"adamw: moments must be f32[{L}] (the leaves' aligned buffer); got "
                       f"{x.shape}")


def _params():
  return plgpu.CompilerParams(num_warps=WARPS, num_stages=1)


def adamw_pallas(gs, ps, mu, nu, scalars, *, hyper: Hyper, copy_dtypes=None, old_copies=None,
                 interpret: bool = False):
  """``(new values, copies, mu', nu')``: ``copies`` a tuple with an entry per leaf (None where
  ``copy_dtypes`` names none). The new values, copies (``old_copies``: the current ones, per
  leaf, or None: new buffers) and moments are written over the old ones' buffers (aliased),
  so a step that keeps the old state (the train step's skip branch) copies nothing."""
  _check(gs, ps, mu, nu)
  cfg = _cfg(gs, ps, copy_dtypes, hyper)
  flat = lambda xs: [x.reshape(-1) for x in xs]
  P = len(gs)
  olds = ([] if old_copies is None else
          [o.reshape(-1) for o, c in zip(old_copies, cfg.copies, strict=True) if c is not None])
  outs = ([jax.ShapeDtypeStruct((n,), p.dtype) for n, p in zip(cfg.sizes, ps, strict=True)]
          + [jax.ShapeDtypeStruct((n,), c) for n, c in zip(cfg.sizes, cfg.copies, strict=True)
             if c is not None]
          + [jax.ShapeDtypeStruct(mu.shape, F32)] * 2)
  k = len(outs) - P - 2
  if olds and len(olds) != k:
    raise ValueError(f"adamw: old_copies has {len(olds)} copies for {k}")
  args = [jnp.asarray(scalars, F32), mu, nu, *flat(gs), *flat(ps), *olds]
  whole = pl.no_block_spec
  kw = dict(grid=(mu.shape[0] // BLOCK,), in_specs=[whole] * len(args),
            out_specs=tuple(whole for _ in outs), interpret=interpret, name="adamw",
            compiler_params=_params())
  kernel = functools.partial(_adamw_kernel, cfg=cfg._replace(olds=bool(olds)))
  if _poison.active():          # (the tests' NaN-filled outputs, not aliased)
    res = _poison.pallas_call(kernel, args, out_shape=tuple(outs), **kw)
  else:
    alias = {1: P + k, 2: P + k + 1, **{3 + P + i: i for i in range(P)},
             **{3 + 2 * P + j: P + j for j in range(len(olds))}}
    res = pl.pallas_call(kernel, out_shape=tuple(outs), input_output_aliases=alias, **kw)(*args)
  new_p = tuple(r.reshape(p.shape) for r, p in zip(res[:P], ps, strict=True))
  it = iter(res[P:-2])
  copies = tuple(None if c is None else next(it).reshape(p.shape)
                 for c, p in zip(cfg.copies, ps, strict=True))
  return new_p, copies, res[-2], res[-1]


def sq_norm_pallas(gs, *, interpret: bool = False):
  """The float32 sum of the leaves' squares (any number of leaves: a pointer each; the
  optimizer passes all its kernel groups' at once)."""
  _check(gs, None, None, None)
  cfg = _cfg(gs, None, None, None)
  blocks = sum(pl.cdiv(n, BLOCK) for n in cfg.sizes)
  whole = pl.no_block_spec
  part = _poison.pallas_call(
      functools.partial(_sq_kernel, cfg=cfg), [g.reshape(-1) for g in gs],
      out_shape=jax.ShapeDtypeStruct((blocks,), F32), grid=(blocks,),
      in_specs=[whole] * len(gs), out_specs=whole, interpret=interpret, name="adamw_sq_norm",
      compiler_params=_params())
  return jnp.sum(part)


def pack(xs, dtype=F32):
  """The leaves in the aligned buffer ``[L]`` (zero between them)."""
  offs, L = offsets([x.size for x in xs])
  parts = []
  for x, o, o2 in zip(xs, offs, (*offs[1:], L), strict=True):
    parts.append(x.reshape(-1).astype(dtype))
    if o2 - o > x.size:
      parts.append(jnp.zeros((o2 - o - x.size,), dtype))
  return jnp.concatenate(parts) if len(parts) > 1 else parts[0]


def adamw_xla(gs, ps, mu, nu, scalars, *, hyper: Hyper, copy_dtypes=None, old_copies=None,
              interpret=None):
  """The twin (same signature): the update on the packed buffer, then each leaf's slice (new
  buffers: ``old_copies`` only keeps the signature)."""
  del old_copies, interpret
  _check(gs, ps, mu, nu)
  offs, _ = offsets([g.size for g in gs])
  sc = [jnp.asarray(scalars, F32)[k] for k in range(5)]
  g, p = pack(gs), pack(ps)
  decay = pack([jnp.full(x.shape, x.ndim >= 2, bool) for x in ps], bool)
  new_p, mu, nu = _update(g, p, mu, nu, sc, decay, hyper)
  cut = lambda buf, x, o: buf[o:o + x.size].reshape(x.shape).astype(x.dtype)
  vals = tuple(cut(new_p, x, o) for x, o in zip(ps, offs, strict=True))
  dts = copy_dtypes if copy_dtypes is not None else (None,) * len(gs)
  copies = tuple(None if d is None else v.astype(d) for v, d in zip(vals, dts, strict=True))
  return vals, copies, mu, nu


def sq_norm_xla(gs, *, interpret=None):
  """The twin: the float32 sum of the leaves' squares."""
  del interpret
  return sum(jnp.sum(jnp.square(g.astype(F32))) for g in gs)
