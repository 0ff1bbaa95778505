"""Where the model casts its parameters to the compute dtype (issue 19: "cast once per step").

``cast_uses(fn, params, *args)`` (``kunlun.train.param_copies``) traces ``fn(params, *args)`` and
returns, per parameter leaf, ``(dtype, uses)``: ``dtype`` when each use of the leaf (also inside
``jit`` / ``remat`` / custom-derivative calls) is a ``convert_element_type`` to one and the same
16-bit dtype (the model's ``w.astype(dtype)`` of a float32 parameter in a bfloat16 config), else
None; ``uses`` counts the casts. A leaf cast at one site is already cast once per step (XLA runs
that convert once); more sites would mean one convert per use. ``summary`` gives the counts that
``bench/train_step.py`` reports as ``param_casts``.
"""

from __future__ import annotations

from kunlun.train.param_copies import cast_uses

__all__ = ["cast_uses", "summary"]


def summary(fn, params, *args) -> dict:
  """``{leaves, cast_16bit, cast_sites, max_sites}`` of ``cast_uses``."""
  res = cast_uses(fn, params, *args)
  sites = [u for d, u in res if d is not None]
  return {"leaves": len(res), "cast_16bit": len(sites), "cast_sites": sum(sites),
          "max_sites": max(sites, default=0)}
