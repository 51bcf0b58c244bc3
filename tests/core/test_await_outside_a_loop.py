"""Awaiting a pending future outside asyncio, uvloop and trio (a coroutine driven by hand, or
by another framework) raises a RuntimeError that says where to await it and what to use
instead."""
from __future__ import annotations

import pytest

from fakes.fake_hub import ManualHub


def test_awaiting_outside_a_loop_raises_and_says_what_to_do():
    fut = ManualHub().new(1)

    async def main() -> None:
        await fut

    coro = main()
    with pytest.raises(RuntimeError, match=r"^await a GPUFuture inside asyncio, uvloop or trio; "
                                           r"use \.wait\(\) in synchronous code$"):
        coro.send(None)
    coro.close()
