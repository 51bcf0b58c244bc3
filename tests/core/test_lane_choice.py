"""Which compute lane independent work goes to: an idle one, never behind a held kernel while
another lane is free."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

import aiogpu
from gpu_kernels import Gate, add_const_n, scale


@pytest.mark.asyncio
async def test_independent_launch_completes_while_a_held_kernel_blocks_its_lane(make_runtime):
    """A held kernel and a launch that depends on it (the barrier bit: nothing behind it on that
    queue starts) occupy one queue; a shader copy took a turn meanwhile. An independent launch
    goes to the idle queue and completes while the held kernel is still held."""
    rt = make_runtime(gpus=1, queues_per_device=2)
    d0 = rt.devices[0]
    n = 16
    x, y, c, d = (d0.alloc(n * 8) for _ in range(4))
    await aiogpu.gather(*(aiogpu.copy(b, np.zeros(n, np.int64)) for b in (x, y, c)))
    gate = Gate()
    held = gate.launch(d0)
    await aiogpu.copy(d, c)                    # within one device: a shader copy on a compute lane
    behind = d0.launch(add_const_n, grid=(n,), block=(n,), args=(x, 1, n), after=[held])
    assert behind.lane is held.lane
    try:
        independent = d0.launch(add_const_n, grid=(n,), block=(n,), args=(y, 2, n))
        assert independent.lane is not held.lane
        await asyncio.wait_for(independent, 30)
        assert not held.done() and not behind.done()
    finally:
        gate.open()
    await asyncio.wait_for(behind, 30)
    np.testing.assert_array_equal(await y.to_numpy(np.int64), np.full(n, 2))


@pytest.mark.asyncio
async def test_independent_launches_spread_over_idle_lanes(make_runtime):
    rt = make_runtime(gpus=1, queues_per_device=3)
    d0 = rt.devices[0]
    gates = [Gate() for _ in range(2)]
    held = [g.launch(d0) for g in gates]
    assert held[0].lane is not held[1].lane    # the second went to an idle lane
    try:
        buf = d0.alloc(64)
        free = d0.launch(scale, grid=(16,), block=(16,), args=(buf, 2.0, 16))
        assert free.lane not in {h.lane for h in held}
        await asyncio.wait_for(free, 30)
    finally:
        for g in gates:
            g.open()
    await asyncio.wait_for(aiogpu.gather(*held), 30)
