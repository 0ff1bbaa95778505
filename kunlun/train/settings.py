"""Start-up checks and ``train.py --show_config`` of every config section, from the one table
``kunlun.configs.fields.FIELDS`` (default, type, range, description of each field).

``check(config)``: types and ranges of every field (model fields without the data schema, which
``kunlun.configs.types.parse`` adds) plus the cross-field relations below; a violation is a one-line
``SettingsError``. ``describe(config)``: one ``path = value  description [allowed]`` line per field.
"""

from __future__ import annotations

from kunlun.configs import fields
from kunlun.configs.fields import FIELDS, MAX_BATCH, Field, SettingsError, check_value, row
from kunlun.configs.transfer import parse_transfer

__all__ = ["FIELDS", "MAX_BATCH", "Field", "SettingsError", "check", "check_flag", "describe",
           "doc"]


def doc(path: str) -> str | None:
  """The description of field ``path`` (``train.lr``, ``model.towers.click.width``)."""
  f = row(path)
  return f.doc if f is not None else None


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


def _given(config, path: str):
  """``[(concrete path, value)]`` of the row ``path`` present in ``config`` (a ``*`` level: every
  key there)."""
  found = [("", config)]
  for part in path.split("."):
    nxt = []
    for p, x in found:
      if not hasattr(x, "keys") or isinstance(x, str):
        continue
      keys = list(x.keys()) if part == "*" else [part] if part in x else []
      nxt += [(f"{p}.{k}" if p else str(k), x[k]) for k in keys]
    found = nxt
  return found


def check(config) -> None:
  """Types and ranges of every field in ``FIELDS`` (a data / train field left out takes its
  default, as the programs do; transfer / model fields left out are filled by their parsers), then
  the relations; ``config.model`` must be present. Raises ``SettingsError``."""
  if config is None or not hasattr(config, "keys") or not len(config.keys()):
    raise SettingsError(f"config = {config!r}: allowed a config with data, train and model "
                        "sections")
  _section(config, "model")
  for name in ("data", "train"):
    _section(config, name)
  transfer = _section(config, "transfer", required=False)
  _section(config, "sharding", required=False)
  got = {}
  for path, f in FIELDS.items():
    given = _given(config, path)
    for p, value in given:
      check_value(p, value, _WHY.get(p, ""))
    got[path] = given[0][1] if given else f.default
  batch, mb = got["data.batch_size"], got["train.microbatches"]
  if batch % mb:
    raise SettingsError(f"config.train.microbatches = {mb}: allowed a divisor of "
                        f"config.data.batch_size = {batch}")
  packed, arch = got["data.jagged_capacity"], got["model.arch"]
  if fields.parse_capacity(packed) and arch not in fields.PACKED_ARCHS:
    raise SettingsError(f"config.data.jagged_capacity = {packed!r}: packed towers run only with "
                        f"config.model.arch in {fields.PACKED_ARCHS}, got {arch!r} (set "
                        "config.data.jagged_capacity='' for padded towers)")
  if transfer is not None:
    parse_transfer(config)


def check_flag(name: str, value, lo: int, allowed: str | None = None, hi: int | None = None
               ) -> None:
  """An integer command-line flag given (not None) must lie in [``lo``, ``hi``]."""
  if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < lo
                            or (hi is not None and value > hi)):
    raise SettingsError(f"--{name}={value}: allowed "
                        f"{allowed or f'an integer {fields.range_text(lo, hi)}'}")


# ---- --show_config ---------------------------------------------------------------------------
def _leaves(x, path=""):
  if hasattr(x, "keys") and not isinstance(x, str):
    for k in x.keys():
      yield from _leaves(x[k], f"{path}.{k}" if path else str(k))
  else:
    yield path, x


def describe(config) -> list[str]:
  """One line per config field: ``path = value  description [allowed]`` (overrides applied)."""
  order = fields.SECTIONS
  top = lambda p: p.split(".")[0]
  rank = lambda p: (order.index(top(p)) if top(p) in order else len(order), p)
  rows = []
  for path, v in sorted(_leaves(config), key=lambda pv: rank(pv[0])):
    f: Field | None = row(path)
    text = f"{f.doc} [{f.allowed()}]" if f is not None else "(no description)"
    rows.append((path, repr(v), text))
  wp = max(len(p) for p, _, _ in rows)
  wv = min(max(len(v) for _, v, _ in rows), 36)
  return [f"{p:<{wp}} = {v:<{wv}}  {d}" for p, v, d in rows]
