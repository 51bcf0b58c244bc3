"""Ctrl-C held back while state must stay consistent, then raised right after.

Python runs the SIGINT handler (by default: raise KeyboardInterrupt) between any two bytecodes of
the main thread. Inside a critical section, the runtime's lock while an operation is submitted or
an emulated HSA call, that would leave half-done state: a future watched but never submitted, a
ring slot reserved but never published, an HSA call whose effect happened but whose result was
lost. While the main thread is inside a *hold* (``hold``/``release``, or ``InterruptSafeLock``),
the installed handler is ``_record``, which only notes the signal; when the outermost hold ends,
the handler it stands in for runs: the interrupt arrives right after the section, as it arrives
right after a call into a C library.

Outside holds ``_record`` forwards at once to the handler it stands in for, so whether it is
still installed changes nothing but what ``signal.getsignal`` returns. That lets an event loop
keep it for the rest of a loop iteration: swapping handlers is a ``sigaction`` system call each
way (about 1.5 us per operation on the H200 before), so on a running asyncio loop the original
handler goes back once per iteration (a ``call_soon``), not once per operation. In synchronous
code, and where the original is Python's default handler, it goes back when the outermost hold
ends, as before. A handler installed by someone else meanwhile is never replaced: it is simply
not ``_record`` any more. (Under ``asyncio.run`` the original is asyncio's own handler, which
``asyncio.Runner`` swaps back for the default one when the run ends. If a run's last iteration
submits work in a done-callback, so that the loop stops with the restore still queued, the
forwarding ``_record`` stays until the next hold ends outside a loop; asyncio then leaves it:
later Ctrl-Cs behave as in that run, where the first one would cancel its finished main task.)

Only the main thread runs signal handlers; elsewhere, and where SIGINT has no Python-level handler,
nothing is held. Holds nest. This module imports nothing from aiogpu: the runtime's lock and the
emulator share it; its state is the main thread's alone.
"""
from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # (the C module behind signal: no stub)
import asyncio
import sys
import threading
from types import FrameType, TracebackType
from typing import Any, Callable

try:
    import cython  # type: ignore[import-untyped,import-not-found,unused-ignore]
except ImportError:            # interpreted, where Cython is not installed (compiled, the import
    # is Cython's own and this never runs; it binds the name unseen, as the .pxd cimports it)
    globals()["cython"] = type("cython", (), {"compiled": False})
if not cython.compiled:
    # Compiled, the .pxd's C function of that name: the main-thread test costs no Python call.
    from threading import get_ident as PyThread_get_thread_ident
    # The other C names of the .pxd, used only compiled (here for type checkers).
    PyThread_allocate_lock: Any = None
    PyThread_free_lock: Any = None
    PyThread_acquire_lock: Any = None
    PyThread_acquire_lock_timed: Any = None
    PyThread_release_lock: Any = None
    PyErr_CheckSignals: Any = None
    PY_LOCK_ACQUIRED: Any = None
    PY_LOCK_INTR: Any = None
else:
    from time import monotonic as _monotonic

SIGINT = _signal.SIGINT
# Module globals that tests may replace (they are read only when a handler is swapped).
_getsignal, _setsignal = _signal.getsignal, _signal.signal
_running_loop = asyncio._get_running_loop
_default_handler = _signal.default_int_handler
_MAIN = threading.main_thread().ident

# The main thread's hold state (only it runs signal handlers, so only it touches these; compiled,
# they are C variables, so that a hold changes no module dict):
_depth = 0                          # holds in progress
_saved: Callable | None = None      # the handler ``_record`` stands in for, while installed
_arrived = False                    # a SIGINT came during the current outermost hold
_restore_on: Any = None             # the loop that ``_restore`` was last queued on


def state() -> tuple[int, Callable | None, bool]:
    """The main thread's hold state, for tests: (holds in progress, the handler ``_record``
    stands in for while it is installed, whether a SIGINT arrived during the current hold)."""
    return _depth, _saved, _arrived


def _record(signum: int, frame: FrameType | None) -> None:
    """The installed handler: inside a hold, note the signal; outside, run the handler it
    stands in for (so a lingering ``_record`` behaves exactly as that handler)."""
    global _arrived
    if _depth:
        _arrived = True
        return
    previous = _saved if _saved is not None else _default_handler
    previous(signum, frame)


def _enter() -> int:
    """Begin a hold on the main thread (install ``_record`` at the outermost one)."""
    global _depth, _saved
    if _depth == 0:
        current = _getsignal(SIGINT)
        if current is not _record:
            if callable(current):
                # Installed before the depth counts the hold: a Ctrl-C now runs ``current``.
                _setsignal(SIGINT, _record)
                _saved = current
            else:                          # SIG_IGN, SIG_DFL, or not set from Python
                _saved = None
    _depth += 1
    return 0


def _exit() -> Callable | None:
    """End a hold on the main thread; the handler to run now if a SIGINT came during the
    outermost hold (the caller runs it: it raises, by default), else None."""
    global _depth, _arrived, _restore_on
    _depth -= 1
    if _depth:
        return None
    if _arrived:
        _arrived = False
        previous = _saved
        _uninstall()
        return previous
    if _saved is not None:
        # Python's default handler is never left in place: asyncio.Runner installs its own
        # only over that one, and a loop that stops right after this iteration (its restore
        # still queued) must not change what the next ``asyncio.run`` does on Ctrl-C.
        loop = _running_loop() if _saved is not _default_handler else None
        if loop is None:
            _uninstall()
        elif _restore_on is not loop:  # on a loop: once this iteration's callbacks have run
            try:
                loop.call_soon(_restore)
                _restore_on = loop
            except RuntimeError:       # (a closed loop)
                _uninstall()
    return None


def _restore() -> None:
    """On the loop, between callbacks (never inside a hold): the original handler goes back."""
    global _restore_on
    _restore_on = None
    if _depth == 0:
        _uninstall()


def _uninstall() -> int:
    """Put the handler ``_record`` stands in for back, unless someone replaced ``_record``."""
    global _saved
    if _saved is None:
        return 0
    if _getsignal(SIGINT) is _record:
        # (A SIGINT pending from just before runs ``_record`` here, which forwards it: it
        # raises before the swap, and ``_saved`` stays valid for the next attempt.)
        _setsignal(SIGINT, _saved)
    _saved = None
    return 0


def hold() -> bool:
    """Hold SIGINT back on the main thread; True if this thread holds (then call ``release``)."""
    if PyThread_get_thread_ident() != _MAIN:
        return False
    _enter()
    return True


def release() -> Callable | None:
    """End a ``hold``: the handler to run now (``handler(SIGINT, frame)``, which for Python's
    default handler raises KeyboardInterrupt) if a SIGINT arrived while it was held, else None."""
    return _exit()


class RawLock:
    """The reentrant lock under ``InterruptSafeLock``, with ``threading.RLock``'s interface
    (``acquire(blocking, timeout)``, ``release``, ``with``, ``_is_owned``) and behaviour: a
    blocking acquire waits with the GIL released and runs signal handlers as they arrive;
    releasing a lock this thread does not hold raises RuntimeError.

    Compiled, it is an owner and a count over a ``PyThread`` lock, taken and released by C
    calls (``RLock.acquire`` parses its arguments, about 500 instructions, on each call);
    interpreted, a ``threading.RLock`` does the work."""

    __slots__ = ("_rlock", "_lock", "_owner", "_count")   # (interpreted: only _rlock is used)

    def __init__(self) -> None:
        if cython.compiled:
            self._lock = PyThread_allocate_lock()
            if not self._lock:
                raise MemoryError("cannot allocate a lock")
            self._owner = 0
            self._count = 0
        else:
            self._rlock = threading.RLock()

    def __dealloc__(self) -> None:      # (compiled only)
        if self._lock:
            PyThread_free_lock(self._lock)

    def _take(self, blocking: bool, timeout: float) -> bool:
        """``acquire`` with its arguments checked."""
        if cython.compiled:
            me = PyThread_get_thread_ident()
            if self._count and self._owner == me:
                self._count += 1
                return True
            if not PyThread_acquire_lock(self._lock, 0):
                if not blocking or not self._wait(timeout):
                    return False
            self._owner = me
            self._count = 1
            return True
        return self._rlock.acquire(blocking, timeout)

    def _wait(self, timeout: float) -> bool:
        """Compiled: wait for the lock, ``timeout`` seconds (< 0: for ever), with the GIL
        released; signal handlers run when a signal interrupts the wait (what they raise
        propagates)."""
        deadline = _monotonic() + timeout if timeout >= 0 else 0.0
        while True:
            if timeout < 0:
                wait_us = -1
            else:
                wait_us = max(0, int((deadline - _monotonic()) * 1e6))
            with cython.nogil:
                status = PyThread_acquire_lock_timed(self._lock, wait_us, 1)
            if status == PY_LOCK_INTR:
                PyErr_CheckSignals()
                continue
            return status == PY_LOCK_ACQUIRED

    def _give(self) -> int:
        if cython.compiled:
            if not self._count or self._owner != PyThread_get_thread_ident():
                raise RuntimeError("cannot release un-acquired lock")
            self._count -= 1
            if not self._count:
                self._owner = 0
                PyThread_release_lock(self._lock)
        else:
            self._rlock.release()
        return 0

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if not blocking and timeout != -1:
            raise ValueError("can't specify a timeout for a non-blocking call")
        if timeout < 0 and timeout != -1:
            raise ValueError("timeout value must be a non-negative number")
        return self._take(blocking, timeout)

    def release(self) -> None:
        self._give()

    def _is_owned(self) -> bool:
        if cython.compiled:
            return self._count > 0 and self._owner == PyThread_get_thread_ident()
        return self._rlock._is_owned()  # type: ignore[attr-defined]

    def __enter__(self) -> bool:
        return self._take(True, -1)

    def __exit__(self, *exc_info: Any) -> None:
        self._give()


class InterruptSafeLock:
    """A reentrant lock whose holder is not interrupted halfway by Ctrl-C, and that runs work
    left for its holder.

    While the main thread holds it, SIGINT is held back (``hold``); when the outermost hold
    ends the lock is released first and then the original handler runs, so KeyboardInterrupt is
    raised by the ``with`` statement's exit, after the section has completed. Other threads use
    it as a plain reentrant lock; ``raw`` is that lock (a ``RawLock``), for sections that need no
    such care.

    Work left for the holder ("try-lock or delegate"): a thread that must not wait for the lock
    appends to ``backlog`` (any object whose truth says whether work waits) and calls
    ``try_run(drain)``; when another thread holds the lock, that holder runs ``drain`` when its
    outermost ``with`` section begins and again before it ends (never inside a nested one, so
    never halfway through the holder's own work). ``drain`` must not raise.
    """

    __slots__ = ("raw", "_held", "backlog", "drain")

    def __init__(self) -> None:
        self.raw = RawLock()
        self._held = 0                  # the holder's nesting in ``with``/``try_run`` (any thread)
        self.backlog: Any = ()          # truthy while work waits for the holder
        self.drain: Callable[[], None] | None = None

    def __enter__(self) -> "InterruptSafeLock":
        self.enter()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._exit(3)

    def enter(self) -> int:
        """``with``'s entry as a call (compiled, a C call: the per-operation sections take
        the lock by ``enter()``, ``try``, and ``exit()`` in ``finally``, without looking
        ``__enter__`` and ``__exit__`` up and binding them each time)."""
        if PyThread_get_thread_ident() == _MAIN:
            _enter()                      # before acquiring: a Ctrl-C cannot leave it acquired
            try:
                self.raw._take(True, -1)
            except BaseException:
                _leave()
                raise
        else:
            self.raw._take(True, -1)
        self._held += 1
        if self._held == 1 and self.backlog:
            self.drain()                  # type: ignore[misc]
        return 0

    def exit(self) -> int:
        """``with``'s exit as a call: runs the backlog, releases the lock, then raises what a
        Ctrl-C held back during the section raises (KeyboardInterrupt, by default)."""
        return self._exit(3)

    def _exit(self, up: int) -> int:
        """``exit``; interpreted, the section's frame is ``up`` frames above ``_leave``'s."""
        if self._held == 1 and self.backlog:
            self.drain()                  # type: ignore[misc]
        self._held -= 1
        self.raw._give()
        if PyThread_get_thread_ident() == _MAIN:
            _leave(up)
        return 0

    def try_run(self, fn: Callable[..., Any], *args: Any) -> bool:
        """Run ``fn(*args)`` under the lock if this thread can take it at once (it is free, or
        this thread holds it already); else return False without waiting (the holder then runs
        ``drain`` before it lets go). Ctrl-C is held back while ``fn`` runs on the main thread."""
        main = PyThread_get_thread_ident() == _MAIN
        if main:
            _enter()
        if not self.raw._take(False, -1):
            if main:
                _leave()
            return False
        self._held += 1
        try:
            fn(*args)
        finally:
            self._held -= 1
            self.raw._give()
            if main:
                _leave()
        return True

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        """As ``RLock.acquire``; no Ctrl-C protection and no backlog run (use ``with``)."""
        return self.raw.acquire(blocking, timeout)

    def release(self) -> None:
        self.raw.release()


def _leave(up: int = 2) -> int:
    """End a hold of the main thread (from a lock's method) and run a held-back SIGINT's
    handler (it raises, by default), given the frame of the lock's caller (interpreted: ``up``
    frames above this function's)."""
    previous = _exit()
    if previous is not None:
        # (Compiled, the lock's methods and this function have no Python frame.)
        previous(SIGINT, sys._getframe(0 if cython.compiled else up))
    return 0


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
