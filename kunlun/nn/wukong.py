"""Wukong interaction layers (spec c.6, appendix A.2).

``FMB(X) = reshape(MLP(LN(flatten(X (X^T Y)))), [n_fm, d])`` with ``Y [N, rank]`` (the optimized
factorization machine: ``(X X^T) Y`` computed as ``X (X^T Y)``, ``O(N d r)``);
``LCB(X) = W^T X`` with ``W [N, n_lcb]``; ``X' = LN(concat(FMB, LCB) + Proj(X))`` where ``Proj``
is the identity when ``N = n_fm + n_lcb`` and a learned token-axis map otherwise. LayerNorms keep
their affine parameters (Wukong's design) and run in float32. On the Pallas backend (``auto`` on
a GPU) a layer's token side (the FM, its norm and the token maps) is one kernel pass over ``x``
and its output norm another (``pallas_kernels.wukong_fm``; ``fm_kernel``, ``out_kernel``).

``WukongStack(cross_layer=True)`` adds GEM's cross-layer attention connections (spec h-19): with
``X_0`` the stack input and ``X_l`` the output of layer ``l - 1``, layer ``l >= 1`` reads
``X_l + sum_{j=0..l} a_{l,j} X~_j`` instead of ``X_l``, where ``a_l = softmax(c_l)`` over a learned
per-layer logit vector ``c_l [l + 1]``, ``X~_j = X_j`` for ``j >= 1`` and ``X~_0 = P^T X_0`` with
a learned token map ``P [N, n_out]`` when ``N != n_out`` (else ``X~_0 = X_0``).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from kunlun.nn import packed
from kunlun.nn.activations import gelu
from kunlun.nn.dense import DenseParams, dense
from kunlun.nn.fused import batched_mixes, token_mix
from kunlun.nn.norms import affine_layer_norm
from pallas_kernels import wukong_fm
from sharding import shard, with_axes
from sharding.packed import per_shard

F32 = jnp.float32
_TOK = ("batch", "tokens", "embed")


class _LayerNorm(nn.Module):
  """LayerNorm of the float32 sum of its inputs over the last axis, with a learned scale and
  bias, returned in ``dtype`` (``norms.affine_layer_norm``: the backward keeps the inputs only)."""
  dtype: Any = F32

  @nn.compact
  def __call__(self, *xs):
    d = xs[0].shape[-1]
    scale = self.param("scale", with_axes(nn.initializers.ones, (None,)), (d,), F32)
    bias = self.param("bias", with_axes(nn.initializers.zeros, (None,)), (d,), F32)
    return affine_layer_norm(xs, scale, bias, 1e-6, self.dtype)


class _NormParams(nn.Module):
  """A LayerNorm's learned ``scale`` and ``bias [d]`` (float32), for a norm computed elsewhere."""
  d: int

  @nn.compact
  def __call__(self):
    scale = self.param("scale", with_axes(nn.initializers.ones, (None,)), (self.d,), F32)
    bias = self.param("bias", with_axes(nn.initializers.zeros, (None,)), (self.d,), F32)
    return scale, bias


def fm_kernel(backend: str, N: int, d: int, rank: int, mixes) -> bool:
  """Whether a layer's token side runs as ``pallas_kernels.wukong_fm``'s kernels: backend
  "pallas", or "auto" compiling for a GPU, at widths the kernels take."""
  return packed.pallas_backend(backend) and wukong_fm.supported(N, d, rank, mixes)


def out_kernel(backend: str, d: int, parts) -> bool:
  """Whether a layer's output norm runs as ``pallas_kernels.wukong_fm.wukong_out_pallas``: as
  ``fm_kernel``, for ``parts`` (the FM's and the LCB's token counts) of width ``d``."""
  return packed.pallas_backend(backend) and wukong_fm.out_supported(d, parts)


def fm_pallas(x, y, ws, scale, bias, *, dtype, through=False):
  """``pallas_kernels.wukong_fm.wukong_fm_pallas`` per device on its examples (global shapes
  here: ``bench.profiling.roofline.record_kernels`` counts its FLOPs at this call): ``h``, the
  mixes and ``x``, with ``through`` the kernel's pass-through of it (its cotangent joins ``dx``
  in the backward kernel)."""
  interpret = packed.interpret_kernels()
  op = lambda x, y, ws, s, b: wukong_fm.wukong_fm_pallas(x, y, ws, s, b, dtype=dtype,
                                                         interpret=interpret, through=through)
  h, mixes, *xt = per_shard(op, (True, False, False, False, False), "batch")(x, y, ws, scale,
                                                                            bias)
  return shard(h, ("batch", None)), tuple(shard(m, _TOK) for m in mixes), (xt or [x])[0]


def out_pallas(parts, res, scale, bias, bias0=None, others=(), logits=None, *, dtype):
  """``pallas_kernels.wukong_fm.wukong_out_pallas`` per device on its examples."""
  interpret = packed.interpret_kernels()
  op = lambda parts, res, s, b, b0, o, c: wukong_fm.wukong_out_pallas(
      parts, res, s, b, bias0=b0, others=o, logits=c, dtype=dtype, interpret=interpret)
  return per_shard(op, (True, True, False, False, False, True, False), "batch")(
      parts, res, scale, bias, bias0, tuple(others), logits)


def cross_mix(x, outs, a, dtype):
  """GEM's cross-layer input ``X + sum_j a_j X~_j`` (``outs``: the ``X~_j``, the last of them
  ``x`` itself; ``a f32[len(outs)]``) in float32, returned in ``dtype``: one elementwise pass,
  nothing stacked in memory."""
  mix = x.astype(F32)
  for j, o in enumerate(outs):
    mix = mix + a[j] * o.astype(F32)
  return mix.astype(dtype)


class WukongLayer(nn.Module):
  """``x [B, N, d]`` -> ``[B, n_fm + n_lcb, d]``; with ``extra [N, m]`` (a token map) also
  ``extra^T x [B, m, d]`` in ``dtype``, computed in the same pass over ``x``.

  The token side (the FM's interactions and their LayerNorm; the LCB, residual and ``extra``
  token maps) and the output norm run as ``pallas_kernels.wukong_fm``'s kernels (``fm_kernel``,
  ``out_kernel``: per device on its examples) or as XLA; the MLP as XLA.

  ``through``: on both kernels, with ``N = n_fm + n_lcb`` (an identity residual), the residual
  is the token side's pass-through of ``x``, so its cotangent joins ``dx`` in the token side's
  backward kernel (no pass adds the two). Only where ``x`` is batched like the layer's
  parameters: under the experts' ``vmap`` a shared ``x``'s pass-through cotangent reaches every
  expert's backward summed, and ``dx`` would count it once per expert (``WukongStack`` sets it
  for the layers after the first, whose input is the expert's own)."""
  n_fm: int
  n_lcb: int
  rank: int
  mlp_hidden: int
  dtype: Any = F32
  backend: str = "xla"
  through: bool = False

  @nn.compact
  def __call__(self, x, extra=None, cross=None):
    """``cross = (outs, c)``: return the next layer's cross-layer input ``cross_mix(out, outs +
    [extra's map, if any] + [out], a)``, ``a`` the rounded ``softmax(c)``
    (``pallas_kernels.wukong_fm.mix_weights``), instead of ``out``, written by the output-norm
    kernel (``out_kernel`` must hold), which computes ``a`` itself."""
    if self.n_fm < 1 or self.n_lcb < 0 or self.rank < 1 or self.mlp_hidden < 1:
      raise ValueError(f"WukongLayer: need n_fm>=1, n_lcb>=0, rank>=1, mlp_hidden>=1; got "
                       f"{self.n_fm}, {self.n_lcb}, {self.rank}, {self.mlp_hidden}")
    B, N, d = x.shape
    dt = self.dtype
    n_out = self.n_fm + self.n_lcb
    with jax.named_scope("WukongLayer"):
      y = self.param("fm_y", with_axes(nn.initializers.normal(N ** -0.5), ("tokens", None)),
                     (N, self.rank), F32)
      maps = {}                                                         # token maps [N, m]
      if self.n_lcb:
        maps["lcb"] = self.param("lcb", with_axes(nn.initializers.normal(N ** -0.5),
                                                  ("tokens", None)), (N, self.n_lcb), F32)
      if N != n_out:
        maps["res"] = self.param("res_proj", with_axes(nn.initializers.normal(N ** -0.5),
                                                       ("tokens", None)), (N, n_out), F32)
      if extra is not None:
        maps["extra"] = extra
      scale, bias = _NormParams(N * self.rank, name="fm_norm")()
      fused = out_kernel(self.backend, d, [self.n_fm] + ([self.n_lcb] if self.n_lcb else []))
      h, mixes, res = self._token_side(x, y, tuple(maps.values()), scale, bias,
                                       through=self.through and fused and "res" not in maps)
      mix = dict(zip(maps, mixes, strict=True))
      h = nn.Dense(self.mlp_hidden, dtype=dt, param_dtype=F32, name="fm_mlp_in",
                   kernel_init=with_axes(nn.initializers.lecun_normal(), (None, "mlp")),
                   bias_init=with_axes(nn.initializers.zeros, ("mlp",)))(h)
      h = shard(gelu(h), ("batch", "mlp"))
      w_out, b_out = DenseParams(self.mlp_hidden, self.n_fm * d, ("mlp", None),
                                 name="fm_mlp_out")()
      h = dense(h, w_out, None if fused else b_out, dt)      # fused: the bias in the out norm
      parts = [h.reshape(B, self.n_fm, d)] + ([mix["lcb"]] if self.n_lcb else [])
      res = mix.get("res", res)
      if cross is not None:
        if not fused:
          raise ValueError("WukongLayer: the cross-layer mix rides in the output-norm kernel only")
        cross = (tuple(cross[0]) + ((mix["extra"],) if extra is not None else ()), cross[1])
      out = shard(self._out_norm(parts, res, fused, b_out.reshape(self.n_fm, d) if fused
                                 else None, cross), _TOK)
      return out if extra is None else (out, mix["extra"])

  def _out_norm(self, parts, res, fused: bool, bias0=None, cross=None):
    """``LN(concat(parts) + res) * scale + bias`` over ``d``, in dtype: the kernels (``fused``,
    i.e. ``out_kernel``; ``bias0 [n_fm, d]``, the FM MLP's output bias, added to the first part
    in the kernel; ``cross = (others, c)``: the kernel writes the cross-layer mix of weights
    ``softmax(c)``) or ``affine_layer_norm``."""
    scale, bias = _NormParams(res.shape[-1], name="out_norm")()
    if fused:
      others, c = cross if cross is not None else ((), None)
      return out_pallas(tuple(parts), res, scale, bias, bias0, others, c, dtype=self.dtype)
    return affine_layer_norm((jnp.concatenate(parts, axis=1), res), scale, bias, 1e-6,
                             self.dtype)

  def _token_side(self, x, y, ws, scale, bias, through=False):
    """``LN(flatten(X (X^T y))) * scale + bias [B, N r]``, ``w^T X [B, m, d]`` for each token
    map ``w [N, m]`` of ``ws``, in dtype, and ``x`` (on the kernels with ``through``, their
    pass-through)."""
    B, N, d = x.shape
    dt = self.dtype
    if ws and fm_kernel(self.backend, N, d, self.rank, [w.shape[1] for w in ws]):
      return fm_pallas(x, y, ws, scale, bias, dtype=dt, through=through)
    xc = x.astype(dt)
    if batched_mixes():                                              # GPU: no transposes
      yb = jnp.broadcast_to(y.astype(dt), (B, N, self.rank))
      xty = jnp.einsum("bnd,bnr->bdr", xc, yb)                        # X^T Y   [B, d, r]
    else:
      xty = jnp.einsum("bnd,nr->bdr", xc, y.astype(dt))
    fm = jnp.einsum("bnd,bdr->bnr", xc, xty).reshape(B, N * self.rank)  # X (X^T Y)
    h = affine_layer_norm((fm,), scale, bias, 1e-6, dt)
    return h, tuple(token_mix(xc, w.astype(dt)) for w in ws), x


def split_tokens(n_out: int, fm_fraction: float = 0.5) -> tuple[int, int]:
  """``(n_fm, n_lcb)`` with ``n_fm = max(1, round(fm_fraction * n_out))``."""
  if n_out < 1:
    raise ValueError(f"Wukong n_out must be >= 1, got {n_out}")
  n_fm = min(n_out, max(1, round(fm_fraction * n_out)))
  return n_fm, n_out - n_fm


class WukongStack(nn.Module):
  """``num_layers`` Wukong layers each emitting ``n_out`` tokens: ``[B, N, d] -> [B, n_out, d]``.

  ``cross_layer``: dense softmax-weighted connections to all earlier outputs (module docstring).
  The logits ``cross_logits_{l} [l + 1]`` start at zero, i.e. the combination starts as a plain
  average of ``X~_0 .. X_l`` on top of the standard input ``X_l``. Zero is the symmetric choice:
  every earlier output gets the same non-zero weight and gradient from step 0, whereas starting
  at the standard path would need a one-hot softmax (very negative logits elsewhere), where the
  softmax is saturated and the other connections get almost no gradient. All inputs of a layer
  end in LayerNorms (``fm_norm``, ``out_norm``), so the larger input scale is harmless. With one
  layer, or ``cross_layer=False``, the stack is exactly the plain one (no extra parameters).
  """
  num_layers: int
  n_out: int
  rank: int
  mlp_hidden: int
  fm_fraction: float = 0.5
  dtype: Any = F32
  cross_layer: bool = False
  backend: str = "xla"

  @nn.compact
  def __call__(self, x):
    if self.num_layers < 1:
      raise ValueError(f"WukongStack.num_layers must be >= 1, got {self.num_layers}")
    n_fm, n_lcb = split_tokens(self.n_out, self.fm_fraction)
    dense = self.cross_layer and self.num_layers > 1
    N, dt = x.shape[1], self.dtype
    # X~_0: the stack input on n_out tokens; its map P rides along layer 0's pass over X_0
    p = (self.param("cross_proj", with_axes(nn.initializers.normal(N ** -0.5), ("tokens", None)),
                    (N, self.n_out), F32) if dense and N != self.n_out else None)
    L = self.num_layers
    # the last layer's input mixes the second-to-last layer's output, which nothing else reads:
    # on the output-norm kernels that layer writes the mix itself (one pass fewer each way)
    fold = dense and out_kernel(self.backend, x.shape[-1], [n_fm] + ([n_lcb] if n_lcb else []))
    outs = []                                                          # X~_0 .. X_l
    for i in range(L):
      if dense and i > 0 and not (fold and i == L - 1):
        x = self._combine(i, x, outs)
      layer = WukongLayer(n_fm, n_lcb, self.rank, self.mlp_hidden, dt, self.backend,
                          through=i > 0, name=f"layer_{i}")
      if i == 0 and dense and p is None:
        outs.append(x.astype(dt))
      cross = (tuple(outs), self._logits(L - 1)) if fold and i == L - 2 else None
      if i == 0 and p is not None:
        x, x0 = layer(x, p, cross=cross)
        outs.append(x0)
      else:
        x = layer(x, cross=cross)
      if dense:
        outs.append(x)
    return x

  def _logits(self, i):
    """Layer ``i``'s cross-layer logits ``c_i f32[i + 1]``."""
    return self.param(f"cross_logits_{i}", with_axes(nn.initializers.zeros, (None,)), (i + 1,),
                      F32)

  def _weights(self, i):
    """Layer ``i``'s cross-layer weights ``softmax(c_i) f32[i + 1]`` (rounded to dtype)."""
    c = self._logits(i)
    with jax.named_scope("WukongCrossLayer"):
      return wukong_fm.mix_weights(c, self.dtype)

  def _combine(self, i, x, outs):
    """Input of layer ``i``: ``X_i + sum_j softmax(c_i)_j X~_j`` over ``len(outs) = i + 1``."""
    a = self._weights(i)
    with jax.named_scope("WukongCrossLayer"):
      return shard(cross_mix(x, outs, a, self.dtype), _TOK)
