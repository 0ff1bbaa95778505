"""Request-level values of the shared serving path (spec d.6; ``kunlun.serving.score``).

A serving batch has ``N`` ad rows (candidate ads with their context features) and ``R`` request
rows (the users' event streams); ``request_index i32[N]`` names each ad's request. Inside the
trunk a value whose leading axis indexes requests is wrapped in ``PerRequest``; a plain array has
ad rows. Modules run on request rows while every input they read is request-level, and the
first module that mixes in an ad-level input runs on ad rows (``apply``).

Packed request histories (``data.jagged`` layout, issue #28): a packed tower's request-level
tokens ``Packed([C, d], jag)`` and ages ``f32[C]`` hold the R requests' real events back to back
(``jag``: ``offsets i32[R+1]``, ``seg``/``pos i32[C]``). They run packed while request-level and
are laid out as padded request rows ``[R, T]`` (``padded``) where they meet ad rows.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from kunlun.nn import packed
from pallas_kernels import jagged


@struct.dataclass
class PerRequest:
  """A pytree of arrays whose leading axis indexes requests (not ads). ``jag`` /
  ``kept_len``: set when the leading axis holds the requests' packed tokens instead (a packed
  tower's ages ``f32[C]``): ``padded`` lays them out as ``[R, kept_len]`` rows."""
  value: Any
  jag: Any = None
  kept_len: int = struct.field(pytree_node=False, default=0)


def is_shared(v) -> bool:
  return isinstance(v, PerRequest)


def requests(seqs: dict, lengths: dict, ages: dict, kept_lens: dict):
  """The trunk's per-tower ``(seqs, lengths, ages)`` of the request rows wrapped as
  ``PerRequest``; a packed tower's lengths are its descriptor's (``i32[R]``) and its ages carry
  the descriptor and ``kept_lens[tower]`` (the padded row width T)."""
  ws, wl, wa = {}, {}, {}
  for n, s in seqs.items():
    ws[n] = PerRequest(s)
    if packed.is_packed(s):
      wl[n], wa[n] = PerRequest(s.jag.lengths), PerRequest(ages[n], s.jag, kept_lens[n])
    else:
      wl[n], wa[n] = PerRequest(lengths[n]), PerRequest(ages[n])
  return ws, wl, wa


def padded(v, kept_len: int | None = None):
  """Packed request tokens as padded request rows: ``PerRequest(Packed([C, ...], jag))`` or a
  ``PerRequest`` with ``jag`` -> ``PerRequest([R, T, ...])`` (zeros at and past each request's
  length; ``T``: ``kept_len`` or the value's own); anything else unchanged."""
  if not isinstance(v, PerRequest):
    return v
  x, jag = (v.value.value, v.value.jag) if packed.is_packed(v.value) else (v.value, v.jag)
  if jag is None:
    return v
  T = kept_len or v.kept_len
  if not T:
    raise ValueError("rows.padded: packed request tokens need the tower's kept length")
  return PerRequest(jagged.unpack(x, jag, T))


def to_ads(v, request_index):
  """Ad rows of ``v``: ``value[request_index]`` for a ``PerRequest`` (packed request tokens
  laid out as padded rows first, ``padded``), else ``v`` itself."""
  if not isinstance(v, PerRequest):
    return v
  return jax.tree.map(lambda x: jnp.take(x, request_index, axis=0), padded(v).value)


def apply(fn, request_index, *args):
  """``fn(*args)`` once per request when every non-None argument is ``PerRequest`` (result
  wrapped as ``PerRequest``), else on ad rows (request-level arguments gathered)."""
  present = [a for a in args if a is not None]
  if present and all(isinstance(a, PerRequest) for a in present):
    return PerRequest(fn(*(None if a is None else a.value for a in args)))
  return fn(*(to_ads(a, request_index) for a in args))


def like(ref, v, request_index):
  """``v`` at the level of ``ref``: gathered to ad rows when ``ref`` has ad rows."""
  return v if isinstance(ref, PerRequest) else to_ads(v, request_index)
