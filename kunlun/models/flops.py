"""Analytic FLOPs (spec Appendix B) of every architecture, per example, and XLA's executed count.
Counting rules and constants: docs/architecture.md, ``kunlun/models/flops.py``."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import jax
import numpy as np

from data.schema import Schema
from kunlun.configs.types import ModelConfig, TowerConfig, parse
from kunlun.models.ablated import ablated_config
from kunlun.nn.inputs import event_side_dim
from kunlun.nn.towers import schedule
from kunlun.nn.wukong import split_tokens

# Elementwise FLOPs per element, as XLA counts the ops of these functions.
RMS = 3          # kunlun.nn.norms.rms_norm: square, mean, multiply
LN = 6           # kunlun.nn.norms.layer_norm: mean, subtract, square, mean, add eps, multiply
LN_AFFINE = 8    # LayerNorm with scale and bias (Wukong, DHEN)
GELU = 8         # tanh-approximate GELU (flax nn.gelu, GDPA fast_gelu)
SIGMOID = 3
SOFTMAX = 7      # masked softmax per score: scale, mask, max, subtract, mask, sum, divide
SOFTMAX_MH = 10  # the same with several heads (XLA also counts the mask broadcast over heads)
GDPA_ACT = {"identity": 0, "relu": 1, "relu2": 2, "silu": 4, "fast_gelu": GELU, "gelu": 64}
GDPA_SCORE = 3   # per GDPA score besides the activation: scale, mask select, clip
LOOKUP = 2       # per looked-up table element: the index clamp and the negative-id select


def band_pairs(n, w: int):
  """Query-key pairs ``(i, j)`` in ``[0, n)^2`` with ``|i - j| <= w`` (``n`` int or array)."""
  n = np.asarray(n, np.float64)
  m = np.clip(np.minimum(w, n - 1), 0, None)
  return n + 2 * (m * n - m * (m + 1) / 2)


def _softmax(heads: int) -> int:
  return SOFTMAX_MH if heads > 1 else SOFTMAX


def _act_cost(activation) -> float:
  acts = (activation,) if isinstance(activation, str) else tuple(activation)
  return float(np.mean([GDPA_ACT[a] for a in acts]))


# ---- modules: forward FLOPs per example (T: the sequence length the count is for) ----------------
def context_flops(cfg: ModelConfig, schema: Schema) -> float:
  """SparseEmbed pooling, DenseTokens (log1p, affine, projection), LCE token mix, surface add."""
  d, n_tok = cfg.d_ns, (cfg.n_dense_tokens if schema.dense else 0)
  F = len(schema.dense)
  sparse = sum((2 * f.max_len + 1 + LOOKUP * f.max_len) * d + 4 * f.max_len
               for f in schema.sparse) + LOOKUP * d                       # + the surface row
  dense = 6 * F + 2 * F * n_tok * d + n_tok * d if n_tok else 0
  n_raw = len(schema.sparse) + n_tok
  return sparse + dense + 2 * n_raw * cfg.n_ns * d + cfg.n_ns * d


def event_embed_flops(stream, T, d: int):
  """EventEmbed: look-ups (item [d], action, surface, [extras], time [side each]), the MLP
  concat -> d -> d with GELU and biases, the validity select, id wrapping / bucketing."""
  sides = 3 + (1 if stream.extra_fields else 0)
  concat = d + sides * event_side_dim(d)
  return (2 * T * concat * d + 2 * T * d * d + (3 + GELU) * T * d
          + LOOKUP * T * concat + (5 * sides + 35) * T)


def weightgen_flops(n_ns: int, d_ns: int, n_kv: int, d: int) -> float:
  return (2 * n_ns * n_kv * d_ns + 2 * n_kv * d_ns * d_ns + 2 * 2 * n_kv * d_ns * d
          + RMS * n_ns * d_ns + (1 + GELU) * n_kv * d_ns)


def pffn_flops(T, n_kv: int, d: int, heads: int = 1, activation="fast_gelu"):
  """LN, GDPA (query = the sequence, ``n_kv`` generated keys), RMSNorm, two residuals."""
  scores = T * n_kv * heads
  return (4 * T * n_kv * d + (GDPA_SCORE + _act_cost(activation)) * scores + T * n_kv
          + (LN + RMS + 5) * T * d)


def attention_scope(T, kind: str, window: int, block: int, executed: bool):
  """``(query rows, keys per row)`` of the score matrix: the model's scope, or as executed."""
  if kind == "full":
    return T, T
  if kind == "block":
    if executed:
      return -(-np.asarray(T) // block) * block, block
    return T, np.minimum(block, T)
  if not executed:                                      # swa: the band among valid events
    n = np.asarray(T, np.float64)
    return n, band_pairs(n, window) / np.maximum(n, 1)
  chunk = max(window, 16)
  if T <= 3 * chunk:                                    # dense masked softmax
    return T, T
  return -(-T // chunk) * chunk, 3 * chunk


def attention_flops(T, d: int, kind: str, window: int, block: int, heads: int = 1,
                    executed: bool = False, activation="softmax"):
  """SeqAttention: RMSNorm, QKV, QK-norm, rotary, scores over the scope, output projection,
  residual. ``8 T d^2`` + ``4 (rows x keys) d`` + elementwise."""
  rows, keys = attention_scope(T, kind, window, block, executed)
  pairs = rows * keys
  per_score = _softmax(heads) if activation == "softmax" else GDPA_SCORE + _act_cost(activation)
  mask = 3 if kind == "swa" else 0                      # band & valid-key mask per pair
  return (8 * T * d * d + 4 * pairs * d + per_score * pairs * heads + mask * pairs
          + (RMS + 2 * (RMS + 1) + 6 + 0.5 + 3) * T * d)


def hsp_flops(T, d: int, n_seed: int, n_sum: int, rank: int, heads: int = 1,
              activation="fast_gelu"):
  """K/V projections, seed attention (GDPA), output projection, SumKronLinear (Q batch-shared)."""
  scores = n_seed * T * heads
  return (4 * T * d * d + 4 * n_seed * T * d + 2 * n_seed * d * d
          + 2 * rank * n_seed * n_sum * d + 2 * rank * n_sum * d * d
          + (GDPA_SCORE + _act_cost(activation)) * scores + n_seed * T
          + (RMS + 2) * T * d + (RMS + 2) * n_seed * d)


def pma_flops(T, d: int, n_sum: int, heads: int = 1):
  """PMA: K/V projections, softmax attention of ``n_sum`` queries, output projection."""
  pairs = n_sum * T
  return (4 * T * d * d + 4 * pairs * d + 2 * n_sum * d * d + _softmax(heads) * pairs * heads
          + pairs + RMS * T * d + n_sum * d)


def wukong_layer_flops(N: int, d: int, n_out: int, rank: int, hidden: int) -> float:
  n_fm, n_lcb = split_tokens(n_out)
  f = 4 * N * d * rank + 2 * N * rank * hidden + 2 * hidden * n_fm * d + 2 * N * n_lcb * d
  if N != n_out:
    f += 2 * N * n_out * d
  return f + LN_AFFINE * N * rank + (1 + GELU) * hidden + n_fm * d + (1 + LN_AFFINE) * n_out * d


def wukong_cross_layer_flops(N: int, d: int, n_out: int, num_layers: int) -> float:
  """Cross-layer connections of one stack (h-19): the ``X_0`` token map (when ``N != n_out``) and,
  for each layer ``l >= 1``, the ``(l + 1)``-term weighted sum plus the residual add."""
  if num_layers < 2:
    return 0.0
  f = 2 * N * n_out * d if N != n_out else 0.0
  return f + sum((2 * (l + 1) + 1) * n_out * d for l in range(1, num_layers))


def mowe_flops(cfg: ModelConfig, n_in: int) -> float:
  m = cfg.mowe
  f, N = 0.0, n_in
  for _ in range(m.layers_per_expert):
    f += wukong_layer_flops(N, cfg.d_ns, cfg.n_ns, m.rank, m.mlp_hidden)
    N = cfg.n_ns
  if m.cross_layer:
    f += wukong_cross_layer_flops(n_in, cfg.d_ns, cfg.n_ns, m.layers_per_expert)
  return m.num_experts * f + m.num_experts * cfg.n_ns * cfg.d_ns        # + the expert mean


def mlp_flops(d_in: int, features, final_act: bool = True) -> float:
  f = 0.0
  for i, h in enumerate(features):
    f += 2 * d_in * h + h + (GELU * h if (i < len(features) - 1 or final_act) else 0)
    d_in = h
  return f


def heads_flops(cfg: ModelConfig, d_z: int) -> float:
  h, S, K = cfg.heads, len(cfg.surfaces), len(cfg.tasks)
  f = mlp_flops(d_z, h.top_mlp)
  D = h.top_mlp[-1]
  tower = lambda d_in: S * K * (2 * d_in * h.tower_hidden + (2 + GELU) * h.tower_hidden + 3)
  if h.kind == "towers":
    return f + tower(D) + 2 * S * K
  E, He = h.num_experts, h.expert_hidden
  f += 2 * E * D * He + (1 + GELU) * E * He + 2 * S * K * D * E + 2 * S * K * E * He
  return f + S * K * 3 * E + tower(He) + 2 * S * K


def dhen_layer_flops(N: int, d: int, n_out: int, rank: int, hidden: int) -> float:
  """DHENLayer (``kunlun/models/dhen.py``): DOT (Gram + triangle projection), low-rank DCN +
  token map, shortcut, LayerNorm, token-wise MLP, LayerNorm."""
  pairs = N * (N + 1) // 2
  f = 2 * N * N * d + N * N + 2 * pairs * n_out * d
  f += 4 * N * d * rank + 3 * N * d + 2 * N * n_out * d
  if N != n_out:
    f += 2 * N * n_out * d
  f += 4 * n_out * d * hidden + (1 + GELU) * n_out * hidden
  return f + (3 + 2 * LN_AFFINE + 2) * n_out * d


def summary_proj_flops(t: TowerConfig, d_ns: int) -> float:
  return 2 * t.n_sum * t.width * d_ns


# ---- architectures -------------------------------------------------------------------------------
def pooling_flops(cfg: ModelConfig, t: TowerConfig, T=None):
  T = t.kept_len if T is None else T
  if cfg.pooling == "pma":
    return pma_flops(T, t.width, t.n_sum, t.heads)
  return hsp_flops(T, t.width, t.n_seed, t.n_sum, cfg.hsp_rank, t.heads, cfg.hsp_activation)


def layer_flops(cfg: ModelConfig, index: int, lens=None, executed: bool = False) -> dict:
  """Per-module forward FLOPs of Kunlun layer ``index`` (per example; ``lens {tower: T}``
  defaults to the kept lengths)."""
  out = defaultdict(float)
  towers = cfg.seq_towers
  for t in towers:
    T = t.kept_len if lens is None else lens[t.name]
    p = schedule(t, index, cfg.comp_skip, cfg.final_hsp)
    if p.weightgen:
      out["weightgen"] += weightgen_flops(cfg.n_ns, cfg.d_ns, t.n_kv, t.width)
    if p.hsp:
      out["pooling"] += pooling_flops(cfg, t, T)
    if p.final_hsp:
      out["pooling"] += pooling_flops(cfg, t, T)
    if p.pffn:
      out["pffn"] += pffn_flops(T, t.n_kv, t.width, t.heads, cfg.pffn_activation)
    if p.attention:
      out["attention"] += attention_flops(T, t.width, cfg.attention.kind, t.window,
                                          cfg.attention.block_size, t.heads, executed,
                                          cfg.attention.activation)
    out["summary_proj"] += summary_proj_flops(t, cfg.d_ns)
  out["mowe"] += mowe_flops(cfg, cfg.n_ns + sum(t.n_sum for t in towers))
  return dict(out)


def _stream_lens(cfg: ModelConfig, lens):
  return {t.name: (t.kept_len if lens is None else lens[t.name]) for t in cfg.towers}


def _kunlun_flops(cfg: ModelConfig, schema: Schema, lens, executed) -> dict:
  per = defaultdict(float)
  per["context"] = context_flops(cfg, schema)
  s_lens = _stream_lens(cfg, lens)
  if cfg.seq_mode == "oneseq":
    t = cfg.oneseq
    for st in schema.streams:
      per["event_embed"] += event_embed_flops(st, s_lens[st.name], t.width)
    merged = sum(s_lens.values())
    per["oneseq_merge"] = merged * t.width
    tower_lens = {t.name: t.kept_len if executed else np.minimum(merged, t.kept_len)}
  else:
    for st in schema.streams:
      per["event_embed"] += event_embed_flops(st, s_lens[st.name], cfg.tower(st.name).width)
    tower_lens = s_lens
  for l in range(cfg.num_layers):
    for k, v in layer_flops(cfg, l, tower_lens, executed).items():
      per[k] += v
  d_z = cfg.n_ns * cfg.d_ns + sum(t.n_sum * t.width for t in cfg.seq_towers)
  per["heads"] = heads_flops(cfg, d_z)
  return dict(per)


def _dlrm_flops(cfg: ModelConfig, schema: Schema, lens, executed) -> dict:
  del executed
  s_lens = _stream_lens(cfg, lens)
  d = cfg.dlrm.seq_dim
  per = {"context": context_flops(cfg, schema)}
  per["event_embed"] = sum(event_embed_flops(st, s_lens[st.name], d) + s_lens[st.name] * d + d
                           for st in schema.streams)
  d_z = cfg.n_ns * cfg.d_ns + len(schema.streams) * d
  per["bottom_mlp"] = mlp_flops(d_z, cfg.dlrm.mlp)
  per["heads"] = heads_flops(cfg, cfg.dlrm.mlp[-1])
  return per


def _interformer_flops(cfg: ModelConfig, schema: Schema, lens, executed) -> dict:
  """``kunlun/models/interformer.py``: CLS Cross Arch, then per layer Cross Arch (X and every
  stream), DHEN interaction, generated-projection PFFN and full RoPE MHA per stream; a final
  Cross Arch."""
  del executed                                      # full attention runs exactly its scope
  s_lens = _stream_lens(cfg, lens)
  i, d_ns, m = cfg.interformer, cfg.d_ns, cfg.mowe
  n_s = {t.name: i.n_cls + t.n_sum + i.n_recent for t in cfg.towers}
  gate = lambda n, d: 2 * n * d * d + (2 + SIGMOID) * n * d
  cross_x = 2 * cfg.n_ns * i.n_cls * d_ns + gate(i.n_cls, d_ns)
  per = defaultdict(float)
  per["context"] = context_flops(cfg, schema)
  for st in schema.streams:
    per["event_embed"] += event_embed_flops(st, s_lens[st.name], cfg.tower(st.name).width)
  per["cross"] += cross_x + sum(2 * i.n_cls * d_ns * t.width for t in cfg.towers)  # CLS tokens

  def cross_seq(t, T):
    return pma_flops(T, t.width, t.n_sum, t.heads) + gate(n_s[t.name], t.width)

  n_in = cfg.n_ns + sum(n_s.values())
  for _ in range(cfg.num_layers):
    per["cross"] += cross_x
    for t in cfg.towers:
      T = i.n_cls + s_lens[t.name]
      d = t.width
      per["cross"] += cross_seq(t, T) + 2 * n_s[t.name] * d * d_ns
      per["pffn"] += (2 * i.n_cls * d_ns * d_ns + (1 + GELU) * d_ns + 2 * d_ns * d * d + d * d
                      + RMS * i.n_cls * d_ns + 2 * T * d * d + (RMS + 1) * T * d)
      per["attention"] += (8 * T * d * d + 4 * T * T * d + _softmax(t.heads) * T * T * t.heads
                           + (RMS + 6 + 2) * T * d)
    N = n_in
    for _ in range(m.layers_per_expert):
      per["interaction"] += dhen_layer_flops(N, d_ns, cfg.n_ns, m.rank, m.mlp_hidden)
      N = cfg.n_ns
  per["cross"] += cross_x + sum(cross_seq(t, i.n_cls + s_lens[t.name]) for t in cfg.towers)
  d_z = i.n_cls * d_ns + sum(n_s[t.name] * t.width for t in cfg.towers)
  per["heads"] = heads_flops(cfg, d_z)
  return dict(per)


def _per_module(cfg: ModelConfig, schema: Schema, lens=None, executed=False) -> dict:
  if cfg.arch == "dlrm":
    return _dlrm_flops(cfg, schema, lens, executed)
  if cfg.arch == "interformer":
    return _interformer_flops(cfg, schema, lens, executed)
  if cfg.arch == "kunlun_ablated":
    cfg = ablated_config(cfg)
  return _kunlun_flops(cfg, schema, lens, executed)


def _result(per: dict) -> dict:
  per = {k: float(v) for k, v in per.items()}
  fwd = float(sum(per.values()))
  return {"forward": fwd, "train_step": 3.0 * fwd, "per_module": per}


def _cfg(config, schema) -> ModelConfig:
  return config if isinstance(config, ModelConfig) else parse(config, schema)


def model_flops(config, schema: Schema) -> dict:
  """Model FLOPs of one example whose streams fill their kept lengths:
  ``{"forward": f, "train_step": 3 f, "per_module": {module: forward FLOPs}}``."""
  return _result(_per_module(_cfg(config, schema), schema))


def executed_estimate(config, schema: Schema) -> dict:
  """Forward FLOPs per example as the compiled program runs them (padded kept lengths, the
  attention scope as executed); same keys as ``model_flops``."""
  return _result(_per_module(_cfg(config, schema), schema, executed=True))


def batch_lengths(cfg: ModelConfig, batch) -> dict:
  """``{stream: f64[B]}`` valid lengths of a (host or device) batch, capped at the kept length."""
  return {t.name: np.minimum(np.asarray(batch["events"][t.name]["length"], np.float64),
                             t.kept_len) for t in cfg.towers}


def batch_flops(config, schema: Schema, batch) -> dict:
  """Model FLOPs of ``batch`` at its actual lengths (padded examples, ``example_mask == 0``,
  count nothing): ``{"forward", "train_step", "examples", "per_module"}``, totals for the batch.
  """
  cfg = _cfg(config, schema)
  per = _per_module(cfg, schema, batch_lengths(cfg, batch))
  B = len(np.asarray(batch["surface"]))
  w = np.asarray(batch.get("example_mask", np.ones(B)), np.float64)
  per = {k: float(np.sum(np.broadcast_to(np.asarray(v, np.float64), (B,)) * w))
         for k, v in per.items()}
  fwd = float(sum(per.values()))
  return {"forward": fwd, "train_step": 3.0 * fwd, "examples": float(w.sum()), "per_module": per}


def executed_flops(fn, *args, **kwargs) -> float:
  """FLOPs XLA's cost analysis reports for ``fn`` (jitted here unless it already is) compiled for
  ``args`` (what the program executes, padding, recomputation and all)."""
  f = fn if hasattr(fn, "lower") else jax.jit(fn)
  cost = f.lower(*args, **kwargs).compile().cost_analysis()
  if isinstance(cost, (list, tuple)):                       # older jax: one dict per program
    cost = cost[0]
  return float(cost.get("flops", 0.0))


def flop_figures(config, schema: Schema, batch, step_fn=None, *step_args, train: bool = True,
                 **step_kwargs) -> dict:
  """The FLOP figures of one step on ``batch`` (totals for the batch), for MFU reports:

  * ``model_actual``: model FLOPs at the batch's actual lengths (``batch_flops``);
  * ``model_padded``: model FLOPs with every stream at its kept length, times the batch size;
  * ``executed_estimate``: the analytic count as executed (padded), times the batch size;
  * ``executed``: XLA's cost analysis of ``step_fn(*step_args, **step_kwargs)`` when given
    (e.g. the jitted train step and its arguments), else None.

  The analytic figures are training-step FLOPs (3x forward) when ``train``, else forward.
  """
  cfg = _cfg(config, schema)
  key = "train_step" if train else "forward"
  B = len(np.asarray(batch["surface"]))
  out = {"model_actual": batch_flops(cfg, schema, batch)[key],
         "model_padded": model_flops(cfg, schema)[key] * B,
         "executed_estimate": executed_estimate(cfg, schema)[key] * B, "executed": None}
  if step_fn is not None:
    out["executed"] = executed_flops(step_fn, *step_args, **step_kwargs)
  return out


@dataclasses.dataclass
class FlopMeter:
  """Model FLOPs (training step, actual lengths) of the batches a loop consumes.

  ``add(batch)`` per step (host batch); ``per_step()`` = the mean over the steps added since the
  last call times ``scale`` (e.g. the process count, when each process sees its share of the
  global batch), None before any; it then starts a new window.
  """
  config: object
  schema: Schema
  scale: float = 1.0
  _sum: float = 0.0
  _n: int = 0

  def __post_init__(self):
    self.config = _cfg(self.config, self.schema)

  def add(self, batch) -> float:
    f = batch_flops(self.config, self.schema, batch)["train_step"]
    self._sum, self._n = self._sum + f, self._n + 1
    return f

  def per_step(self) -> float | None:
    if not self._n:
      return None
    f = self.scale * self._sum / self._n
    self._sum, self._n = 0.0, 0
    return f
