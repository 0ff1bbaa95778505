"""The one entry point the model uses for GDPA (spec c.1).

``o_i = out_scale * sum_j act(scale * <q_i, k_j>) v_j`` over valid keys, no softmax. The backend
("xla" reference now; "pallas", "triton" or "auto" once registered) is a config choice passed
through to ``pallas_kernels.gdpa``; this wrapper only adds the ``GDPA`` profiler scope.
"""

from __future__ import annotations

import jax

import pallas_kernels


def gdpa(q, k, v, *, backend: str = "xla", **kw):
  """``q [B|1, Tq, H, D]``, ``k, v [B, Tk, H, D]`` -> ``[B, Tq, H, D]`` in ``q.dtype``.

  Keyword arguments are those of ``pallas_kernels.gdpa``: ``activation`` (name or per-head tuple),
  ``scale`` (default ``1/sqrt(D)``), ``out_scale``, ``q_lengths``, ``kv_lengths``, ``window``,
  ``broadcast_q``, ``interpret``.
  """
  with jax.named_scope("GDPA"):
    return pallas_kernels.gdpa(q, k, v, backend=backend, **kw)
