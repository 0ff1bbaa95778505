"""``nn.Dense``'s parameters declared apart from its computation, for modules with a fused
kernel that takes the weights itself: ``DenseParams`` declares ``kernel [d_in, features]`` and
``bias [features]`` (float32) under ``nn.Dense``'s names and initialisers, so the parameter tree
and checkpoints are those of ``nn.Dense``; ``dense`` computes ``x [..., d_in] -> [...,
features]`` as ``nn.Dense`` in ``dtype`` does."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
from jax import lax

from sharding import with_axes

F32 = jnp.float32


class DenseParams(nn.Module):
  """``() -> (kernel [d_in, features], bias [features] or None)`` on the logical ``axes`` (the
  kernel's; the bias takes the last)."""
  d_in: int
  features: int
  axes: tuple = ("embed", "mlp")
  use_bias: bool = True
  kernel_init: object = nn.initializers.lecun_normal()

  @nn.compact
  def __call__(self):
    kernel = self.param("kernel", with_axes(self.kernel_init, self.axes),
                        (self.d_in, self.features), F32)
    bias = (self.param("bias", with_axes(nn.initializers.zeros, self.axes[-1:]),
                       (self.features,), F32) if self.use_bias else None)
    return kernel, bias


def dense(x, kernel, bias, dtype):
  """``x kernel + bias`` with every operand in ``dtype``, as ``nn.Dense`` computes it."""
  y = lax.dot_general(x.astype(dtype), kernel.astype(dtype), (((x.ndim - 1,), (0,)), ((), ())))
  return y if bias is None else y + bias.astype(dtype).reshape((1,) * (y.ndim - 1) + (-1,))
