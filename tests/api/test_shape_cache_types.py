"""A launch shape validated once is looked up, not validated again; but a grid or block equal to
a cached one without being the same plain integers (``True == 1``, ``1.0 == 1``, and they hash
alike) is validated as if new, so it raises what it raises the first time."""
from __future__ import annotations

import pytest

import aiogpu
from tests import gpu_kernels


@pytest.mark.parametrize("bad_grid, bad_block", [((True,), (1,)), ((1.0,), (1,)), ((1,), (True,)), ((1,), (1.0,))])
def test_a_shape_equal_to_a_cached_one_but_not_plain_ints_raises(bad_grid, bad_block):
    rt = aiogpu.Runtime("emulator")
    try:
        dev = rt.devices[0]
        buf = dev.alloc(64)
        with pytest.raises(TypeError) as first:
            dev.launch(gpu_kernels.add_const_n, bad_grid, bad_block, (buf, 1, 1))
        for _ in range(3):                 # cached now, and taken by the plain path
            dev.launch(gpu_kernels.add_const_n, (1,), (1,), (buf, 1, 1)).wait(30)
        with pytest.raises(TypeError) as again:
            dev.launch(gpu_kernels.add_const_n, bad_grid, bad_block, (buf, 1, 1))
        assert str(again.value) == str(first.value)
    finally:
        rt.close()


seen: list = []


@aiogpu.kernel("u32", name="record_shape")
def record_shape(launch, tag):
    seen.append((int(tag), tuple(launch.grid), tuple(launch.block)))


@aiogpu.kernel("u32", name="record_shape_too")
def record_shape_too(launch, tag):
    seen.append((100 + int(tag), tuple(launch.grid), tuple(launch.block)))


def test_each_launch_runs_its_own_shape_when_the_last_one_found_is_kept():
    """The plain launch keeps the last shape it found (``Device._last_launch``), keyed by the
    very kernel, grid and block objects: alternating kernels, grids and blocks, each launch still
    dispatches its own kernel over its own grid and block, equal tuples that are other objects
    included."""
    rt = aiogpu.Runtime("emulator")
    try:
        dev = rt.devices[0]
        g1, g2, b1, b2 = (64,), (128,), (32,), (64,)
        plan = [(record_shape, g1, b1), (record_shape, g2, b1), (record_shape_too, g2, b1), (record_shape, g2, b2),
                (record_shape, tuple([64]), tuple([32])), (record_shape_too, g1, b2)]
        for k, g, b in plan:                       # (validated on the general path once each)
            dev.launch(k, g, b, (0,)).wait(30)
        seen.clear()
        order = plan * 3
        futs = [dev.launch(k, g, b, (j,)) for j, (k, g, b) in enumerate(order)]
        aiogpu.gather(*futs).wait(30)
        # (independent launches may run on several queues, in any order: each is told by its tag)
        want = [((100 if k is record_shape_too else 0) + j, g, b) for j, (k, g, b) in enumerate(order)]
        assert sorted(seen) == sorted(want)
        k, g, b = plan[-1]
        assert dev._last_launch[:3] == (k, g, b) and dev._last_launch[3] is dev._shapes[(k, g, b)]
    finally:
        rt.close()
