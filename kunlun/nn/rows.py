"""Request-level values of the shared serving path (spec d.6; ``kunlun.serving.score``).

A serving batch has ``N`` ad rows (candidate ads with their context features) and ``R`` request
rows (the users' event streams); ``request_index i32[N]`` names each ad's request. Inside the
trunk a value whose leading axis indexes requests is wrapped in ``PerRequest``; a plain array has
ad rows. Modules run on request rows while every input they read is request-level, and the
first module that mixes in an ad-level input runs on ad rows (``apply``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class PerRequest:
  """A pytree of arrays whose leading axis indexes requests (not ads)."""
  value: Any


def is_shared(v) -> bool:
  return isinstance(v, PerRequest)


def to_ads(v, request_index):
  """Ad rows of ``v``: ``value[request_index]`` for a ``PerRequest``, else ``v`` itself."""
  if not isinstance(v, PerRequest):
    return v
  return jax.tree.map(lambda x: jnp.take(x, request_index, axis=0), v.value)


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
