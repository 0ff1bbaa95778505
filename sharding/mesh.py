"""Device meshes with the five axes ``data, fsdp, tensor, context, expert`` (all AxisType.Auto).

Sizes come in two groups, as in MaxText: ``ici`` (inside a host / NVLink island) and ``dcn``
(across hosts). Axis ``i`` of the mesh has size ``dcn[i] * ici[i]`` with the across-host part
major, so neighbouring devices on an axis share a host. Every axis always exists (size 1 when
unused). One ``-1`` per group absorbs the remaining devices.

  sizes = parse_mesh_flag("data=1,fsdp=-1,tensor=1,context=1,expert=1")
  mesh = make_mesh(sizes)                          # one host
  mesh = make_mesh({"fsdp": -1}, {"data": 2})      # two hosts: fsdp inside, data across
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from sharding.axes import MESH_AXES


def parse_mesh_flag(flag: str) -> dict[str, int]:
  """Parses ``"data=1,fsdp=-1,..."`` into ``{axis: size}`` for all five axes (missing -> 1).

  Raises ValueError naming the offending entry for an unknown axis, a repeated axis, a size that
  is not an integer >= 1 or -1, or more than one ``-1``.
  """
  sizes = {a: 1 for a in MESH_AXES}
  seen = set()
  flag = (flag or "").strip()
  for entry in filter(None, (e.strip() for e in flag.split(","))):
    if "=" not in entry:
      raise ValueError(f"mesh flag entry {entry!r} is not of the form axis=size (in {flag!r})")
    name, value = (s.strip() for s in entry.split("=", 1))
    if name not in MESH_AXES:
      raise ValueError(f"unknown mesh axis {name!r} in {flag!r}; allowed axes: {MESH_AXES}")
    if name in seen:
      raise ValueError(f"mesh axis {name!r} given twice in {flag!r}")
    seen.add(name)
    try:
      size = int(value)
    except ValueError:
      raise ValueError(
          f"mesh axis {name!r}: size {value!r} is not an integer (in {flag!r})") from None
    if size < 1 and size != -1:
      raise ValueError(f"mesh axis {name!r}: size {size} must be >= 1 or -1 (in {flag!r})")
    sizes[name] = size
  _check_sizes(sizes, "mesh flag")
  return sizes


def _check_sizes(sizes: dict, what: str) -> None:
  for name, size in sizes.items():
    if name not in MESH_AXES:
      raise ValueError(f"{what}: unknown mesh axis {name!r}; allowed axes: {MESH_AXES}")
    if not isinstance(size, (int, np.integer)) or (size < 1 and size != -1):
      raise ValueError(f"{what}: axis {name!r} has size {size!r}; sizes must be ints >= 1 or -1")
  if sum(1 for s in sizes.values() if s == -1) > 1:
    raise ValueError(f"{what}: at most one axis may be -1, got {dict(sizes)}")


def _named(sizes) -> dict:
  return dict(zip(MESH_AXES, sizes, strict=True))


def resolve_sizes(sizes: dict | None, total: int, what: str = "mesh") -> tuple[int, ...]:
  """Completes ``sizes`` (missing axes -> 1, one -1 absorbs the rest) so the product is ``total``.

  Returns the sizes in ``MESH_AXES`` order. ValueError states both numbers on a mismatch.
  """
  sizes = dict(sizes or {})
  _check_sizes(sizes, what)
  full = [int(sizes.get(a, 1)) for a in MESH_AXES]
  known = math.prod(s for s in full if s != -1)
  if -1 in full:
    if total % known:
      raise ValueError(f"{what}: the fixed sizes {_named(full)} multiply to {known}, "
                       f"which does not divide the {total} devices available")
    full[full.index(-1)] = total // known
  elif known != total:
    raise ValueError(f"{what}: sizes {_named(full)} multiply to {known} but there "
                     f"are {total} devices")
  return tuple(full)


def _hybrid_array(ici, dcn, devices):
  """``dcn``-major device array, grouping devices by process (one group per dcn slice)."""
  n_groups = math.prod(dcn)
  if jax.process_count() > 1 and n_groups == jax.process_count():
    try:
      return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, process_is_granule=True,
                                                  allow_split_physical_axes=True)
    except (ValueError, AssertionError, NotImplementedError):
      pass  # fall back to the plain grouping below (e.g. CPU devices without topology)
  devs = sorted(devices, key=lambda d: (d.process_index, d.id))
  arr = np.asarray(devs, dtype=object).reshape(*dcn, *ici)
  n = len(MESH_AXES)
  arr = arr.transpose([j for i in range(n) for j in (i, n + i)])     # (dcn0, ici0, dcn1, ici1..)
  return arr.reshape([d * i for d, i in zip(dcn, ici, strict=True)])


def make_mesh(ici: dict | None = None, dcn: dict | None = None, devices=None) -> Mesh:
  """Builds the 5-axis mesh (``MESH_AXES`` order, AxisType.Auto).

  Args:
    ici: within-host sizes ``{axis: size}`` (missing -> 1, one -1 allowed). Without ``dcn`` these
      are the sizes of the whole mesh and must multiply to the number of devices.
    dcn: across-host sizes; their product is the number of device groups (hosts / processes), and
      ``ici`` then describes one group. Axis sizes multiply (``dcn * ici``, dcn major).
    devices: the devices to use (default ``jax.devices()``, all processes).
  """
  devices = list(jax.devices() if devices is None else devices)
  n = len(devices)
  if dcn is None or all(v == 1 for v in dcn.values()):
    shape = resolve_sizes(ici, n, "mesh (ici)")
    if jax.process_count() > 1:
      arr = _hybrid_array(shape, (1,) * len(MESH_AXES), devices)
    else:
      try:
        arr = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
      except (ValueError, AssertionError, NotImplementedError):
        arr = np.asarray(devices, dtype=object).reshape(shape)
  else:
    dcn_shape = resolve_sizes(dcn, _groups(dcn, n), "mesh (dcn)")
    groups = math.prod(dcn_shape)
    if n % groups:
      raise ValueError(f"mesh: dcn sizes {_named(dcn_shape)} make {groups} device "
                       f"groups, which does not divide the {n} devices")
    ici_shape = resolve_sizes(ici, n // groups, f"mesh (ici, per group of {n // groups})")
    arr = _hybrid_array(ici_shape, dcn_shape, devices)
  return Mesh(arr, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def _groups(dcn: dict, n_devices: int) -> int:
  """Number of dcn groups: the product of dcn sizes, or the process count when one is -1."""
  fixed = math.prod(v for v in dcn.values() if v != -1)
  if any(v == -1 for v in dcn.values()):
    return max(jax.process_count(), fixed)
  return fixed


def mesh_from_flags(mesh: str = "fsdp=-1", dcn_mesh: str | None = None, devices=None) -> Mesh:
  """``make_mesh`` from flag strings (``--mesh`` within hosts, ``--dcn_mesh`` across hosts)."""
  dcn = parse_mesh_flag(dcn_mesh) if dcn_mesh else None
  return make_mesh(parse_mesh_flag(mesh), dcn, devices)


def describe(mesh: Mesh) -> str:
  """``"data=1 fsdp=8 tensor=1 context=1 expert=1 (8 devices, 1 process)"``."""
  sizes = " ".join(f"{a}={mesh.shape[a]}" for a in mesh.axis_names)
  procs = len({d.process_index for d in mesh.devices.flat})
  return f"{sizes} ({mesh.devices.size} devices, {procs} process{'es' if procs > 1 else ''})"
