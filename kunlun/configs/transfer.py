"""``config.transfer``, validated: ``parse_transfer(config) -> TransferConfig`` (fields, defaults
and ranges: the ``transfer.*`` rows of ``kunlun.configs.fields``). Absent section: every knob off.
Here, not in ``kunlun.transfer``, so that ``kunlun.train`` can check it without importing that.
"""

from __future__ import annotations

import dataclasses

from kunlun.configs.fields import FIELDS, JOIN_KEYS, SettingsError, check_value, default, defaults

__all__ = ["JOIN_KEYS", "TransferConfig", "parse_transfer", "transfer_config"]

_NAMES = tuple(p.split(".", 1)[1] for p in FIELDS if p.startswith("transfer."))


def _age(seconds: float) -> float | None:
  return None if seconds == -1 else float(seconds)


@dataclasses.dataclass(frozen=True)
class TransferConfig:
  """The parsed section (``max_age``: None = no limit, the config's -1)."""
  kd_lambda: float = float(default("transfer.kd_lambda"))
  loopfm_ctx: bool = default("transfer.loopfm_ctx")
  loopfm_events: bool = default("transfer.loopfm_events")
  join_key: str = default("transfer.join_key")
  max_age: float | None = _age(default("transfer.max_age"))

  @property
  def uses_fm(self) -> bool:
    """True when training needs FM outputs (soft targets or LoopFM features)."""
    return self.kd_lambda > 0 or self.loopfm_ctx or self.loopfm_events


def transfer_config():
  """The ``config.transfer`` defaults (a ConfigDict) for presets that train with transfer."""
  return defaults("transfer")


def parse_transfer(config) -> TransferConfig:
  """Validates ``config.transfer`` (absent: all off); SettingsError (a ValueError) names the field
  and what is allowed."""
  t = config.get("transfer", None) if hasattr(config, "get") else None
  if t is None:
    return TransferConfig()
  unknown = sorted(set(t.keys()) - set(_NAMES))
  if unknown:
    raise SettingsError(f"config.transfer: unknown fields {unknown}; allowed: {sorted(_NAMES)}")
  d = {k: t[k] if k in t else default(f"transfer.{k}") for k in _NAMES}
  if d["max_age"] is None:          # the parsed form's "no limit", stored back into a config
    d["max_age"] = -1
  for k, v in d.items():
    check_value(f"transfer.{k}", v)
  if d["max_age"] < 0 and d["max_age"] != -1:
    raise SettingsError(f"config.transfer.max_age = {d['max_age']!r}: allowed seconds >= 0 or -1 "
                        "(no limit)")
  return TransferConfig(float(d["kd_lambda"]), d["loopfm_ctx"], d["loopfm_events"], d["join_key"],
                        _age(d["max_age"]))
