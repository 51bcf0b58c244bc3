"""Implementations of ``python -m aiogpu demo | bench | stress``, and what they share.

Ctrl-C: every command stops at once. ``__main__`` turns the KeyboardInterrupt into one line on
stderr and exit status 130; ``closing`` makes the runtimes' shutdown quick when interrupted.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

INTERRUPTED_CLOSE_S = 0.5   # after Ctrl-C, how long close() waits for work still on the GPU


@contextlib.contextmanager
def closing(*runtimes: Any) -> Iterator[None]:
    """Close ``runtimes`` when the block ends: normally once their work has finished, after
    Ctrl-C without waiting for it (the process is ending: what still runs ends with it)."""
    try:
        yield
    except KeyboardInterrupt:
        for rt in runtimes:
            rt.close(timeout=INTERRUPTED_CLOSE_S)
        raise
    finally:
        for rt in runtimes:
            rt.close()              # no-op for a runtime already closed
