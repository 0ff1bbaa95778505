"""Which parameters the model reads only through one cast to its 16-bit compute dtype, and their
copies in that dtype (kept in the optimizer state, ``kunlun.train.optim``).

``cast_uses(fn, params, *args)`` traces ``fn(params, *args)`` (``jax.make_jaxpr``) and returns,
per parameter leaf, ``(dtype, uses)``: ``dtype`` when every use of the leaf (also inside ``jit``
/ ``remat`` calls) is a ``convert_element_type`` to one and the same 16-bit dtype, else None;
``uses`` counts the casts. ``copy_dtypes`` picks the leaves cast at exactly one site outside any
custom-derivative rule: for such a leaf ``w``, a step that is handed ``w.astype(dtype)`` in its
place computes the same loss, and the gradient w.r.t. the copy, cast back to float32, equals the
gradient w.r.t. ``w`` bit for bit (the cast's transpose is that cast back). So the optimizer can
write the copy where it writes ``w`` (the update fusion's second output) and the step does not
launch one cast per weight.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

LOW = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_SUB = ("jaxpr", "call_jaxpr", "fun_jaxpr")    # sub-jaxprs whose inputs are the operands, 1:1
_CALLS = ("jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint", "remat")
_CUSTOM = ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr")


def _uses(jaxpr, var, out: list, through: tuple) -> bool:
  """Appends the target dtype of every use of ``var`` in ``jaxpr``; False when a use is not a
  cast (also inside the calls named in ``through``)."""
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
      if eqn.primitive.name not in through or sub is None:
        return False
      sub = getattr(sub, "jaxpr", sub)
      if len(sub.invars) != len(eqn.invars) or not _uses(sub, sub.invars[i], out, through):
        return False
  return True


def cast_uses(fn, params, *args, custom: bool = True) -> list[tuple]:
  """Per leaf of ``params``: ``(dtype, uses)`` when every use casts it to the same 16-bit
  ``dtype``, else ``(None, uses)``. ``custom``: also follow a leaf into custom-derivative calls
  (their rules may treat the cast differently; ``copy_dtypes`` does not)."""
  closed = jax.make_jaxpr(fn)(params, *args)
  leaves = jax.tree.leaves(params)
  through = _CALLS + (_CUSTOM if custom else ())
  res = []
  for var, leaf in zip(closed.jaxpr.invars[:len(leaves)], leaves, strict=True):
    dts = []
    ok = _uses(closed.jaxpr, var, dts, through)
    same = ok and dts and all(d == dts[0] for d in dts) and dts[0] in LOW
    res.append((dts[0] if same and jnp.dtype(leaf.dtype) != dts[0] else None, len(dts)))
  return res


def copy_dtypes(fn, params, *args) -> list:
  """Per leaf of ``params``: the 16-bit dtype of its copy (the leaf is cast to it at exactly one
  site, outside custom-derivative rules), else None."""
  return [d if d is not None and n == 1 else None
          for d, n in cast_uses(fn, params, *args, custom=False)]
