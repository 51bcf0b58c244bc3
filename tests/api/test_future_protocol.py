"""GPUFuture in asyncio's future protocol (asyncio and uvloop), and wait() refusing to block a
running event loop (asyncio, uvloop, trio)."""
from __future__ import annotations

import asyncio
import contextvars
import threading

import numpy as np
import pytest

import aiogpu
from gpu_kernels import fail_if

GATES: dict[int, threading.Event] = {}


@aiogpu.kernel("i32*, u32")
def gated_write(launch, out, key):
    GATES[int(key)].wait(30)
    out[0] = key


def gate(key: int) -> threading.Event:
    GATES[key] = threading.Event()
    return GATES[key]


def held_and_quick(rt, key):
    """A launch held by gate ``key`` and an independent one, and the gate."""
    d = rt.devices[0]
    g = gate(key)
    held = d.launch(gated_write, grid=(1,), block=(1,), args=(d.alloc(4), key))
    quick = d.launch(fail_if, grid=(1,), block=(1,), args=(d.alloc(4), 0))
    return g, held, quick


def test_isfuture_and_the_protocols_answers(rt, run):
    async def main():
        fut = rt.devices[0].launch(fail_if, grid=(1,), block=(1,), args=(rt.devices[0].alloc(4), 0))
        assert asyncio.isfuture(fut)
        assert fut.get_loop() is asyncio.get_running_loop()
        await fut
        assert fut.cancel() is False and not fut.cancelled() and fut.result() is None
    run(main())
    outside = rt.devices[0].launch(fail_if, grid=(1,), block=(1,), args=(rt.devices[0].alloc(4), 0))
    assert outside.cancel() is False and outside.cancel(msg="x") is False and not outside.cancelled()
    with pytest.raises(RuntimeError):
        outside.get_loop()
    outside.wait(10)


def test_asyncio_wait_first_completed(rt, run):
    async def main():
        g, held, quick = held_and_quick(rt, 201)
        done, pending = await asyncio.wait([held, quick], return_when=asyncio.FIRST_COMPLETED)
        assert done == {quick} and pending == {held}
        done, pending = await asyncio.wait([held], timeout=0.01)
        assert not done and pending == {held}
        g.set()
        done, pending = await asyncio.wait([held, quick])
        assert done == {held, quick} and not pending
    run(main())


def test_asyncio_wait_first_exception(rt, run):
    async def main():
        d = rt.devices[0]
        g = gate(202)
        held = d.launch(gated_write, grid=(1,), block=(1,), args=(d.alloc(4), 202))
        bad = d.launch(fail_if, grid=(1,), block=(1,), args=(d.alloc(4), 1))
        done, pending = await asyncio.wait([held, bad], return_when=asyncio.FIRST_EXCEPTION)
        assert done == {bad} and isinstance(bad.exception(), aiogpu.GPUError)
        g.set()
        await held
    run(main())


def test_as_completed_yields_in_completion_order(rt, run):
    async def main():
        d = rt.devices[0]
        g = gate(203)
        a, b = d.alloc(4), d.alloc(4)
        d.launch(gated_write, grid=(1,), block=(1,), args=(a, 203))
        slow = a.view(np.int32).to_numpy()        # waits for the gated write
        fast = aiogpu.copy(b, np.full(1, 7, np.int32))
        order = []
        for i, next_done in enumerate(asyncio.as_completed([slow, fast])):
            if i == 1:
                g.set()
            order.append(await next_done)
        assert order[0] is None and order[1].tolist() == [203]
    run(main())


def test_gather_shield_and_wait_for(rt, run):
    async def main():
        d = rt.devices[0]
        buf = d.alloc(8)
        up = aiogpu.copy(buf.view(np.int32), np.array([1, 2], np.int32))
        down = buf.view(np.int32).to_numpy()
        res = await asyncio.gather(up, down)
        assert res[0] is None and res[1].tolist() == [1, 2]
        assert (await asyncio.shield(buf.view(np.int32)[1:2].to_numpy())).tolist() == [2]
        assert (await asyncio.wait_for(buf.view(np.int32).to_numpy(), 20)).tolist() == [1, 2]
        bad = d.launch(fail_if, grid=(1,), block=(1,), args=(d.alloc(4), 1))
        with pytest.raises(aiogpu.GPUError):
            await asyncio.gather(up, bad)
        got = await asyncio.gather(up, bad, return_exceptions=True)
        assert got[0] is None and isinstance(got[1], aiogpu.GPUError)
    run(main())


def test_shield_protects_against_cancelling_the_outer_task(rt, run):
    async def main():
        d = rt.devices[0]
        g = gate(204)
        out = d.alloc(4)
        held = d.launch(gated_write, grid=(1,), block=(1,), args=(out, 204))
        task = asyncio.ensure_future(asyncio.shield(held))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not held.done() and not held.cancelled()
        g.set()
        await held
        assert (await out.view(np.int32).to_numpy()).tolist() == [204]
    run(main())


def test_wait_for_times_out_through_the_adapter_and_the_work_runs_on(rt, run):
    async def main():
        d = rt.devices[0]
        g = gate(205)
        out = d.alloc(4)
        held = d.launch(gated_write, grid=(1,), block=(1,), args=(out, 205))
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(held.asyncio(), 0.05)
        assert not held.done()
        g.set()
        assert await held.asyncio() is None
        assert (await out.view(np.int32).to_numpy()).tolist() == [205]
        bad = d.launch(fail_if, grid=(1,), block=(1,), args=(d.alloc(4), 1))
        with pytest.raises(aiogpu.GPUError):
            await bad.asyncio()
    run(main())


def test_callbacks_are_scheduled_removable_and_run_in_their_context(rt, run):
    var = contextvars.ContextVar("var", default="unset")

    async def main():
        d = rt.devices[0]
        fut = d.launch(fail_if, grid=(1,), block=(1,), args=(d.alloc(4), 0))
        await fut
        seen = []
        fut.add_done_callback(lambda f: seen.append("done"))
        assert seen == []                      # a done future's callback is scheduled, not run
        await asyncio.sleep(0)
        assert seen == ["done"]
        g = gate(206)
        held = d.launch(gated_write, grid=(1,), block=(1,), args=(d.alloc(4), 206))
        removed = []

        def gone(f):
            removed.append(f)
        held.add_done_callback(gone)
        held.add_done_callback(gone)
        ctx = contextvars.copy_context()
        ctx.run(var.set, "theirs")
        held.add_done_callback(lambda f: seen.append(var.get()), context=ctx)
        assert held.remove_done_callback(gone) == 2
        assert held.remove_done_callback(gone) == 0
        g.set()
        await held
        await asyncio.sleep(0)
        assert removed == [] and seen == ["done", "theirs"]
    run(main())


# -- wait() on an event loop's thread --------------------------------------------------------------
def test_wait_on_a_running_loop_raises_and_works_from_a_thread(rt, run):
    async def main():
        d = rt.devices[0]
        g = gate(207)
        held = d.launch(gated_write, grid=(1,), block=(1,), args=(d.alloc(4), 207))
        with pytest.raises(aiogpu.BlockingCallError, match="await"):
            held.wait(5)
        assert isinstance(aiogpu.BlockingCallError("x"), RuntimeError)
        g.set()
        assert await asyncio.to_thread(held.wait, 20)         # another thread may block
        with pytest.raises(aiogpu.BlockingCallError):
            held.wait()                                       # done or not: the rule is the thread
    run(main())
    fut = rt.devices[0].launch(fail_if, grid=(1,), block=(1,), args=(rt.devices[0].alloc(4), 0))
    assert fut.wait(20)                                       # plain synchronous code


def test_wait_under_trio_raises(rt):
    trio = pytest.importorskip("trio")

    async def main():
        d = rt.devices[0]
        fut = d.launch(fail_if, grid=(1,), block=(1,), args=(d.alloc(4), 0))
        with pytest.raises(aiogpu.BlockingCallError):
            fut.wait(5)
        await fut                                             # awaiting under trio still works
        assert fut.done() and not fut.cancelled()
    trio.run(main)
