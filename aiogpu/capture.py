"""Which graph, if any, is capturing operations in this context, and what a capture returns
in place of a future (``GraphNode``; see graph.py).

Kept apart from graph.py so that devices and the runtime can ask "am I being captured?" and
"is this a node?" without importing the graph layer above them.

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
from typing import Any, NoReturn

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


_NOT_WORK = ("a graph node is not work: nothing runs until a replay; await exe.launch() "
             "(exe = graph.instantiate()) instead of {what}")


class GraphNode:
    """A place in a captured graph: what ``launch``, ``copy``, ``fill`` and ``gather`` return
    inside ``with aiogpu.Graph()``.

    Not a future: nothing runs at capture, and one node stands for its operation in every
    replay. It is accepted in ``after=`` of later operations of the same capture (ValueError
    elsewhere) and as a key of ``exe.launch(args=..., grid=..., block=...)``. Every future
    method (``await``, ``done``, ``result``, ``exception``, ``wait``, ``add_done_callback``,
    ``asyncio``, ...) raises TypeError; ``asyncio.isfuture(node)`` is False, so
    ``asyncio.gather``/``asyncio.wait`` fail with that TypeError instead of waiting. The future
    of the work is the replay's: ``await exe.launch()``."""

    __slots__ = ("graph", "kind", "op", "deps", "index", "label", "preds", "__weakref__")

    # The capture's ordering state (``ordering.Hazards``) reads these as it reads a future's:
    # a node never retires and never fails (its replays do).
    retired = False
    _exc = None

    def __init__(self, graph: Any, kind: str, op: dict, deps: dict, index: int, label: str):
        self.graph, self.kind, self.op, self.deps, self.index = graph, kind, op, deps, index
        self.label = label
        self.preds: list = []

    def _refuse(self, what: str) -> NoReturn:
        raise TypeError(_NOT_WORK.format(what=what) + f" ({self!r})")

    def __await__(self) -> Any:
        # Defined (to say why) rather than absent: asyncio.gather and asyncio.ensure_future
        # wrap an awaitable in a task, which then fails with this error at its first step.
        self._refuse("awaiting a node")

    def done(self) -> NoReturn:
        self._refuse("asking a node whether it is done")

    def cancelled(self) -> NoReturn:
        self._refuse("asking a node whether it was cancelled")

    def cancel(self, msg: Any = None) -> NoReturn:
        self._refuse("cancelling a node")

    def result(self) -> NoReturn:
        self._refuse("asking a node for its result")

    def exception(self) -> NoReturn:
        self._refuse("asking a node for its exception")

    def wait(self, timeout: float | None = None) -> NoReturn:
        self._refuse("waiting for a node")

    def add_done_callback(self, fn: Any, *, context: Any = None) -> NoReturn:
        self._refuse("adding a done-callback to a node")

    def remove_done_callback(self, fn: Any) -> NoReturn:
        self._refuse("removing a done-callback from a node")

    def get_loop(self) -> NoReturn:
        self._refuse("asking a node for its loop")

    def asyncio(self) -> NoReturn:
        self._refuse("bridging a node to asyncio")

    def wait_on(self, stream: Any, *, device: Any = None) -> NoReturn:
        self._refuse("making a stream wait on a node")

    def _submitted_work(self) -> NoReturn:
        self._refuse("asking a node for its submitted work")

    def __repr__(self) -> str:
        return f"<GraphNode {self.index} {self.kind} {self.label}>"
