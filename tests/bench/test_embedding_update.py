"""bench.embedding_update's byte count of in-place scatters, against hand-counted bytes."""

import jax
import jax.numpy as jnp

from bench.embedding_update import inplace_scatter_bytes
from bench.profiling import roofline


def test_inplace_scatter_is_charged_its_rows_not_the_table():
  """A donated [10000, 8] f32 table scatter-added at 16 ids: indices (16 x 4 B) + 3 x updates
  (16 x 8 x 4 B), where the roofline charges the 320 kB table in and out."""
  f = jax.jit(lambda t, i, u: t.at[i].add(u), donate_argnums=0)
  text = f.lower(jax.ShapeDtypeStruct((10000, 8), jnp.float32),
                 jax.ShapeDtypeStruct((16,), jnp.int32),
                 jax.ShapeDtypeStruct((16, 8), jnp.float32)).compile().as_text()
  charges = inplace_scatter_bytes(text)
  assert list(charges.values()) == [16 * 4 + 3 * 16 * 8 * 4]
  op = next(c for c in roofline.op_costs(text) if c["name"] in charges)
  assert op["bytes_in"] + op["bytes_out"] >= 2 * 10000 * 8 * 4
