"""Plain numpy loops (float64) for GDPA and block attention: an independent check of both the
XLA references and the kernels. Loops over batch, head and query row; vectorised over keys."""

import math

import numpy as np

_ERF = np.vectorize(math.erf)

def _tanh_gelu(x):
  return 0.5 * x * (1.0 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def _bf16(x):
  """Round to bfloat16 (nearest even) in numpy: keep the top 16 bits of the float32."""
  b = np.asarray(x, np.float32).view(np.uint32)
  b = ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
  return b.view(np.float32).astype(np.float64)


_C = 1.0 / math.sqrt(2.0 * math.pi)
NP_ACTS = {
    "identity": lambda x: x,
    "gelu": lambda x: 0.5 * x * (1.0 + _ERF(x / math.sqrt(2.0))),
    "gelu_tanh": _tanh_gelu,
    "fast_gelu": _tanh_gelu,
    "fast_gelu_bf16": lambda x: _tanh_gelu(_bf16(x)),
    "gelu_taylor": lambda x: 0.5 * x + _C * x ** 2 - _C / 6 * x ** 4 + _C / 40 * x ** 6,
    "silu": lambda x: x / (1.0 + np.exp(-x)),
    "fast_silu": lambda x: x / (1.0 + np.exp(-x)),
    "relu": lambda x: np.maximum(x, 0.0),
    "relu2": lambda x: np.maximum(x, 0.0) ** 2,
    "leaky_relu": lambda x: np.where(x >= 0, x, 0.01 * x),
    "hardswish": lambda x: x * np.clip(x + 3.0, 0.0, 6.0) / 6.0,
}


def _acts(activation, heads):
  return (activation,) * heads if isinstance(activation, str) else tuple(activation)


def _operands(q, k, v, scale, q_index, kv_index):
  """q, k, v in float64, the sizes (B output rows, Tq, Tk, Hq, D, G query heads per kv head)
  and the score scale (default D ** -0.5)."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  Tq, Hq, D = q.shape[1:]
  Tk, Hkv = k.shape[1:3]
  B = len(q_index) if q_index is not None else len(kv_index) if kv_index is not None else len(k)
  return q, k, v, (B, Tq, Tk, Hq, D, Hq // Hkv), D ** -0.5 if scale is None else scale


def gdpa_loop(q, k, v, activation="fast_gelu", scale=None, out_scale=1.0, q_lengths=None,
              kv_lengths=None, window=None, broadcast_q=False, score_clip=None, q_index=None,
              kv_index=None):
  """Output row b reads q[q_index[b]] and k, v[kv_index[b]] (lengths indexed like their operand;
  with broadcast_q, q_lengths has the output batch); q head h reads k/v head h // G."""
  q, k, v, (B, Tq, Tk, Hq, D, G), scale = _operands(q, k, v, scale, q_index, kv_index)
  acts = _acts(activation, Hq)
  out = np.zeros((B, Tq, Hq, D))
  for b in range(B):
    qb = 0 if broadcast_q else (b if q_index is None else int(q_index[b]))
    kb = b if kv_index is None else int(kv_index[b])
    ql = Tq if q_lengths is None else int(q_lengths[b if broadcast_q else qb])
    kl = Tk if kv_lengths is None else int(kv_lengths[kb])
    for h in range(Hq):
      for i in range(ql):
        js = [j for j in range(kl) if window is None or abs(i - j) <= window]
        if not js:
          continue
        s = np.array([q[qb, i, h] @ k[kb, j, h // G] for j in js]) * scale
        if score_clip:
          s = np.minimum(np.maximum(s, -score_clip), score_clip)
        p = NP_ACTS[acts[h]](s)
        out[b, i, h] = out_scale * sum(p[n] * v[kb, j, h // G] for n, j in enumerate(js))
  return out


def rotate(x, cos, sin):
  """Half-split rotary of one row ``x [D]`` with ``cos, sin [D/2]``."""
  d2 = x.shape[-1] // 2
  x1, x2 = x[:d2], x[d2:]
  return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin])


def block_loop(q, k, v, block_size, activation="softmax", lengths=None, rotary=None,
               score_clip=None):
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  B, T, H, D = q.shape
  out = np.zeros((B, T, H, D))
  if rotary is not None:
    cos, sin = (np.asarray(r, np.float64) for r in rotary)
    if cos.ndim == 3:
      cos, sin = cos[:, :, None, :], sin[:, :, None, :]
  for b in range(B):
    L = T if lengths is None else int(lengths[b])
    for h in range(H):
      act = None if activation == "softmax" else _acts(activation, H)[h]
      def rot(x, t, b=b, h=h):
        if rotary is None:
          return x
        rb, rh = (b if cos.shape[0] > 1 else 0), (h if cos.shape[2] > 1 else 0)
        return rotate(x, cos[rb, t, rh], sin[rb, t, rh])
      for i in range(L):
        start = (i // block_size) * block_size
        js = list(range(start, min(start + block_size, L)))
        s = np.array([rot(q[b, i, h], i) @ rot(k[b, j, h], j) for j in js]) / math.sqrt(D)
        if act is None:
          p = np.exp(s - s.max())
          p = p / p.sum()
        else:
          if score_clip:
            s = np.minimum(np.maximum(s, -score_clip), score_clip)
          p = NP_ACTS[act](s) / block_size
        out[b, i, h] = sum(p[n] * v[b, j, h] for n, j in enumerate(js))
  return out


def softmax_loop(q, k, v, window=None, scale=None, q_lengths=None, kv_lengths=None,
                 kv_start=None, q_offset=0, q_index=None, kv_index=None, do=None):
  """Dense masked softmax attention in float64, and with ``do`` its gradients (dq, dk, dv by the
  closed form dS = P (dO V^T - rowsum(dO O)), summed into shared rows).

  Output row b reads q[q_index[b]] and k, v[kv_index[b]]; query i sits at key position
  i + q_offset and sees keys j in [kv_start, kv_len) with |i + q_offset - j| <= window; rows at
  or beyond q_len or without a key are zero. Returns ``o`` or ``(o, dq, dk, dv)``.
  """
  q, k, v, (B, Tq, Tk, Hq, D, G), scale = _operands(q, k, v, scale, q_index, kv_index)
  o = np.zeros((B, Tq, Hq, D))
  dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
  for b in range(B):
    qb = b if q_index is None else int(q_index[b])
    kb = b if kv_index is None else int(kv_index[b])
    ql = Tq if q_lengths is None else min(int(q_lengths[qb]), Tq)
    kl = Tk if kv_lengths is None else min(int(kv_lengths[kb]), Tk)
    k0 = 0 if kv_start is None else int(kv_start[kb])
    for h in range(Hq):
      hk = h // G
      for i in range(ql):
        js = [j for j in range(k0, kl) if window is None or abs(i + q_offset - j) <= window]
        if not js:
          continue
        s = np.array([q[qb, i, h] @ k[kb, j, hk] for j in js]) * scale
        p = np.exp(s - s.max())
        p /= p.sum()
        vs = np.stack([v[kb, j, hk] for j in js])
        o[b, i, h] = p @ vs
        if do is None:
          continue
        g = np.asarray(do[b, i, h], np.float64)
        ds = p * (vs @ g - g @ o[b, i, h])
        ks = np.stack([k[kb, j, hk] for j in js])
        dq[qb, i, h] += scale * ds @ ks
        for n, j in enumerate(js):
          dk[kb, j, hk] += scale * ds[n] * q[qb, i, h]
          dv[kb, j, hk] += p[n] * g
  return o if do is None else (o, dq, dk, dv)
