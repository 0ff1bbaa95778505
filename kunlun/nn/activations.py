"""Elementwise activations with a small backward footprint.

``gelu``: flax's ``nn.gelu`` (tanh approximation) with a hand-written VJP that keeps only the
input and recomputes the activation's derivative in the backward (``jax.vjp`` of the same
function, so gradients are those of autodiff). Autodiff would keep each intermediate (``x^3``,
the ``tanh``, ...) for the backward, and XLA then emits the forward as several fusions, one per
kept value; here it is one.
"""

from __future__ import annotations

import functools

import jax

_gelu = functools.partial(jax.nn.gelu, approximate=True)


@jax.custom_vjp
def gelu(x):
  """``nn.gelu(x)`` (tanh approximation), same values and gradients."""
  return _gelu(x)


def _fwd(x):
  return _gelu(x), x


def _bwd(x, g):
  # the barrier keeps XLA from merging the recomputation with the forward's intermediates (CSE
  # would bring back the forward that keeps them all)
  return jax.vjp(_gelu, jax.lax.optimization_barrier(x))[1](g)


gelu.defvjp(_fwd, _bwd)
