"""The roofline's byte count of the in-place scatter bench.embedding_update measures, against
hand-counted bytes."""

import jax
import jax.numpy as jnp

from bench.profiling import roofline


def test_inplace_scatter_is_charged_its_rows_not_the_table():
  """A donated [10000, 8] f32 table scatter-added at 16 ids: indices (16 x 4 B) + 3 x updates
  (16 x 8 x 4 B: updates read, rows read, rows written), not the 320 kB table in and out."""
  f = jax.jit(lambda t, i, u: t.at[i].add(u), donate_argnums=0)
  text = f.lower(jax.ShapeDtypeStruct((10000, 8), jnp.float32),
                 jax.ShapeDtypeStruct((16,), jnp.int32),
                 jax.ShapeDtypeStruct((16, 8), jnp.float32)).compile().as_text()
  (op,) = [c for c in roofline.op_costs(text) if "scatter" in c["op_name"]]
  assert op["bytes_in"] + op["bytes_out"] == 16 * 4 + 3 * 16 * 8 * 4
