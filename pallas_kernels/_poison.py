"""``pallas_call`` wrapper with a test switch that NaN-fills every output before the kernel runs.

Under ``poison_outputs()`` each kernel output is aliased to a NaN-filled input buffer, so any
element a kernel forgets to write stays NaN and is caught by the tests (forward and backward
kernels alike, also through ``jax.grad``). The switch is read at trace time.
"""

from __future__ import annotations

import contextlib

import jax.numpy as jnp
from jax.experimental import pallas as pl

_POISON = [False]


@contextlib.contextmanager
def poison_outputs():
  """Within this context, newly traced kernels start from NaN-filled outputs."""
  _POISON.append(True)
  try:
    yield
  finally:
    _POISON.pop()


def active() -> bool:
  """Whether kernels traced now start from NaN-filled outputs (``poison_outputs``)."""
  return _POISON[-1]


def pallas_call(kernel, args, *, out_shape, in_specs, out_specs, **kw):
  """``pl.pallas_call(kernel, ...)(*args)``, poisoned under ``poison_outputs()``."""
  if not _POISON[-1]:
    return pl.pallas_call(kernel, out_shape=out_shape, in_specs=in_specs, out_specs=out_specs,
                          **kw)(*args)
  multi = isinstance(out_shape, (tuple, list))
  outs = tuple(out_shape) if multi else (out_shape,)
  specs = tuple(out_specs) if multi else (out_specs,)
  n = len(args)

  def poisoned(*refs):  # inputs, then the (aliased) NaN buffers, then the outputs
    kernel(*refs[:n], *refs[n + len(outs):])

  inits = [jnp.full(o.shape, jnp.nan, o.dtype) for o in outs]
  return pl.pallas_call(poisoned, out_shape=out_shape, in_specs=[*in_specs, *specs],
                        out_specs=out_specs,
                        input_output_aliases={n + i: i for i in range(len(outs))}, **kw)(
                            *args, *inits)
