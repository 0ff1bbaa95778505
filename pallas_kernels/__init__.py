"""GDPA and block-attention kernels behind one API, each with an XLA reference twin.

``gdpa(q, k, v, *, activation, scale, out_scale, q_lengths, kv_lengths, window, broadcast_q,
backend, interpret, score_clip)`` and ``block_attention(q, k, v, *, block_size, activation,
lengths, rotary, backend, interpret)``; layout ``[batch, seq, heads, head_dim]``. ``backend``:
"xla" (reference), "pallas", "triton" (jax-triton, GPU only) or "auto".
"""

from pallas_kernels.api import block_attention, gdpa, register_backend  # noqa: F401
from pallas_kernels.reference import block_attention_reference, gdpa_reference  # noqa: F401
