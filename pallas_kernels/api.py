"""Backend dispatch for the kernels. Backends register themselves lazily by name.

``backend="auto"`` picks per device and shape class from ``backend_table.json`` (written by
``bench/kernels.py --write_table`` from measured, checked timings; see ``select_backend``).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import os

import jax
import jax.numpy as jnp

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
_SOFTMAX = {
    "xla": "pallas_kernels.reference:softmax_attention_reference",
    "pallas": "pallas_kernels.pallas_softmax:softmax_attention_pallas",
    "cudnn": "pallas_kernels.cudnn_softmax:softmax_attention_cudnn",
}
BACKENDS = ("xla", "pallas", "triton", "auto")
SOFTMAX_BACKENDS = ("xla", "pallas", "cudnn", "triton", "auto")
TABLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "backend_table.json")


def register_backend(kind: str, name: str, target: str) -> None:
  """Registers ``target`` ("module:function") as backend ``name`` for kernel ``kind``."""
  {"gdpa": _GDPA, "block_attention": _BLOCK, "softmax_attention": _SOFTMAX}[kind][name] = target


def softmax_class(window) -> str:
  """Shape class of softmax attention: ``swa`` (banded, a window) or ``full``."""
  return "full" if window is None else "swa"


def shape_class(kind: str, tq: int, tk: int, window=None) -> str:
  """The table's shape class: block attention is one class; softmax attention ``swa`` (with a
  window) or ``full``; GDPA is ``cross`` (short kv, long q: the PFFN), ``pool`` (short q, long
  kv: HSP seeds) or ``self`` (comparable lengths)."""
  if kind == "block_attention":
    return "block"
  if kind == "softmax_attention":
    return softmax_class(window)
  if tk <= 256 and tq >= 4 * tk:
    return "cross"
  if tq <= 256 and tk >= 4 * tq:
    return "pool"
  return "self"


@functools.cache
def load_table(path: str = TABLE_PATH) -> dict:
  """The committed backend table (``{}`` when there is none)."""
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    return json.load(f)


def _has_jax_triton() -> bool:
  return importlib.util.find_spec("jax_triton") is not None


def cudnn_supports(dtype, head_dim) -> bool:
  """cuDNN flash attention's operand limits: fp16/bf16 inputs, head_dim a multiple of 8 <= 128."""
  return (dtype is not None and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
          and head_dim is not None and head_dim % 8 == 0 and head_dim <= 128)


def select_backend(kind: str, tq: int, tk: int, *, mode: str = "fwd_bwd", device_kind=None,
                   platform=None, table=None, has_jax_triton=None, window=None, dtype=None,
                   head_dim=None) -> str:
  """The fastest correct backend for ``kind`` ("gdpa" / "block_attention" /
  "softmax_attention") at this shape class.

  ``mode``: "fwd_bwd" (training, the default: ``auto`` cannot know whether a gradient follows)
  or "fwd" (inference). The table maps device kind -> kind -> shape class -> mode -> backend.
  Without an entry: CPU -> xla; GPU -> for GDPA triton when jax-triton is importable, else xla
  (never pallas: its GDPA backward was measured slower than XLA's); for block attention pallas
  (measured 2.1x XLA forward+backward on the H200). Softmax attention (``window``, ``dtype`` and
  ``head_dim`` pick the class and cuDNN's eligibility): banded ("swa") -> pallas (the kernel
  visits only the key tiles of the band and moves q, k, v, o once; cuDNN needs two left-window
  calls plus reversal gathers and a merge, see ``cudnn_softmax``); full -> cudnn when it takes
  the operands (16-bit, head_dim % 8 == 0, <= 128: measured 3x XLA fwd+bwd at T 2048,
  jax_stack_notes 2.2), else pallas. A table entry naming cudnn for operands cuDNN cannot
  take is ignored.
  """
  platform = platform or compile_platform()
  if platform != "gpu":
    return "xla"
  device_kind = device_kind or _compile_device_kind()
  table = load_table() if table is None else table
  entry = (table.get("devices", {}).get(device_kind, {}).get(kind, {})
           .get(shape_class(kind, tq, tk, window), {}).get(mode))
  has_jt = _has_jax_triton() if has_jax_triton is None else has_jax_triton
  ok_cudnn = cudnn_supports(dtype, head_dim)
  if entry and (entry != "triton" or has_jt) and (entry != "cudnn" or ok_cudnn):
    return entry
  if kind == "block_attention":
    return "pallas"
  if kind == "softmax_attention":
    return "cudnn" if window is None and ok_cudnn else "pallas"
  return "triton" if has_jt else "xla"


def _resolve(table: dict, backend: str, kind: str, tq: int, tk: int):
  if backend not in BACKENDS:
    raise ValueError(f"unknown {kind} backend {backend!r}; allowed: {BACKENDS}")
  if backend == "auto":
    backend = select_backend(kind, tq, tk)
  if backend not in table:
    raise ValueError(f"{kind} backend {backend!r} is not available (registered: {sorted(table)})")
  mod, fn = table[backend].split(":")
  return backend, getattr(importlib.import_module(mod), fn)


def compile_platform() -> str:
  """The platform being compiled for: that of the devices of the mesh set by ``jax.set_mesh``
  (a deviceless GPU target on a CPU host: "gpu"), else ``jax.default_backend()``."""
  dev = jax.sharding.get_abstract_mesh().abstract_device
  return dev.platform if dev is not None else jax.default_backend()


def _compile_device_kind() -> str:
  dev = jax.sharding.get_abstract_mesh().abstract_device
  return dev.device_kind if dev is not None else jax.devices()[0].device_kind


def _interpret(backend: str, interpret: bool) -> bool:
  """Pallas kernels have no CPU lowering: compiled for a CPU they execute in interpret mode;
  compiled for a GPU (also a deviceless target on a CPU host) they lower to Triton."""
  return interpret or (backend == "pallas" and compile_platform() == "cpu")


def gdpa(q, k, v, *, activation="fast_gelu", scale=None, out_scale=1.0, q_lengths=None,
         kv_lengths=None, window=None, broadcast_q=False, q_index=None, kv_index=None,
         backend="auto", interpret=False, score_clip=None, **tuning):
  """See ``pallas_kernels.reference.gdpa_reference`` for the exact semantics.

  ``q [Bq, Tq, H_q, D]``, ``k, v [Bk, Tk, H_kv, D]`` (GQA: ``H_q = G * H_kv``) -> ``[B, Tq, H_q,
  D]``. ``q_index`` / ``kv_index`` (``i32[B]`` or None): output row b reads ``q[q_index[b]]`` /
  ``k, v[kv_index[b]]`` (request-level sharing; the kernels index in place, nothing is
  gathered); ``q_lengths`` / ``kv_lengths`` are indexed like their operand.
  ``score_clip``: clamp ``scale * q.k`` to ``[-score_clip, score_clip]`` before the activation
  (spec h-13; zero gradient where clamped); None or 0 = off. Every backend implements it.

  ``tuning``: backend-only options passed through (pallas: ``block_q``, ``block_k``,
  ``block_q_bwd``, ``block_k_bwd``, ``num_warps``, ``num_stages``, ``fp8``; triton: ``config``);
  the xla backend accepts none.
  """
  name, fn = _resolve(_GDPA, backend, "gdpa", q.shape[1], k.shape[1])
  return fn(q, k, v, activation=activation, scale=scale, out_scale=out_scale,
            q_lengths=q_lengths, kv_lengths=kv_lengths, window=window, broadcast_q=broadcast_q,
            q_index=q_index, kv_index=kv_index, interpret=_interpret(name, interpret),
            score_clip=score_clip, **tuning)


def block_attention(q, k, v, *, block_size=64, activation="softmax", lengths=None, rotary=None,
                    backend="auto", interpret=False, score_clip=None):
  """See ``pallas_kernels.reference.block_attention_reference`` for the exact semantics.

  ``score_clip`` clamps the scores of GDPA activations (as in ``gdpa``); softmax ignores it.
  """
  name, fn = _resolve(_BLOCK, backend, "block_attention", q.shape[1], q.shape[1])
  return fn(q, k, v, block_size=block_size, activation=activation, lengths=lengths,
            rotary=rotary, interpret=_interpret(name, interpret), score_clip=score_clip)


def softmax_attention(q, k, v, *, window=None, scale=None, q_lengths=None, kv_lengths=None,
                      kv_start=None, q_offset=0, q_index=None, kv_index=None, backend="auto",
                      interpret=False, **tuning):
  """Softmax attention, full or banded: see ``reference.softmax_attention_reference``.

  ``q [Bq, Tq, H_q, D]``, ``k, v [Bk, Tk, H_kv, D]`` -> ``[B, Tq, H_q, D]``; valid keys
  ``[kv_start, kv_lengths)``, band ``|i + q_offset - j| <= window``. ``backend``: "xla"
  (reference; banded in ``O(T * 3c)``), "pallas" (``pallas_softmax``: flash attention visiting
  only the band's key tiles; interpret mode on CPU), "cudnn" (``cudnn_softmax``: full attention
  with cuDNN's padding masks, the band as two causal left-window calls merged by their
  log-sum-exp; GPU, or ``interpret=True`` for its XLA stand-in), "triton" (no jax-triton
  softmax kernel: runs pallas, so a model-wide ``backend="triton"`` still reaches a kernel) or
  "auto" (``select_backend``). ``tuning``: backend-only options (pallas: ``block_q``,
  ``block_k``, ``block_q_bwd``, ``block_k_bwd``, ``num_warps``, ``num_stages``).
  """
  if backend not in SOFTMAX_BACKENDS:
    raise ValueError(f"unknown softmax_attention backend {backend!r}; allowed: "
                     f"{SOFTMAX_BACKENDS}")
  if backend == "auto":
    backend = select_backend("softmax_attention", q.shape[1], k.shape[1], window=window,
                             dtype=q.dtype, head_dim=q.shape[-1])
  name = "pallas" if backend == "triton" else backend
  if name not in _SOFTMAX:
    raise ValueError(f"softmax_attention backend {name!r} is not available "
                     f"(registered: {sorted(_SOFTMAX)})")
  mod, fn = _SOFTMAX[name].split(":")
  fn = getattr(importlib.import_module(mod), fn)
  return fn(q, k, v, window=window, scale=scale, q_lengths=q_lengths, kv_lengths=kv_lengths,
            kv_start=kv_start, q_offset=q_offset, q_index=q_index, kv_index=kv_index,
            interpret=_interpret(name, interpret), **tuning)


__all__ = ["gdpa", "block_attention", "softmax_attention", "register_backend", "select_backend",
           "reference"]
