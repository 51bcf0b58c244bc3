"""The only event-loop-specific code: how a GPU completion reaches an asyncio loop or a trio run.

A *port* is one event loop. The waiter thread hands each port a batch of completions with one
thread-safe call per wake-up (``post``), never one call per future. Posting to a loop that has
closed, or a trio run that has finished, is dropped silently: the waiter thread never raises.
"""
from __future__ import annotations

import asyncio
import sys
import weakref
from typing import Any, Callable, Generator

Batch = list[Any]


class AsyncioPort:
    """An asyncio (or uvloop) event loop. Awaiters are asyncio futures of that loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = weakref.ref(loop)

    def post(self, awaiters: Batch) -> None:
        loop = self._loop()
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(_wake_asyncio, awaiters)
        except RuntimeError:  # closed between the check and the call
            pass

    def wait(self, register: Callable[[Any], None], unregister: Callable[[Any], None]) -> Generator:
        loop = self._loop()
        fut = loop.create_future()
        register(fut)
        try:
            yield from fut.__await__()
        finally:
            if not fut.done():  # cancelled: detach this awaiter only
                fut.cancel()
            unregister(fut)


def _wake_asyncio(awaiters: Batch) -> None:
    for fut in awaiters:
        if not fut.done():
            fut.set_result(None)


class TrioPort:
    """A trio run. Awaiters are trio tasks parked with ``wait_task_rescheduled``."""

    def __init__(self, token: Any):
        self._token = token

    def post(self, awaiters: Batch) -> None:
        import trio

        try:
            self._token.run_sync_soon(_wake_trio, awaiters)
        except trio.RunFinishedError:
            pass

    def wait(self, register: Callable[[Any], None], unregister: Callable[[Any], None]) -> Generator:
        import trio

        task = trio.lowlevel.current_task()
        cell = [task, False]  # [task, woken]
        register(cell)

        def abort(_raise_cancel: Any) -> Any:
            unregister(cell)
            cell[1] = True
            return trio.lowlevel.Abort.SUCCEEDED

        try:
            yield from trio.lowlevel.wait_task_rescheduled(abort).__await__()
        finally:
            unregister(cell)


def _wake_trio(awaiters: Batch) -> None:
    import trio

    for cell in awaiters:
        if not cell[1]:
            cell[1] = True
            trio.lowlevel.reschedule(cell[0])


_asyncio_ports: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncioPort]" = weakref.WeakKeyDictionary()
_trio_ports: dict[Any, TrioPort] = {}


def _in_trio() -> Any:
    trio = sys.modules.get("trio")
    if trio is None:
        return None
    try:
        return trio.lowlevel.current_trio_token()
    except RuntimeError:
        return None


def current_port() -> AsyncioPort | TrioPort | None:
    """The port of the running event loop, or None in plain synchronous code."""
    token = _in_trio()
    if token is not None:
        port = _trio_ports.get(token)
        if port is None:
            if len(_trio_ports) > 64:  # finished runs: drop their ports
                _trio_ports.clear()
            port = _trio_ports[token] = TrioPort(token)
        return port
    loop = asyncio._get_running_loop()
    if loop is None:
        return None
    port = _asyncio_ports.get(loop)
    if port is None:
        port = _asyncio_ports[loop] = AsyncioPort(loop)
    return port
