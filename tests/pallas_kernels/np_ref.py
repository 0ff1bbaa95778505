"""Plain numpy loops (float64) for GDPA and block attention: an independent check of both the
XLA references and the kernels. Loops over batch, head and query row; vectorised over keys."""

import math

import numpy as np

_ERF = np.vectorize(math.erf)

NP_ACTS = {
    "identity": lambda x: x,
    "gelu": lambda x: 0.5 * x * (1.0 + _ERF(x / math.sqrt(2.0))),
    "fast_gelu": lambda x: 0.5 * x * (
        1.0 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3))),
    "silu": lambda x: x / (1.0 + np.exp(-x)),
    "relu": lambda x: np.maximum(x, 0.0),
    "relu2": lambda x: np.maximum(x, 0.0) ** 2,
}


def _acts(activation, heads):
  return (activation,) * heads if isinstance(activation, str) else tuple(activation)


def gdpa_loop(q, k, v, activation="fast_gelu", scale=None, out_scale=1.0, q_lengths=None,
              kv_lengths=None, window=None, broadcast_q=False, score_clip=None):
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  B, Tk, H, D = k.shape
  Tq = q.shape[1]
  scale = D ** -0.5 if scale is None else scale
  acts = _acts(activation, H)
  out = np.zeros((B, Tq, H, D))
  for b in range(B):
    ql = Tq if q_lengths is None else int(q_lengths[b])
    kl = Tk if kv_lengths is None else int(kv_lengths[b])
    qb = q[0 if broadcast_q else b]
    for h in range(H):
      for i in range(ql):
        js = [j for j in range(kl) if window is None or abs(i - j) <= window]
        if not js:
          continue
        s = np.array([qb[i, h] @ k[b, j, h] for j in js]) * scale
        if score_clip:
          s = np.minimum(np.maximum(s, -score_clip), score_clip)
        p = NP_ACTS[acts[h]](s)
        out[b, i, h] = out_scale * sum(p[n] * v[b, j, h] for n, j in enumerate(js))
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
