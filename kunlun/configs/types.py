"""Model configuration: the ``config.model`` schema, its validation and a frozen parsed form.

Presets (``kunlun/configs/*.py``) fill ``config.model`` (``default_model()``, an
``ml_collections.ConfigDict``); ``parse(config, schema)`` validates it and returns a frozen,
hashable ``ModelConfig`` that Linen modules take as a field. Every field, its default, range and
description: the ``model.*`` rows of ``kunlun.configs.fields`` (``train.py --show_config``).
"""

from __future__ import annotations

import dataclasses

import ml_collections

from data.schema import Schema
from kunlun.configs.fields import ARCHS, DAY, FIELDS, TOWER_FIELDS, check_value, choices, defaults
from kunlun.configs.fields import default as _d

__all__ = ["ARCHS", "TOWER_FIELDS", "ModelConfig", "default_model", "parse", "tower",
           "upgrade_stored", "validate", "with_defaults", "seq_lens"]

ONESEQ = "oneseq"   # tower name of the merged stream


@dataclasses.dataclass(frozen=True)
class BucketSpec:
  """Per-head bucket embeddings of one tower's modules (``kunlun.nn.time_encoding``): ``kinds``
  from ``BUCKET_KINDS``; ``num_buckets`` per kind; ``age_horizon`` seconds covered by the
  even-width age buckets (older events share the last one); ``kept_len`` the tower's kept
  length (position buckets)."""
  kinds: tuple[str, ...]
  num_buckets: int
  age_horizon: float
  kept_len: int


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
  kind: str = _d("model.attention.kind")
  activation: str | tuple[str, ...] = _d("model.attention.activation")   # or one per head
  qk_norm: bool = _d("model.attention.qk_norm")
  rotary: bool = _d("model.attention.rotary")
  block_size: int = _d("model.attention.block_size")


@dataclasses.dataclass(frozen=True)
class MoWEConfig:
  num_experts: int = _d("model.mowe.num_experts")
  layers_per_expert: int = _d("model.mowe.layers_per_expert")
  rank: int = _d("model.mowe.rank")
  mlp_hidden: int = _d("model.mowe.mlp_hidden")
  cross_layer: bool = _d("model.mowe.cross_layer")


@dataclasses.dataclass(frozen=True)
class TimeBucketConfig:
  """Per-head additive time/position bucket embeddings (spec b.5-2); see kunlun.nn.time_encoding."""
  enabled: bool = _d("model.time_buckets.enabled")
  kinds: tuple[str, ...] = tuple(_d("model.time_buckets.kinds").split(","))
  num_buckets: int = _d("model.time_buckets.num_buckets")
  age_horizon_days: float = _d("model.time_buckets.age_horizon_days")

  def spec(self, tower: TowerConfig) -> BucketSpec | None:
    """The tower's ``BucketSpec``, or None when the switch is off."""
    if not self.enabled:
      return None
    return BucketSpec(self.kinds, self.num_buckets, self.age_horizon_days * DAY, tower.kept_len)


@dataclasses.dataclass(frozen=True)
class HeadsConfig:
  kind: str = _d("model.heads.kind")
  top_mlp: tuple[int, ...] = _d("model.heads.top_mlp")
  tower_hidden: int = _d("model.heads.tower_hidden")
  num_experts: int = _d("model.heads.num_experts")
  expert_hidden: int = _d("model.heads.expert_hidden")


@dataclasses.dataclass(frozen=True)
class DLRMConfig:
  seq_dim: int = _d("model.dlrm.seq_dim")
  mlp: tuple[int, ...] = _d("model.dlrm.mlp")


@dataclasses.dataclass(frozen=True)
class InterFormerConfig:
  n_cls: int = _d("model.interformer.n_cls")
  n_recent: int = _d("model.interformer.n_recent")


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
  """Every ``config.model`` field with its table default (presets override; ``towers`` must be
  filled, one ``tower(...)`` per stream)."""
  return defaults("model")


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


def _parse_tower(field, name, t, num_layers, attention, max_len=None) -> TowerConfig:
  keys = set(t.keys())
  if keys != set(TOWER_FIELDS):
    raise ValueError(f"config.model.{field}: fields {sorted(keys)} differ from the required "
                     f"{list(TOWER_FIELDS)} (missing {sorted(set(TOWER_FIELDS) - keys)}, unknown "
                     f"{sorted(keys - set(TOWER_FIELDS))})")
  for f in TOWER_FIELDS:
    check_value(f"model.{field}.{f}", t[f])
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
                     f"non-empty tuple/list of per-head names from {choices('gdpa')}")
  acts = tuple(value)
  bad = [a for a in acts if a not in choices("gdpa")]
  if bad:
    raise ValueError(f"config.model.{field} = {acts!r}: {bad} not allowed per head; allowed "
                     f"per-head names: {choices('gdpa')}" + (" (softmax only as a single name)"
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
  for path, f in FIELDS.items():      # types and ranges (the towers': _parse_tower)
    if path.startswith(("model.towers.", "model.oneseq.")) or not path.startswith("model."):
      continue
    if f.kind == "activation":        # names only; head counts checked below
      _activation(path[len("model."):], _get(m, path[len("model."):]), choices(f.choices), ())
    else:
      check_value(path, _get(m, path[len("model."):]))
  time_buckets = _time_buckets(m.time_buckets)
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
          for f, allowed in (("attention.activation", choices("attention")),
                             ("pffn_activation", choices("gdpa")),
                             ("hsp_activation", choices("gdpa")))}
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
  """The parsed ``time_buckets`` (values checked by the table in ``parse``)."""
  kinds = tb.kinds
  if isinstance(kinds, str):
    kinds = tuple(k.strip() for k in kinds.split(",") if k.strip())
  return TimeBucketConfig(enabled=tb.enabled, kinds=tuple(kinds), num_buckets=tb.num_buckets,
                          age_horizon_days=float(tb.age_horizon_days))


def _with_defaults(m) -> ml_collections.ConfigDict:
  """Returns a copy of ``m`` with missing (sub)fields filled from ``default_model()``.

  Built as a plain dict first so that a value of another type (e.g. a list for a tuple) is checked
  by the validators above rather than rejected by ConfigDict's type locking.
  """
  out = default_model().to_dict()
  for k in m.keys():
    v = m[k]
    if k not in ("towers", "oneseq") and isinstance(out.get(k), dict):   # a sub-section
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
