"""Ordering on the device: hazards and after= become device-side waits; independent work overlaps."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

import aiogpu
from gpu_kernels import Gate, add_into, sleep_ms, slow_increment


def timeline(rt):
    return list(rt.api.emulator.timeline)


@pytest.mark.asyncio
async def test_conflicting_launches_from_concurrent_tasks_are_ordered(rt):
    d0 = rt.devices[0]
    counter = d0.alloc(8)
    await aiogpu.copy(counter, np.zeros(1, np.int64))

    async def bump():
        await asyncio.sleep(0)
        await d0.launch(slow_increment, grid=(1,), block=(1,), args=(counter,))

    await asyncio.gather(*(bump() for _ in range(40)))
    assert (await counter.to_numpy(np.int64))[0] == 40


@pytest.mark.asyncio
async def test_conflicts_across_devices_are_ordered(rt):
    d0, d1 = rt.devices
    a0, a1 = d0.alloc(8), d1.alloc(8)
    await aiogpu.copy(a0, np.zeros(1, np.int64))
    for _ in range(10):   # bounce a counter between devices: RAW/WAR/WAW across engines
        d0.launch(slow_increment, grid=(1,), block=(1,), args=(a0,))
        aiogpu.copy(a1, a0)
        d1.launch(slow_increment, grid=(1,), block=(1,), args=(a1,))
        aiogpu.copy(a0, a1)
    assert (await a0.to_numpy(np.int64))[0] == 20


@pytest.mark.asyncio
async def test_independent_launches_overlap_on_the_device(rt):
    d0 = rt.devices[0]
    futs = [d0.launch(sleep_ms, grid=(1,), block=(1,), args=(100,)) for _ in range(2)]
    await aiogpu.gather(*futs)
    recs = [r for r in timeline(rt) if r.kind == "dispatch" and r.name == "sleep_ms"]
    assert len(recs) == 2
    a, b = recs
    assert a.start_ns < b.end_ns and b.start_ns < a.end_ns, "independent dispatches did not overlap"


@pytest.mark.asyncio
async def test_dependent_work_waits_on_the_device_not_the_host(rt):
    d0, d1 = rt.devices
    src, dst = d0.alloc(8), d1.alloc(8)
    gate = Gate()                    # holds `first` back until everything below is submitted
    first = d0.launch(slow_increment, grid=(1,), block=(1,), args=(src,), after=[gate.launch(d0)])
    wakeups_before = rt.hub.wakeups
    second = aiogpu.copy(dst, src)   # depends on `first` (read after write), on another engine
    third = d1.launch(slow_increment, grid=(1,), block=(1,), args=(dst,))
    # Everything is already on the device while `first` cannot have run: nothing waited on the host.
    assert not first.done()
    assert second.queue is not None and third.queue is not None
    assert third.packet is not None, "the dependent launch was not published to its ring"
    gate.open()
    await third
    copies = [r for r in timeline(rt) if r.kind == "copy"]
    incs = sorted((r for r in timeline(rt) if r.name == "slow_increment"), key=lambda r: r.start_ns)
    assert copies and incs[0].end_ns <= copies[0].start_ns <= copies[0].end_ns <= incs[1].start_ns
    assert rt.hub.wakeups >= wakeups_before  # (the waiter may wake; it gates nothing)


@pytest.mark.asyncio
async def test_after_with_many_dependencies_chains_barrier_packets(rt):
    d0, d1 = rt.devices
    out = d0.alloc(8)
    await aiogpu.copy(out, np.zeros(1, np.int64))
    gates = [d1.launch(sleep_ms, grid=(1,), block=(1,), args=(100 + i,)) for i in range(12)]
    f = d0.launch(slow_increment, grid=(1,), block=(1,), args=(out,), after=gates)
    await f
    barriers = [r for r in timeline(rt) if r.kind == "barrier" and r.agent == d0.index]
    assert len(barriers) >= 3  # 12 signals over barrier-AND packets of 5
    last_gate_end = max(r.end_ns for r in timeline(rt) if r.name == "sleep_ms")
    inc = [r for r in timeline(rt) if r.name == "slow_increment"][-1]
    assert inc.start_ns >= last_gate_end


@pytest.mark.asyncio
async def test_const_arguments_are_read_only_and_readers_overlap(rt):
    d0 = rt.devices[0]
    src, dst1, dst2 = d0.alloc(8 * 4), d0.alloc(8 * 4), d0.alloc(8 * 4)
    await aiogpu.gather(aiogpu.copy(src, np.arange(4, dtype=np.int64)),
                        aiogpu.copy(dst1, np.zeros(4, np.int64)), aiogpu.copy(dst2, np.zeros(4, np.int64)))
    f1 = d0.launch(add_into, grid=(4,), block=(4,), args=(dst1, src, 4))
    f2 = d0.launch(add_into, grid=(4,), block=(4,), args=(dst2, src, 4))
    assert f1.queue != f2.queue, "two readers of one buffer were serialised onto one queue"
    await aiogpu.gather(f1, f2)
    assert list(await dst2.to_numpy(np.int64)) == [0, 1, 2, 3]


@pytest.mark.asyncio
async def test_a_to_numpy_result_is_ordered_until_its_download_lands(rt):
    """The array ``to_numpy`` returns is recorded, by its address, as written by the download:
    a copy that reads it before the download has landed waits for it on the device."""
    d0 = rt.devices[0]
    src, dst = d0.alloc(8), d0.alloc(8)
    await aiogpu.copy(src, np.zeros(1, np.int64))
    d0.launch(slow_increment, grid=(1,), block=(1,), args=(src,))   # the download waits for it
    pending = src.to_numpy(np.int64)
    assert not pending.done()
    await aiogpu.copy(dst, pending.value)        # reads the array before the download landed
    assert (await pending)[0] == 1
    assert (await dst.to_numpy(np.int64))[0] == 1
