"""The one entry point the model uses for GDPA (spec c.1).

``o_i = out_scale * sum_j act(scale * <q_i, k_j>) v_j`` over valid keys, no softmax. The backend
("xla", "pallas", "triton" or "auto") is a config choice passed to ``pallas_kernels.gdpa``; this
wrapper adds the ``GDPA`` profiler scope and, for kernel backends under a sharded mesh, runs the
kernel per shard (``sharding.context``: XLA cannot partition a custom call by itself). ``seq``
names the operand whose sequence axis may be context-sharded: ``"q"`` (PFFN: the sequence is the
query; purely local) or ``"kv"`` (HSP: the sequence is the key/value side; partial sums + psum).
The "xla" backend is left to XLA's SPMD partitioner.
"""

from __future__ import annotations

import jax

import pallas_kernels
from sharding import context


def gdpa_op(q, k, v, *, backend: str = "xla", seq: str = "q", **kw):
  """``q [B|1, Tq, H, D]``, ``k, v [B, Tk, H, D]`` -> ``[B, Tq, H, D]`` in ``q.dtype``.

  Keyword arguments are those of ``pallas_kernels.gdpa``: ``activation`` (name or per-head tuple),
  ``scale`` (default ``1/sqrt(D)``), ``out_scale``, ``q_lengths``, ``kv_lengths``, ``window``,
  ``broadcast_q``, ``q_index`` / ``kv_index`` (request-level sharing: output row b reads
  ``q[q_index[b]]`` / ``k, v[kv_index[b]]``), ``interpret``, ``score_clip`` (clamp scores to
  ``[-c, c]`` before the activation, spec h-13; None or 0 = off). GQA: ``k, v`` may have
  ``H_q / G`` heads.
  """
  with jax.named_scope("GDPA"):
    if backend == "xla" or kw.get("interpret") or not context.is_sharded(q if seq == "q" else k):
      return pallas_kernels.gdpa(q, k, v, backend=backend, **kw)
    if kw.pop("q_index", None) is not None or kw.pop("kv_index", None) is not None:
      raise ValueError("gdpa_op: q_index / kv_index with a context-sharded sequence and a kernel "
                       "backend is not supported; use backend='xla' or an unsharded sequence")
    window = kw.pop("window", None)
    if window is not None:           # banded self-attention: halo exchange between shards
      return context.swa_attention(q, k, v, kw["q_lengths"], window,
                                   activation=kw.get("activation", "fast_gelu"),
                                   out_scale=kw.get("out_scale", 1.0),
                                   score_clip=kw.get("score_clip"))
    return context.context_parallel_gdpa(q, k, v, shard=seq, backend=backend, **kw)
