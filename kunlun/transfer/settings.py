"""``config.transfer``: the knowledge-transfer knobs of a vertical-model config, validated.

  kd_lambda      weight of the student-adapter soft-target BCE (0 = no distillation)
  loopfm_ctx     the current example's FM embedding as an extra context token
  loopfm_events  per-event FM embeddings through the event-encoder adapter
  join_key       history join key: "user_item" | "user"
  max_age        seconds; joined embeddings older than this count as missing (-1 = no limit)

A config without a ``transfer`` section is a plain model (every knob off).
"""

from __future__ import annotations

import dataclasses

JOIN_KEYS = ("user_item", "user")


@dataclasses.dataclass(frozen=True)
class TransferConfig:
  kd_lambda: float = 0.0
  loopfm_ctx: bool = False
  loopfm_events: bool = False
  join_key: str = "user_item"
  max_age: float | None = None          # None = no limit

  @property
  def uses_fm(self) -> bool:
    """True when training needs FM outputs (soft targets or LoopFM features)."""
    return self.kd_lambda > 0 or self.loopfm_ctx or self.loopfm_events


def parse_transfer(config) -> TransferConfig:
  """Validates ``config.transfer`` (absent: all off). ValueError names the field and the rule."""
  t = config.get("transfer", None) if hasattr(config, "get") else None
  if t is None:
    return TransferConfig()
  fields = {f.name for f in dataclasses.fields(TransferConfig)}
  unknown = sorted(set(t.keys()) - fields)
  if unknown:
    raise ValueError(f"config.transfer: unknown fields {unknown}; allowed: {sorted(fields)}")
  d = {**dataclasses.asdict(TransferConfig()), **dict(t.items())}
  lam = d["kd_lambda"]
  if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not lam >= 0:
    raise ValueError(f"config.transfer.kd_lambda = {lam!r} must be a number >= 0")
  for f in ("loopfm_ctx", "loopfm_events"):
    if not isinstance(d[f], bool):
      raise ValueError(f"config.transfer.{f} = {d[f]!r} must be a bool")
  if d["join_key"] not in JOIN_KEYS:
    raise ValueError(f"config.transfer.join_key = {d['join_key']!r}; allowed: {JOIN_KEYS}")
  age = d["max_age"]
  if age is not None:
    if isinstance(age, bool) or not isinstance(age, (int, float)) or (age < 0 and age != -1):
      raise ValueError(f"config.transfer.max_age = {age!r} must be seconds >= 0 or -1 (no limit)")
    age = None if age == -1 else float(age)
  return TransferConfig(float(lam), d["loopfm_ctx"], d["loopfm_events"], d["join_key"], age)
