"""Graph copies of host memory lock the whole array their side views, so that two executables
copying overlapping views of one array that start at the same address are both accepted (ROCr
cannot unlock two registrations with one start address)."""
from __future__ import annotations

import numpy as np

import aiogpu


def test_two_executables_copy_views_of_one_array_that_share_their_start(make_runtime):
    rt = make_runtime(gpus=1)
    d0 = rt.devices[0]
    host = np.arange(64, dtype=np.int64)
    short, long = d0.alloc(16 * 8), d0.alloc(32 * 8)
    with aiogpu.Graph() as g1:
        aiogpu.copy(short, host[:16])
    with aiogpu.Graph() as g2:
        aiogpu.copy(long, host[:32])
    with g1.instantiate() as e1, g2.instantiate() as e2:
        assert aiogpu.gather(e1.launch(), e2.launch()).wait(20)
    got = long.to_numpy(np.int64)
    assert got.wait(20) and (got.result() == np.arange(32)).all()
