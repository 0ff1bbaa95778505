"""Where the model casts its parameters to the compute dtype (issue 19: "cast once per step").

``cast_uses(fn, params, *args)`` traces ``fn(params, *args)`` (``jax.make_jaxpr``) and returns, per
parameter leaf, ``(dtype, uses)``: ``dtype`` when each use of the leaf (also inside ``pjit`` /
``remat`` / custom-derivative calls) is a ``convert_element_type`` to one and the same 16-bit
dtype (the model's ``w.astype(dtype)`` of a float32 parameter in a bfloat16 config), else None;
``uses`` counts the casts. A leaf cast at one site is already cast once per step (XLA runs that
convert once); more sites would mean one convert per use. ``summary`` gives the counts that
``bench/train_step.py`` reports as ``param_casts``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_LOW = (jnp.bfloat16, jnp.float16)
_SUB = ("jaxpr", "call_jaxpr", "fun_jaxpr")   # sub-jaxprs whose inputs are the operands, 1:1
_ONE_TO_ONE = ("pjit", "closed_call", "core_call", "remat2", "checkpoint", "custom_jvp_call",
               "custom_vjp_call", "custom_vjp_call_jaxpr", "remat")


def _uses(jaxpr, var, out: list) -> bool:
  """Appends the target dtype of every use of ``var`` in ``jaxpr``; False when a use is not a
  cast (then the leaf does not qualify)."""
  if any(v is var for v in jaxpr.outvars):
    return False
  for eqn in jaxpr.eqns:
    for i, x in enumerate(eqn.invars):
      if x is not var:
        continue
      if eqn.primitive.name == "convert_element_type":
        out.append(jnp.dtype(eqn.params["new_dtype"]))
        continue
      sub = next((eqn.params[k] for k in _SUB if k in eqn.params), None)
      if eqn.primitive.name not in _ONE_TO_ONE or sub is None:
        return False
      sub = getattr(sub, "jaxpr", sub)
      if len(sub.invars) != len(eqn.invars) or not _uses(sub, sub.invars[i], out):
        return False
  return True


def cast_uses(fn, params, *args) -> list[tuple]:
  """Per leaf of ``params``: ``(dtype, uses)`` when every use casts it to the same 16-bit
  ``dtype``, else ``(None, uses)``."""
  closed = jax.make_jaxpr(fn)(params, *args)
  n = len(jax.tree.leaves(params))
  res = []
  for var, leaf in zip(closed.jaxpr.invars[:n], jax.tree.leaves(params), strict=True):
    dts = []
    ok = _uses(closed.jaxpr, var, dts)
    same = ok and dts and all(d == dts[0] for d in dts) and dts[0] in map(jnp.dtype, _LOW)
    res.append((dts[0] if same and jnp.dtype(leaf.dtype) != dts[0] else None, len(dts)))
  return res


def summary(fn, params, *args) -> dict:
  """``{leaves, cast_16bit, cast_sites, max_sites}`` of ``cast_uses``."""
  res = cast_uses(fn, params, *args)
  sites = [u for d, u in res if d is not None]
  return {"leaves": len(res), "cast_16bit": len(sites), "cast_sites": sum(sites),
          "max_sites": max(sites, default=0)}
