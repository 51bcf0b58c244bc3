"""``remove_done_callback(fn)`` finds ``fn`` by identity, whatever ``fn``'s own ``==`` says,
also where the future wraps it (registered with ``context=``, or from an asyncio task)."""
from __future__ import annotations

import asyncio
import contextvars

from fakes.fake_hub import ManualHub


class EqualToNothing:
    """A callback whose ``==`` is False even for itself."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, fut) -> None:
        self.calls += 1

    def __eq__(self, other) -> bool:
        return False

    __hash__ = object.__hash__


def test_a_callback_registered_with_a_context_is_removed_by_identity():
    hub = ManualHub()
    fut = hub.new(1)
    cb = EqualToNothing()
    fut.add_done_callback(cb, context=contextvars.copy_context())
    assert fut.remove_done_callback(cb) == 1
    hub.complete(fut)
    assert cb.calls == 0


def test_a_callback_registered_from_a_task_is_removed_by_identity():
    hub = ManualHub()
    fut = hub.new(1)
    cb = EqualToNothing()

    async def main() -> int:
        fut.add_done_callback(cb)
        return fut.remove_done_callback(cb)

    assert asyncio.run(main()) == 1
    hub.complete(fut)
    assert cb.calls == 0
