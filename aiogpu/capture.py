"""Which graph, if any, is capturing operations in this context (see graph.py).

Kept apart from graph.py so that devices can ask "am I being captured?" without importing the
graph layer above them.
"""
from __future__ import annotations

import contextvars
from typing import Any

_active: contextvars.ContextVar[Any] = contextvars.ContextVar("aiogpu_capture", default=None)


def current(runtime: Any) -> Any:
    """The capture recording operations of ``runtime`` in this context, else None."""
    cap = _active.get()
    if cap is not None and cap.accepts(runtime):
        return cap
    return None


def begin(capture: Any) -> contextvars.Token:
    return _active.set(capture)


def end(token: contextvars.Token) -> None:
    _active.reset(token)
