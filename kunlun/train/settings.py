"""Every run setting in one table: type, allowed range and a one-line description of each field
of ``config.seed``, ``config.data``, ``config.train``, ``config.sharding`` and
``config.transfer``, plus the descriptions of ``config.model`` (validated, against the data
schema, by ``kunlun.config.parse``; transfer rules by ``kunlun.transfer.settings``).

``check(config)`` applies the table (types, ranges, relations) before any data is read or
anything compiles, to a config from ``--config`` / overrides and to one loaded from a workdir's
``run_info.json`` alike; a violation is a ``SettingsError`` of one line naming the field, the
value and what is allowed. ``describe(config)`` is ``train.py --show_config``: every field with its
value and description. No jax here: both run before the accelerator starts.
"""

from __future__ import annotations

import dataclasses
import math

MAX_BATCH = 1 << 20        # examples per global batch: larger ones do not fit in host memory


class SettingsError(ValueError):
  """A setting outside its allowed range (one line: field, value, what is allowed)."""


@dataclasses.dataclass(frozen=True)
class Field:
  """``kind``: int | number | bool | str | choice | weights | numbers. ``lo`` / ``hi`` bound ints
  and numbers (inclusive; ``open_hi``: exclusive). ``choices``: allowed values, or the name of a
  function below that returns them (registries imported lazily)."""
  doc: str
  kind: str
  lo: float | None = None
  hi: float | None = None
  choices: tuple | str | None = None
  open_hi: bool = False
  optional: bool = False    # may be absent (read with .get and a default)

  def allowed(self) -> str:
    if self.kind in ("int", "number"):
      what = "an integer" if self.kind == "int" else "a number"
      if self.lo is not None and self.hi is not None:
        return f"{what} in [{_num(self.lo)}, {_num(self.hi)}{')' if self.open_hi else ']'}"
      if self.lo is not None:
        return f"{what} >= {_num(self.lo)}"
      return what
    if self.kind == "choice":
      return f"one of {_choices(self.choices)}"
    if self.kind == "weights":
      return "'auto', 'surface=weight,...' or a mapping {surface: weight >= 0}"
    if self.kind == "numbers":
      return "a tuple of numbers >= 0 (empty: all 1.0)"
    return {"bool": "True or False", "str": "a string"}[self.kind]

  def problem(self, v) -> bool:
    """True when ``v`` is not allowed."""
    if self.kind == "bool":
      return not isinstance(v, bool)
    if self.kind == "str":
      return not isinstance(v, str)
    if self.kind == "choice":
      return v not in _choices(self.choices)
    if self.kind == "weights":
      return not _weights_ok(v)
    if self.kind == "numbers":
      return not isinstance(v, (tuple, list)) or not all(_finite(x) and x >= 0 for x in v)
    if isinstance(v, bool) or not isinstance(v, int if self.kind == "int" else (int, float)):
      return True
    if not _finite(v):
      return True
    if self.lo is not None and v < self.lo:
      return True
    return self.hi is not None and (v >= self.hi if self.open_hi else v > self.hi)


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


def _choices(spec) -> tuple:
  if not isinstance(spec, str):
    return tuple(spec)
  if spec == "rules":
    from sharding.rules import PRESETS
    return tuple(PRESETS)
  if spec == "presets":
    from data.synthetic import PRESETS
    return tuple(PRESETS)
  if spec == "remat":
    from kunlun.remat import POLICIES
    return tuple(POLICIES)
  if spec == "remat_scope":
    from kunlun.remat import SCOPES
    return tuple(SCOPES)
  raise KeyError(spec)


I, N = "int", "number"
FIELDS: dict[str, Field] = {
    "seed": Field("PRNG seed of parameter init and the training RNG (dropout, ...)", I),
    # ---- data
    "data.preset": Field("synthetic preset generated into <workdir>/data when --data_dir is "
                         "absent", "choice", choices="presets"),
    "data.num_examples": Field("train examples generated for the synthetic preset", I, 1),
    "data.synthetic_seed": Field("seed of the generated synthetic data", I, optional=True),
    "data.batch_size": Field("global batch size (examples per training step, all processes)", I,
                             1, MAX_BATCH),
    "data.surface_weights": Field("per-surface sampling weights: 'surface=w,...', a mapping, or "
                                  "'auto' (in proportion to the train records)", "weights"),
    "data.shuffle_seed": Field("seed of the per-surface record shuffle", I),
    "data.num_threads": Field("record-loading threads per process", I, 1, 256),
    "data.prefetch": Field("batches loaded ahead of the step (0: load on demand)", I, 0, 1024),
    "data.skip_invalid": Field("count, report and skip invalid records instead of stopping",
                               "bool"),
    "data.length_balance": Field("Base Batch Shuffling: sort small groups by history length",
                                 "bool"),
    "data.train_split": Field("split train.py reads (e.g. 'pretrain': an earlier window)", "str"),
    "data.eval_batch_size": Field("eval.py global batch size (0: data.batch_size)", I, 0,
                                  MAX_BATCH),
    "data.valid_split": Field("held-out split for periodic validation ('' or absent in the "
                              "data: none)", "str"),
    # ---- train
    "train.steps": Field("total training steps (--steps overrides; train.epochs replaces)", I, 0),
    "train.epochs": Field("> 0: passes over the train split, replacing train.steps", N, 0),
    "train.validate_every": Field("steps between validations; 0 = once per epoch; -1 = never",
                                  I, -1),
    "train.keep_best": Field("keep the params of the best validation NE in <workdir>/best "
                             "(eval.py --best)", "bool"),
    "train.best_task": Field("task whose validation NE picks the best ('' = mean over tasks)",
                             "str"),
    "train.schedule_steps": Field("length of the LR schedule (0: train.steps)", I, 0),
    "train.lr": Field("AdamW peak learning rate (dense parameters)", N, 0),
    "train.warmup_steps": Field("linear LR warm-up steps", I, 0),
    "train.schedule": Field("LR schedule after warm-up", "choice",
                            choices=("cosine", "constant")),
    "train.weight_decay": Field("AdamW weight decay (matrices only)", N, 0),
    "train.b1": Field("AdamW first-moment decay", N, 0, 1, open_hi=True),
    "train.b2": Field("AdamW second-moment decay", N, 0, 1, open_hi=True),
    "train.clip_norm": Field("global gradient-norm clip", N, 0),
    "train.emb_lr": Field("row-wise Adagrad learning rate (embedding tables)", N, 0),
    "train.sparse_embedding_update": Field("Adagrad reads / writes only the looked-up embedding "
                                           "rows", "bool"),
    "train.checkpoint_every": Field("steps between checkpoints (and at the end)", I, 1),
    "train.keep_checkpoints": Field("checkpoints kept (older ones deleted)", I, 1),
    "train.log_every": Field("steps between log lines / metrics.jsonl records", I, 1),
    "train.max_bad_steps": Field("consecutive non-finite steps skipped; one more stops the run",
                                 I, 0),
    "train.task_weights": Field("per-task loss weights, one per task (empty: all 1.0)",
                                "numbers"),
    "train.remat": Field("recompute in the backward pass (memory for compute)", "choice",
                         choices="remat"),
    "train.remat_scope": Field("what the remat policy wraps", "choice", choices="remat_scope"),
    "train.microbatches": Field("gradient accumulation: the batch in this many strided parts",
                                I, 1),
    "train.metrics_lag": Field("step statistics fetched this many steps late (0: every step)",
                               I, 0, 1000),
    # ---- sharding
    "sharding.rules": Field("logical-to-mesh axis rules preset (sharding/rules.py)", "choice",
                            choices="rules"),
    # ---- transfer (rules: kunlun.transfer.settings.parse_transfer)
    "transfer.kd_lambda": Field("weight of the student-adapter soft-target BCE (0 = off)", N, 0),
    "transfer.loopfm_ctx": Field("FM embedding of the current example as an extra context "
                                 "token", "bool"),
    "transfer.loopfm_events": Field("per-event FM embeddings through the event-encoder adapter",
                                    "bool"),
    "transfer.join_key": Field("history join key of the FM embeddings", "choice",
                               choices=("user_item", "user")),
    "transfer.max_age": Field("seconds; joined embeddings older than this are missing (-1 = no "
                              "limit)", N, -1),
}

# config.model: descriptions only (kunlun.config.parse validates them against the data schema);
# "*" matches one level (a tower name).
_TOWER = {"width": "event token width d_e", "heads": "attention heads H_e",
          "n_kv": "PFFN generated keys / values", "window": "SWA half-window w_e (0..kept_len)",
          "kept_len": "most recent events kept T_e", "n_seed": "HSP seed tokens",
          "n_sum": "HSP summary tokens per layer", "depth": "layers the tower runs (<= num_layers)"}
MODEL_DOCS: dict[str, str] = {
    "arch": "model family: kunlun | interformer | dlrm | kunlun_ablated",
    "dtype": "compute dtype (params stay float32): float32 | bfloat16",
    "backend": "GDPA / block-attention kernels: xla | pallas | triton | auto",
    "d_ns": "non-sequence token width", "n_ns": "non-sequence tokens after the LCE",
    "n_dense_tokens": "tokens the dense features are projected into",
    "num_layers": "Kunlun layers L", "comp_skip": "Computation Skip (spec c.7)",
    "final_hsp": "extra HSP of each tower's output in its last layer",
    "seq_mode": "towers (one tower per stream) | oneseq (one merged stream)",
    "num_time_buckets": "log-bucketed event-age embedding size",
    "time_buckets.enabled": "per-head time / position bucket embeddings on the attention operand",
    "time_buckets.kinds": "bucket kinds: subset of age,log_age,gap,position",
    "time_buckets.num_buckets": "buckets per kind",
    "time_buckets.age_horizon_days": "age bucketing horizon (days)",
    "attention.kind": "sequence self-attention: swa | block | full",
    "attention.activation": "softmax, a GDPA activation, or one per head",
    "attention.qk_norm": "RMS-normalise queries and keys",
    "attention.rotary": "rotary time encoding",
    "attention.block_size": "block size of block attention",
    "pffn_activation": "GDPA activation of the PFFN (a name or one per head)",
    "key_norm": "RMS-normalise the generated PFFN keys", "pooling": "sequence summary: hsp | pma",
    "hsp_rank": "SumKronLinear rank r_k", "hsp_activation": "GDPA activation of HSP",
    "score_clip": "clip GDPA scores to [-c, c] (0 = off)",
    "mowe.num_experts": "MoWE experts", "mowe.layers_per_expert": "layers per MoWE expert",
    "mowe.rank": "MoWE low-rank width", "mowe.mlp_hidden": "MoWE MLP hidden width",
    "mowe.cross_layer": "Wukong cross-layer attention connections",
    "tower_templates": "towers whose sizes serve streams 0, 1, ... of other data ('' = name order)",
    **{f"towers.*.{k}": f"tower: {v}" for k, v in _TOWER.items()},
    **{f"oneseq.{k}": f"merged OneSeq tower: {v}" for k, v in _TOWER.items()},
    "heads.kind": "task heads: towers | mmoe", "heads.top_mlp": "shared MLP widths below the heads",
    "heads.tower_hidden": "hidden width of each task tower", "heads.num_experts": "MMoE experts",
    "heads.expert_hidden": "MMoE expert hidden width",
    "dlrm.seq_dim": "DLRM baseline: pooled sequence width", "dlrm.mlp": "DLRM baseline: MLP widths",
    "interformer.n_cls": "InterFormer: CLS tokens", "interformer.n_recent": "InterFormer: recent "
                                                                            "tokens in S_sum",
}


def doc(path: str) -> str | None:
  """The description of field ``path`` (``train.lr``, ``model.towers.click.width``)."""
  if path in FIELDS:
    return FIELDS[path].doc
  if path.startswith("model."):
    p = path[len("model."):]
    if p in MODEL_DOCS:
      return MODEL_DOCS[p]
    parts = p.split(".")
    if len(parts) == 3 and parts[0] == "towers":
      return MODEL_DOCS.get(f"towers.*.{parts[2]}")
  return None


# ---- checks ----------------------------------------------------------------------------------
def _fail(path: str, value, allowed: str, why: str = ""):
  if hasattr(value, "to_dict"):
    value = value.to_dict()
  shown = " ".join(repr(value).split())
  if len(shown) > 80:
    shown = shown[:77] + "..."
  raise SettingsError(f"config.{path} = {shown}: allowed {allowed}" + (f" ({why})" if why else ""))


_WHY = {"train.keep_checkpoints": "0 would delete every checkpoint, the trained model too",
        "data.batch_size": f"at most {MAX_BATCH}: a larger batch does not fit in host memory"}


def _section(config, name: str, required: bool = True):
  sec = config.get(name, None) if hasattr(config, "get") else None
  if sec is None:
    if required:
      raise SettingsError(f"config.{name}: missing (the config has "
                          f"{sorted(config.keys()) if hasattr(config, 'keys') else config!r})")
    return None
  if not hasattr(sec, "keys"):
    raise SettingsError(f"config.{name} = {sec!r}: allowed a section of fields")
  return sec


def _defaults():
  from kunlun.configs.common import base_config
  return base_config()


def check(config) -> None:
  """Types, ranges and relations of every non-model field (table ``FIELDS``; a field left out
  takes its ``kunlun.configs.common`` default, as the programs do); ``config.model`` must be
  present (its fields: ``kunlun.config.parse``). Raises ``SettingsError``."""
  if config is None or not hasattr(config, "keys") or not len(config.keys()):
    raise SettingsError(f"config = {config!r}: allowed a config with data, train and model "
                        "sections")
  _section(config, "model")
  base = _defaults()
  sections = {"data": _section(config, "data"), "train": _section(config, "train"),
              "sharding": _section(config, "sharding", required=False),
              "transfer": _section(config, "transfer", required=False)}
  got = {}
  for path, f in FIELDS.items():
    head, _, name = path.rpartition(".")
    holder = config if not head else sections[head]
    if holder is not None and name in holder:
      value = holder[name]
    elif f.optional or head == "transfer":
      continue
    else:
      value = base[head][name] if head else base[name]
    if f.problem(value):
      _fail(path, value, f.allowed(), _WHY.get(path, ""))
    got[path] = value
  batch, mb = got["data.batch_size"], got["train.microbatches"]
  if batch % mb:
    raise SettingsError(f"config.train.microbatches = {mb}: allowed a divisor of "
                        f"config.data.batch_size = {batch}")
  if mb > 1 and got["train.sparse_embedding_update"]:
    raise SettingsError("config.train.microbatches > 1 needs the dense embedding update "
                        "(config.train.sparse_embedding_update = False)")
  if sections["transfer"] is not None:
    from kunlun.transfer.settings import parse_transfer
    try:
      parse_transfer(config)
    except ValueError as e:
      raise SettingsError(str(e)) from None


def check_flag(name: str, value, lo: int, allowed: str | None = None) -> None:
  """An integer command-line flag given (not None) must be >= ``lo``."""
  if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < lo):
    raise SettingsError(f"--{name}={value}: allowed {allowed or f'an integer >= {lo}'}")


# ---- --show_config ---------------------------------------------------------------------------
def _leaves(x, path=""):
  if hasattr(x, "keys") and not isinstance(x, str):
    for k in x.keys():
      yield from _leaves(x[k], f"{path}.{k}" if path else str(k))
  else:
    yield path, x


def describe(config) -> list[str]:
  """One line per config field: ``path = value  description [allowed]`` (overrides applied)."""
  order = ("seed", "data", "train", "sharding", "transfer", "model")
  rank = lambda p: (order.index(p.split(".")[0]) if p.split(".")[0] in order else len(order), p)
  rows = []
  for path, v in sorted(_leaves(config), key=lambda pv: rank(pv[0])):
    f = FIELDS.get(path)
    text = doc(path) or "(no description)"
    if f is not None and f.kind in ("int", "number", "choice"):
      text += f" [{f.allowed()}]"
    rows.append((path, repr(v), text))
  wp = max(len(p) for p, _, _ in rows)
  wv = min(max(len(v) for _, v, _ in rows), 36)
  return [f"{p:<{wp}} = {v:<{wv}}  {d}" for p, v, d in rows]
