"""Table rows against the code they configure, at hand-written boundary values (not values
derived from the row itself, so a wrong row fails here)."""

import pytest

from data import jagged
from kunlun.configs import vm_tiny
from kunlun.train import settings


@pytest.mark.parametrize("buckets,ok", [(0, False), (1, True), (4, True), (5, False)])
def test_jagged_buckets_range_is_what_capacity_buckets_accepts(buckets, ok):
  c = vm_tiny.get_config()
  c.data.jagged_buckets = buckets
  sample = [3, 5, 8, 13, 21, 34]                    # history lengths of a stream
  if ok:
    settings.check(c)
    caps = jagged.capacity_buckets(sample, batch_size=4, buckets=buckets)
    assert len(caps) == buckets and list(caps) == sorted(caps)
  else:
    with pytest.raises(settings.SettingsError, match=f"config.data.jagged_buckets = {buckets}"):
      settings.check(c)
    with pytest.raises(ValueError, match="jagged buckets"):
      jagged.capacity_buckets(sample, batch_size=4, buckets=buckets)
