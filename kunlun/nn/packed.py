"""Packed ("jagged") event towers in the trunk (issue #28): ``Packed(value [N, ...], jag)``.

A packed tower's tokens ``[N, d]`` (B examples back to back, ``pallas_kernels.jagged.Jagged``)
run every sequence module per token; the cross-token ops go through the jagged kernels here
(``backend``: "xla" the XLA twins, "pallas" ``jagged_pallas``, "auto" Pallas on a GPU else XLA).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from pallas_kernels import jagged, jagged_pallas
from pallas_kernels.api import compile_platform

F32 = jnp.float32


@struct.dataclass
class Packed:
  """One packed tower: ``value [N, ...]`` with ``jag`` (offsets / seg / pos). Why a wrapper and
  not ``[1, N, d]``: the modules dispatch on its type and the descriptor travels with the tokens
  (as ``kunlun.nn.rows.PerRequest`` does), so the layer's dicts of towers stay as they are."""
  value: Any
  jag: jagged.Jagged


def is_packed(v) -> bool:
  return isinstance(v, Packed)


def as_rows(x, jag: jagged.Jagged):
  """``(x [N, ...] as [1, N, ...], lengths i32[1] = real tokens)``: the packed buffer as one
  padded row, for the per-token ops that mask rows at or past a length (real tokens are
  ``[0, offsets[B])``)."""
  return x[None], jag.total[None]


def _use_pallas(backend: str) -> bool:
  if backend == "auto":
    return compile_platform() == "gpu"
  if backend not in ("xla", "pallas"):
    raise ValueError(f"model.backend = {backend!r} has no jagged kernels (packed towers: xla, "
                     "pallas or auto)")
  return backend == "pallas"


def _interpret() -> bool:
  return compile_platform() != "gpu"


def gdpa_cross(q, k, v, jag, *, backend: str, **kw):
  """PFFN's GDPA: ``q [N, H, D]`` reads its example's ``k, v [B, n_kv, H, D]`` -> ``[N, H, D]``."""
  with jax.named_scope("GDPA"):
    if _use_pallas(backend):
      return jagged_pallas.jagged_gdpa_cross_pallas(q, k, v, jag, interpret=_interpret(), **kw)
    return jagged.jagged_gdpa_cross(q, k, v, jag, **kw)


def gdpa_pool(q, k, v, jag, *, backend: str, **kw):
  """HSP's GDPA: seeds ``q [S, H, D]`` pool ``k, v [N, H, D]`` per example -> ``[B, S, H, D]``."""
  with jax.named_scope("GDPA"):
    if _use_pallas(backend):
      return jagged_pallas.jagged_gdpa_pool_pallas(q, k, v, jag, interpret=_interpret(), **kw)
    return jagged.jagged_gdpa_pool(q, k, v, jag, **kw)


def block_attention(q, k, v, jag, *, backend: str, **kw):
  """Attention within each example's blocks, ``q, k, v [N, H, D]`` (already rotated)."""
  if _use_pallas(backend):
    return jagged_pallas.jagged_block_attention_pallas(q, k, v, jag, interpret=_interpret(), **kw)
  return jagged.jagged_block_attention(q, k, v, jag, **kw)


def softmax_attention(q, k, v, jag, *, backend: str, window=None):
  """Softmax self-attention within each example (``window``: the band; None: full)."""
  if _use_pallas(backend):
    return jagged_pallas.jagged_softmax_attention_pallas(q, k, v, jag, window=window,
                                                         interpret=_interpret())
  return jagged.jagged_softmax_attention(q, k, v, jag, window=window)
