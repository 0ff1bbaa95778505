"""Mesh flag parsing, mesh construction, rule presets, spec fitting and the sharding check."""

import flax.linen as nn
import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from sharding import checks, partition
from sharding import mesh as M
from sharding import rules as R
from sharding.axes import LOGICAL_AXES, MESH_AXES


def test_parse_mesh_flag_fills_missing_axes():
  assert M.parse_mesh_flag("fsdp=-1,tensor=2") == {
      "data": 1, "fsdp": -1, "tensor": 2, "context": 1, "expert": 1}
  assert M.parse_mesh_flag(" data = 2 , expert=4 ")["data"] == 2
  assert M.parse_mesh_flag("") == {a: 1 for a in MESH_AXES}


@pytest.mark.parametrize("flag, needle", [
    ("pipeline=2", "unknown mesh axis 'pipeline'"),
    ("data=two", "'two' is not an integer"),
    ("data=0", "size 0 must be"),
    ("data=-2", "size -2 must be"),
    ("data=-1,fsdp=-1", "at most one axis may be -1"),
    ("data=2,data=2", "given twice"),
    ("fsdp", "not of the form axis=size"),
])
def test_parse_mesh_flag_errors(flag, needle):
  with pytest.raises(ValueError, match=needle):
    M.parse_mesh_flag(flag)


def test_make_mesh_sizes_and_types():
  mesh = M.make_mesh(M.parse_mesh_flag("data=2,fsdp=-1,tensor=2"))
  assert mesh.axis_names == MESH_AXES
  assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2, "context": 1, "expert": 1}
  assert all(t == AxisType.Auto for t in mesh.axis_types)
  assert sorted(d.id for d in mesh.devices.flat) == list(range(8))


def test_make_mesh_mismatch_states_both_numbers():
  with pytest.raises(ValueError, match=r"multiply to 4 but there are 8 devices"):
    M.make_mesh({"fsdp": 4})
  with pytest.raises(ValueError, match=r"multiply to 3, which does not divide the 8"):
    M.make_mesh({"tensor": 3, "fsdp": -1})
  with pytest.raises(ValueError, match="unknown mesh axis 'stage'"):
    M.make_mesh({"stage": 2, "fsdp": -1})


def test_make_mesh_hybrid_dcn_major():
  devs = jax.devices()
  mesh = M.make_mesh({"fsdp": -1, "tensor": 2}, {"data": 2}, devices=devs)
  assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2, "context": 1, "expert": 1}
  # each data slice (one "host" group) holds one contiguous block of devices
  ids = np.vectorize(lambda d: d.id)(mesh.devices)
  assert sorted(ids[0].ravel()) == [0, 1, 2, 3] and sorted(ids[1].ravel()) == [4, 5, 6, 7]
  # dcn and ici on the same axis: ici inner
  mesh = M.make_mesh({"fsdp": 2, "tensor": 2}, {"fsdp": 2}, devices=devs)
  ids = np.vectorize(lambda d: d.id)(mesh.devices)[0, :, :, 0, 0]
  np.testing.assert_array_equal(ids, [[0, 1], [2, 3], [4, 5], [6, 7]])
  with pytest.raises(ValueError, match="multiply to 8 but there are 4 devices"):
    M.make_mesh({"fsdp": 8}, {"data": 2})


def test_get_rules_and_validation():
  with pytest.raises(ValueError, match="unknown sharding rules preset 'zero3'"):
    R.get_rules("zero3")
  with pytest.raises(ValueError, match="unknown mesh axis 'model'"):
    R.validate((("mlp", "model"),))
  with pytest.raises(ValueError, match="unknown logical axis 'hidden'"):
    R.validate((("hidden", "tensor"),))
  for name in R.NAMES:
    assert {r[0] for r in R.get_rules(name)} == set(LOGICAL_AXES)


ALL = ("data", "fsdp", "tensor", "context", "expert")
# (logical axes) -> expected PartitionSpec per preset; written out by hand from the rule doc.
EXPECTED = {
    ("batch", "seq", "embed"): {
        "dp": P(ALL, None, None), "fsdp": P(ALL, None, None),
        "fsdp_tp": P(("data", "fsdp", "context", "expert"), None, None),
        "fsdp_cp": P(("data", "fsdp", "tensor", "expert"), "context", None),
        "fsdp_ep": P(ALL, None, None),
        "5d": P(("data", "fsdp", "expert"), "context", None)},
    ("embed", "mlp"): {
        "dp": P(None, None), "fsdp": P("fsdp", None), "fsdp_tp": P("fsdp", "tensor"),
        "fsdp_cp": P(("fsdp", "context"), None), "fsdp_ep": P(("fsdp", "expert"), None),
        "5d": P(("fsdp", "context", "expert"), "tensor")},
    ("exp", "embed", "mlp"): {
        "dp": P(None, None, None), "fsdp": P(None, "fsdp", None),
        "fsdp_tp": P(None, "fsdp", "tensor"), "fsdp_cp": P(None, ("fsdp", "context"), None),
        "fsdp_ep": P("expert", "fsdp", None), "5d": P("expert", ("fsdp", "context"), "tensor")},
    ("exp", "batch", "tokens", "embed"): {
        "fsdp_ep": P("expert", ("data", "fsdp", "tensor", "context"), None, None),
        "5d": P("expert", ("data", "fsdp"), None, None)},
    ("batch", "seq", "heads", "head_dim"): {
        "fsdp_tp": P(("data", "fsdp", "context", "expert"), None, "tensor", None),
        "5d": P(("data", "fsdp", "expert"), "context", "tensor", None)},
    ("table_rows", "table_dim"): {name: P(ALL, None) for name in R.NAMES},
}


@pytest.mark.parametrize("logical", list(EXPECTED))
def test_preset_specs(logical):
  for name, want in EXPECTED[logical].items():
    got = nn.logical_to_mesh_axes(logical, R.get_rules(name))
    assert got == want, (name, logical, got)


def test_fit_spec_drops_indivisible_axes():
  mesh = M.make_mesh({"fsdp": 4, "tensor": 2})
  assert partition.fit_spec(P(ALL, None), (50, 16), mesh) == P(("data", "tensor", "context", "expert"), None)
  assert partition.fit_spec(P(("fsdp", "tensor"), "tensor"), (12, 3), mesh) == P(("fsdp",), None)
  assert partition.fit_spec(P("fsdp"), (8, 3), mesh) == P("fsdp", None)


def test_assert_params_sufficiently_sharded():
  mesh = M.make_mesh({"data": 2, "fsdp": 4})
  sds = lambda shape, spec: jax.ShapeDtypeStruct(shape, np.float32, sharding=NamedSharding(mesh, spec))
  good = {"w": sds((64, 32), P("fsdp", None)), "b": sds((32,), P())}
  frac = checks.assert_params_sufficiently_sharded(good, tolerance=0.1)
  # per device: 64*32/4 + 32 floats; perfect: (64*32 + 32) / 4
  dev, ideal = 64 * 32 / 4 + 32, (64 * 32 + 32) / 4
  assert frac == pytest.approx((dev - ideal) / dev)
  bad = {**good, "big": sds((128, 64), P(None, None))}
  with pytest.raises(ValueError, match=r"(?s)replicated copies.*\['big'\]"):
    checks.assert_params_sufficiently_sharded(bad)
  # with every axis a replica axis nothing counts as a copy
  assert checks.assert_params_sufficiently_sharded(bad, replica_axes=MESH_AXES) == 0.0  # clamped


HLO = """
  %all-gather.2 = f32[16,2,4]{2,1,0} all-gather(%param.6), channel_id=9, replica_groups=[2,4]<=[8], dimensions={0}
  %ar = (f32[4,16]{1,0}, bf16[8]{0}) all-reduce(%a, %b), channel_id=3, replica_groups={{0,4},{1,5},{2,6},{3,7}}, to_apply=%add
  %ag = s32[16,3,1]{2,1,0} all-gather(%x), replica_groups=mesh['data'=1,'fsdp'=2,'tensor'=2,'context'=1,'expert'=2] {'fsdp','expert'}, dimensions={0}
  %ags = (f32[8,16]{1,0}, f32[64,16]{1,0}) all-gather-start(%p), replica_groups=[1,8]<=[8], dimensions={0}
  %agd = f32[64,16]{1,0} all-gather-done(%ags)
  %cp = f32[1,8,16]{2,0,1} collective-permute(%w), source_target_pairs={{0,1},{1,0}}
  %rs = f32[4,16]{1,0} reduce-scatter(%g), replica_groups=[2,4]<=[8], dimensions={0}
  %add.1 = f32[4,16]{1,0} add(%x, %y)
"""


def test_hlo_collective_parser():
  ops = checks.collectives(HLO)
  got = [(c["op"], c["bytes"], c["group"]) for c in ops]
  assert got == [("all-gather", 16 * 2 * 4 * 4, 4), ("all-reduce", 4 * 16 * 4 + 8 * 2, 2),
                 ("all-gather", 16 * 3 * 4, 4), ("all-gather", 64 * 16 * 4, 8),
                 ("collective-permute", 8 * 16 * 4, 2), ("reduce-scatter", 4 * 16 * 4, 4)]
  wire = [c["wire_bytes"] for c in ops]
  assert wire == [512 * 3 / 4, 2 * 272 / 2, 192 * 3 / 4, 4096 * 7 / 8, 512, 256 * 3]
  s = checks.collective_summary(HLO)
  assert s["all-gather"]["count"] == 3 and s["reduce-scatter"]["bytes"] == 256
