"""The only event-loop-specific code: how a GPU completion reaches an asyncio loop or a trio run.

A *port* is one event loop. The waiter thread hands each port a batch of completions with one
thread-safe call per wake-up (``post``), never one call per future. A batch holds awaiters
(parked tasks) and ``Callback`` items (done-callbacks); the loop runs through all of it, and a
callback that raises stops nothing else: on asyncio its exception goes to the loop's exception
handler, as for any asyncio callback; on trio, which has no such handler, it is logged on the
``aiogpu`` logger. KeyboardInterrupt and SystemExit from a callback propagate (asyncio: out of the
loop, as asyncio does), after the rest of the batch has been handed to the loop again.
Posting to a loop that has closed, or a trio run that has finished, is dropped silently: the
waiter thread never raises.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import sys
import threading
import weakref
from typing import Any, Callable, Generator

Batch = list[Any]
log = logging.getLogger("aiogpu")


class Callback:
    """A done-callback in a batch: ``fn(arg)`` on the loop that registered it."""

    __slots__ = ("fn", "arg")

    def __init__(self, fn: Callable[[Any], Any], arg: Any):
        self.fn, self.arg = fn, arg

    def run(self) -> None:
        self.fn(self.arg)

    def set_result(self, _value: Any) -> None:  # callbacks with no loop run on the waiter thread
        self.run()


class AsyncioPort:
    """An asyncio (or uvloop) event loop. Awaiters are asyncio futures of that loop.

    Posts from any thread go into one queue per loop; the loop drains it ``WAKE_SLICE`` items
    per iteration (one ``call_soon_threadsafe`` while a drain is scheduled, however many posts
    arrive), so the number of tasks woken in one iteration is bounded whether their
    completions came in one batch or in a hundred."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = weakref.ref(loop)
        self._queue: collections.deque = collections.deque()
        self._lock = threading.Lock()     # guards the queue's hand-over with ``_scheduled``
        self._scheduled = False           # a drain is queued on the loop
        self._admitted = 0                # ready results taken without waiting, this iteration
        self._counting = False            # ``_new_iteration`` is queued on the loop

    def post(self, awaiters: Batch) -> None:
        loop = self._loop()
        if loop is None or loop.is_closed():
            return
        with self._lock:
            self._queue.extend(awaiters)
            if self._scheduled:
                return
            self._scheduled = True
        try:
            loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # closed between the check and the call: nothing will run
            with self._lock:
                self._queue.clear()
                self._scheduled = False

    def _drain(self) -> None:
        """On the loop: wake the next slice; the rest waits for the next iteration."""
        queue = self._queue
        with self._lock:
            batch = [queue.popleft() for _ in range(min(WAKE_SLICE, len(queue)))]
            more = self._scheduled = bool(queue)
        if more:
            asyncio.get_running_loop().call_soon(self._drain)
        for i, item in enumerate(batch):
            if type(item) is Callback:
                try:
                    item.run()
                except (SystemExit, KeyboardInterrupt):
                    self._requeue(batch[i + 1:])
                    raise
                except BaseException as exc:
                    asyncio.get_running_loop().call_exception_handler(
                        {"message": f"Exception in GPUFuture done-callback {item.fn!r}",
                         "exception": exc, "future": item.arg})
            elif not item.done():
                item.set_result(None)

    def admit(self) -> bool:
        """On the loop, for an await whose result is ready: True to go on now, False to wait
        for a slot (``take_turn``). At most ``WAKE_SLICE`` such awaits go on per iteration,
        and none overtakes the tasks already queued to be woken: a burst of requests whose GPU
        work finished before they awaited it spreads over iterations, as woken ones do."""
        if self._queue or self._admitted >= WAKE_SLICE:
            return False
        if not self._counting:            # the count is per iteration: reset at the next one
            self._counting = True
            asyncio.get_running_loop().call_soon(self._new_iteration)
        self._admitted += 1
        return True

    def _new_iteration(self) -> None:
        self._admitted, self._counting = 0, False

    def take_turn(self) -> Generator:
        """Wait, in line with the queued wake-ups, until a later iteration has a slot."""
        loop: Any = self._loop()
        fut = loop.create_future()
        self.post([fut])
        try:
            yield from fut.__await__()
        finally:
            if not fut.done():
                fut.cancel()

    def _requeue(self, rest: Batch) -> None:
        """The items after a callback that raised KeyboardInterrupt: first in line again."""
        with self._lock:
            self._queue.extendleft(reversed(rest))
            if self._scheduled or not self._queue:
                return
            self._scheduled = True
        asyncio.get_running_loop().call_soon(self._drain)

    def wait(self, register: Callable[[Any], None], unregister: Callable[[Any], None]) -> Generator:
        loop: Any = self._loop()
        fut = loop.create_future()
        register(fut)
        try:
            yield from fut.__await__()
        finally:
            # Cancelled: detach this awaiter only. A task destroyed after its loop was closed
            # also gets here; cancelling would schedule on the closed loop, so it is left be.
            if not fut.done() and not loop.is_closed():
                fut.cancel()
            unregister(fut)


# Tasks (and done-callbacks) woken per loop iteration, over all completions. A woken task runs
# in the next iteration and may do a request's whole host-side work there: waking hundreds at
# once would make one long iteration in which no timer fires and no socket is read (the loop's
# lag is the iteration's length). The rest is woken in the following iterations, in order.
WAKE_SLICE = 8


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


def _wake_trio(batch: Batch) -> None:
    import trio

    for i, item in enumerate(batch):
        if type(item) is Callback:
            try:
                item.run()
            except (SystemExit, KeyboardInterrupt):
                trio.lowlevel.current_trio_token().run_sync_soon(_wake_trio, batch[i + 1:])
                raise
            except BaseException:
                log.exception("exception in GPUFuture done-callback %r", item.fn)
        elif not item[1]:
            item[1] = True
            trio.lowlevel.reschedule(item[0])


def checkpoint() -> Generator:
    """The schedule point of an await whose result is ready. On trio a checkpoint (a
    cancellation point and a schedule point: trio's rule for library calls). On asyncio
    nothing (asyncio has no such rule), unless this loop iteration has already let
    ``WAKE_SLICE`` aiogpu awaits go on: then a wait for a slot in a later one."""
    if _in_trio() is not None:
        import trio

        yield from trio.lowlevel.checkpoint().__await__()
        return
    loop = asyncio._get_running_loop()
    if loop is not None:
        port = _asyncio_port(loop)
        if not port.admit():
            yield from port.take_turn()


_asyncio_ports: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncioPort]" = weakref.WeakKeyDictionary()
_trio_ports: dict[Any, TrioPort] = {}


def _in_trio() -> Any:
    """The current trio run's token, or None. Reads ``trio.lowlevel`` only once trio is fully
    imported: while another thread imports it, ``sys.modules["trio"]`` is half-built (and no
    trio run can exist yet). ``in_trio_run`` (trio >= 0.23) answers "no" without raising."""
    lowlevel = getattr(sys.modules.get("trio"), "lowlevel", None)
    if lowlevel is None:
        return None
    in_run = getattr(lowlevel, "in_trio_run", None)
    if in_run is not None and not in_run():
        return None
    current = getattr(lowlevel, "current_trio_token", None)
    if current is None:
        return None
    try:
        return current()
    except RuntimeError:
        return None


# The port of the loop asked about last: a service asks for the same loop again and again.
_last_port: AsyncioPort | None = None


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
    return _asyncio_port(loop)


def _asyncio_port(loop: asyncio.AbstractEventLoop) -> AsyncioPort:
    global _last_port
    last = _last_port
    if last is not None and last._loop() is loop:     # (a weak reference: no loop kept alive)
        return last
    asyncio_port = _asyncio_ports.get(loop)
    if asyncio_port is None:
        asyncio_port = _asyncio_ports[loop] = AsyncioPort(loop)
    _last_port = asyncio_port
    return asyncio_port
