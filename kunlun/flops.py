"""Analytic model FLOPs (spec Appendix B): per module and per model, per example.

Forward FLOPs count matmuls only (a multiply-add = 2 FLOPs), mirroring exactly the contractions of
the modules in ``kunlun/``; elementwise work (norms, activations, softmax), embedding look-ups and
batch-shared work (the HSP/PMA seed query projection, computed once per batch) are not counted.
Self-attention counts the *model* cost of its scope: ``4 T (2w+1) d`` for "swa" (the band),
``4 T^2 d`` for "full", ``4 T b d`` for "block"; no recomputation. The Wukong cross-layer
connections (``mowe.cross_layer``, h-19) count their ``X_0`` token map and weighted sums, which are
contractions in ``kunlun/wukong.py``. A training step is 3x forward.
Multiply by the batch size for a step.
"""

from __future__ import annotations

from collections import defaultdict

from data.schema import Schema
from kunlun.baselines import interformer_config
from kunlun.config import ModelConfig, TowerConfig, parse
from kunlun.inputs import event_side_dim
from kunlun.towers import schedule
from kunlun.wukong import split_tokens


def context_flops(cfg: ModelConfig, schema: Schema) -> float:
  """DenseTokens projection + LCE token mix."""
  n_dense_tok = cfg.n_dense_tokens if schema.dense else 0
  dense = 2 * len(schema.dense) * n_dense_tok * cfg.d_ns
  n_raw = len(schema.sparse) + n_dense_tok
  return dense + 2 * n_raw * cfg.n_ns * cfg.d_ns


def event_embed_flops(stream, T: int, d: int) -> float:
  """EventEmbed MLP: concat(item [d], action, surface, [extras], time [side each]) -> d -> d."""
  sides = 3 + (1 if stream.extra_fields else 0)
  concat = d + sides * event_side_dim(d)
  return 2 * T * concat * d + 2 * T * d * d


def weightgen_flops(n_ns: int, d_ns: int, n_kv: int, d: int) -> float:
  return 2 * n_ns * n_kv * d_ns + 2 * n_kv * d_ns * d_ns + 2 * 2 * n_kv * d_ns * d


def pffn_flops(T: int, n_kv: int, d: int) -> float:
  return 4 * T * n_kv * d


def attention_flops(T: int, d: int, kind: str, window: int, block: int) -> float:
  proj = 8 * T * d * d
  if kind == "swa":
    return proj + 4 * T * min(2 * window + 1, T) * d
  if kind == "block":
    return proj + 4 * T * min(block, T) * d
  return proj + 4 * T * T * d


def hsp_flops(T: int, d: int, n_seed: int, n_sum: int, rank: int) -> float:
  """K/V projections, seed attention, output projection, SumKronLinear (Q is batch-shared)."""
  return (4 * T * d * d + 4 * n_seed * T * d + 2 * n_seed * d * d
          + 2 * rank * n_seed * n_sum * d + 2 * rank * n_sum * d * d)


def pma_flops(T: int, d: int, n_sum: int) -> float:
  return 4 * T * d * d + 4 * n_sum * T * d + 2 * n_sum * d * d


def wukong_layer_flops(N: int, d: int, n_out: int, rank: int, hidden: int) -> float:
  n_fm, n_lcb = split_tokens(n_out)
  f = 4 * N * d * rank + 2 * N * rank * hidden + 2 * hidden * n_fm * d + 2 * N * n_lcb * d
  if N != n_out:
    f += 2 * N * n_out * d
  return f


def wukong_cross_layer_flops(N: int, d: int, n_out: int, num_layers: int) -> float:
  """Cross-layer connections of one stack (h-19): the ``X_0`` token map (when ``N != n_out``) and,
  for each layer ``l >= 1``, the ``(l + 1)``-term weighted sum (a contraction of ``l + 1``)."""
  if num_layers < 2:
    return 0.0
  f = 2 * N * n_out * d if N != n_out else 0.0
  return f + sum(2 * (l + 1) * n_out * d for l in range(1, num_layers))


def mowe_flops(cfg: ModelConfig, n_in: int) -> float:
  m = cfg.mowe
  f, N = 0.0, n_in
  for _ in range(m.layers_per_expert):
    f += wukong_layer_flops(N, cfg.d_ns, cfg.n_ns, m.rank, m.mlp_hidden)
    N = cfg.n_ns
  if m.cross_layer:
    f += wukong_cross_layer_flops(n_in, cfg.d_ns, cfg.n_ns, m.layers_per_expert)
  return m.num_experts * f


def mlp_flops(d_in: int, features) -> float:
  f = 0.0
  for h in features:
    f += 2 * d_in * h
    d_in = h
  return f


def heads_flops(cfg: ModelConfig, d_z: int) -> float:
  h, S, K = cfg.heads, len(cfg.surfaces), len(cfg.tasks)
  f = mlp_flops(d_z, h.top_mlp)
  D = h.top_mlp[-1]
  if h.kind == "towers":
    return f + S * K * (2 * D * h.tower_hidden + 2 * h.tower_hidden)
  E, He = h.num_experts, h.expert_hidden
  f += 2 * E * D * He + 2 * S * K * D * E + 2 * S * K * E * He
  return f + S * K * (2 * He * h.tower_hidden + 2 * h.tower_hidden)


def pooling_flops(cfg: ModelConfig, t: TowerConfig) -> float:
  if cfg.pooling == "pma":
    return pma_flops(t.kept_len, t.width, t.n_sum)
  return hsp_flops(t.kept_len, t.width, t.n_seed, t.n_sum, cfg.hsp_rank)


def layer_flops(cfg: ModelConfig, index: int) -> dict[str, float]:
  """Per-module forward FLOPs of Kunlun layer ``index`` (per example)."""
  out = defaultdict(float)
  towers = cfg.seq_towers
  for t in towers:
    p = schedule(t, index, cfg.comp_skip, cfg.final_hsp)
    if p.weightgen:
      out["weightgen"] += weightgen_flops(cfg.n_ns, cfg.d_ns, t.n_kv, t.width)
    if p.hsp:
      out["pooling"] += pooling_flops(cfg, t)
    if p.final_hsp:
      out["pooling"] += pooling_flops(cfg, t)
    if p.pffn:
      out["pffn"] += pffn_flops(t.kept_len, t.n_kv, t.width)
    if p.attention:
      out["attention"] += attention_flops(t.kept_len, t.width, cfg.attention.kind, t.window,
                                          cfg.attention.block_size)
    out["summary_proj"] += 2 * t.n_sum * t.width * cfg.d_ns
  out["mowe"] += mowe_flops(cfg, cfg.n_ns + sum(t.n_sum for t in towers))
  return dict(out)


def _kunlun_flops(cfg: ModelConfig, schema: Schema) -> dict[str, float]:
  per = defaultdict(float)
  per["context"] = context_flops(cfg, schema)
  for st in schema.streams:
    t = cfg.oneseq if cfg.seq_mode == "oneseq" else cfg.tower(st.name)
    T = cfg.tower(st.name).kept_len if cfg.seq_mode == "towers" else _tower_len(cfg, st.name)
    per["event_embed"] += event_embed_flops(st, T, t.width)
  for l in range(cfg.num_layers):
    for k, v in layer_flops(cfg, l).items():
      per[k] += v
  d_z = cfg.n_ns * cfg.d_ns + sum(t.n_sum * t.width for t in cfg.seq_towers)
  per["heads"] = heads_flops(cfg, d_z)
  return dict(per)


def _tower_len(cfg: ModelConfig, stream: str) -> int:
  for t in cfg.towers:
    if t.name == stream:
      return t.kept_len
  raise KeyError(stream)


def _dlrm_flops(cfg: ModelConfig, schema: Schema) -> dict[str, float]:
  per = {"context": context_flops(cfg, schema)}
  per["event_embed"] = sum(event_embed_flops(st, _tower_len(cfg, st.name), cfg.dlrm.seq_dim)
                           for st in schema.streams)
  d_z = cfg.n_ns * cfg.d_ns + len(schema.streams) * cfg.dlrm.seq_dim
  per["bottom_mlp"] = mlp_flops(d_z, cfg.dlrm.mlp)
  per["heads"] = heads_flops(cfg, cfg.dlrm.mlp[-1])
  return per


def model_flops(config, schema: Schema) -> dict:
  """``{"forward": f, "train_step": 3 f, "per_module": {module: forward FLOPs}}`` per example."""
  cfg = config if isinstance(config, ModelConfig) else parse(config, schema)
  if cfg.arch == "dlrm":
    per = _dlrm_flops(cfg, schema)
  else:
    if cfg.arch == "interformer":
      cfg = interformer_config(cfg)
    per = _kunlun_flops(cfg, schema)
  fwd = float(sum(per.values()))
  return {"forward": fwd, "train_step": 3.0 * fwd, "per_module": per}
