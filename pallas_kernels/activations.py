"""Pointwise score activations shared by every GDPA / block-attention backend."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _fast_gelu(x):
  return 0.5 * x * (1.0 + jnp.tanh(_SQRT_2_OVER_PI * x * (1.0 + 0.044715 * x * x)))


ACTIVATIONS = {
    "identity": lambda x: x,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "fast_gelu": _fast_gelu,
    "silu": jax.nn.silu,
    "relu": jax.nn.relu,
    "relu2": lambda x: jnp.square(jax.nn.relu(x)),
}
NAMES = tuple(ACTIVATIONS)


def per_head(activation, num_heads: int) -> tuple[str, ...]:
  """Normalises ``activation`` (a name or a tuple of names, one per head) to a tuple."""
  if isinstance(activation, str):
    acts = (activation,) * num_heads
  else:
    acts = tuple(activation)
    if len(acts) != num_heads:
      raise ValueError(f"activation tuple has {len(acts)} entries but there are {num_heads} heads")
  for a in acts:
    if a not in ACTIVATIONS:
      raise ValueError(f"unknown activation {a!r}; allowed: {NAMES}")
  return acts


def apply_per_head(s, acts: tuple[str, ...], head_axis: int):
  """Applies ``acts[h]`` to slice h of ``s`` along ``head_axis`` (one call if all equal)."""
  if len(set(acts)) == 1:
    return ACTIVATIONS[acts[0]](s)
  parts = [ACTIVATIONS[a](jax.lax.index_in_dim(s, h, head_axis, keepdims=True))
           for h, a in enumerate(acts)]
  return jnp.concatenate(parts, axis=head_axis)


def value_and_slope(s, act: str):
  """Returns ``(act(s), act'(s))`` elementwise (via a JVP, so it matches ``jax.grad``)."""
  return jax.jvp(ACTIVATIONS[act], (s,), (jnp.ones_like(s),))


def _erf_kernel(x):
  """erf from exp and a rational polynomial (Abramowitz & Stegun 7.1.26, |error| < 1.5e-7):
  the Pallas Triton lowering has no rule for ``lax.erf``."""
  z = jnp.abs(x)
  t = 1.0 / (1.0 + 0.3275911 * z)
  poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027
                                                                         + t * 1.061405429))))
  e = 1.0 - poly * jnp.exp(-z * z)
  return jnp.where(x < 0, -e, e)


def _gelu_kernel(x, with_slope):
  cdf = 0.5 * (1.0 + _erf_kernel(x * (1.0 / math.sqrt(2.0))))
  if not with_slope:
    return x * cdf
  return x * cdf, cdf + x * jnp.exp(-0.5 * x * x) * (1.0 / math.sqrt(2.0 * math.pi))


def in_kernel(s, acts: tuple[str, ...], head, with_slope: bool = False):
  """Applies the activation of head ``head`` (a traced scalar) to a score tile ``s``.

  One activation for every head is a direct call; distinct per-head activations dispatch with
  ``lax.switch`` on a code computed from ``head``, so each tile evaluates only its own function.
  Returns ``act(s)`` or, with ``with_slope``, ``(act(s), act'(s))``.
  """
  def fn(a):
    if a == "gelu":
      return lambda x: _gelu_kernel(x, with_slope)
    return (lambda x: value_and_slope(x, a)) if with_slope else ACTIVATIONS[a]

  distinct = sorted(set(acts))
  if len(distinct) == 1:
    return fn(distinct[0])(s)
  code = jnp.int32(0)
  for h, a in enumerate(acts):  # a select chain (no bool -> int casts: Triton-lowering safe)
    code = jnp.where(head == h, jnp.int32(distinct.index(a)), code)
  return jax.lax.switch(code, [fn(a) for a in distinct], s)
