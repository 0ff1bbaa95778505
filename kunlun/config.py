"""Model configuration: the ``config.model`` schema, its validation and a frozen parsed form.

Presets (``kunlun/configs/*.py``) fill ``config.model`` as an ``ml_collections.ConfigDict``;
``parse(config, schema)`` validates it and returns a frozen, hashable ``ModelConfig`` that Linen
modules take as a field. Every knob of spec d.7 / h is a field here:

  arch                "kunlun" | "interformer" | "dlrm" | "kunlun_ablated"   (model family:
                      model.py, baselines/)
  dtype               "float32" | "bfloat16"                      (compute; params stay fp32)
  backend             "xla" | "pallas" | "triton" | "auto"        (GDPA / block-attention kernels)
  d_ns, n_ns          non-sequence token width and count (after LCE)
  n_dense_tokens      tokens the dense features are projected into
  num_layers          Kunlun layers L
  comp_skip           Computation Skip on/off (spec c.7)
  final_hsp           extra HSP of each tower's output in its last layer ([D], not in spec d.1 /
                      d.4; default off; runs stored before the switch existed had it on)
  seq_mode            "towers" (one tower per stream) | "oneseq" (one merged stream, spec h-18)
  num_time_buckets    log-bucketed event-age embedding size (event MLP input)
  time_buckets.{enabled, kinds, num_buckets, age_horizon_days}   per-head additive bucket
                      embeddings on the per-token GDPA/attention operand of SWA, PFFN and HSP
                      (spec b.5-2, ``kunlun.time_encoding``); ``kinds`` a comma-separated subset
                      of age,log_age,gap,position. Off by default (bench/time_buckets.py)
  attention.{kind, activation, qk_norm, rotary, block_size}   sequence self-attention (c.4)
  pffn_activation     GDPA activation of the PFFN (c.3); key_norm: RMS-normalise generated keys
  pooling             "hsp" | "pma" (c.5); hsp_rank (SumKronLinear r_k), hsp_activation
                      (pffn_activation, hsp_activation and a non-softmax attention.activation take
                      one name, or one GDPA name per head: a tuple/list, or "relu,silu" (also a
                      command-line override), whose length equals every running tower's heads;
                      a ConfigDict field holding a name needs ``with m.ignore_type():`` to take a
                      tuple. Parsed to a tuple.)
  score_clip          clip GDPA pre-activation scores to [-c, c] (spec h-13: 8); 0 = off
  mowe.{num_experts, layers_per_expert, rank, mlp_hidden, cross_layer}    (c.6; cross_layer:
                      Wukong cross-layer attention connections, spec h-19)
  towers.<stream>.{width, heads, n_kv, window, kept_len, n_seed, n_sum, depth}  (c.8)
  tower_templates     "click,impression": the towers whose sizes serve streams 0, 1, ... of a
                      dataset whose streams have other names (kunlun/schema_fit.py; "" = name order)
  oneseq.{width, heads, n_kv, window, kept_len, n_seed, n_sum, depth}   (merged tower)
  heads.{kind, top_mlp, tower_hidden, num_experts, expert_hidden}       (d.3)
  dlrm.{seq_dim, mlp}  (DLRM baseline only)
  interformer.{n_cls, n_recent}   (InterFormer only: CLS tokens = X_sum tokens, recent tokens in
                      S_sum; its PMA queries are towers.*.n_sum and its DHEN interaction takes
                      mowe.{layers_per_expert, rank, mlp_hidden}, so both are sized by one knob)
"""

from __future__ import annotations

import dataclasses

import ml_collections

from data.schema import Schema
from kunlun.time_encoding import BUCKET_KINDS, DAY, BucketSpec
from pallas_kernels.activations import NAMES as GDPA_ACTIVATIONS

ARCHS = ("kunlun", "interformer", "dlrm", "kunlun_ablated")
DTYPES = ("float32", "bfloat16")
BACKENDS = ("xla", "pallas", "triton", "auto")
SEQ_MODES = ("towers", "oneseq")
ATTENTION_KINDS = ("swa", "block", "full")
ATTENTION_ACTIVATIONS = ("softmax",) + GDPA_ACTIVATIONS
POOLINGS = ("hsp", "pma")
HEAD_KINDS = ("towers", "mmoe")
TOWER_FIELDS = ("width", "heads", "n_kv", "window", "kept_len", "n_seed", "n_sum", "depth")
ONESEQ = "oneseq"   # tower name of the merged stream


@dataclasses.dataclass(frozen=True)
class TowerConfig:
  """One event tower (spec c.8): width d_e, heads H_e, PFFN keys n_kv, SWA half-window w_e,
  kept length T_e, HSP seeds/summary tokens, depth L_e (layers it runs; <= num_layers)."""
  name: str
  width: int
  heads: int
  n_kv: int
  window: int
  kept_len: int
  n_seed: int
  n_sum: int
  depth: int

  @property
  def head_dim(self) -> int:
    return self.width // self.heads


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  kind: str = "swa"
  activation: str | tuple[str, ...] = "softmax"   # "softmax", a GDPA name, or one per head
  qk_norm: bool = True
  rotary: bool = True
  block_size: int = 64


@dataclasses.dataclass(frozen=True)
class MoWEConfig:
  num_experts: int = 2
  layers_per_expert: int = 1
  rank: int = 8
  mlp_hidden: int = 64
  cross_layer: bool = False


@dataclasses.dataclass(frozen=True)
class TimeBucketConfig:
  """Per-head additive time/position bucket embeddings (spec b.5-2); see kunlun.time_encoding."""
  enabled: bool = False
  kinds: tuple[str, ...] = ("age", "gap", "position")
  num_buckets: int = 32
  age_horizon_days: float = 32.0

  def spec(self, tower: TowerConfig) -> BucketSpec | None:
    """The tower's ``BucketSpec``, or None when the switch is off."""
    if not self.enabled:
      return None
    return BucketSpec(self.kinds, self.num_buckets, self.age_horizon_days * DAY, tower.kept_len)


@dataclasses.dataclass(frozen=True)
class HeadsConfig:
  kind: str = "towers"
  top_mlp: tuple[int, ...] = (64,)
  tower_hidden: int = 32
  num_experts: int = 2
  expert_hidden: int = 32


@dataclasses.dataclass(frozen=True)
class DLRMConfig:
  seq_dim: int = 32
  mlp: tuple[int, ...] = (128, 64)


@dataclasses.dataclass(frozen=True)
class InterFormerConfig:
  n_cls: int = 4
  n_recent: int = 2


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Frozen, validated form of ``config.model`` (hashable, so Linen modules can hold it)."""
  arch: str
  dtype: str
  backend: str
  d_ns: int
  n_ns: int
  n_dense_tokens: int
  num_layers: int
  comp_skip: bool
  final_hsp: bool
  seq_mode: str
  num_time_buckets: int
  attention: AttentionConfig
  pffn_activation: str | tuple[str, ...]   # a name, or one per head
  key_norm: bool
  pooling: str
  hsp_rank: int
  hsp_activation: str | tuple[str, ...]
  score_clip: float
  mowe: MoWEConfig
  towers: tuple[TowerConfig, ...]      # per stream, in schema order
  oneseq: TowerConfig | None           # the merged tower (seq_mode == "oneseq")
  heads: HeadsConfig
  dlrm: DLRMConfig
  interformer: InterFormerConfig
  streams: tuple[str, ...]             # schema stream names, in order
  surfaces: tuple[str, ...]
  tasks: tuple[str, ...]
  time_buckets: TimeBucketConfig = TimeBucketConfig()

  @property
  def seq_towers(self) -> tuple[TowerConfig, ...]:
    """The towers the trunk actually runs (one merged tower in OneSeq mode)."""
    return (self.oneseq,) if self.seq_mode == "oneseq" else self.towers

  def tower(self, name: str) -> TowerConfig:
    for t in self.seq_towers:
      if t.name == name:
        return t
    raise KeyError(f"no tower {name!r}; towers: {[t.name for t in self.seq_towers]}")


def default_model() -> ml_collections.ConfigDict:
  """Every ``config.model`` field with a default (presets override; ``towers`` must be filled)."""
  m = ml_collections.ConfigDict()
  m.arch = "kunlun"
  m.dtype = "float32"
  m.backend = "xla"
  m.d_ns = 32
  m.n_ns = 8
  m.n_dense_tokens = 1
  m.num_layers = 2
  m.comp_skip = True
  m.final_hsp = False             # spec d.1 / d.4: no extra summary of the last layer's output
  m.seq_mode = "towers"
  m.num_time_buckets = 32
  m.time_buckets = ml_collections.ConfigDict(dict(enabled=False, kinds="age,gap,position",
                                                  num_buckets=32, age_horizon_days=32.0))
  m.attention = ml_collections.ConfigDict(dict(kind="swa", activation="softmax", qk_norm=True,
                                               rotary=True, block_size=64))
  m.pffn_activation = "fast_gelu"
  m.key_norm = False
  m.pooling = "hsp"
  m.hsp_rank = 4
  m.hsp_activation = "fast_gelu"
  m.score_clip = 8.0              # spec h-13: GDPA scores clipped to [-8, 8]
  m.mowe = ml_collections.ConfigDict(dict(num_experts=2, layers_per_expert=1, rank=8,
                                          mlp_hidden=64, cross_layer=True))   # h-19
  m.towers = ml_collections.ConfigDict()
  m.tower_templates = ""          # size templates by stream index (kunlun/schema_fit.py)
  m.oneseq = tower(width=32, heads=2, n_kv=16, window=16, kept_len=64, n_seed=8, n_sum=2, depth=2)
  m.heads = ml_collections.ConfigDict(dict(kind="towers", top_mlp=(64,), tower_hidden=32,
                                           num_experts=2, expert_hidden=32))
  m.dlrm = ml_collections.ConfigDict(dict(seq_dim=32, mlp=(128, 64)))
  m.interformer = ml_collections.ConfigDict(dict(n_cls=4, n_recent=2))
  return m


def tower(**kw) -> ml_collections.ConfigDict:
  """A tower ConfigDict; every field of ``TOWER_FIELDS`` must be given."""
  missing = [f for f in TOWER_FIELDS if f not in kw]
  extra = [f for f in kw if f not in TOWER_FIELDS]
  if missing or extra:
    raise ValueError(f"tower(): missing {missing}, unknown {extra}; fields are {TOWER_FIELDS}")
  return ml_collections.ConfigDict(kw)


# ---- validation ----------------------------------------------------------------------------------
def _choice(field, value, allowed):
  if value not in allowed:
    raise ValueError(f"config.model.{field} = {value!r} is not allowed; allowed values: {allowed}")


def _pos_int(field, value, minimum=1):
  if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
    raise ValueError(f"config.model.{field} = {value!r} must be an integer >= {minimum}")


def _parse_tower(field, name, t, num_layers, attention, max_len=None) -> TowerConfig:
  keys = set(t.keys())
  if keys != set(TOWER_FIELDS):
    raise ValueError(f"config.model.{field}: fields {sorted(keys)} differ from the required "
                     f"{list(TOWER_FIELDS)} (missing {sorted(set(TOWER_FIELDS) - keys)}, unknown "
                     f"{sorted(keys - set(TOWER_FIELDS))})")
  for f in TOWER_FIELDS:
    _pos_int(f"{field}.{f}", t[f], minimum=0 if f == "window" else 1)
  tc = TowerConfig(name=name, **{f: t[f] for f in TOWER_FIELDS})
  if tc.width % tc.heads:
    raise ValueError(f"config.model.{field}.heads = {tc.heads} does not divide "
                     f"{field}.width = {tc.width}; allowed heads: divisors of {tc.width}")
  if attention.rotary and tc.head_dim % 2:
    raise ValueError(f"config.model.{field}: head_dim = width/heads = {tc.head_dim} must be even "
                     "for rotary time encoding (attention.rotary = True)")
  if tc.window > tc.kept_len:
    raise ValueError(f"config.model.{field}.window = {tc.window} is larger than "
                     f"{field}.kept_len = {tc.kept_len}; allowed: 0..{tc.kept_len}")
  if attention.kind == "block" and tc.kept_len % attention.block_size:
    raise ValueError(f"config.model.{field}.kept_len = {tc.kept_len} must be a multiple of "
                     f"attention.block_size = {attention.block_size} for attention.kind = 'block'")
  if tc.n_seed < tc.n_sum:
    raise ValueError(f"config.model.{field}.n_seed = {tc.n_seed} must be >= "
                     f"{field}.n_sum = {tc.n_sum} (seeds are compressed into summary tokens)")
  if tc.depth > num_layers:
    raise ValueError(f"config.model.{field}.depth = {tc.depth} exceeds num_layers = "
                     f"{num_layers}; allowed: 1..{num_layers}")
  if max_len is not None and tc.kept_len > max_len:
    raise ValueError(f"config.model.{field}.kept_len = {tc.kept_len} exceeds the schema's "
                     f"max_len = {max_len} for stream {name!r}; allowed: 1..{max_len}")
  return tc


def _get(m, field):
  for part in field.split("."):
    m = m[part]
  return m


def _activation(field, value, allowed, towers):
  """Validates an activation field: one name from ``allowed``, or one GDPA name per head (a
  tuple/list or a comma-separated string) whose length equals every tower's heads.

  Returns the name, or the names as a tuple (hashable, for the frozen ModelConfig)."""
  if isinstance(value, str) and "," in value:
    value = tuple(a.strip() for a in value.split(","))
  if isinstance(value, str):
    _choice(field, value, allowed)
    return value
  if not isinstance(value, (tuple, list)) or not value:
    raise ValueError(f"config.model.{field} = {value!r} must be one name from {allowed} or a "
                     f"non-empty tuple/list of per-head names from {GDPA_ACTIVATIONS}")
  acts = tuple(value)
  bad = [a for a in acts if a not in GDPA_ACTIVATIONS]
  if bad:
    raise ValueError(f"config.model.{field} = {acts!r}: {bad} not allowed per head; allowed "
                     f"per-head names: {GDPA_ACTIVATIONS}" + (" (softmax only as a single name)"
                                                               if "softmax" in allowed else ""))
  wrong = {t.name: t.heads for t in towers if t.heads != len(acts)}
  if wrong:
    raise ValueError(f"config.model.{field} has {len(acts)} per-head activations but the heads "
                     f"of tower(s) {wrong} differ; give one name per head ({len(acts)} heads in "
                     "every running tower) or a single name")
  return acts


def parse(config, schema: Schema) -> ModelConfig:
  """Validates ``config.model`` (or a full config) against ``schema``; returns a ModelConfig.

  Raises ValueError naming the offending field and the allowed values.
  """
  m = config.model if "model" in config else config
  known = set(default_model().keys())
  unknown = sorted(set(m.keys()) - known)
  if unknown:
    raise ValueError(f"config.model: unknown fields {unknown}; allowed fields: {sorted(known)}")
  m = _with_defaults(m)
  _choice("arch", m.arch, ARCHS)
  _choice("dtype", m.dtype, DTYPES)
  _choice("backend", m.backend, BACKENDS)
  _choice("seq_mode", m.seq_mode, SEQ_MODES)
  _choice("attention.kind", m.attention.kind, ATTENTION_KINDS)
  for f, allowed in (("attention.activation", ATTENTION_ACTIVATIONS),
                     ("pffn_activation", GDPA_ACTIVATIONS), ("hsp_activation", GDPA_ACTIVATIONS)):
    _activation(f, _get(m, f), allowed, ())               # names only; head counts checked below
  _choice("pooling", m.pooling, POOLINGS)
  _choice("heads.kind", m.heads.kind, HEAD_KINDS)
  for f in ("d_ns", "n_ns", "n_dense_tokens", "num_layers", "num_time_buckets", "hsp_rank"):
    _pos_int(f, m[f])
  _pos_int("attention.block_size", m.attention.block_size)
  for f in ("num_experts", "layers_per_expert", "rank", "mlp_hidden"):
    _pos_int(f"mowe.{f}", m.mowe[f])
  for f in ("tower_hidden", "num_experts", "expert_hidden"):
    _pos_int(f"heads.{f}", m.heads[f])
  for i, h in enumerate(m.heads.top_mlp):
    _pos_int(f"heads.top_mlp[{i}]", h)
  _pos_int("interformer.n_cls", m.interformer.n_cls)
  _pos_int("interformer.n_recent", m.interformer.n_recent, minimum=0)
  _pos_int("dlrm.seq_dim", m.dlrm.seq_dim)
  for i, h in enumerate(m.dlrm.mlp):
    _pos_int(f"dlrm.mlp[{i}]", h)
  if isinstance(m.score_clip, bool) or not isinstance(m.score_clip, (int, float)) \
      or not m.score_clip >= 0:
    raise ValueError(f"config.model.score_clip = {m.score_clip!r} must be a number >= 0 (0 = off)")
  if not isinstance(m.final_hsp, bool):
    raise ValueError(f"config.model.final_hsp = {m.final_hsp!r} must be a bool")
  time_buckets = _time_buckets(m.time_buckets)
  if not isinstance(m.mowe.cross_layer, bool):
    raise ValueError(f"config.model.mowe.cross_layer = {m.mowe.cross_layer!r} must be a bool")
  attention = AttentionConfig(**{**m.attention.to_dict(), "activation": "softmax"})

  names = schema.stream_names
  given = tuple(m.towers.keys())
  bad = [s for s in given if s not in names]
  if bad:
    raise ValueError(f"config.model.towers: unknown stream(s) {bad}; allowed streams (schema): "
                     f"{list(names)}")
  missing = [s for s in names if s not in given]
  if missing:
    raise ValueError(f"config.model.towers: no tower for stream(s) {missing}; every schema stream "
                     f"{list(names)} needs one")
  towers = tuple(_parse_tower(f"towers.{s.name}", s.name, m.towers[s.name], m.num_layers,
                              attention, s.max_len) for s in schema.streams)
  oneseq = None
  if m.seq_mode == "oneseq":
    total = sum(t.kept_len for t in towers)
    oneseq = _parse_tower("oneseq", ONESEQ, m.oneseq, m.num_layers, attention)
    if oneseq.kept_len > total:
      raise ValueError(f"config.model.oneseq.kept_len = {oneseq.kept_len} exceeds the merged "
                       f"length sum(towers.*.kept_len) = {total}; allowed: 1..{total}")
  # the towers whose modules take the activations (InterFormer always runs per-stream towers)
  running = (oneseq,) if (oneseq is not None and m.arch == "kunlun") else towers
  acts = {f: _activation(f, _get(m, f), allowed, running)
          for f, allowed in (("attention.activation", ATTENTION_ACTIVATIONS),
                             ("pffn_activation", GDPA_ACTIVATIONS),
                             ("hsp_activation", GDPA_ACTIVATIONS))}
  attention = dataclasses.replace(attention, activation=acts["attention.activation"])
  return ModelConfig(
      arch=m.arch, dtype=m.dtype, backend=m.backend, d_ns=m.d_ns, n_ns=m.n_ns,
      n_dense_tokens=m.n_dense_tokens, num_layers=m.num_layers, comp_skip=bool(m.comp_skip),
      final_hsp=m.final_hsp, seq_mode=m.seq_mode, num_time_buckets=m.num_time_buckets,
      attention=attention,
      pffn_activation=acts["pffn_activation"], key_norm=bool(m.key_norm), pooling=m.pooling,
      hsp_rank=m.hsp_rank, hsp_activation=acts["hsp_activation"], score_clip=float(m.score_clip),
      mowe=MoWEConfig(**m.mowe.to_dict()), towers=towers, oneseq=oneseq,
      heads=HeadsConfig(**{**m.heads.to_dict(), "top_mlp": tuple(m.heads.top_mlp)}),
      dlrm=DLRMConfig(seq_dim=m.dlrm.seq_dim, mlp=tuple(m.dlrm.mlp)),
      interformer=InterFormerConfig(**m.interformer.to_dict()),
      streams=names, surfaces=tuple(schema.surfaces), tasks=schema.task_names,
      time_buckets=time_buckets)


def _time_buckets(tb) -> TimeBucketConfig:
  if not isinstance(tb.enabled, bool):
    raise ValueError(f"config.model.time_buckets.enabled = {tb.enabled!r} must be a bool")
  kinds = tb.kinds
  if isinstance(kinds, str):
    kinds = tuple(k.strip() for k in kinds.split(",") if k.strip())
  kinds = tuple(kinds)
  bad = [k for k in kinds if k not in BUCKET_KINDS]
  if not kinds or bad or len(set(kinds)) != len(kinds):
    raise ValueError(f"config.model.time_buckets.kinds = {tb.kinds!r} must name distinct kinds "
                     f"from {BUCKET_KINDS} (comma-separated)")
  _pos_int("time_buckets.num_buckets", tb.num_buckets, minimum=2)
  h = tb.age_horizon_days
  if isinstance(h, bool) or not isinstance(h, (int, float)) or not h > 0:
    raise ValueError(f"config.model.time_buckets.age_horizon_days = {h!r} must be a number > 0")
  return TimeBucketConfig(enabled=tb.enabled, kinds=kinds, num_buckets=tb.num_buckets,
                          age_horizon_days=float(h))


def _with_defaults(m) -> ml_collections.ConfigDict:
  """Returns a copy of ``m`` with missing (sub)fields filled from ``default_model()``.

  Built as a plain dict first so that a value of another type (e.g. a list for a tuple) is checked
  by the validators above rather than rejected by ConfigDict's type locking.
  """
  out = default_model().to_dict()
  for k in m.keys():
    v = m[k]
    if k in ("attention", "mowe", "heads", "dlrm", "interformer", "time_buckets"):
      for kk in v.keys():
        if kk not in out[k]:
          raise ValueError(f"config.model.{k}: unknown field {kk!r}; allowed: {sorted(out[k])}")
        out[k][kk] = v[kk]
    elif k == "towers":
      out[k] = {s: dict(v[s]) for s in v.keys()}
    elif k == "oneseq":
      out[k] = dict(v)
    else:
      out[k] = v
  return ml_collections.ConfigDict(out)


def with_defaults(m) -> ml_collections.ConfigDict:
  """``config.model`` with every field present (defaults filled in), e.g. to store with a run."""
  return _with_defaults(m)


# Fields added after runs were stored, with the value those runs were trained with (a stored
# config.model lacking the field predates it). ``upgrade_stored`` fills them on load.
STORED_BEFORE = {"final_hsp": True}


def upgrade_stored(m) -> ml_collections.ConfigDict:
  """A stored ``config.model`` (``train.py`` run info) with every field added since it was written
  set to the value that run was trained with (``STORED_BEFORE``); other fields unchanged."""
  m = m.copy_and_resolve_references()
  with m.unlocked():
    if "final_hsp" not in m and m.get("arch") == "interformer":
      m.arch = "kunlun_ablated"     # "interformer" was this Kunlun-with-switches-off variant
    for k, v in STORED_BEFORE.items():
      if k not in m:
        m[k] = v
  return m


def validate(config, schema: Schema) -> ModelConfig:
  """Alias of ``parse`` for callers that only want the check."""
  return parse(config, schema)


def seq_lens(config) -> dict[str, int]:
  """Kept length T per stream (the data pipeline pads/truncates each stream to it)."""
  m = config.model if "model" in config else config
  return {s: int(m.towers[s].kept_len) for s in m.towers.keys()}   # {} for data without streams
