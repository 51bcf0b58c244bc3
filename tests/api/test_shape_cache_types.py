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
