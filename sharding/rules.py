"""Logical-to-mesh axis rule presets, kept as data.

A rule set is an ordered tuple of ``(logical_name, mesh_axes)`` pairs with flax's
``logical_to_mesh_axes`` semantics: rules are one global priority list; a rule applies to a
dimension only if none of its mesh axes is already used by another dimension of the same array;
later entries for the same logical name are fallbacks. ``mesh_axes`` is ``None`` (replicated), one
axis name, or a tuple of axis names.

Every preset works on every mesh (axes of size 1 cost nothing). Axes that a preset does not use for
parameters or sequences carry the batch, so no device ever duplicates another's work. In every
preset embedding-table rows are sharded over ALL devices (``table_rows`` -> all five axes): a table
is never replicated, so no table-sized gradient all-reduce can appear (jax_stack_notes §10).

Presets (mesh axes: data, fsdp, tensor, context, expert):

  dp       pure data parallelism: batch over every axis; dense parameters replicated.
  fsdp     ZeRO-3: batch over every axis; dense parameters sharded over ``fsdp`` on their
           ``embed`` dimension (``data`` then gives HSDP replicas); experts stay whole per device.
  fsdp_tp  fsdp + tensor parallelism: ``heads`` and ``mlp`` on ``tensor`` (parameters and
           activations); batch over data, fsdp, context, expert.
  fsdp_cp  fsdp + context parallelism: ``seq`` on ``context``; parameters sharded over
           fsdp x context (the context group would otherwise hold replicas); batch over data,
           fsdp, tensor, expert.
  fsdp_ep  fsdp + expert parallelism: the stacked ``exp`` axis of MoWE on ``expert``; other
           parameters sharded over fsdp x expert; batch over data, fsdp, context, tensor, expert.
  5d       all five: batch over data, fsdp, expert; seq on context; heads/mlp on tensor; exp on
           expert; parameters' embed over fsdp x context x expert where free (fallback fsdp).

Rule order (shared by all presets): ``exp`` first (so stacked expert weights and per-expert
activations take ``expert`` before anything else), then ``batch`` (activations keep their batch
sharding before ``embed`` can claim fsdp), then ``seq``, ``heads``/``mlp``, then ``embed``
(with fallbacks), then tables.
"""

from __future__ import annotations

from sharding.axes import LOGICAL_AXES, MESH_AXES

ALL = ("data", "fsdp", "tensor", "context", "expert")
_NONE = tuple((name, None) for name in ("tokens", "head_dim", "kv", "seeds", "table_dim", "layers"))
_TABLES = (("table_rows", ALL),)

PRESETS: dict[str, tuple] = {
    "dp": (
        ("batch", ALL),
        ("seq", None), ("heads", None), ("mlp", None), ("exp", None), ("embed", None),
        *_TABLES, *_NONE,
    ),
    "fsdp": (
        ("exp", None),
        ("batch", ALL),
        ("seq", None), ("heads", None), ("mlp", None),
        ("embed", "fsdp"),
        *_TABLES, *_NONE,
    ),
    "fsdp_tp": (
        ("exp", None),
        ("batch", ("data", "fsdp", "context", "expert")),
        ("seq", None),
        ("heads", "tensor"), ("mlp", "tensor"),
        ("embed", "fsdp"),
        *_TABLES, *_NONE,
    ),
    "fsdp_cp": (
        ("exp", None),
        ("batch", ("data", "fsdp", "tensor", "expert")),
        ("seq", "context"),
        ("heads", None), ("mlp", None),
        ("embed", ("fsdp", "context")), ("embed", "fsdp"),
        *_TABLES, *_NONE,
    ),
    "fsdp_ep": (
        ("exp", "expert"),
        ("batch", ALL),
        ("batch", ("data", "fsdp", "tensor", "context")),
        ("seq", None), ("heads", None), ("mlp", None),
        ("embed", ("fsdp", "expert")), ("embed", "fsdp"),
        *_TABLES, *_NONE,
    ),
    "5d": (
        ("exp", "expert"),
        ("batch", ("data", "fsdp", "expert")),
        ("batch", ("data", "fsdp")),
        ("seq", "context"),
        ("heads", "tensor"), ("mlp", "tensor"),
        ("embed", ("fsdp", "context", "expert")), ("embed", ("fsdp", "context")),
        ("embed", ("fsdp", "expert")), ("embed", "fsdp"),
        *_TABLES, *_NONE,
    ),
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
