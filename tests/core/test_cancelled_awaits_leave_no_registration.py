"""A task that stops awaiting a pending future (cancelled, or timed out) takes its registration
with it: the future holds no awaiter for it, and its completion hands nothing to that loop. A
task woken by the completion leaves none either (the settling took it; the port does not look
again)."""
from __future__ import annotations

import asyncio

from aiogpu import _loops
from fakes.fake_hub import ManualHub


def test_a_cancelled_await_is_unregistered(monkeypatch):
    hub = ManualHub()
    fut = hub.new(1)
    posted: list = []
    # (Where the loop bridge is compiled the port is an extension type whose methods cannot be
    # wrapped: there the registrations are checked, here also what the completion posts.)
    try:
        original = _loops.AsyncioPort.post

        def post(self, awaiters):
            posted.extend(awaiters)
            return original(self, awaiters)

        monkeypatch.setattr(_loops.AsyncioPort, "post", post)
    except TypeError:
        pass

    async def main() -> None:
        task = asyncio.create_task(_await(fut))
        for _ in range(5):
            await asyncio.sleep(0)
        assert sum(map(len, (fut._ports or {}).values())) == 1     # parked on it
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        assert sum(map(len, (fut._ports or {}).values())) == 0
        hub.complete(fut)
        await asyncio.sleep(0)

    asyncio.run(main())
    assert posted == []


def test_a_woken_await_leaves_no_registration():
    hub = ManualHub()
    first, second = hub.new(1), hub.new(2)

    async def main() -> None:
        tasks = [asyncio.create_task(_await(f)) for f in (first, second, first)]
        for _ in range(5):
            await asyncio.sleep(0)
        assert sum(map(len, (first._ports or {}).values())) == 2     # two tasks parked on it
        hub.complete(first)
        await asyncio.wait_for(asyncio.gather(tasks[0], tasks[2]), 5)
        assert not first._ports
        assert sum(map(len, (second._ports or {}).values())) == 1    # the other one still waits
        hub.complete(second)
        await asyncio.wait_for(tasks[1], 5)
        assert not second._ports

    asyncio.run(main())


async def _await(fut) -> None:
    await fut
