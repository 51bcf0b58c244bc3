"""Full rings park work in a back-log; nothing blocks the event loop; resources recycle."""
from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

import aiogpu
from gpu_kernels import Gate, sleep_ms, slow_increment


@pytest.mark.asyncio
async def test_tiny_ring_takes_a_thousand_launches_without_blocking(make_runtime):
    rt = make_runtime(ring_size=4, queues_per_device=1, gpus=1, emulator_min_queue_size=4)
    d0 = rt.devices[0]
    assert d0.queues[0].size == 4
    gate = Gate()
    held = gate.launch(d0)
    t0 = time.perf_counter()
    futs = [d0.launch(sleep_ms, grid=(1,), block=(1,), args=(0,), after=[held]) for _ in range(1000)]
    submit_s = time.perf_counter() - t0
    assert len(d0.queues[0].backlog) >= 996, "a ring of 4 should have parked all but 3 launches"
    gate.open()
    # The loop stays responsive while the back-log drains.
    ticks = 0
    while not all(f.done() for f in futs):
        await asyncio.sleep(0.001)
        ticks += 1
    await aiogpu.gather(*futs)
    assert ticks > 1
    assert submit_s < 10


@pytest.mark.asyncio
async def test_back_logged_conflicting_work_stays_ordered(make_runtime):
    rt = make_runtime(ring_size=4, gpus=2, emulator_min_queue_size=4)
    d0, d1 = rt.devices
    c0 = d0.alloc(8)
    await aiogpu.copy(c0, np.zeros(1, np.int64))
    for _ in range(30):
        d0.launch(slow_increment, grid=(1,), block=(1,), args=(c0,))
    assert (await c0.to_numpy(np.int64))[0] == 30


@pytest.mark.parametrize("asked,got", [(4, 64), (100, 128), (1024, 1024), (1 << 20, 131072)])
def test_ring_size_is_clamped_to_what_rocr_accepts(make_runtime, asked, got):
    """ROCr accepts powers of two in [64, 0x20000] only: the runtime rounds and clamps (an
    unclamped ring of 4 would fail hsa_queue_create with INVALID_ARGUMENT)."""
    rt = make_runtime(ring_size=asked, gpus=1, queues_per_device=1)
    assert rt.devices[0].queues[0].size == got


@pytest.mark.asyncio
async def test_kernarg_ring_reuse_only_after_retirement(make_runtime):
    rt = make_runtime(gpus=1)
    d0 = rt.devices[0]
    ring = d0.queues[0].kernarg
    slow = d0.launch(sleep_ms, grid=(1,), block=(1,), args=(200,))
    assert ring.in_use >= 1
    await slow
    assert ring.in_use == 0
