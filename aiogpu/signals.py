"""Awaitable completion signals: GPUFuture, the signal pool and the one background waiter thread.

A GPU future is an HSA signal with a condition (value < 1: the packet processor decrements it from
1 to 0). One waiter thread per runtime blocks in ``hsa_amd_signal_wait_any`` over a wake signal and
every pending signal. It is level-triggered: after any wake-up it rescans every pending signal with
an acquire load, so a missed edge costs at most one timeout (``LOST_WAKEUP_GUARD_S``), never a hang.
Completions go to each event loop in one batch per wake-up (see ``_loops``).
"""
from __future__ import annotations

import contextvars
import ctypes
import threading
import time
from collections import deque
from typing import Any, Callable, Iterable

from . import _loops
from .errors import GPUError, WatchdogTimeout
from .hsa_bindings import types as T

LOST_WAKEUP_GUARD_S = 0.1
VALUE_OFFSET = T.amd_signal_t.value.offset

# The futures submitted in this context are appended here when a TaskGroup is active.
submission_scope: contextvars.ContextVar[list | None] = contextvars.ContextVar("aiogpu_scope", default=None)
PENDING, DONE, FAILED = 0, 1, 2


class GPUFuture:
    """The completion of work submitted to a GPU.

    Awaitable under asyncio, uvloop and trio (through anyio); ``wait(timeout)`` blocks a plain
    thread. Cancelling a task that awaits it detaches that awaiter only: the GPU work runs on and
    keeps its buffers alive until it has retired. A future may be passed in ``after=`` of later
    work, which then waits for it on the device.
    """

    __slots__ = ("_hub", "_state", "_exc", "signal", "_ports", "_event", "_callbacks", "_cleanup",
                 "_dependents", "_dep_signals", "retired", "label", "value", "device", "queue", "packet", "submitted_at", "keep",
                 "__weakref__")

    def __init__(self, hub: "CompletionHub | None", label: str = "", *, signal: int = 0):
        self._hub = hub
        self._state = PENDING
        self._exc: BaseException | None = None
        self.signal = signal            # HSA signal handle (0: not backed by a signal)
        self._ports: dict[Any, list] = {}
        self._event: threading.Event | None = None
        self._callbacks: list[tuple[Any, Callable]] = []
        self._cleanup: list[Callable[[], None]] = []
        self._dependents: list[GPUFuture] = []
        self._dep_signals: list[int] = []   # signals of other futures that our packets name
        self.retired = signal == 0          # the device is done with it (resources freed)
        self.label = label
        self.value: Any = None            # what result() returns (an array for to_numpy)
        self.device: Any = None           # the device whose queue or engine runs it
        self.queue: str | None = None     # where the work runs ("gpu0.q1", "gpu0.sdma0", ...)
        self.packet: int | None = None    # packet index of the completion packet in that queue
        self.submitted_at = time.monotonic()
        self.keep: list[Any] = []         # buffers and host arrays the GPU work uses

    # -- state -------------------------------------------------------------------------------
    def done(self) -> bool:
        """True once the work has completed or failed."""
        return self._state != PENDING

    def result(self) -> Any:
        """The value (None for launches, the array for ``to_numpy``) if the work completed; raises its GPUError if it failed, or InvalidStateError."""
        if self._state == PENDING:
            raise InvalidStateError(f"{self!r} is not done")
        if self._exc is not None:
            raise self._exc
        return self.value

    def exception(self) -> BaseException | None:
        """The failure (a GPUError), None on success; InvalidStateError while pending."""
        if self._state == PENDING:
            raise InvalidStateError(f"{self!r} is not done")
        return self._exc

    def wait(self, timeout: float | None = None) -> bool:
        """Block this (non-event-loop) thread until done or ``timeout`` seconds; returns done()."""
        if self._state != PENDING:
            return True
        hub = self._hub
        with hub.lock:
            if self._state != PENDING:
                return True
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        return event.wait(timeout)

    def add_done_callback(self, fn: Callable[["GPUFuture"], Any]) -> None:
        """Call ``fn(self)`` once done: on the calling event loop if there is one, else on the
        runtime's waiter thread (keep such callbacks short and non-blocking)."""
        port = _loops.current_port()
        if self._hub is None or self._state != PENDING:
            self._run_callback(port, fn)
            return
        with self._hub.lock:
            if self._state == PENDING:
                self._callbacks.append((port, fn))
                return
        self._run_callback(port, fn)

    def _run_callback(self, port: Any, fn: Callable) -> None:
        if port is None:
            fn(self)
        else:
            port.post([_CallbackAwaiter(fn, self)])

    def __await__(self):
        if self._state == PENDING:
            port = _loops.current_port()
            if port is None:
                raise RuntimeError("await a GPUFuture inside asyncio, uvloop or trio; "
                                   "use .wait() in synchronous code")
            hub = self._hub
            if hub.spin_s > 0:
                yield from hub.spin(self)
            if self._state == PENDING:
                yield from port.wait(lambda a: self._register(port, a),
                                     lambda a: self._unregister(port, a))
        return self.result()

    def _register(self, port: Any, awaiter: Any) -> None:
        with self._hub.lock:
            if self._state == PENDING:
                self._ports.setdefault(port, []).append(awaiter)
                return
        port.post([awaiter])  # finished meanwhile: wake at once

    def _unregister(self, port: Any, awaiter: Any) -> None:
        with self._hub.lock:
            waiters = self._ports.get(port)
            if waiters and awaiter in waiters:
                waiters.remove(awaiter)

    def __repr__(self) -> str:
        state = ("pending", "done", "failed")[self._state]
        where = f" on {self.queue}" if self.queue else ""
        return f"<GPUFuture {self.label or '?'}{where} {state}>"


class InvalidStateError(RuntimeError):
    """result()/exception() of a future that is still pending."""


class _CallbackAwaiter:
    """A done-callback delivered through a port like an awaiter."""

    __slots__ = ("fn", "fut")

    def __init__(self, fn: Callable, fut: GPUFuture):
        self.fn, self.fut = fn, fut

    def done(self) -> bool:
        return False

    def set_result(self, _value: Any) -> None:
        self.fn(self.fut)

    def __getitem__(self, i: int) -> Any:  # trio ports use [task, woken] cells
        raise TypeError


def completed_future(hub: "CompletionHub | None", label: str = "",
                     exc: BaseException | None = None) -> GPUFuture:
    """A future that is already done (or failed with ``exc``)."""
    fut = GPUFuture(hub, label)
    fut._state = FAILED if exc is not None else DONE
    fut._exc = exc
    return fut


class SignalPool:
    """HSA signals for completions, recycled only when nobody can read them any more.

    Each signal carries a reference count: one for its owner future (dropped when its completion
    was observed) and one per packet that names it as a dependency (dropped when that packet is
    known to have retired). Only at zero is it reset to 1 and reused; a reset signal can
    therefore never satisfy or stall a packet that still reads it.
    """

    def __init__(self, api: Any):
        self._api = api
        self._free: list[int] = []
        self._refs: dict[int, int] = {}
        self.views: dict[int, ctypes.c_int64] = {}  # handle -> the value word in memory
        self.created = 0

    def acquire(self) -> int:
        if self._free:
            handle = self._free.pop()
            self._api.hsa_signal_store_relaxed(T.hsa_signal_t(handle), 1)
        else:
            sig = T.hsa_signal_t()
            self._api.check(self._api.hsa_signal_create(1, 0, None, ctypes.byref(sig)), "hsa_signal_create")
            handle = sig.handle
            # A signal handle is the address of its amd_signal_t; the value is at offset 8.
            self.views[handle] = ctypes.c_int64.from_address(handle + VALUE_OFFSET)
            self.created += 1
        self._refs[handle] = 1
        return handle

    def retain(self, handle: int) -> None:
        self._refs[handle] += 1

    def release(self, handle: int) -> None:
        count = self._refs[handle] - 1
        if count:
            self._refs[handle] = count
        else:
            del self._refs[handle]
            self._free.append(handle)

    @property
    def in_use(self) -> int:
        return len(self._refs)

    def destroy(self) -> None:
        for handle in self._free + list(self._refs):
            self._api.hsa_signal_destroy(T.hsa_signal_t(handle))
        self._free.clear()
        self._refs.clear()
        self.views.clear()


class CompletionHub:
    """Pending futures, their signals, and the waiter thread that observes them.

    ``lock`` is the runtime's one lock: it guards future state here and the submission state of
    the layers above (they hold it while they write packets), so that a completion is never
    processed halfway through a submission that depends on it.
    """

    def __init__(self, api: Any, *, watchdog_s: float | None = None, spin_s: float = 0.0):
        self.api = api
        self.lock = threading.RLock()
        self.pool = SignalPool(api)
        self.watchdog_s = watchdog_s
        self.spin_s = spin_s
        self._pending: dict[int, GPUFuture] = {}
        self._events: deque[Callable[[], None]] = deque()
        self._dirty = True
        self._woken = False
        self._stop = False
        self._wake = self._create_wake_signal()
        self._freq = self._timestamp_frequency()
        self.wakeups = 0
        self.leaked: list[GPUFuture] = []   # futures failed by the watchdog, never recycled
        self._thread = threading.Thread(target=self._run, name="aiogpu-waiter", daemon=True)
        self._thread.start()

    # -- used by the layers above --------------------------------------------------------------
    def new_future(self, label: str) -> GPUFuture:
        """A pending future backed by a fresh pool signal, watched from now on (call under lock)."""
        fut = GPUFuture(self, label, signal=self.pool.acquire())
        scope = submission_scope.get()
        if scope is not None:
            scope.append(fut)
        self._pending[fut.signal] = fut
        self._dirty = True
        if not self._woken:      # one wake-up covers every registration until the next scan
            self._woken = True
            self.wake()
        return fut

    def depend(self, fut: GPUFuture, on: GPUFuture, *, semantic: bool = True) -> None:
        """Record that packets of ``fut`` name ``on``'s signal (kept from reuse until ``fut``
        retires); when ``semantic``, ``fut`` also fails if ``on`` fails. Call under lock with
        ``on`` not yet retired."""
        self.pool.retain(on.signal)
        fut._dep_signals.append(on.signal)
        if semantic:
            on._dependents.append(fut)

    def wake(self) -> None:
        self.api.hsa_signal_store_screlease(T.hsa_signal_t(self._wake), 1)

    def post_event(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the waiter thread soon; safe from any thread, including driver threads."""
        self._events.append(fn)
        self.wake()

    def fail(self, fut: GPUFuture, exc: BaseException) -> None:
        """Fail ``fut`` and, transitively, everything that depends on it (call under lock).

        Its resources stay held, and its signal stays watched, until it retires: for a future
        whose packet will never run (a dead queue) the caller then uses ``retire_failed``.
        """
        posts: dict[Any, list] = {}
        self._finish(fut, exc, posts)
        self._post(posts)

    def retire_failed(self, fut: GPUFuture) -> None:
        """A failed future whose packet can no longer run (its queue is destroyed): set its
        signal to 0, so that packets waiting on it elsewhere proceed rather than stall their
        queues (their own futures have failed already), and free what it held (under lock)."""
        if fut._state == FAILED and not fut.retired:
            if fut.signal:
                self.api.hsa_signal_store_screlease(T.hsa_signal_t(fut.signal), 0)
            self._retire(fut)

    def discard(self, fut: GPUFuture) -> None:
        """Forget a future whose packet was never submitted (under lock)."""
        for handle in fut._dep_signals:
            self.pool.release(handle)
        fut._dep_signals = []
        if fut.signal and self._pending.pop(fut.signal, None) is not None:
            self._dirty = True
            self.pool.release(fut.signal)
        fut.signal, fut.retired = 0, True

    def pending_futures(self) -> list[GPUFuture]:
        with self.lock:
            return list(self._pending.values())

    @property
    def pending_count(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        self._stop = True
        self.wake()
        self._thread.join(timeout=5)
        self.api.hsa_signal_destroy(T.hsa_signal_t(self._wake))
        self.pool.destroy()

    # -- the waiter thread ---------------------------------------------------------------------
    def _create_wake_signal(self) -> int:
        sig = T.hsa_signal_t()
        self.api.check(self.api.hsa_signal_create(0, 0, None, ctypes.byref(sig)), "hsa_signal_create")
        return sig.handle

    def _timestamp_frequency(self) -> int:
        freq = ctypes.c_uint64(0)
        self.api.hsa_system_get_info(T.HSA_SYSTEM_INFO_TIMESTAMP_FREQUENCY, ctypes.byref(freq))
        return freq.value or 1_000_000_000

    def _run(self) -> None:
        api, arrays = self.api, None
        timeout = int(LOST_WAKEUP_GUARD_S * self._freq)
        while not self._stop:
            if self._dirty or arrays is None:
                arrays = self._build_arrays()
            n, sigs, conds, vals = arrays
            api.hsa_amd_signal_wait_any(n, sigs, conds, vals, timeout, T.HSA_WAIT_STATE_BLOCKED, None)
            # Level-triggered: reset the wake signal first, then look at everything.
            api.hsa_signal_store_relaxed(T.hsa_signal_t(self._wake), 0)
            self._woken = False
            self.wakeups += 1
            self._scan()

    def _build_arrays(self) -> tuple:
        with self.lock:
            handles = [self._wake, *self._pending]
            self._dirty = False
        n = len(handles)
        sigs = (T.hsa_signal_t * n)(*[T.hsa_signal_t(h) for h in handles])
        conds = (T.hsa_signal_condition_t * n)(T.HSA_SIGNAL_CONDITION_NE, *[T.HSA_SIGNAL_CONDITION_LT] * (n - 1))
        vals = (T.hsa_signal_value_t * n)(0, *[1] * (n - 1))
        return n, sigs, conds, vals

    def _scan(self) -> None:
        """Look at every pending signal: a cheap read of each value word outside the lock, then,
        under the lock, an acquire load (``hsa_signal_load_scacquire``) of each that looks done
        before its future is resolved."""
        while self._events:
            self._run_event(self._events.popleft())
        with self.lock:
            snapshot = list(self._pending.items())
        views = self.pool.views
        candidates = [(h, f) for h, f in snapshot if views[h].value < 1]
        if not candidates and self.watchdog_s is None:
            return
        load = self.api.hsa_signal_load_scacquire
        posts: dict[Any, list] = {}
        with self.lock:
            for handle, fut in candidates:
                if self._pending.get(handle) is not fut or load(T.hsa_signal_t(handle)) >= 1:
                    continue
                if fut._state == PENDING:
                    self._finish(fut, None, posts)
                else:
                    self._retire(fut)
            if self.watchdog_s is not None:
                self._check_watchdog(posts)
        self._post(posts)

    def _run_event(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:  # an event must never kill the waiter
            import logging
            logging.getLogger("aiogpu").exception("waiter event failed")

    def _check_watchdog(self, posts: dict) -> None:
        deadline = time.monotonic() - self.watchdog_s
        for fut in [f for f in self._pending.values() if f.submitted_at < deadline]:
            exc = WatchdogTimeout(f"{fut.label} on {fut.queue}: no completion within "
                                  f"{self.watchdog_s:g} s (lost or stalled completion)",
                                  queue=fut.queue, packet=fut.packet)
            self._finish(fut, exc, posts)
            # Its packet may still complete late: never recycle what it names (a deliberate,
            # counted leak), but release its signal so that work waiting on it proceeds.
            self._pending.pop(fut.signal, None)
            self._dirty = True
            self.leaked.append(fut)
            self.api.hsa_signal_store_screlease(T.hsa_signal_t(fut.signal), 0)

    # -- completion ----------------------------------------------------------------------------
    def _finish(self, fut: GPUFuture, exc: BaseException | None, posts: dict) -> None:
        """Settle the user-visible state; retire at once on success (the signal said so)."""
        if fut._state != PENDING:
            return
        fut._state = FAILED if exc is not None else DONE
        fut._exc = exc
        for port, awaiters in fut._ports.items():
            posts.setdefault(port, []).extend(awaiters)
        fut._ports = {}
        for port, fn in fut._callbacks:
            posts.setdefault(port, []).append(_CallbackAwaiter(fn, fut))
        fut._callbacks = []
        if fut._event is not None:
            fut._event.set()
        if exc is None:
            self._retire(fut)
        else:
            self._propagate(fut, exc, posts)

    def _retire(self, fut: GPUFuture) -> None:
        """The work has retired on the device: free what it held, recycle its signal."""
        if fut.retired:
            return
        fut.retired = True
        if fut.signal and self._pending.pop(fut.signal, None) is not None:
            self._dirty = True
        for fn in fut._cleanup:
            fn()
        fut._cleanup = []
        for handle in fut._dep_signals:
            self.pool.release(handle)
        fut._dep_signals = []
        if fut.signal:
            self.pool.release(fut.signal)
        fut.keep = []
        fut._dependents = []

    def _propagate(self, fut: GPUFuture, exc: BaseException, posts: dict) -> None:
        # Dependents fail now; their packets still run (on a released signal) and retire later.
        for dep in fut._dependents:
            err = GPUError(f"{dep.label}: a dependency failed ({fut.label}: {exc})",
                           status=getattr(exc, "status", None), queue=dep.queue, packet=dep.packet)
            err.__cause__ = exc
            self._finish(dep, err, posts)
        fut._dependents = []

    def _post(self, posts: dict) -> None:
        for port, awaiters in posts.items():
            if port is None:
                for a in awaiters:
                    self._run_event(lambda a=a: a.set_result(None))
            else:
                port.post(awaiters)

    # -- latency: a short spin on the loop before parking on the waiter -------------------------
    def spin(self, fut: GPUFuture):
        """Poll ``fut``'s signal for up to ``spin_s`` seconds, yielding to the loop in between."""
        deadline = time.perf_counter() + self.spin_s
        load = self.api.hsa_signal_load_scacquire
        sig = T.hsa_signal_t(fut.signal)
        while fut._state == PENDING and fut.signal and time.perf_counter() < deadline:
            if load(sig) < 1:
                self.wake()
                break
            yield
