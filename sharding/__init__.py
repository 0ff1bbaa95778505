"""Declarative 5D parallelism: mesh axes ``data, fsdp, tensor, context, expert``.

Model code names only logical axes (``sharding.axes``) and applies activation constraints only
through ``sharding.shard``; rule presets (``sharding.rules``) map them onto the mesh.
"""

from sharding.axes import MESH_AXES, shard, with_axes  # noqa: F401
