"""A KeyboardInterrupt raised by a GPUFuture done-callback in a trio run reaches the run as a
Ctrl-C does: delivered to the main task (at its checkpoint), so ``trio.run`` raises
KeyboardInterrupt itself (not trio's TrioInternalError) and the main task may catch it; the
callbacks completed with it still run."""
from __future__ import annotations

import pytest
import trio

from aiogpu.futures import GPUFuture
from fakes.fake_hub import ManualHub


def _interrupt(_fut: GPUFuture) -> None:
    raise KeyboardInterrupt


def test_trio_run_raises_the_keyboard_interrupt_of_a_done_callback():
    hub = ManualHub()
    futs = [hub.new(k) for k in range(1, 12)]
    ran: list = []

    async def main() -> None:
        futs[0].add_done_callback(_interrupt)
        for f in futs[1:]:
            f.add_done_callback(ran.append)
        hub.complete(*futs)
        await trio.sleep(30)

    with pytest.raises(KeyboardInterrupt) as info:
        trio.run(main)
    assert type(info.value) is KeyboardInterrupt
    assert ran == futs[1:]


def test_the_main_task_may_catch_it_at_its_checkpoint():
    hub = ManualHub()
    fut = hub.new(1)
    after = hub.new(2)
    ran: list = []

    async def main() -> str:
        fut.add_done_callback(_interrupt)
        after.add_done_callback(ran.append)
        hub.complete(fut, after)
        try:
            await trio.sleep(30)
        except KeyboardInterrupt:
            await trio.sleep(0)       # the run goes on
            return "caught"
        return "not interrupted"

    assert trio.run(main) == "caught"
    assert ran == [after]
