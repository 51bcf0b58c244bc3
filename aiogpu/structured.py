"""Structured concurrency over GPU work: a task group that outlives the work it submitted.

``async with aiogpu.TaskGroup() as tg: tg.start_soon(...)`` is anyio's task group (asyncio or
trio) with one more guarantee: it exits only after every GPU operation submitted inside it (by
its own body or any of its tasks) has completed or failed. The first failure cancels the sibling
tasks as usual; their GPU work cannot be cancelled, so the group waits for it, shielded, before it
re-raises. No buffer the group used is in use by the device once it has exited.
"""
from __future__ import annotations

from types import TracebackType
from typing import Any, Awaitable, Callable

import anyio

from . import futures


class TaskGroup:
    """An anyio task group that also waits for the GPU work submitted within it."""

    def __init__(self) -> None:
        self._tg = anyio.create_task_group()
        self._submitted: list[futures.GPUFuture] = []
        self._token: Any = None

    async def __aenter__(self) -> "TaskGroup":
        await self._tg.__aenter__()
        self._token = futures.submission_scope.set(self._submitted)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> bool | None:
        futures.submission_scope.reset(self._token)
        try:
            return await self._tg.__aexit__(exc_type, exc, tb)
        finally:
            with anyio.CancelScope(shield=True):
                for fut in self._submitted:
                    if not fut.done():
                        await _settle(fut)

    def start_soon(self, fn: Callable[..., Awaitable[Any]], *args: Any, name: Any = None) -> None:
        """Start ``fn(*args)`` as a task of the group (anyio semantics)."""
        self._tg.start_soon(fn, *args, name=name)

    @property
    def cancel_scope(self) -> anyio.CancelScope:
        return self._tg.cancel_scope

    @property
    def submitted(self) -> list[futures.GPUFuture]:
        """The GPU futures submitted inside this group so far."""
        return list(self._submitted)


async def _settle(fut: futures.GPUFuture) -> None:
    try:
        await fut
    except Exception:  # its failure belongs to whoever awaited it; we only wait
        pass
