"""GDPA, block-attention and softmax-attention kernels behind one API, each with an XLA twin.

``gdpa(q, k, v, *, activation, scale, out_scale, q_lengths, kv_lengths, window, broadcast_q,
backend, interpret, score_clip)``, ``block_attention(q, k, v, *, block_size, activation,
lengths, rotary, backend, interpret)`` and ``softmax_attention(q, k, v, *, window, scale,
q_lengths, kv_lengths, kv_start, q_offset, q_index, kv_index, backend, interpret)``; layout
``[batch, seq, heads, head_dim]``. ``backend``: "xla" (reference), "pallas", "triton"
(jax-triton, GPU only), "cudnn" (softmax attention only) or "auto".
"""

from pallas_kernels.api import (  # noqa: F401
    block_attention,
    gdpa,
    register_backend,
    softmax_attention,
)
from pallas_kernels.reference import (  # noqa: F401
    block_attention_reference,
    gdpa_reference,
    softmax_attention_reference,
)
