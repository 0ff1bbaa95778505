"""The ingest spec (``Spec``: one small JSON / YAML file) and the schema proposal inferred from a
log's scan (``ColumnStats``, ``propose``, ``schema_from``); ``role(column)`` names a column's
role. The spec file's keys and the roles: data/README.md ("The spec file").
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

import numpy as np

from data.ingest.vocab import VOCAB_CAP
from data.schema import MAX_LEN, Schema

KEYS = ("surface", "request_ts", "user_id", "ad_id")
PREFIXES = ("dense", "sparse", "label", "true_prob")
TS_UNITS = ("s", "ms", "us")
SECTIONS = ("sparse", "dense", "streams", "surfaces", "tasks")
MAX_VOCAB = 1 << 22          # larger id ranges are hashed into this many rows
HISTORY_KEYS = ("streams", "max_len", "stats", "action", "label_delay")
# Label delays of built histories and statistics (``label_delays``). Known without being stated:
# only the exact task names of the synthetic data, whose meaning is fixed (a click is known at
# its event; a conversion a day later); every other task needs its delay stated (--label_delay
# task=duration, or task=immediate), since a name does not say when its label arrives (a `cvr`
# is a conversion, a `like` is immediate, a `purchase_7d` takes a week). Durations are bounded.
KNOWN_DELAYS = {"click": 0, "conversion": 86_400}
MAX_DELAY_DAYS = 365
IMMEDIATE = "immediate"
_DURATION = re.compile(r"(\d{1,12})\s*([smhd]?)")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86_400}


def duration(value, where: str) -> int:
  """Seconds of ``value``: an integer >= 0 or text such as ``immediate``, ``0s``, ``90``, ``5m``,
  ``2h``, ``1d``, at most ``MAX_DELAY_DAYS``; else a one-line ValueError naming ``where``."""
  s = None
  if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
    s = value
  elif isinstance(value, str) and value.strip() == IMMEDIATE:
    s = 0
  elif isinstance(value, str) and (m := _DURATION.fullmatch(value.strip())):
    s = int(m.group(1)) * _UNIT_S[m.group(2)]
  if s is None or s > MAX_DELAY_DAYS * 86_400:
    raise ValueError(f"{where}={value!r}: expected a duration from 0s ({IMMEDIATE}) to "
                     f"{MAX_DELAY_DAYS}d, such as 90, 5m, 2h or 1d")
  return s


def label_delays(history: dict, tasks) -> dict[str, int]:
  """Per task, the seconds after its event a label becomes visible to later requests (built
  histories and ``--history_stats``): a request at ``r`` sees the label of an event at ``e``
  when ``e + delay < r`` (0: strictly earlier). ``history["label_delay"]`` states them; a task
  it does not name gets ``KNOWN_DELAYS``, else a one-line ValueError asking for it."""
  given = history.get("label_delay") or {}
  bad = sorted(set(given) - set(tasks))
  if bad:
    raise ValueError(f"--label_delay / history.label_delay: no task(s) {bad}; the tasks are "
                     f"{list(tasks)}")
  unknown = [t for t in tasks if t not in given and t not in KNOWN_DELAYS]
  if unknown:
    ask = ",".join(f"{t}=<duration>" for t in unknown)
    raise ValueError(f"the label delay of task(s) {', '.join(map(repr, unknown))} is unknown "
                     "(built histories and statistics would show a label before it is known): "
                     f"state it with --label_delay {ask} (e.g. 1d, or {IMMEDIATE} for a label "
                     "known at its event; or history.label_delay in the spec file)")
  return {t: duration(given[t], f"--label_delay {t}") if t in given else KNOWN_DELAYS[t]
          for t in tasks}


VOCAB_CHOICES = ("exact", "hash")


def role(name: str) -> str | None:
  """The role a (renamed) column name plays, or None for an unknown column."""
  if name in KEYS:
    return name
  parts = name.split(".")
  if len(parts) == 2 and parts[0] in PREFIXES and parts[1]:
    return parts[0]
  if len(parts) == 3 and parts[0] == "events" and parts[1] and parts[2]:
    return "events"
  return None


@dataclasses.dataclass
class Spec:
  columns: dict = dataclasses.field(default_factory=dict)
  surface: str = "all"
  ids_as_features: bool = False
  truncate_history: bool = False
  ts_unit: str = "s"
  history: dict | None = None
  hashed_events: list = dataclasses.field(default_factory=list)
  hash_keys: list = dataclasses.field(default_factory=list)   # join keys hashed in every row
  vocab: dict = dataclasses.field(default_factory=dict)
  vocab_max: int = 10_000
  schema: dict = dataclasses.field(default_factory=dict)

  @classmethod
  def from_dict(cls, d: dict, where: str = "spec") -> "Spec":
    if not isinstance(d, dict):
      raise ValueError(f"{where}: expected a mapping at the top level")
    fields = {f.name for f in dataclasses.fields(cls)}
    bad = sorted(set(d) - fields)
    if bad:
      raise ValueError(f"{where}: unknown key(s) {bad}; allowed: {sorted(fields)}")
    s = cls(**d)
    s.check(where)
    return s

  @classmethod
  def load(cls, path: str) -> "Spec":
    if not os.path.exists(path):
      raise ValueError(f"--schema={path}: no such file")
    with open(path) as f:
      text = f.read()
    try:
      if path.endswith((".yaml", ".yml")):
        import yaml
        d = yaml.safe_load(text) or {}
      else:
        d = json.loads(text)
    except Exception as e:   # JSON / YAML syntax errors: name the file, one line
      raise ValueError(f"--schema={path}: cannot parse: {str(e).splitlines()[0]}") from None
    return cls.from_dict(d, path)

  def check(self, where: str) -> None:
    if not isinstance(self.columns, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in self.columns.items()):
      raise ValueError(f"{where}: 'columns' must map role names to your column names")
    bad = sorted(k for k in self.columns if role(k) is None)
    if bad:
      raise ValueError(f"{where}: columns: {bad} are not roles (surface, request_ts, user_id, "
                       "ad_id, dense.<f>, sparse.<f>, events.<s>.<c>, label.<t>, true_prob.<t>)")
    targets = list(self.columns.values())
    dup = sorted({t for t in targets if targets.count(t) > 1})
    if dup:
      raise ValueError(f"{where}: columns: {dup} mapped to more than one role")
    if not isinstance(self.vocab, dict) or any(
        not isinstance(k, str) or v not in VOCAB_CHOICES for k, v in self.vocab.items()):
      raise ValueError(f"{where}: vocab must map sparse feature names to one of {VOCAB_CHOICES}")
    vm = self.vocab_max
    if isinstance(vm, bool) or not isinstance(vm, int) or not 0 <= vm <= VOCAB_CAP:
      raise ValueError(f"{where}: vocab_max={vm!r} must be an integer in [0, {VOCAB_CAP}]")
    if not isinstance(self.hash_keys, list) or not set(self.hash_keys) <= {"user_id", "ad_id"}:
      raise ValueError(f"{where}: hash_keys={self.hash_keys!r}: a list of user_id / ad_id")
    if self.ts_unit not in TS_UNITS:
      raise ValueError(f"{where}: ts_unit={self.ts_unit!r}; allowed: {TS_UNITS}")
    bad = sorted(set(self.schema) - set(SECTIONS))
    if bad:
      raise ValueError(f"{where}: schema: unknown section(s) {bad}; allowed: {SECTIONS}")
    for k, v in self.schema.items():
      item = str if k in ("dense", "surfaces") else dict
      if not isinstance(v, list) or not all(isinstance(x, item) for x in v):
        raise ValueError(f"{where}: schema.{k} must be a list of "
                         + ("names" if item is str else "mappings (as in schema.json)"))
    if self.history is not None:
      h = self.history
      if not isinstance(h, dict) or not isinstance(h.get("streams"), dict) or not h["streams"]:
        raise ValueError(f"{where}: history needs 'streams': {{name: 'all' | 'label.<task>'}}")
      bad = sorted(set(h) - set(HISTORY_KEYS))
      if bad:
        raise ValueError(f"{where}: history: unknown key(s) {bad}; allowed: {HISTORY_KEYS}")
      for name, sel in h["streams"].items():
        if "." in name or not (sel == "all" or (isinstance(sel, str) and sel.startswith("label."))):
          raise ValueError(f"{where}: history.streams.{name}={sel!r}: expected 'all' or "
                           "'label.<task>' (stream names without dots)")
      ld = h.get("label_delay") or {}
      if not isinstance(ld, dict):
        raise ValueError(f"{where}: history.label_delay must map task names to durations")
      for t, v in ld.items():
        duration(v, f"--label_delay {t}")
      ml = h.get("max_len", 50)
      if isinstance(ml, bool) or not isinstance(ml, int) or not 1 <= ml <= MAX_LEN:
        raise ValueError(f"{where}: history.max_len={ml!r} must be an integer in [1, {MAX_LEN}]")

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


class ColumnStats:
  """What the scan saw in one canonical column."""

  def __init__(self):
    self.max_len = 0
    self.lo, self.hi = None, None
    self.hashed = False
    self.nulls = 0
    self.count = 0
    self.pos = 0.0
    self.distinct: set | None = set()
    self.strings: dict | None = {}       # hash -> string of a string column (data.ingest.vocab)

  def values(self, x: np.ndarray) -> None:
    if not len(x):
      return
    lo, hi = int(x.min()), int(x.max())
    self.lo = lo if self.lo is None else min(self.lo, lo)
    self.hi = hi if self.hi is None else max(self.hi, hi)
    if self.distinct is not None:
      self.distinct.update(np.unique(x).tolist())
      if len(self.distinct) > MAX_VOCAB:
        self.distinct = None             # too many to count: at least MAX_VOCAB

  def add_strings(self, hashes: np.ndarray, strings: list) -> None:
    """The distinct strings of a string column (and their hashes), up to ``VOCAB_CAP``."""
    if self.strings is not None:
      self.strings.update(zip(np.asarray(hashes).tolist(), strings, strict=True))
      if len(self.strings) > VOCAB_CAP:
        self.strings = None

  def merge(self, o: "ColumnStats") -> "ColumnStats":
    """Both scans' stats in one (Beam combines partial scans)."""
    self.max_len = max(self.max_len, o.max_len)
    for k, f in (("lo", min), ("hi", max)):
      a, b = getattr(self, k), getattr(o, k)
      setattr(self, k, b if a is None else a if b is None else f(a, b))
    self.hashed |= o.hashed
    self.nulls += o.nulls
    self.count += o.count
    self.pos += o.pos
    self.distinct = None if self.distinct is None or o.distinct is None else (
        self.distinct | o.distinct)
    if self.distinct is not None and len(self.distinct) > MAX_VOCAB:
      self.distinct = None
    if self.strings is not None and o.strings is not None:
      self.add_strings(np.array(list(o.strings), np.int64), list(o.strings.values()))
    else:
      self.strings = None
    return self

  @property
  def n_distinct(self) -> int:
    return MAX_VOCAB if self.distinct is None else len(self.distinct)

  def vocab_values(self) -> list | None:
    """The sorted distinct values (strings of a string column), None when not all were kept."""
    if self.distinct is None or len(self.distinct) > VOCAB_CAP:
      return None
    if self.hashed:
      if self.strings is None or set(self.strings) != self.distinct:
        return None
      return sorted(self.strings.values())
    return sorted(self.distinct)


def vocab_for(st: ColumnStats) -> tuple[int, bool]:
  """(vocab_size, hashed) for an id column: compact non-negative ids keep their values
  (vocab = max id + 1); hashed or wide ids get ``2 * distinct`` rounded up to a power of two
  (at most MAX_VOCAB rows)."""
  if not st.hashed and st.hi is not None and st.lo >= 0 and st.hi < MAX_VOCAB:
    return st.hi + 1, False
  n = max(2 * st.n_distinct, 16)
  return min(MAX_VOCAB, 1 << (n - 1).bit_length()), True


def propose(stats: dict[str, ColumnStats], surfaces, order, spec: Spec,
            history_streams: dict | None = None) -> tuple[dict, list, list[str]]:
  """The schema.json sections from the scan: ``(schema_dict, hashed_events, notes)``.

  ``order``: canonical column names in first-seen order; ``history_streams``: ``{stream:
  {"max_len", "item", "action"}}`` ColumnStats-like facts for streams built by ``history``.
  Sections given in ``spec.schema`` are taken as they are.
  """
  notes, hashed_events, compact = [], list(spec.hashed_events), []
  out = {"surfaces": sorted(surfaces),
         "dense": [c.split(".", 1)[1] for c in order if role(c) == "dense"], "sparse": [],
         "streams": [], "tasks": []}
  exact = []
  for c in order:
    if role(c) == "sparse":
      st = stats[c]
      name = c.split(".", 1)[1]
      force = spec.vocab.get(name)
      vocab, hashed = vocab_for(st)
      entry = {"name": name, "vocab_size": vocab, "max_len": max(st.max_len, 1),
               "hashed": hashed}
      values = st.vocab_values()
      if force == "exact" or (force is None and hashed and values is not None
                              and len(values) <= spec.vocab_max):
        if values is None:
          raise ValueError(f"vocab.{name}=exact: the column has more than "
                           f"{min(st.n_distinct, MAX_VOCAB):,} distinct values, too many to keep "
                           "(hash it: vocab.{name}=hash)")
        entry.update(vocab_size=len(values) + 2, hashed=False, vocab=values)
        exact.append(f"{name} {len(values)}")
      elif force == "hash" and not hashed:
        n = max(2 * st.n_distinct, 16)
        entry.update(vocab_size=min(MAX_VOCAB, 1 << (n - 1).bit_length()), hashed=True)
      out["sparse"].append(entry)
      if not entry["hashed"] and "vocab" not in entry:
        compact.append(f"{name} {entry['vocab_size']}")
  if compact:
    notes.append(f"sparse features keep their ids (vocab_size = max id + 1; larger ids in later "
                 f"data are invalid: raise vocab_size or set hashed: true): {', '.join(compact)}")
  if exact:
    notes.append("exact vocabularies (value -> id 2.., id 0 = null, 1 = out of vocabulary; "
                 f"stored in schema.json): {', '.join(exact)}")
  bad = sorted(set(spec.vocab) - {c.split(".", 1)[1] for c in order if role(c) == "sparse"})
  if bad and "sparse" not in spec.schema:
    raise ValueError(f"vocab: {bad} are not sparse features of the input")
  streams: dict[str, dict] = {}
  for c in order:
    if role(c) == "events":
      _, s, col = c.split(".")
      streams.setdefault(s, {})[col] = stats[c]
  for s, cols in streams.items():
    if "item" not in cols or "ts" not in cols:
      raise ValueError(f"stream {s!r}: columns events.{s}.item and events.{s}.ts are required")
    d = {"name": s, "max_len": max(cols["item"].max_len, 1), "extra_fields": []}
    for col in ["item", "action"] + [k for k in cols if k not in ("item", "action", "surface",
                                                                   "ts")]:
      st = cols.get(col)
      vocab = 1 if st is None or st.hi is None else st.hi + 1
      if st is not None and st.lo is not None and st.lo < 0:
        raise ValueError(f"events.{s}.{col}: negative ids ({st.lo}); ids must be >= 0")
      if vocab > MAX_VOCAB:
        hashed_events.append(f"events.{s}.{col}")
        notes.append(f"events.{s}.{col}: ids up to {st.hi} hashed into {MAX_VOCAB} rows")
        vocab = MAX_VOCAB
      if col == "item":
        d["item_vocab"] = vocab
      elif col == "action":
        d["action_vocab"] = vocab
      else:
        d["extra_fields"].append({"name": col, "vocab_size": vocab})
    out["streams"].append(d)
  for s, h in (history_streams or {}).items():
    out["streams"].append({"name": s, "max_len": h["max_len"], "item_vocab": h["item_vocab"],
                           "action_vocab": h["action_vocab"], "extra_fields": []})
  for c in order:
    if role(c) == "label":
      out["tasks"].append({"name": c.split(".", 1)[1], "always_valid": stats[c].nulls == 0})
  if not out["tasks"] and "tasks" not in spec.schema:
    raise ValueError("no label columns: name at least one, e.g. --rename label.click=<your "
                     "0/1 column> (or a 'columns' entry in the --schema file)")
  for k in SECTIONS:
    if k in spec.schema:
      out[k] = spec.schema[k]
  return out, sorted(set(hashed_events)), notes


def schema_from(d: dict, where: str = "schema") -> Schema:
  try:
    return Schema.from_dict(d)
  except ValueError as e:
    raise ValueError(f"{where}: {e}") from None
