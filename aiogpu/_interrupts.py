"""Ctrl-C held back while state must stay consistent, then raised right after.

Python runs the SIGINT handler (by default: raise KeyboardInterrupt) between any two bytecodes of
the main thread. Inside a critical section, the runtime's lock while an operation is submitted or
an emulated HSA call, that would leave half-done state: a future watched but never submitted, a
ring slot reserved but never published, an HSA call whose effect happened but whose result was
lost. ``hold()`` swaps in a handler that only records the signal; ``release()`` puts the original
back and says whether a SIGINT came meanwhile, and the caller then runs the original handler: the
interrupt arrives right after the section, as it arrives right after a call into a C library.

Only the main thread runs signal handlers; elsewhere, and where SIGINT has no Python-level handler,
nothing is held. Holds nest: an inner section finds the recording handler installed and leaves it.
This module imports nothing from aiogpu: the runtime's lock and the emulator share it.
"""
from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # (the C module behind signal: no stub)
import sys
import threading
from types import FrameType, TracebackType
from typing import Any, Callable

SIGINT = _signal.SIGINT
_getsignal, _setsignal, _get_ident = _signal.getsignal, _signal.signal, threading.get_ident
_MAIN = threading.main_thread().ident
_arrived = False


def _record(signum: int, frame: FrameType | None) -> None:
    """The handler while held: note the signal, act on it at release."""
    global _arrived
    _arrived = True


def hold() -> Callable | None:
    """Hold SIGINT back (main thread, Python-level handler, not held already); returns the
    handler to give to ``release``, or None when nothing was held."""
    if threading.get_ident() != _MAIN:
        return None
    current = _signal.getsignal(SIGINT)
    if current is _record or not callable(current):
        return None
    _signal.signal(SIGINT, _record)
    return current


def release(previous: Callable) -> bool:
    """Reinstall ``previous``; True if a SIGINT arrived while it was held (the caller then runs
    ``previous(SIGINT, frame)``, which for Python's default handler raises KeyboardInterrupt)."""
    global _arrived
    try:
        _signal.signal(SIGINT, previous)
    finally:        # a SIGINT just after the reinstall raises here: it supersedes the held one
        arrived, _arrived = _arrived, False
    return arrived


class InterruptSafeLock:
    """A reentrant lock whose holder is not interrupted halfway by Ctrl-C, and that runs work
    left for its holder.

    While the main thread holds it, SIGINT is held back (``hold``); when the outermost hold
    ends the lock is released first and then the original handler runs, so KeyboardInterrupt is
    raised by the ``with`` statement's exit, after the section has completed. Other threads use
    it as a plain ``threading.RLock``; ``raw`` is that RLock, for sections that need no such care.

    Work left for the holder ("try-lock or delegate"): a thread that must not wait for the lock
    appends to ``backlog`` (any object whose truth says whether work waits) and calls
    ``try_run(drain)``; when another thread holds the lock, that holder runs ``drain`` when its
    outermost ``with`` section begins and again before it ends (never inside a nested one, so
    never halfway through the holder's own work). ``drain`` must not raise.
    """

    __slots__ = ("raw", "_depth", "_previous", "_held", "backlog", "drain")

    def __init__(self) -> None:
        self.raw = threading.RLock()
        self._depth = 0                 # the main thread's nesting (only it touches these)
        self._previous: Callable | None = None
        self._held = 0                  # the holder's nesting in ``with``/``try_run`` (any thread)
        self.backlog: Any = ()          # truthy while work waits for the holder
        self.drain: Callable[[], None] | None = None

    def __enter__(self) -> "InterruptSafeLock":
        if _get_ident() == _MAIN:
            if self._depth == 0:
                # ``hold()`` inlined: this runs once per operation submitted.
                current = _getsignal(SIGINT)
                if current is not _record and callable(current):
                    _setsignal(SIGINT, _record)   # before acquiring: a Ctrl-C cannot leave it acquired
                    self._previous = current
            self._depth += 1
            try:
                self.raw.acquire()
            except BaseException:
                self._leave()
                raise
        else:
            self.raw.acquire()
        self._held += 1
        if self.backlog and self._held == 1:
            self.drain()                  # type: ignore[misc]
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.backlog and self._held == 1:
            self.drain()                  # type: ignore[misc]
        self._held -= 1
        self.raw.release()
        if _get_ident() == _MAIN:
            # ``_leave()`` and ``release()`` inlined: this runs once per operation submitted.
            depth = self._depth = self._depth - 1
            if depth == 0 and self._previous is not None:
                global _arrived
                previous, self._previous = self._previous, None
                try:
                    _setsignal(SIGINT, previous)
                finally:    # a SIGINT just after the reinstall raises here: it supersedes the held one
                    arrived, _arrived = _arrived, False
                if arrived:
                    previous(SIGINT, sys._getframe(0))

    def _leave(self) -> None:
        self._depth -= 1
        if self._depth == 0 and self._previous is not None:
            previous, self._previous = self._previous, None
            if release(previous):
                previous(SIGINT, sys._getframe(1))

    def try_run(self, fn: Callable[[], Any]) -> bool:
        """Run ``fn`` under the lock if this thread can take it at once (it is free, or this
        thread holds it already); else return False without waiting (the holder then runs
        ``drain`` before it lets go). Ctrl-C is held back while ``fn`` runs on the main thread."""
        main = _get_ident() == _MAIN
        if main:
            self._depth += 1
            if self._depth == 1:
                current = _getsignal(SIGINT)
                if current is not _record and callable(current):
                    _setsignal(SIGINT, _record)
                    self._previous = current
        if not self.raw.acquire(False):
            if main:
                self._leave()
            return False
        self._held += 1
        try:
            fn()
        finally:
            self._held -= 1
            self.raw.release()
            if main:
                self._leave()
        return True

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        """As ``RLock.acquire``; no Ctrl-C protection and no backlog run (use ``with``)."""
        return self.raw.acquire(blocking, timeout)

    def release(self) -> None:
        self.raw.release()


def run_in_caller(action: Callable[[], Any], inside: Callable[[FrameType], bool]) -> None:
    """Run ``action`` (it raises) in this thread's code outside the current callback: at the
    first Python call or return event of a frame for which ``inside`` (tested on it and on the
    frames that called it) is false.

    An exception raised inside a ctypes callback cannot propagate: ctypes prints it and returns
    garbage. This is how an emulated HSA call hands an interrupt to its caller once it has
    returned. It uses ``sys.setprofile`` for that one event; a profiler that was active is
    reinstalled, but Python drops it when ``action`` raises.
    """
    local = _delivery
    if getattr(local, "action", None) is not None:
        return                          # one interrupt is on its way already
    local.action, local.inside, local.profile = action, inside, sys.getprofile()
    sys.setprofile(_deliver)


_delivery = threading.local()


def _deliver(frame: FrameType, event: str, arg: Any) -> None:
    local = _delivery
    f: FrameType | None = frame
    while f is not None:
        if local.inside(f):
            return
        f = f.f_back
    action, local.action = local.action, None
    sys.setprofile(local.profile)
    action()
