"""The config table: every field of every config section once, as ``FIELDS[path] = Field(default,
doc, kind, range/choices)`` (paths ``train.lr``, ``model.mowe.rank``; ``*`` = any tower name).

Derived from it: ``base_config()`` / ``default_model()`` / ``transfer_config()`` defaults, the
``kunlun.configs.types`` dataclass defaults, ``check_value`` (the types and ranges checked by
``kunlun.train.settings``, ``kunlun.configs.types.parse``, ``kunlun.configs.transfer``) and
``train.py --show_config``. No jax here.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from typing import Any

import ml_collections

MAX_BATCH = 1 << 20        # examples per global batch: larger ones do not fit in host memory
MAX_SEED = (1 << 32) - 1   # grain's shuffle takes [0, 2**32 - 1]; jax.random.key keeps 32 bits
MAX_STEPS = (1 << 31) - 1  # the optimizer's step count is int32
MAX_SIZE = 1 << 16         # any model width, count or length: each becomes an allocation
PACKED_ARCHS = ("kunlun", "kunlun_ablated")   # the architectures with packed (jagged) towers
REQUIRED = "<required>"    # default of a field every preset must set (tower sizes)

ARCHS = ("kunlun", "interformer", "dlrm", "kunlun_ablated")
DTYPES = ("float32", "bfloat16")
BACKENDS = ("xla", "pallas", "triton", "auto")
SEQ_MODES = ("towers", "oneseq")
ATTENTION_KINDS = ("swa", "block", "full")
POOLINGS = ("hsp", "pma")
HEAD_KINDS = ("towers", "mmoe")
JOIN_KEYS = ("user_item", "user")


class SettingsError(ValueError):
  """A setting outside its allowed range (one line: field, value, what is allowed)."""


@dataclasses.dataclass(frozen=True)
class Field:
  """One config field. ``kind``: int | number | bool | str | choice | weights | numbers | ints |
  activation | kinds. ``lo`` / ``hi`` bound ints and numbers (inclusive; ``open_lo`` /
  ``open_hi``: exclusive). ``choices``: allowed values, or the name of a registry below (imported
  lazily: those modules import jax). ``optional``: may be absent (not in the preset defaults)."""
  default: Any
  doc: str
  kind: str
  lo: float | None = None
  hi: float | None = None
  choices: tuple | str | None = None
  open_lo: bool = False
  open_hi: bool = False
  optional: bool = False

  def allowed(self) -> str:
    if self.kind in ("int", "number"):
      what = "an integer" if self.kind == "int" else "a number"
      return f"{what} {range_text(self.lo, self.hi, self.open_lo, self.open_hi)}".rstrip()
    if self.kind == "choice":
      return f"one of {choices(self.choices)}"
    if self.kind == "activation":
      return f"one of {choices(self.choices)}, or one GDPA activation per head"
    if self.kind == "kinds":
      return f"distinct names from {choices(self.choices)}, comma-separated"
    if self.kind == "ints":
      return f"a tuple of integers {range_text(self.lo, self.hi)}"
    if self.kind == "weights":
      return "'auto', 'surface=weight,...' or a mapping {surface: weight >= 0}"
    if self.kind == "numbers":
      return "a tuple of numbers >= 0 (empty: all 1.0)"
    if self.kind == "capacity":
      return "'' (off), 'auto' or 'stream=N,...' (N a positive multiple of 64)"
    return {"bool": "True or False", "str": "a string"}[self.kind]

  def reason(self, v) -> str:
    """Why a ``capacity`` value is not allowed (its parser's words; "" otherwise)."""
    if self.kind == "capacity":
      try:
        parse_capacity(v)
      except ValueError as e:
        return str(e)
    return ""

  def problem(self, v) -> bool:
    """True when ``v`` is not allowed."""
    if self.kind == "bool":
      return not isinstance(v, bool)
    if self.kind == "str":
      return not isinstance(v, str)
    if self.kind == "choice":
      return v not in choices(self.choices)
    if self.kind == "activation":
      names = tuple(a.strip() for a in v.split(",")) if isinstance(v, str) and "," in v else v
      if isinstance(names, str):
        return names not in choices(self.choices)
      return (not isinstance(names, (tuple, list)) or not names
              or any(a not in choices("gdpa") for a in names))
    if self.kind == "kinds":
      names = tuple(k.strip() for k in v.split(",") if k.strip()) if isinstance(v, str) else v
      return (not isinstance(names, (tuple, list)) or not names or len(set(names)) != len(names)
              or any(k not in choices(self.choices) for k in names))
    if self.kind == "ints":
      return not isinstance(v, (tuple, list)) or any(_int_problem(x, self.lo, self.hi)
                                                     for x in v)
    if self.kind == "weights":
      return not _weights_ok(v)
    if self.kind == "numbers":
      return not isinstance(v, (tuple, list)) or not all(_finite(x) and x >= 0 for x in v)
    if self.kind == "capacity":
      return bool(self.reason(v))
    if isinstance(v, bool) or not isinstance(v, int if self.kind == "int" else (int, float)):
      return True
    if not _finite(v):
      return True
    if self.lo is not None and (v <= self.lo if self.open_lo else v < self.lo):
      return True
    return self.hi is not None and (v >= self.hi if self.open_hi else v > self.hi)


def parse_capacity(v):
  """``data.jagged_capacity``: "" -> None (every stream padded), "auto" -> "auto" (from a length
  sample, ``kunlun.train.capacity.jagged_capacity``), "click=4096,..." -> {stream: N} (a stream
  named twice: ValueError)."""
  if not isinstance(v, str):
    raise ValueError(f"data.jagged_capacity = {v!r}: not a string")
  v = v.strip()
  if v in ("", "auto"):
    return v or None
  out = {}
  for item in v.split(","):
    name, eq, n = item.partition("=")
    if not eq or not name.strip() or not n.strip().isdigit() or int(n) <= 0 or int(n) % 64:
      raise ValueError(f"data.jagged_capacity item {item!r}: allowed 'stream=N' with N a "
                       "positive multiple of 64")
    if name.strip() in out:
      raise ValueError(f"data.jagged_capacity: stream {name.strip()!r} given twice")
    out[name.strip()] = int(n)
  return out


def _int_problem(x, lo, hi=None) -> bool:
  return isinstance(x, bool) or not isinstance(x, int) or x < lo or (hi is not None and x > hi)


def range_text(lo, hi, open_lo: bool = False, open_hi: bool = False) -> str:
  """``in [lo, hi]`` / ``>= lo`` (``(`` / ``)`` for open ends; "" without bounds)."""
  if lo is not None and hi is not None:
    return f"in {'(' if open_lo else '['}{_num(lo)}, {_num(hi)}{')' if open_hi else ']'}"
  if lo is not None:
    return f"{'>' if open_lo else '>='} {_num(lo)}"
  return ""


def _num(x) -> str:
  return f"{int(x)}" if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


def _finite(x) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _weights_ok(v) -> bool:
  if isinstance(v, str):
    return True                     # parsed (names, numbers) by data.schema.surface_weights
  items = v.items() if hasattr(v, "items") else None
  return items is not None and all(isinstance(k, str) and _finite(w) and w >= 0
                                   for k, w in items)


REMAT_POLICIES = ("none", "dots_no_batch", "dots_saveable", "full")   # kunlun/nn/remat.py
# train.remat also takes "auto": the least recompute whose compiled step fits the device's memory
# (kunlun.train.step.pick_remat tries them in this order)
REMAT_ORDER = ("none", "dots_saveable", "dots_no_batch", "full")
REMAT_CHOICES = REMAT_POLICIES + ("auto",)
REMAT_SCOPES = ("layer", "tower")
BUCKET_KINDS = ("age", "log_age", "gap", "position")   # kunlun/nn/time_encoding.py
DAY = 86_400.0                                          # seconds

# registry name -> its names; or -> (module, attribute) of a lower layer that imports jax,
# imported only when asked
_NAMES = {"remat": REMAT_CHOICES, "remat_scope": REMAT_SCOPES, "bucket_kinds": BUCKET_KINDS}
_LAZY = {"rules": ("sharding.rules", "PRESETS"), "presets": ("data.synthetic", "PRESETS"),
         "gdpa": ("pallas_kernels.activations", "NAMES")}


def choices(spec) -> tuple:
  """The allowed values of a ``choice`` field (a registry name is imported here, lazily)."""
  if not isinstance(spec, str):
    return tuple(spec)
  if spec == "attention":
    return ("softmax",) + choices("gdpa")
  if spec in _NAMES:
    return _NAMES[spec]
  module, name = _LAZY[spec]
  return tuple(getattr(importlib.import_module(module), name))


I, N, B, S, C = "int", "number", "bool", "str", "choice"
F = Field
_TOWER = {  # field: (doc, lowest value, default of the merged OneSeq tower)
    "width": ("event token width d_e", 1, 32), "heads": ("attention heads H_e", 1, 2),
    "n_kv": ("PFFN generated keys / values", 1, 16),
    "window": ("SWA half-window w_e (<= kept_len)", 0, 16),
    "kept_len": ("most recent events kept T_e", 1, 64), "n_seed": ("HSP seed tokens", 1, 8),
    "n_sum": ("HSP summary tokens per layer", 1, 2),
    "depth": ("layers the tower runs (<= num_layers)", 1, 2)}
TOWER_FIELDS = tuple(_TOWER)

FIELDS: dict[str, Field] = {
    "seed": F(0, "PRNG seed of parameter init and the training RNG (dropout, ...)", I, 0,
              MAX_SEED),
    # ---- data
    "data.preset": F("tiny", "synthetic preset generated into <workdir>/data when --data_dir is "
                     "absent", C, choices="presets"),
    "data.num_examples": F(20_000, "train examples generated for the synthetic preset", I, 1),
    "data.synthetic_seed": F(0, "seed of the generated synthetic data", I, 0, MAX_SEED,
                             optional=True),
    "data.batch_size": F(64, "global batch size (examples per training step, all processes)", I,
                         1, MAX_BATCH),
    "data.surface_weights": F("feed=0.5,stories=0.3,reels=0.2", "per-surface sampling weights: "
                              "'surface=w,...', a mapping, or 'auto' (in proportion to the train "
                              "records; weights naming none of the data's surfaces: 'auto')",
                              "weights"),
    "data.shuffle_seed": F(0, "seed of the per-surface record shuffle", I, 0, MAX_SEED),
    "data.num_threads": F(2, "record-loading threads per process", I, 1, 256),
    "data.prefetch": F(4, "batches loaded ahead of the step (0: load on demand)", I, 0, 1024),
    "data.skip_invalid": F(False, "count, report and skip invalid records instead of stopping",
                           B),
    "data.length_balance": F(False, "Base Batch Shuffling: sort small groups by history length",
                             B),
    "data.train_split": F("train", "split train.py reads (e.g. 'pretrain': an earlier window)", S),
    "data.eval_batch_size": F(0, "eval.py global batch size (0: data.batch_size)", I, 0,
                              MAX_BATCH),
    "data.jagged_capacity": F("", "packed (jagged) event towers at a static token capacity "
                              "per process batch (issue #28; Kunlun towers mode): '' off, 'auto' "
                              "(from a length sample, P(overflow) <= 0.001) or 'stream=N,...'",
                              "capacity"),
    "data.jagged_buckets": F(1, "with jagged_capacity=auto: that many static capacities "
                             "(1-4), each batch packed at the smallest that fits (one process; "
                             "a compiled step each)", I, 1, 4),
    "data.valid_split": F("valid", "held-out split for periodic validation ('' or absent in the "
                          "data: none)", S),
    # ---- train
    "train.steps": F(300, "total training steps (--steps overrides; train.epochs replaces)", I, 0,
                     MAX_STEPS),
    "train.epochs": F(0.0, "> 0: passes over the train split, replacing train.steps", N, 0),
    "train.validate_every": F(0, "steps between validations; 0 = once per epoch; -1 = never", I,
                              -1),
    "train.keep_best": F(False, "keep the params of the best validation NE in <workdir>/best "
                         "(eval.py --best)", B),
    "train.best_task": F("", "task whose validation NE picks the best ('' = mean over tasks)", S),
    "train.schedule_steps": F(0, "length of the LR schedule (0: train.steps)", I, 0, MAX_STEPS),
    "train.lr": F(2e-3, "AdamW peak learning rate (dense parameters)", N, 0),
    "train.warmup_steps": F(50, "linear LR warm-up steps", I, 0, MAX_STEPS),
    "train.schedule": F("cosine", "LR schedule after warm-up", C, choices=("cosine", "constant")),
    "train.weight_decay": F(1e-5, "AdamW weight decay (matrices only)", N, 0),
    "train.b1": F(0.9, "AdamW first-moment decay", N, 0, 1, open_hi=True),
    "train.b2": F(0.999, "AdamW second-moment decay", N, 0, 1, open_hi=True),
    "train.clip_norm": F(1.0, "global gradient-norm clip", N, 0),
    "train.emb_lr": F(0.05, "row-wise Adagrad learning rate (embedding tables)", N, 0),
    "train.sparse_embedding_update": F(True, "Adagrad reads / writes only the looked-up "
                                       "embedding rows (False: the dense table update)", B),
    "train.param_copies": F(True, "16-bit compute dtype: the optimizer keeps a copy of each "
                            "weight the model only reads cast, so the step does not cast it", B),
    "train.checkpoint_every": F(100, "steps between checkpoints (and at the end)", I, 1),
    "train.keep_checkpoints": F(3, "checkpoints kept (older ones deleted)", I, 1),
    "train.log_every": F(10, "steps between log lines / metrics.jsonl records", I, 1),
    "train.max_bad_steps": F(5, "consecutive non-finite steps skipped; one more stops the run",
                             I, 0),
    "train.task_weights": F((), "per-task loss weights, one per task (empty: all 1.0)",
                            "numbers"),
    "train.remat": F("none", "recompute in the backward pass (memory for compute); auto: the "
                     "least recompute whose compiled step fits train.remat_memory of a device",
                     C, choices="remat"),
    "train.remat_memory": F(0.9, "remat=auto: the share of a device's memory the step may "
                            "take", N, 0, 1, open_lo=True),
    "train.remat_scope": F("layer", "what the remat policy wraps (kunlun/nn/remat.py)", C,
                           choices="remat_scope"),
    "train.microbatches": F(1, "gradient accumulation: the batch in this many parts "
                            "(strided; packed: by block)", I, 1),
    "train.metrics_lag": F(1, "step statistics fetched this many steps late (0: every step)",
                           I, 0, 1000),
    # ---- sharding
    "sharding.rules": F("fsdp", "logical-to-mesh axis rules preset (sharding/rules.py)", C,
                        choices="rules"),
    # ---- transfer (relations: kunlun.configs.transfer.parse_transfer)
    "transfer.kd_lambda": F(0.0, "weight of the student-adapter soft-target BCE (0 = off)", N, 0),
    "transfer.loopfm_ctx": F(False, "FM embedding of the current example as an extra context "
                             "token", B),
    "transfer.loopfm_events": F(False, "per-event FM embeddings through the event-encoder "
                                "adapter", B),
    "transfer.join_key": F("user_item", "history join key of the FM embeddings", C,
                           choices=JOIN_KEYS),
    "transfer.max_age": F(-1.0, "seconds; joined embeddings older than this are missing (-1 = "
                          "no limit)", N, -1),
    # ---- model (relations and the data schema: kunlun.configs.types.parse)
    "model.arch": F("kunlun", "model family (model.py, baselines/)", C, choices=ARCHS),
    "model.dtype": F("float32", "compute dtype (params stay float32)", C, choices=DTYPES),
    "model.backend": F("xla", "the Pallas kernels (attention, GDPA, packed towers, the optimizer)",
                       C, choices=BACKENDS),
    "model.d_ns": F(32, "non-sequence token width", I, 1),
    "model.n_ns": F(8, "non-sequence tokens after the LCE", I, 1),
    "model.n_dense_tokens": F(1, "tokens the dense features are projected into", I, 1),
    "model.num_layers": F(2, "Kunlun layers L", I, 1),
    "model.comp_skip": F(True, "Computation Skip (spec c.7)", B),
    "model.final_hsp": F(False, "extra HSP of each tower's output in its last layer (not in spec "
                         "d.1 / d.4; runs stored before the switch had it on)", B),
    "model.seq_mode": F("towers", "towers: one tower per stream; oneseq: one merged stream (spec "
                        "h-18)", C, choices=SEQ_MODES),
    "model.num_time_buckets": F(32, "log-bucketed event-age embedding size (event MLP input)", I,
                                1),
    "model.time_buckets.enabled": F(False, "per-head time / position bucket embeddings on the "
                                    "SWA / PFFN / HSP operand (spec b.5-2)", B),
    "model.time_buckets.kinds": F("age,gap,position", "bucket kinds", "kinds",
                                  choices="bucket_kinds"),
    "model.time_buckets.num_buckets": F(32, "buckets per kind", I, 2),
    "model.time_buckets.age_horizon_days": F(32.0, "age bucketing horizon (days)", N, 0,
                                             open_lo=True),
    "model.attention.kind": F("swa", "sequence self-attention (spec c.4)", C,
                              choices=ATTENTION_KINDS),
    "model.attention.activation": F("softmax", "softmax, a GDPA activation, or one per head",
                                    "activation", choices="attention"),
    "model.attention.qk_norm": F(True, "RMS-normalise queries and keys", B),
    "model.attention.rotary": F(True, "rotary time encoding (head_dim must be even)", B),
    "model.attention.block_size": F(64, "block size of block attention", I, 1),
    "model.pffn_activation": F("fast_gelu", "GDPA activation of the PFFN (spec c.3; a name or one "
                               "per head)", "activation", choices="gdpa"),
    "model.key_norm": F(False, "RMS-normalise the generated PFFN keys", B),
    "model.pooling": F("hsp", "sequence summary (spec c.5)", C, choices=POOLINGS),
    "model.hsp_rank": F(4, "SumKronLinear rank r_k", I, 1),
    "model.hsp_activation": F("fast_gelu", "GDPA activation of HSP (a name or one per head)",
                              "activation", choices="gdpa"),
    "model.score_clip": F(8.0, "clip GDPA scores to [-c, c] (spec h-13: 8; 0 = off)", N, 0),
    "model.mowe.num_experts": F(2, "MoWE experts (spec c.6)", I, 1),
    "model.mowe.layers_per_expert": F(1, "Wukong layers per MoWE expert", I, 1),
    "model.mowe.rank": F(8, "MoWE low-rank width", I, 1),
    "model.mowe.mlp_hidden": F(64, "MoWE MLP hidden width", I, 1),
    "model.mowe.cross_layer": F(True, "Wukong cross-layer attention connections (GEM, spec h-19)",
                                B),
    **{f"model.towers.*.{k}": F(REQUIRED, f"tower: {d}", I, lo)
       for k, (d, lo, _) in _TOWER.items()},
    "model.tower_templates": F("", "towers whose sizes serve streams 0, 1, ... of other data ('' "
                               "= name order; kunlun/configs/fit.py)", S),
    **{f"model.oneseq.{k}": F(one, f"merged OneSeq tower: {d}", I, lo)
       for k, (d, lo, one) in _TOWER.items()},
    "model.heads.kind": F("towers", "task heads (spec d.3)", C, choices=HEAD_KINDS),
    "model.heads.top_mlp": F((64,), "shared MLP widths below the heads", "ints", 1),
    "model.heads.tower_hidden": F(32, "hidden width of each task tower", I, 1),
    "model.heads.num_experts": F(2, "MMoE experts", I, 1),
    "model.heads.expert_hidden": F(32, "MMoE expert hidden width", I, 1),
    "model.dlrm.seq_dim": F(32, "DLRM baseline: pooled sequence width", I, 1),
    "model.dlrm.mlp": F((128, 64), "DLRM baseline: MLP widths", "ints", 1),
    "model.interformer.n_cls": F(4, "InterFormer: CLS tokens (X_sum tokens)", I, 1),
    "model.interformer.n_recent": F(2, "InterFormer: recent tokens in S_sum", I, 0),
}
# every model integer (a width, count or length) becomes an allocation: at most MAX_SIZE
FIELDS.update({p: dataclasses.replace(f, hi=MAX_SIZE) for p, f in FIELDS.items()
               if p.startswith("model.") and f.kind in (I, "ints") and f.hi is None})
SECTIONS = ("seed", "data", "train", "sharding", "transfer", "model")   # --show_config order


def row(path: str) -> Field | None:
  """The table row of a concrete field path (``model.towers.click.width`` -> ``model.towers.*``)."""
  if path in FIELDS:
    return FIELDS[path]
  parts = path.split(".")
  if len(parts) == 4 and parts[:2] == ["model", "towers"]:
    return FIELDS.get(f"model.towers.*.{parts[3]}")
  return None


def default(path: str):
  """The table default of ``path``."""
  return FIELDS[path].default


def defaults(section: str) -> ml_collections.ConfigDict:
  """The ConfigDict of a section's defaults (optional fields left out; ``*`` levels empty)."""
  out = ml_collections.ConfigDict()
  for path, f in FIELDS.items():
    parts = path.split(".")
    if parts[0] != section or f.optional:
      continue
    d = out
    for p in parts[1:-1]:
      if p == "*":
        break
      if p not in d:
        d[p] = ml_collections.ConfigDict()
      d = d[p]
    else:
      d[parts[-1]] = f.default
  return out


def check_value(path: str, value, why: str = "") -> None:
  """Raises SettingsError (``config.<path> = <value>: allowed ...``) when ``value`` is not allowed
  by the row of ``path``."""
  f = row(path)
  if f is not None and f.problem(value):
    if hasattr(value, "to_dict"):
      value = value.to_dict()
    shown = " ".join(repr(value).split())
    if len(shown) > 80:
      shown = shown[:77] + "..."
    why = why or f.reason(value)
    raise SettingsError(f"config.{path} = {shown}: allowed {f.allowed()}"
                        + (f" ({why})" if why else ""))
