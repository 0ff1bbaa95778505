"""Backend dispatch for the kernels. Backends register themselves lazily by name."""

from __future__ import annotations

import importlib

import jax

from pallas_kernels import reference

# name -> "module:function" (imported on first use, so optional backends cost nothing)
_GDPA = {
    "xla": "pallas_kernels.reference:gdpa_reference",
    "pallas": "pallas_kernels.pallas_gdpa:gdpa_pallas",
    "triton": "pallas_kernels.triton_gdpa:gdpa_triton",  # jax-triton; GPU only, lazy import
}
_BLOCK = {
    "xla": "pallas_kernels.reference:block_attention_reference",
    "pallas": "pallas_kernels.pallas_block:block_attention_pallas",
}
BACKENDS = ("xla", "pallas", "triton", "auto")


def register_backend(kind: str, name: str, target: str) -> None:
  """Registers ``target`` ("module:function") as backend ``name`` for kernel ``kind``."""
  {"gdpa": _GDPA, "block_attention": _BLOCK}[kind][name] = target


def _resolve(table: dict, backend: str, kind: str):
  if backend not in BACKENDS:
    raise ValueError(f"unknown {kind} backend {backend!r}; allowed: {BACKENDS}")
  if backend == "auto":
    backend = "pallas" if (jax.default_backend() == "gpu" and "pallas" in table) else "xla"
  if backend not in table:
    raise ValueError(f"{kind} backend {backend!r} is not available (registered: {sorted(table)})")
  mod, fn = table[backend].split(":")
  return getattr(importlib.import_module(mod), fn)


def _interpret(backend: str, interpret: bool) -> bool:
  """Pallas kernels have no CPU lowering: on a CPU-only run they execute in interpret mode."""
  return interpret or (backend == "pallas" and jax.default_backend() == "cpu")


def gdpa(q, k, v, *, activation="fast_gelu", scale=None, out_scale=1.0, q_lengths=None,
         kv_lengths=None, window=None, broadcast_q=False, backend="auto", interpret=False,
         score_clip=None, **tuning):
  """See ``pallas_kernels.reference.gdpa_reference`` for the exact semantics.

  ``score_clip``: clamp ``scale * q.k`` to ``[-score_clip, score_clip]`` before the activation
  (spec h-13; zero gradient where clamped); None or 0 = off. Every backend implements it.

  ``tuning``: backend-only options passed through (pallas: ``block_q``, ``block_k``,
  ``block_q_bwd``, ``block_k_bwd``, ``num_warps``, ``num_stages``, ``fp8``; triton: ``block_q``,
  ``block_k``, ``num_warps``, ``num_stages``); the xla backend accepts none.
  """
  fn = _resolve(_GDPA, backend, "gdpa")
  return fn(q, k, v, activation=activation, scale=scale, out_scale=out_scale,
            q_lengths=q_lengths, kv_lengths=kv_lengths, window=window, broadcast_q=broadcast_q,
            interpret=_interpret(backend, interpret), score_clip=score_clip, **tuning)


def block_attention(q, k, v, *, block_size=64, activation="softmax", lengths=None, rotary=None,
                    backend="auto", interpret=False, score_clip=None):
  """See ``pallas_kernels.reference.block_attention_reference`` for the exact semantics.

  ``score_clip`` clamps the scores of GDPA activations (as in ``gdpa``); softmax ignores it.
  """
  fn = _resolve(_BLOCK, backend, "block_attention")
  return fn(q, k, v, block_size=block_size, activation=activation, lengths=lengths,
            rotary=rotary, interpret=_interpret(backend, interpret), score_clip=score_clip)


__all__ = ["gdpa", "block_attention", "register_backend", "reference"]
