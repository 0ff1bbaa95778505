"""A shared check of the packed modules' tests: the Pallas backend (interpret mode) against the
XLA backend, output and gradients (parameters and tokens)."""

import jax
import jax.numpy as jnp
import numpy as np


def _rel(u, w) -> float:
  """Largest absolute difference relative to the largest element of ``w``."""
  u, w = np.asarray(u, np.float64), np.asarray(w, np.float64)
  return float(np.max(np.abs(u - w)) / max(np.max(np.abs(w)), 1e-30))


def pallas_matches_xla(mods, params, x, apply, g, dtype, bf16_tol=2e-2):
  """``apply(module, params, x) -> y``; ``mods`` {"xla", "pallas"}: asserts the Pallas run's
  ``y`` and the gradients of ``sum(y * g)`` within 1e-5 (float32) or ``bf16_tol`` (bfloat16) of
  the largest element of the XLA run's; returns the Pallas ``y``."""
  def run(m):
    loss = lambda v, x: jnp.sum(apply(m, v, x).astype(jnp.float32) * g)
    return jax.jit(lambda v, x: (apply(m, v, x), jax.grad(loss, argnums=(0, 1))(v, x)))(params, x)

  (want, g_want), (got, g_got) = run(mods["xla"]), run(mods["pallas"])
  tol = 1e-5 if dtype == jnp.float32 else bf16_tol
  assert _rel(got, want) <= tol
  for (path, u), w in zip(jax.tree_util.tree_leaves_with_path(g_got), jax.tree.leaves(g_want),
                          strict=True):
    assert _rel(u, w) <= tol, jax.tree_util.keystr(path)
  return got
