"""Pointwise score activations shared by every GDPA / block-attention backend (spec c.1: the
twelve of Meta's GDPA kernels). Notes: pallas_kernels/README.md, ``activations.py``."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_C = 0.044715
# Taylor coefficients of x * Phi(x) at 0: 1/2, 1/sqrt(2 pi), -1/(6 sqrt(2 pi)), 1/(40 sqrt(2 pi)).
_T2 = 1.0 / math.sqrt(2.0 * math.pi)
_T4 = -_T2 / 6.0
_T6 = _T2 / 40.0
LEAKY_SLOPE = 0.01


def _fast_gelu(x):
  return 0.5 * x * (1.0 + jnp.tanh(_SQRT_2_OVER_PI * x * (1.0 + _GELU_C * x * x)))


def _round_bf16(x):
  return x.astype(jnp.bfloat16).astype(x.dtype)


@jax.custom_jvp
def _fast_gelu_bf16(x):
  return _fast_gelu(_round_bf16(x))


@_fast_gelu_bf16.defjvp
def _fast_gelu_bf16_jvp(primals, tangents):
  (x,), (t,) = primals, tangents
  return jax.jvp(_fast_gelu, (_round_bf16(x),), (t,))   # slope at the rounded point


def _gelu_taylor(x):
  x2 = x * x
  return x * (0.5 + x * (_T2 + x2 * (_T4 + x2 * _T6)))


ACTIVATIONS = {
    "identity": lambda x: x,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "fast_gelu": _fast_gelu,
    "fast_gelu_bf16": _fast_gelu_bf16,
    "gelu_taylor": _gelu_taylor,
    "silu": jax.nn.silu,
    "fast_silu": jax.nn.silu,
    "relu": jax.nn.relu,
    "relu2": lambda x: jnp.square(jax.nn.relu(x)),
    "leaky_relu": lambda x: jnp.where(x >= 0, x, LEAKY_SLOPE * x),
    "hardswish": jax.nn.hard_swish,
}
NAMES = tuple(ACTIVATIONS)
# Stable integer codes (the Triton kernels' ACT constexpr; never reorder, only append).
CODES = {name: i for i, name in enumerate(NAMES)}


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


# ----------------------------------------------------------------------------- kernel forms


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


def _tanh_gelu_kernel(x, with_slope, tanh):
  x2 = x * x
  t = tanh(x * (_SQRT_2_OVER_PI + _SQRT_2_OVER_PI * _GELU_C * x2))
  hx = 0.5 * x
  p = hx + hx * t
  if not with_slope:
    return p
  return p, 0.5 + 0.5 * t + hx * (1.0 - t * t) * (_SQRT_2_OVER_PI
                                                  + 3.0 * _SQRT_2_OVER_PI * _GELU_C * x2)


def _silu_kernel(x, with_slope, sigmoid):
  sg = sigmoid(x)
  p = x * sg
  return (p, sg * (1.0 + x * (1.0 - sg))) if with_slope else p


def _exact_sigmoid(x):
  return 1.0 / (1.0 + jnp.exp(-x))


def _kernel_table(tanh, sigmoid):
  """name -> f(x, with_slope) in plain fp32 jnp ops (Triton-lowering safe)."""
  one, zero = 1.0, 0.0

  def taylor(x, ws):
    x2 = x * x
    p = x * (0.5 + x * (_T2 + x2 * (_T4 + x2 * _T6)))
    return (p, 0.5 + x * (2 * _T2 + x2 * (4 * _T4 + x2 * 6 * _T6))) if ws else p

  def relu(x, ws):
    p = jnp.maximum(x, zero)
    return (p, jnp.where(x > 0, one, zero)) if ws else p

  def relu2(x, ws):
    r = jnp.maximum(x, zero)
    return (r * r, 2.0 * r) if ws else r * r

  def leaky(x, ws):
    pos = x >= 0
    p = jnp.where(pos, x, LEAKY_SLOPE * x)
    return (p, jnp.where(pos, one, LEAKY_SLOPE)) if ws else p

  def hardswish(x, ws):
    p = x * jnp.minimum(jnp.maximum(x + 3.0, zero), 6.0) * (1.0 / 6.0)
    if not ws:
      return p
    return p, jnp.where(x < -3.0, zero, jnp.where(x > 3.0, one, x * (1.0 / 3.0) + 0.5))

  tanh_gelu = lambda x, ws: _tanh_gelu_kernel(x, ws, tanh)
  return {
      "identity": lambda x, ws: (x, jnp.ones_like(x)) if ws else x,
      "gelu": _gelu_kernel,
      "gelu_tanh": lambda x, ws: _tanh_gelu_kernel(x, ws, jnp.tanh),
      "fast_gelu": tanh_gelu,
      "fast_gelu_bf16": lambda x, ws: tanh_gelu(_round_bf16(x), ws),
      "gelu_taylor": taylor,
      "silu": lambda x, ws: _silu_kernel(x, ws, _exact_sigmoid),
      "fast_silu": lambda x, ws: _silu_kernel(x, ws, sigmoid),
      "relu": relu,
      "relu2": relu2,
      "leaky_relu": leaky,
      "hardswish": hardswish,
  }


_EXACT = _kernel_table(jnp.tanh, _exact_sigmoid)


def _fast_table():
  tanh = plgpu.approx_tanh
  return _kernel_table(tanh, lambda x: 0.5 + 0.5 * tanh(0.5 * x))


def kernel_fn(name: str, with_slope: bool = False, fast: bool = False):
  """``f(x) -> act(x)`` or ``(act(x), act'(x))`` for fp32 tiles inside a kernel."""
  table = _fast_table() if fast else _EXACT
  f = table[name]
  return lambda x: f(x, with_slope)


def in_kernel(s, acts: tuple[str, ...], head, with_slope: bool = False, fast: bool = False):
  """Applies the activation of head ``head`` (a traced scalar) to a score tile ``s``.

  One activation for every head is a direct call; distinct per-head activations dispatch with
  ``lax.switch`` on a code computed from ``head``, so each tile evaluates only its own function.
  Returns ``act(s)`` or, with ``with_slope``, ``(act(s), act'(s))``.
  """
  distinct = sorted(set(acts))
  if len(distinct) == 1:
    return kernel_fn(distinct[0], with_slope, fast)(s)
  code = jnp.int32(0)
  for h, a in enumerate(acts):  # a select chain (no bool -> int casts: Triton-lowering safe)
    code = jnp.where(head == h, jnp.int32(distinct.index(a)), code)
  return jax.lax.switch(code, [kernel_fn(a, with_slope, fast) for a in distinct], s)
