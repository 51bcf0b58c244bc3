"""Timeouts and cancellation around GPUFutures on asyncio and uvloop: every idiomatic form times
out while the work is still pending, the work runs on and completes with its buffers, and only
the task that stopped waiting is affected (GPUFuture.cancel is per task).

Each test holds the work pending behind a gate that only the test opens, after the timeout has
been seen (a fallback timer opens it much later, so a form that does not time out fails on the
state it returns with, instead of hanging)."""
from __future__ import annotations

import asyncio
import threading

import anyio
import numpy as np
import pytest

import aiogpu

GATES: dict[int, threading.Event] = {}
FALLBACK_S = 20.0


@aiogpu.kernel("i32*, u32")
def gated_write(launch, out, key):
    GATES[int(key)].wait(60)
    out[0] = key


class Held:
    """A launch that writes ``key`` into its own buffer once its gate opens."""

    def __init__(self, rt, key: int):
        self.key = key
        self.gate = GATES[key] = threading.Event()
        self.timer = threading.Timer(FALLBACK_S, self.gate.set)
        self.timer.start()
        d = rt.devices[0]
        self.out = d.alloc(4)
        self.fut = d.launch(gated_write, grid=(1,), block=(1,), args=(self.out, key))

    async def release_and_check(self) -> None:
        """Open the gate: the work completes, and wrote its buffer."""
        self.gate.set()
        self.timer.cancel()
        assert await self.fut is None
        assert (await self.out.view(np.int32).to_numpy()).tolist() == [self.key]


async def _wait_for(fut):
    return await asyncio.wait_for(fut, 0.05)


async def _wait_for_zero(fut):
    return await asyncio.wait_for(fut, 0)


async def _timeout(fut):
    async with asyncio.timeout(0.05):
        return await fut


async def _fail_after(fut):
    with anyio.fail_after(0.05):
        return await fut


async def _gather_in_wait_for(fut):
    return await asyncio.wait_for(asyncio.gather(fut), 0.05)


async def _gather_in_timeout(fut):
    async with asyncio.timeout(0.05):
        return await asyncio.gather(fut)


async def _gather_returning_exceptions(fut):
    return await asyncio.wait_for(asyncio.gather(fut, return_exceptions=True), 0.05)


async def _aiogpu_gather_in_wait_for(fut):
    return await asyncio.wait_for(aiogpu.gather(fut), 0.05)


FORMS = [_wait_for, _wait_for_zero, _timeout, _fail_after, _gather_in_wait_for, _gather_in_timeout,
         _gather_returning_exceptions, _aiogpu_gather_in_wait_for]


@pytest.mark.parametrize("form", FORMS, ids=[f.__name__.strip("_") for f in FORMS])
def test_each_idiomatic_timeout_raises_while_the_work_is_pending(rt, run, form):
    async def main():
        held = Held(rt, 400 + FORMS.index(form))
        with pytest.raises(TimeoutError):
            await form(held.fut)
        assert not held.fut.done() and not held.gate.is_set()
        await held.release_and_check()
    run(main())


def test_asyncio_wait_with_a_timeout_returns_the_pending_future(rt, run):
    async def main():
        held = Held(rt, 420)
        done, pending = await asyncio.wait([held.fut], timeout=0.05)
        assert not done and pending == {held.fut}
        assert not held.fut.done()
        await held.release_and_check()
    run(main())


def test_a_timed_out_task_alone_sees_the_future_cancelled(rt, run):
    async def main():
        held = Held(rt, 421)
        other_started = asyncio.Event()

        async def other():
            other_started.set()
            return await held.fut

        async def with_callback():
            seen = asyncio.get_running_loop().create_future()
            held.fut.add_done_callback(lambda f: seen.set_result(f.cancelled()))
            return await seen

        others = [asyncio.create_task(other()), asyncio.create_task(with_callback())]
        await other_started.wait()
        with pytest.raises(TimeoutError):
            # (a timeout of 0 cancels what it waits for on every Python version; 3.11 does so
            # for any timeout, 3.12 and later cancel the waiting task instead)
            await asyncio.wait_for(held.fut, 0)
        # To this task the future looks cancelled; to the work and the other waiters it does not
        assert held.fut.cancelled() and not held.fut.done()
        with pytest.raises(asyncio.CancelledError):
            held.fut.result()
        with pytest.raises(asyncio.CancelledError):
            held.fut.exception()

        async def look():
            return held.fut.cancelled()
        assert await asyncio.create_task(look()) is False
        assert not any(t.done() for t in others)
        held.gate.set()
        held.timer.cancel()
        assert await held.fut is None        # awaiting again waits for the work
        assert not held.fut.cancelled() and held.fut.result() is None
        assert await asyncio.gather(*others) == [None, False]
    run(main())


def test_awaiting_again_after_a_timeout_waits_for_the_work(rt, run):
    async def main():
        held = Held(rt, 422)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(held.fut, 0)
        assert held.fut.cancelled()
        asyncio.get_running_loop().call_soon(held.gate.set)   # (opens once this task parks)
        assert await held.fut is None
        assert not held.fut.cancelled()
        await held.release_and_check()
    run(main())


def test_cancelling_the_task_in_wait_for_detaches_it_while_the_work_runs_on(rt, run):
    async def main():
        held = Held(rt, 423)
        entered = asyncio.Event()

        async def waiter():
            entered.set()
            return await asyncio.wait_for(held.fut, 30)

        task = asyncio.create_task(waiter())
        await entered.wait()
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not held.fut.done()
        await held.release_and_check()
    run(main())


def test_cancel_outside_a_task_or_of_a_done_future_changes_nothing(rt, run):
    held = Held(rt, 424)
    assert held.fut.cancel() is False and not held.fut.cancelled()

    async def main():
        seen = []
        held.fut.add_done_callback(lambda f: seen.append(f.result()))
        # a loop callback (no task) cancelling it: no task of it is being cancelled
        asyncio.get_running_loop().call_soon(lambda: seen.append(held.fut.cancel()))
        await asyncio.sleep(0.01)
        assert seen == [False] and not held.fut.cancelled()
        await held.release_and_check()
        assert held.fut.cancel() is False and not held.fut.cancelled()
        await asyncio.sleep(0)
        assert seen == [False, None]
    run(main())


def test_a_failure_after_a_timeout_reaches_the_task_that_awaits_again(rt, run):
    from gpu_kernels import fail_if

    async def main():
        held = Held(rt, 425)
        d = rt.devices[0]
        bad = d.launch(fail_if, grid=(1,), block=(1,), args=(d.alloc(4), 1), after=[held.fut])
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(bad, 0.05)
        assert not bad.done()
        held.gate.set()
        held.timer.cancel()
        with pytest.raises(aiogpu.GPUError):
            await bad
        assert isinstance(bad.exception(), aiogpu.GPUError)
        await held.release_and_check()
    run(main())


def test_a_cancelled_task_group_still_waits_for_its_work_when_the_future_is_cancelled(rt, run):
    """aiogpu.TaskGroup's exit waits for its GPU work through the library's own registration:
    GPUFuture.cancel(), which detaches the waits of tasks being cancelled, leaves it alone."""
    async def main():
        held = None
        inside = asyncio.Event()

        async def host():
            nonlocal held
            async with aiogpu.TaskGroup():
                held = Held(rt, 430)
                inside.set()
                await asyncio.sleep(60)

        task = asyncio.create_task(host())
        await inside.wait()
        task.cancel()
        for _ in range(50):                  # the group reaches its exit and waits there
            await asyncio.sleep(0)
        assert not task.done()
        held.fut.cancel()                    # (the waiting task is being cancelled)
        for _ in range(50):
            await asyncio.sleep(0)
        assert not task.done() and not held.fut.done()
        held.gate.set()
        held.timer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert held.fut.done() and held.fut.result() is None
    run(main())
