"""GPU errors, their propagation across queues and devices, cancellation, task groups."""
from __future__ import annotations

import asyncio
import time

import anyio
import numpy as np
import pytest

import aiogpu
from aiogpu.hsa_bindings import types as T
from gpu_kernels import fail_if, sleep_ms, slow_increment


@pytest.mark.asyncio
async def test_kernel_exception_fails_its_future_and_dependents_on_other_devices(rt):
    d0, d1 = rt.devices
    out0, out1 = d0.alloc(4), d1.alloc(4)
    bad = d0.launch(fail_if, grid=(1,), block=(1,), args=(out0, 1))
    peer = aiogpu.copy(out1, out0)                     # reads what the failed kernel wrote
    later = d1.launch(fail_if, grid=(1,), block=(1,), args=(out1, 0), after=[peer])
    t0 = time.monotonic()
    with pytest.raises(aiogpu.GPUError) as info:
        await bad
    assert info.value.status == T.HSA_STATUS_ERROR_EXCEPTION
    assert info.value.queue.startswith("gpu0.q")
    assert info.value.packet is not None
    for dep in (peer, later):
        with pytest.raises(aiogpu.GPUError):
            await dep
    assert time.monotonic() - t0 < 1.0
    # The device stays usable: the broken queue was replaced.
    ok = d0.alloc(4)
    await d0.launch(fail_if, grid=(1,), block=(1,), args=(ok, 0))
    assert (await ok.to_numpy(np.int32))[0] == 1


@pytest.mark.asyncio
async def test_injected_queue_error_names_queue_packet_and_status(rt):
    d0 = rt.devices[0]
    buf = d0.alloc(8)
    await aiogpu.copy(buf, np.zeros(1, np.int64))
    rt.api.emulator.faults.queue_error_at(1, status=T.HSA_STATUS_ERROR_INVALID_PACKET_FORMAT)
    f = d0.launch(slow_increment, grid=(1,), block=(1,), args=(buf,))
    with pytest.raises(aiogpu.GPUError) as info:
        await f
    err = info.value
    assert err.status == T.HSA_STATUS_ERROR_INVALID_PACKET_FORMAT
    assert err.queue == f.queue and err.packet == f.packet
    assert "INVALID_PACKET_FORMAT" in str(err) and f.queue in str(err)
    # What the failed kernel would have written is undefined: reading it fails...
    with pytest.raises(aiogpu.GPUError, match="dependency failed"):
        await buf.to_numpy(np.int64)
    # ...until it is overwritten. The replaced queue runs new work.
    await aiogpu.copy(buf, np.full(1, 41, np.int64))
    await d0.launch(slow_increment, grid=(1,), block=(1,), args=(buf,))
    assert (await buf.to_numpy(np.int64))[0] == 42


@pytest.mark.asyncio
async def test_cancelled_awaiter_detaches_but_work_runs_on(rt):
    d0 = rt.devices[0]
    buf = d0.alloc(8)
    await aiogpu.copy(buf, np.zeros(1, np.int64))
    f = d0.launch(slow_increment, grid=(1,), block=(1,), args=(buf,))
    task = asyncio.ensure_future(_await(f))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not f.done()
    buf.free()                      # deferred: the kernel still uses it
    assert not buf.released             # the kernel still uses it
    await f                         # a second awaiter still sees the completion
    assert f.done() and f.exception() is None
    assert buf.released


async def _await(f):
    await f


async def task_group_scenario(rt):
    """The first GPU error cancels the sibling; the group exits after the sibling's GPU work."""
    d0, d1 = rt.devices
    sibling_work = []

    async def failing():
        out = d0.alloc(4)
        await d0.launch(fail_if, grid=(1,), block=(1,), args=(out, 1))

    async def sibling():
        f = d1.launch(sleep_ms, grid=(1,), block=(1,), args=(300,))
        sibling_work.append(f)
        await f
        raise AssertionError("the sibling was not cancelled")

    with pytest.raises(BaseException) as info:
        async with aiogpu.TaskGroup() as tg:
            tg.start_soon(failing)
            tg.start_soon(sibling)
    assert "GPUError" in repr(info.value)
    assert sibling_work and sibling_work[0].done(), "the group exited while its GPU work was running"
    assert tg.submitted and all(f.done() for f in tg.submitted)


@pytest.mark.asyncio
async def test_task_group_on_asyncio(rt):
    await task_group_scenario(rt)


def test_task_group_on_trio(rt):
    anyio.run(task_group_scenario, rt, backend="trio")


@pytest.mark.asyncio
async def test_queue_error_fails_only_work_that_had_not_completed(make_runtime):
    """Issue 13.11: when a queue fails, work on it that already completed (its completion signal
    reads 0) completes; only the rest fails."""
    rt = make_runtime(gpus=1, queues_per_device=1)
    d0 = rt.devices[0]
    rt.api.emulator.faults.queue_error_at(201, agent=0)
    futs = [d0.launch(sleep_ms, grid=(1,), block=(1,), args=(0,)) for _ in range(201)]
    results = await asyncio.gather(*[_outcome(f) for f in futs])
    ran = {r.packet for r in rt.api.emulator.timeline.records(kind="dispatch")}
    wrongly_failed = [f for f, r in zip(futs, results) if r is not None and f.packet in ran]
    assert len(ran) == 200 and not wrongly_failed, f"{len(wrongly_failed)} completed kernels reported failed"
    assert isinstance(results[-1], aiogpu.GPUError) and results[-1].packet == futs[-1].packet


@pytest.mark.asyncio
async def test_blame_does_not_depend_on_the_read_index(make_runtime):
    """Issue 14.7: the read index advances as packets launch, so when a kernel fails later
    packets may already be past it; the failed kernel is blamed, not whatever the read index names."""
    rt = make_runtime(gpus=1, queues_per_device=1)
    d0 = rt.devices[0]
    out = d0.alloc(4)
    with rt.lock:   # all on the failing queue: the error is handled (queue replaced) only after
        bad = d0.launch(fail_if, grid=(1,), block=(1,), args=(out, 1))
        later = [d0.launch(sleep_ms, grid=(1,), block=(1,), args=(300,)) for _ in range(3)]
    with pytest.raises(aiogpu.GPUError) as info:
        await bad
    assert info.value.status == T.HSA_STATUS_ERROR_EXCEPTION
    assert info.value.packet == bad.packet and "before it" not in str(info.value)
    assert f"failed at packet {bad.packet}:" in str(info.value)
    for f in later:
        with pytest.raises(aiogpu.GPUError, match="queue gpu0.q0 failed"):
            await f


async def _outcome(fut):
    try:
        await fut
    except aiogpu.GPUError as exc:
        return exc
    return None


@pytest.mark.asyncio
async def test_memory_fault_fails_everything_pending_on_the_device(make_runtime):
    """Issue 14.3: ROCr reports a memory fault through the system event only, and KFD evicts every
    queue of the device (SDMA included): the runtime fails all pending work there from the event
    (and what depends on it elsewhere). KFD keeps the process evicted there (queues created later
    too) and ROCr never recreates its SDMA queues: the device is lost, and later work on it fails at
    once with DeviceLost; the other device goes on (tests/hsa/test_device_lost.py has the rest)."""
    rt = make_runtime(gpus=2)
    d0, d1 = rt.devices
    target, other = d0.alloc(4096), d1.alloc(4)
    rt.api.emulator.faults.memory_fault_at(3, agent=0)   # the last of the three: all are submitted by then
    slow = [d0.launch(sleep_ms, grid=(1,), block=(1,), args=(200,)) for _ in range(3)]
    up = aiogpu.copy(target, np.ones(4096, np.uint8), after=[slow[0]])
    across = d1.launch(fail_if, grid=(1,), block=(1,), args=(other, 0), after=[slow[1]])
    t0 = time.monotonic()
    outcomes = await asyncio.wait_for(asyncio.gather(*[_outcome(f) for f in slow + [up, across]]), 10)
    assert time.monotonic() - t0 < 5, "pending work waited for a watchdog"
    assert all(isinstance(o, aiogpu.GPUError) for o in outcomes), [str(o)[:90] for o in outcomes]
    assert all(o.status == T.HSA_STATUS_ERROR_MEMORY_FAULT for o in outcomes[:4])
    assert len(rt.memory_faults) == 1 and not rt.api.emulator.queue_errors
    assert all(isinstance(o, aiogpu.DeviceLost) for o in outcomes[:4])
    with pytest.raises(aiogpu.DeviceLost):                    # the device is lost
        await asyncio.wait_for(aiogpu.copy(d0.alloc(4096), np.full(4096, 7, np.uint8)), 10)
    await d1.launch(fail_if, grid=(1,), block=(1,), args=(d1.alloc(4), 0))   # the other goes on
    assert not any(r.kind == "copy" and r.agent == 0 and r.start_ns > t0 * 1e9 for r in rt.api.emulator.timeline)


@aiogpu.kernel("i64*, u32")
def hold_then_increment(launch, buf, ms):
    time.sleep(ms / 1000)
    buf[0] += 1


def test_watchdog_is_on_by_default(make_runtime):
    """Issue 14.3: without a watchdog a lost completion (or a fault ROCr does not report) hangs
    forever; the HSA runtime has one unless asked not to."""
    from aiogpu.hsa.runtime import DEFAULT_WATCHDOG_S
    assert make_runtime().hub.watchdog_s == DEFAULT_WATCHDOG_S > 0
    assert make_runtime(watchdog_s=None).hub.watchdog_s is None


@pytest.mark.asyncio
async def test_watchdog_fails_a_lost_completion_and_the_device_recovers(make_runtime):
    rt = make_runtime(gpus=1, watchdog_s=0.5)
    d0 = rt.devices[0]
    rt.api.emulator.faults.lose_completion_at(1, agent=0)
    lost = d0.launch(sleep_ms, grid=(1,), block=(1,), args=(0,))
    with pytest.raises(aiogpu.GPUError, match="no completion within"):
        await asyncio.wait_for(lost, 10)
    await d0.launch(sleep_ms, grid=(1,), block=(1,), args=(0,))


@pytest.mark.asyncio
async def test_watchdog_counts_from_the_lanes_last_progress_not_from_submission(make_runtime):
    """Work queued behind a busy queue is not "silent": the watchdog measures the time since its
    lane last completed something, so a long chain of short kernels never trips it."""
    rt = make_runtime(gpus=1, queues_per_device=1, watchdog_s=1.0)
    d0 = rt.devices[0]
    buf = d0.alloc(8)
    await aiogpu.copy(buf, np.zeros(1, np.int64))
    chain = [d0.launch(hold_then_increment, grid=(1,), block=(1,), args=(buf, 300)) for _ in range(6)]
    await aiogpu.gather(*chain)
    assert (await buf.to_numpy(np.int64))[0] == 6
