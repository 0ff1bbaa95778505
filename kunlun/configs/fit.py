"""Fits a preset to a dataset: the preset describes sizes, the dataset's schema names the streams,
surfaces and tasks (so ``train.py --config=kunlun/configs/tiny.py --data_dir=<any dataset>``).

Towers (``config.model.towers``): a schema stream with a tower of its own name keeps it (named
sizes of the synthetic presets and of saved runs apply unchanged). Any other stream takes a size
template: the tower named at the stream's index in ``model.tower_templates`` (e.g.
``"click,impression"``: stream 0 -> click's sizes, stream 1 -> impression's, later streams -> the
last), or the towers in name order when that is empty. Then ``kept_len`` is clipped to the stream's
``max_len`` (to a multiple of ``attention.block_size`` for block attention), ``window`` to
``kept_len``, ``oneseq.kept_len`` to the merged length; towers of streams the data lacks are
dropped. Heads follow ``schema.surfaces`` x ``schema.tasks`` by construction.

Surface weights (``data.surface_weights``): when they name none of the data's surfaces (a preset's
synthetic defaults on another dataset) they become ``"auto"`` (each surface in proportion to its
train records; noted only when more than one surface has train records: on one, every weighting
trains the same); otherwise ``data.schema.surface_weights`` rules apply (unknown names need weight
0, surfaces left out get 0).

Both functions change the config in place and return notes (one line each) saying what changed.
"""

from __future__ import annotations

import ml_collections

from data.schema import Schema, surface_weights


def _templates(m) -> list[str]:
  names = list(m.towers.keys())
  given = str(m.get("tower_templates", "") or "")
  order = [t.strip() for t in given.split(",") if t.strip()]
  bad = [t for t in order if t not in names]
  if bad:
    raise ValueError(f"config.model.tower_templates={given!r}: {bad} are not towers of the config; "
                     f"towers: {names}")
  return order or sorted(names)


def fit_towers(config, schema: Schema) -> list[str]:
  """Rewrites ``config.model.towers`` (and ``oneseq.kept_len``) for ``schema``; returns notes."""
  m = config.model if "model" in config else config
  if not len(m.towers) and schema.streams:
    raise ValueError("config.model.towers is empty: give at least one tower (a size template)")
  need = [s.name for s in schema.streams if s.name not in m.towers]
  order = _templates(m) if need else []
  att = m.get("attention", None) or {}
  block = int(att.get("block_size", 64)) if att.get("kind", "swa") == "block" else 1
  notes, new = [], {}
  for i, s in enumerate(schema.streams):
    src = s.name if s.name in m.towers else order[min(i, len(order) - 1)]
    t = {f: m.towers[src][f] for f in m.towers[src].keys()}
    if src != s.name:
      notes.append(f"tower {s.name!r} (stream {i}) takes the sizes of template {src!r}")
    if isinstance(t.get("kept_len"), int) and t["kept_len"] > s.max_len:
      kept = s.max_len if block <= 1 or s.max_len < block else s.max_len // block * block
      notes.append(f"towers.{s.name}.kept_len {t['kept_len']} -> {kept} (stream max_len "
                   f"{s.max_len})")
      t["kept_len"] = kept
      if isinstance(t.get("window"), int) and t["window"] > kept:
        t["window"] = kept
    new[s.name] = t
  dropped = [n for n in m.towers.keys() if n not in new]
  if dropped and notes:
    notes.append(f"tower(s) {dropped} unused: the data has no such stream")
  elif dropped:
    notes.append(f"tower(s) {dropped} dropped: the data has no such stream")
  if notes:
    m.towers = ml_collections.ConfigDict(new)
    if "tower_templates" in m:           # the saved config names its own towers
      m.tower_templates = ",".join(new)
  if m.get("seq_mode", "towers") == "oneseq" and "oneseq" in m:
    total = sum(t["kept_len"] for t in new.values() if isinstance(t.get("kept_len"), int))
    if isinstance(m.oneseq.get("kept_len"), int) and m.oneseq.kept_len > total > 0:
      notes.append(f"oneseq.kept_len {m.oneseq.kept_len} -> {total} (sum of the towers' kept "
                   "lengths)")
      m.oneseq.kept_len = total
      m.oneseq.window = min(m.oneseq.window, total)
  return notes


def _named(value) -> dict:
  """The surfaces a surface_weights value names with a non-zero weight ({} for 'auto')."""
  if value is None or (isinstance(value, str) and value.strip().lower() in ("", "auto")):
    return {}
  if isinstance(value, str):
    out = {}
    for part in value.split(","):
      k, _, v = part.partition("=")
      try:
        out[k.strip()] = float(v)
      except ValueError:
        out[k.strip()] = 1.0        # malformed: surface_weights() reports it
    return {k: v for k, v in out.items() if v != 0}
  return {str(k): v for k, v in dict(value).items() if v != 0}


def fit_surface_weights(config, schema: Schema, counts: dict[str, int]) -> tuple[dict, list[str]]:
  """Resolves ``config.data.surface_weights`` for ``schema``; returns ``({surface: weight},
  notes)``. ``counts``: train records per surface."""
  value = config.data.get("surface_weights", "auto")
  named = _named(value)
  notes = []
  if named and not set(named) & set(schema.surfaces):
    if sum(1 for s in schema.surfaces if counts.get(s, 0)) > 1:   # else every weighting is 100%
      notes.append(f"data.surface_weights names none of the data's surfaces ({sorted(named)} vs "
                   f"{list(schema.surfaces)}): using 'auto' (each surface in proportion to its "
                   "train records)")
    with config.data.unlocked():
      del config.data["surface_weights"]
      config.data.surface_weights = "auto"
    value = "auto"
  w = surface_weights(value, schema.surfaces, counts)
  left = [s for s in schema.surfaces if w[s] == 0 and counts.get(s, 0)]
  if left and value != "auto":
    notes.append(f"surface(s) {left} have weight 0 in data.surface_weights: not trained on")
  return w, notes
