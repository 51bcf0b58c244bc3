"""Which graph, if any, is capturing operations in this context (see graph.py).

Kept apart from graph.py so that devices can ask "am I being captured?" without importing the
graph layer above them.

A capture belongs to the block that opened it: to the task (asyncio or trio) or, outside any
task, the thread that entered ``with Graph()``. Tasks and threads started inside the block
inherit its context variables, but their operations run rather than being recorded into a
graph that may be finished before they submit (as trio's cancel scopes belong to the task
that entered them).
"""
from __future__ import annotations

import asyncio
import contextvars
import sys
import threading
from typing import Any

_active: contextvars.ContextVar[Any] = contextvars.ContextVar("aiogpu_capture", default=None)


def current(runtime: Any) -> Any:
    """The capture recording operations of ``runtime`` in this context, else None."""
    active = _active.get()
    if active is None:
        return None
    cap, owner = active
    if owner is _owner() and cap.accepts(runtime):
        return cap
    return None


def begin(capture: Any) -> contextvars.Token:
    return _active.set((capture, _owner()))


def end(token: contextvars.Token) -> None:
    _active.reset(token)


def _owner() -> Any:
    """The running asyncio or trio task, else the current thread."""
    try:
        task = asyncio.current_task()
    except RuntimeError:          # no running asyncio loop in this thread
        task = None
    if task is None and "trio" in sys.modules:
        try:
            task = sys.modules["trio"].lowlevel.current_task()
        except RuntimeError:      # not inside trio
            task = None
    return task if task is not None else threading.current_thread()
