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
    assert not buf._finalizer.alive is False
    await f                         # a second awaiter still sees the completion
    assert f.done() and f.exception() is None
    assert buf._finalizer.alive is False


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
