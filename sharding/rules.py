"""Logical-to-mesh axis rule presets, kept as data.
Notes: docs/sharding.md, ``sharding/rules.py``."""

from __future__ import annotations

from sharding.axes import LOGICAL_AXES, MESH_AXES

ALL = ("data", "fsdp", "tensor", "context", "expert")
_NONE = tuple((name, None) for name in ("head_dim", "kv", "seeds", "table_dim", "layers"))
_TABLES = (("table_rows", ALL),)


def _fallbacks(name, axes, must="fsdp"):
  """``(name, sub)`` for every order-preserving sub-tuple of ``axes`` holding ``must``, longest
  first: e.g. embed over (fsdp, context) falls back to fsdp alone when context is taken (a rule
  applies only if all of its mesh axes are still free). Every preset's batch holds ``fsdp``, so
  these rules never shard an activation: they only spread parameters."""
  axes = tuple(axes)
  subs = [tuple(a for k, a in enumerate(axes) if mask >> k & 1)
          for mask in range(1, 2 ** len(axes))]
  subs = [t for t in subs if must in t]
  subs.sort(key=lambda t: (-len(t), [axes.index(a) for a in t]))
  return tuple((name, sub[0] if len(sub) == 1 else sub) for sub in subs)


def _preset(batch, batch_fallback=None, seq=None, tp=None, exp=None, zero=()):
  """A rule set. ``zero``: the axes that shard parameters ZeRO-3 style (on ``embed``; ``mlp`` and
  ``tokens`` use them as low-priority fallbacks for parameters without an ``embed`` dimension)."""
  tp_axes = (tp,) if tp else ()
  rules = [("exp", exp), ("batch", batch)]
  if batch_fallback:
    rules.append(("batch", batch_fallback))
  # a packed tower's blocks (kunlun.nn.packed): the batch axes, then the sequence axes, so that
  # context parallelism splits a batch shard's blocks by example (block s on batch shard
  # s // n_seq, context shard s % n_seq)
  seq_axes = (seq,) if isinstance(seq, str) else tuple(seq or ())
  for axes in (batch, batch_fallback) if batch_fallback else (batch,):
    rules.append(("blocks", tuple(axes) + seq_axes))
  rules += [("seq", seq), ("heads", tp)]
  rules += _fallbacks("embed", zero) if zero else [("embed", None)]
  for _, sub in _fallbacks("mlp", zero) if zero else ():
    axes = tp_axes + ((sub,) if isinstance(sub, str) else sub)
    rules.append(("mlp", axes[0] if len(axes) == 1 else axes))
  rules.append(("mlp", tp))
  rules += _fallbacks("tokens", zero) if zero else [("tokens", None)]
  return tuple(rules) + _TABLES + _NONE


PRESETS: dict[str, tuple] = {
    "dp": _preset(batch=ALL),
    "fsdp": _preset(batch=ALL, zero=("fsdp",)),
    "fsdp_tp": _preset(batch=("data", "fsdp", "context", "expert"), tp="tensor", zero=("fsdp",)),
    "fsdp_cp": _preset(batch=("data", "fsdp", "tensor", "expert"), seq="context",
                       zero=("fsdp", "context")),
    "fsdp_ep": _preset(batch=ALL, batch_fallback=("data", "fsdp", "tensor", "context"),
                       exp="expert", zero=("fsdp", "expert")),
    "5d": _preset(batch=("data", "fsdp", "expert"), batch_fallback=("data", "fsdp"), seq="context",
                  tp="tensor", exp="expert", zero=("fsdp", "context", "expert")),
}
NAMES = tuple(PRESETS)


def validate(rules) -> None:
  """Raises ValueError if a rule names an unknown logical or mesh axis."""
  for entry in rules:
    if not (isinstance(entry, (tuple, list)) and len(entry) == 2):
      raise ValueError(f"rule {entry!r} is not a (logical_name, mesh_axes) pair")
    name, axes = entry
    if name not in LOGICAL_AXES:
      raise ValueError(f"rule {entry!r}: unknown logical axis {name!r}; allowed: {LOGICAL_AXES}")
    for a in (axes if isinstance(axes, (tuple, list)) else (axes,)):
      if a is not None and a not in MESH_AXES:
        raise ValueError(f"rule {entry!r}: unknown mesh axis {a!r}; allowed: {MESH_AXES}")


def get_rules(name: str) -> tuple:
  """The rule preset ``name`` (one of ``NAMES``) as a tuple of ``(logical, mesh_axes)`` pairs."""
  if name not in PRESETS:
    raise ValueError(f"unknown sharding rules preset {name!r}; allowed: {NAMES}")
  return PRESETS[name]


for _name, _rules in PRESETS.items():
  validate(_rules)
  assert {r[0] for r in _rules} == set(LOGICAL_AXES), _name
