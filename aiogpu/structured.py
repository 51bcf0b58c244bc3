"""Structured concurrency over GPU work: a task group that outlives the work it submitted.

``async with aiogpu.TaskGroup() as tg: tg.start_soon(...)`` is anyio's task group (asyncio or
trio) in which the GPU operations submitted inside it (by its body or any of its tasks) count as
members, like tasks:

- a failed operation fails the group as a failed task does: the siblings (and the body) are
  cancelled and the group raises an ``ExceptionGroup`` holding the ``GPUError``, also when no one
  awaits that operation's future;
- a failure the program has *retrieved* (awaited, or read through ``result()``/``exception()``,
  directly or through a future that depends on it) belongs to whoever retrieved it: that task
  handles or raises it, the group adds nothing; likewise a failure that only follows from another
  failure of the group (a dependent, a queue-mate) is not raised a second time;
- the group exits only after every submitted operation has completed or failed. GPU work cannot
  be cancelled, so after a failure or a cancellation the group still waits for it (shielded)
  before it raises. No buffer the group used is in use by the device once it has exited.
"""
from __future__ import annotations

from types import TracebackType
from typing import Any, Awaitable, Callable

import anyio

from . import _loops, futures


class TaskGroup:
    """An anyio task group whose members include the GPU work submitted within it."""

    def __init__(self) -> None:
        self._tg = anyio.create_task_group()
        self._submitted: list[futures.GPUFuture] = []
        self._failures: list[BaseException] = []   # failed submissions, in the order seen
        self._unhandled: list[BaseException] = []  # ... not yet looked at by the monitor
        self._heard = 0                 # submitted futures whose settling reached ``_done``
        self._token: Any = None
        self._port: Any = None
        self._tasks = 0                 # tasks started with start_soon that are still running
        self._body_done = False
        self._changed: Any = None     # an anyio.Event while the group is entered

    async def __aenter__(self) -> "TaskGroup":
        await self._tg.__aenter__()
        self._port = _loops.current_port()
        self._changed = anyio.Event()
        # A member task that raises the failures of submitted work and keeps the group open
        # until that work has settled (a loop callback cannot start tasks under anyio).
        self._tg.start_soon(self._monitor, name="aiogpu.TaskGroup: submitted GPU work")
        self._token = futures.submission_scope.set(_Scope(self))
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> bool | None:
        futures.submission_scope.reset(self._token)
        self._body_done = True
        self._changed.set()
        try:
            return await self._tg.__aexit__(exc_type, exc, tb)
        finally:
            with anyio.CancelScope(shield=True):
                for fut in self._submitted:
                    await _settled(fut)

    def start_soon(self, fn: Callable[..., Awaitable[Any]], *args: Any, name: Any = None) -> None:
        """Start ``fn(*args)`` as a task of the group (anyio semantics)."""
        self._tasks += 1
        try:
            self._tg.start_soon(self._child, fn, args, name=name if name is not None else _name(fn))
        except BaseException:
            self._tasks -= 1
            raise

    @property
    def cancel_scope(self) -> anyio.CancelScope:
        return self._tg.cancel_scope

    @property
    def submitted(self) -> list[futures.GPUFuture]:
        """The GPU futures submitted inside this group so far."""
        return list(self._submitted)

    # -- internals -----------------------------------------------------------------------------
    def _submitted_one(self, fut: futures.GPUFuture) -> None:
        # Called by the runtime under its lock, on the submitting thread.
        self._submitted.append(fut)
        fut._notify(self._port, self._done)

    def _done(self, fut: futures.GPUFuture) -> None:
        # On the group's loop, once ``fut`` has settled.
        self._heard += 1
        if fut._exc is not None:
            self._failures.append(fut._exc)
            self._unhandled.append(fut._exc)
        self._changed.set()

    async def _monitor(self) -> None:
        while True:
            while self._unhandled:
                exc = self._unhandled.pop(0)
                # One checkpoint first: a task woken by the same failure retrieves it now.
                await anyio.lowlevel.checkpoint()
                if not futures.was_retrieved(exc) and not self._follows_another(exc):
                    raise exc
            if self._body_done and self._tasks == 0:
                # Finished once every submission's settling has reached ``_done`` on this loop:
                # ``done()`` turns True on the waiter thread before that, and a failure not
                # heard of yet would be lost.
                if self._heard == len(self._submitted):
                    return
                left = [f for f in self._submitted if not f.done()]
                for f in left:   # the group now waits for this work: wake for it (FutureHub.arm)
                    f._hub.arm(f)
            self._changed = anyio.Event()
            await self._changed.wait()

    def _follows_another(self, exc: BaseException) -> bool:
        """True if ``exc`` was caused by another failure of the group (a dependent's error)."""
        return any(e is f for e in futures.cause_chain(exc)[1:] for f in self._failures)

    async def _child(self, fn: Callable[..., Awaitable[Any]], args: tuple) -> Any:
        try:
            return await fn(*args)
        finally:
            self._tasks -= 1
            self._changed.set()


class _Scope:
    """What the runtime appends submitted futures to while a TaskGroup is active."""

    __slots__ = ("group",)

    def __init__(self, group: TaskGroup):
        self.group = group

    def append(self, fut: futures.GPUFuture) -> None:
        self.group._submitted_one(fut)


async def _settled(fut: futures.GPUFuture) -> None:
    """Wait until ``fut`` is done without retrieving its failure (a done-callback, not await)."""
    if fut.done():
        return
    event = anyio.Event()
    # (the library's own registration: no GPUFuture.cancel() of a task being cancelled detaches it)
    fut._when_done(_loops.current_port(), lambda _f: event.set())
    await event.wait()


def _name(fn: Any) -> str:
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None) or repr(fn)
    return f"{module}.{qualname}" if module else qualname
