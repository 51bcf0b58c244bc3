"""GPU futures and the hub that settles them: backend-neutral.

A ``GPUFuture`` is the completion of GPU work. A ``FutureHub`` owns the runtime's one lock, the
pending futures, and the rules every backend shares: a future settles once; a failure spreads to
the futures that depend on it; a future's resources are freed when the device has *retired* its
work (which, for a failed future, may be later than its failure); awaiters are woken in batches,
one thread-safe call per event loop (see ``_loops``). Backends subclass the hub with a waiter
thread that observes their completion objects (HSA signals in ``signals.py``, CUDA events).
"""
from __future__ import annotations

import asyncio as _asyncio
import contextlib
import contextvars
import functools
import logging
import threading
import time
import weakref
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Generator, Generic, Iterator, TypeVar

from . import _loops
from ._interrupts import InterruptSafeLock
from . import trace as _trace
from .errors import BlockingCallError, DeviceLost, GPUError, InvalidStateError

log = logging.getLogger("aiogpu")

# The futures submitted in this context are appended here when a TaskGroup is active.
submission_scope: contextvars.ContextVar[Any] = contextvars.ContextVar("aiogpu_scope", default=None)
PENDING, DONE, FAILED = 0, 1, 2


_T = TypeVar("_T")

if TYPE_CHECKING:
    # For type checkers, a GPUFuture is an asyncio future (asyncio.wait's stubs ask for one);
    # at run time it only speaks the protocol (it belongs to no loop).
    _FutureProtocol = _asyncio.Future
else:
    _FutureProtocol = Generic


class GPUFuture(_FutureProtocol[_T]):
    """The completion of work submitted to a GPU; ``GPUFuture[T]``: ``await`` gives a ``T``
    (``GPUFuture[np.ndarray]`` from ``to_numpy``, ``GPUFuture[None]`` from ``launch``, ``copy``,
    ``fill``, ``gather`` and a graph's ``launch``).

    Awaitable under asyncio, uvloop and trio (through anyio); ``wait(timeout)`` blocks a plain
    thread. Cancelling a task that awaits it detaches that awaiter only: the GPU work runs on and
    keeps its buffers alive until it has retired. A future may be passed in ``after=`` of later
    work, which then waits for it on the device.

    It also speaks asyncio's future protocol, so ``asyncio.isfuture``, ``asyncio.wait``,
    ``asyncio.as_completed``, ``asyncio.gather``, ``asyncio.shield`` and ``asyncio.wait_for``
    take it directly, on asyncio and uvloop: ``get_loop()`` is the running loop (a GPUFuture
    belongs to no loop), ``add_done_callback(fn, context=...)`` runs ``fn`` through the calling
    loop's queue (never inside the call), ``remove_done_callback(fn)`` removes it.

    GPU work cannot be cancelled, so a GPUFuture is cancelled *per task* (see ``cancel()``): to
    the task that cancels it, and to a task being cancelled that waits for it through a
    done-callback, it looks cancelled from then on while the work runs on; every other waiter
    sees the work itself. This is how asyncio's helpers pass a cancellation or a timeout down to
    what a task waits for (``wait_for``'s timeout on Python 3.11, a timeout of 0 on every
    version, the children of a cancelled ``gather``), so ``asyncio.wait_for(fut, t)``,
    ``async with asyncio.timeout(t)``, anyio's ``fail_after``, ``asyncio.wait(..., timeout=t)``
    and a timeout around ``asyncio.gather(...)`` of GPUFutures all raise ``TimeoutError`` on
    time, leaving the work running with its buffers. ``asyncio()`` gives a separate asyncio
    future for code that wants one.
    """

    # asyncio's duck-typing marker (asyncio.isfuture): a future, never yielded to a task itself.
    _asyncio_future_blocking = False
    if TYPE_CHECKING:    # our own fields, not asyncio.Future's of the same names
        _state: int  # type: ignore[assignment]
        _callbacks: list[tuple[Any, Callable]] | tuple  # type: ignore[assignment]

    __slots__ = ("_hub", "_state", "_exc", "signal", "_ports", "_event", "_callbacks", "_cleanup",
                 "_dependents", "_dep_signals", "preds", "_on_retire", "_retiring", "retired", "label", "value", "device", "kind", "nbytes", "queue", "packet",
                 "lane", "submitted_at", "keep", "members", "waited", "_views", "__weakref__")
    # (asyncio.gather reads it of a cancelled child: cancel() keeps no message)
    _cancel_message = None

    def __init__(self, hub: "FutureHub | None", label: str = "", *, signal: int = 0):
        self._hub: Any = hub    # (None only for futures settled at creation)
        self._state = PENDING
        self._exc: BaseException | None = None
        self.signal = signal            # HSA signal handle (0: not backed by a signal)
        # Empty (None or ()) until the first entry: fewer objects per future for the garbage
        # collector to track (a request's futures live across several of its collections).
        self._ports: dict[Any, list] | None = None
        self._event: threading.Event | None = None
        self._callbacks = ()
        self._cleanup: list[Callable[[], None]] | tuple = ()
        # Rarely used: an empty tuple until the first entry (fewer objects per future for the
        # garbage collector to track; see _add_dependent, _add_dep_signal, _on_retire).
        self._dependents: list[GPUFuture] | tuple = ()
        self._dep_signals: list[int] | tuple = ()   # signals of other futures that our packets name
        self.retired = signal == 0          # the device is done with it (resources freed)
        self.preds: list[GPUFuture] = []    # earlier work it was ordered after (see ordering)
        self._on_retire: list[Callable[[], None]] | tuple = ()   # run once it has retired
        self._retiring = False              # a failed future waiting for its preds to retire
        self.label = label
        self.value: Any = None            # what result() returns (an array for to_numpy)
        self.kind = ""                    # "dispatch", "copy", "join", "graph" (for traces)
        self.nbytes = 0                   # bytes moved (copies)
        self.device: Any = None           # the device whose queue or engine runs it
        self.queue: str | None = None     # where the work runs ("gpu0.q1", "gpu0.sdma0", ...)
        self.packet: int | None = None    # packet index of the completion packet in that queue
        self.lane: Any = None             # the backend's lane object (queue, stream) it runs on
        self.submitted_at = time.monotonic()
        self.keep: list[Any] | tuple = ()  # buffers and host arrays the GPU work uses
        self.members: list[GPUFuture] | None = None   # a join's members (see Runtime.gather)
        self.waited = False               # someone waits for it: the waiter wakes for it (hub.arm)
        # The tasks to which it looks cancelled while pending (see cancel()); usually None.
        self._views: "weakref.WeakSet[Any] | None" = None

    # -- state -------------------------------------------------------------------------------
    def done(self) -> bool:
        """True once the work has completed or failed. Reads the completion itself (the
        signal) when the waiter has not settled it yet, so it is current for work nobody
        awaits too."""
        if self._state == PENDING and self.signal:
            self._hub.observe(self)
        return self._state != PENDING

    def _submitted_work(self) -> "GPUFuture | None":
        """The future of the device work behind this one: itself (deferred work: what it was
        submitted as, None until then; see ``deferred``)."""
        return self

    def result(self) -> _T:
        """The value (None for launches, the array for ``to_numpy``) if the work completed;
        raises its GPUError if it failed; while pending, InvalidStateError (CancelledError to a
        task that cancelled it, see ``cancel()``).

        Like ``exception()`` (and ``await``), it marks the failure as *retrieved*: someone saw it
        (see ``aiogpu.TaskGroup``)."""
        if self._state == PENDING:
            if self._views is not None and _viewing_task() in self._views:
                raise _asyncio.CancelledError()
            raise InvalidStateError(f"{self!r} is not done")
        if self._exc is not None:
            mark_retrieved(self._exc)
            raise self._exc
        return self.value

    def exception(self) -> BaseException | None:
        """The failure (a GPUError), None on success; InvalidStateError while pending
        (CancelledError to a task that cancelled it, see ``cancel()``)."""
        if self._state == PENDING:
            if self._views is not None and _viewing_task() in self._views:
                raise _asyncio.CancelledError()
            raise InvalidStateError(f"{self!r} is not done")
        if self._exc is not None:
            mark_retrieved(self._exc)
        return self._exc

    def wait(self, timeout: float | None = None) -> bool:
        """Block this thread until done or ``timeout`` seconds; returns done().

        For synchronous code and threads. On the thread of a running event loop (asyncio,
        uvloop, trio) it raises BlockingCallError, done or not, instead of stalling the loop:
        ``await`` the future there."""
        if _loops.current_port() is not None:
            raise BlockingCallError(f"{self!r}.wait() would block the running event loop; "
                                    f"`await` it instead (or call wait() from another thread)")
        if self.done():
            return True
        hub = self._hub
        hub.arm(self)
        with hub.state_lock:
            if self._state != PENDING:
                return True
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        return event.wait(timeout)

    def wait_on(self, stream: Any, *, device: Any = None) -> None:
        """Make another library's CUDA stream (a ``torch.cuda.Stream``, a CuPy ``Stream``, a
        ``CUstream`` or an int handle) wait, on the device, for this future's work: what the
        library queues there afterwards runs after it. Never blocks the host.

        Returns at once (nothing to wait for) when the work has finished; raises its error if
        it failed (the library must not read what it left undefined). NotOnCudaError on a
        backend without CUDA streams; InvalidStateError while the work waits for its kernel's
        compile (await it, or ``await dev.load(kernel)`` first); ValueError for a stream of
        another GPU context; RuntimeClosedError after ``close()``."""
        owner = getattr(self._hub, "owner", None)
        if owner is None:
            if self._exc is not None:
                raise self._exc
            return
        owner.wait_on(self, stream, device=device)

    def add_done_callback(self, fn: Callable[["GPUFuture[_T]"], Any], *, context: Any = None) -> None:
        """Call ``fn(self)`` once done, in ``context`` (a contextvars.Context) if given.

        On an event loop (asyncio, uvloop, trio): scheduled on that loop, never called inside
        this call, as asyncio does; what it raises goes to the loop's exception handler.

        Without a loop (a plain thread): on a future that is done already, ``fn`` runs inline,
        before this call returns, and what it raises propagates to the caller. Otherwise it
        runs once the work has settled, on the thread that settled it: the runtime's waiter
        thread as a rule, or a thread whose own ``done()``, ``result()``, ``wait()`` or await
        observed the completion first. Keep such callbacks short, non-blocking and
        thread-safe. What one raises there (BaseException included) is reported through the
        ``aiogpu`` logger and stops nothing else: the waiter runs on and later callbacks and
        futures complete; only a KeyboardInterrupt or SystemExit raised on the main thread
        (outside the runtime's lock) propagates there, once the callbacks settled with it
        have run.

        Registered from an asyncio task, it belongs to that task: ``cancel()`` from that task
        (or while that task is being cancelled) calls it at once, the future then looking
        cancelled to it."""
        if context is not None:
            fn = _InContext(fn, context)
        port = _loops.current_port()
        if type(port) is _loops.AsyncioPort:
            task = _asyncio.current_task()
            if task is not None:
                fn = _TaskCallback(fn, task)
        self._when_done(port, fn)

    def _when_done(self, port: Any, fn: Callable) -> None:
        """Call ``fn(self)`` on ``port`` (None: on the waiter thread) once done, waking the
        waiter for it; for the library's own callbacks, which no ``cancel()`` detaches."""
        if self._hub is None or self._state != PENDING:
            self._run_callback(port, fn)
            return
        self._hub.arm(self)
        with self._hub.state_lock:
            if self._state == PENDING:
                self._add_callback(port, fn)
                return
        self._run_callback(port, fn)

    def _add_callback(self, port: Any, fn: Callable) -> None:
        if self._callbacks:
            self._callbacks.append((port, fn))         # type: ignore[union-attr]
        else:
            self._callbacks = [(port, fn)]

    def remove_done_callback(self, fn: Callable[["GPUFuture[_T]"], Any]) -> int:
        """Remove every registration of ``fn`` not yet handed to its loop; returns how many
        were removed (asyncio's protocol)."""
        if self._hub is None:
            return 0
        with self._hub.state_lock:
            keep = [(p, f) for p, f in self._callbacks if not (f is fn or f == fn)]
            removed = len(self._callbacks) - len(keep)
            self._callbacks = keep
        return removed

    def cancel(self, msg: Any = None) -> bool:
        """Cancel this future *for the tasks that stop waiting for it*; the GPU work runs on
        and keeps its buffers (it cannot be cancelled).

        Those tasks are the calling asyncio task, and every task being cancelled
        (``Task.cancelling()`` > 0: asyncio's helpers call ``cancel()`` on what such a task
        waits for) that registered done-callbacks on this future. Their done-callbacks run at
        once (through their loop's queue, as for any completion); to them, and to those
        callbacks, the future then looks cancelled while the work is pending: ``cancelled()``
        True, ``result()`` and ``exception()`` raise CancelledError. ``done()`` stays the
        work's own state, and every other waiter is unaffected. Such a task's next ``await``
        of the future waits for the work again; once the work has settled, every task sees its
        outcome.

        Returns True if it was cancelled for some task; False (nothing changes) when it is
        done, or when it is called outside a task and no task waiting for it is being
        cancelled. ``msg`` is ignored."""
        if self._hub is None or self._state != PENDING:
            return False
        caller = _viewing_task()
        detached: list[tuple[Any, _TaskCallback]] = []
        with self._hub.state_lock:
            if self._state != PENDING:
                return False
            keep = []
            for port, fn in self._callbacks:
                if type(fn) is _TaskCallback and (fn.task is caller or _being_cancelled(fn.task)):
                    detached.append((port, fn))
                else:
                    keep.append((port, fn))
            tasks = {fn.task for _, fn in detached}
            if caller is not None:
                tasks.add(caller)
            if not tasks:
                return False
            self._callbacks = keep
            if self._views is None:
                self._views = weakref.WeakSet()
            self._views.update(tasks)
        for port, fn in detached:
            port.post([_CallbackAwaiter(fn.as_task, self)])
        return True

    def cancelled(self) -> bool:
        """True only to a task for which it was cancelled (see ``cancel()``), while the work is
        pending: a GPUFuture completes or fails, it is never cancelled for everyone."""
        return (self._state == PENDING and self._views is not None
                and _viewing_task() in self._views)

    def _make_cancelled_error(self) -> BaseException:
        """The CancelledError of a cancelled future (asyncio.gather asks a cancelled child)."""
        return _asyncio.CancelledError()

    def get_loop(self) -> _asyncio.AbstractEventLoop:
        """The running asyncio loop (asyncio's protocol: a GPUFuture serves every loop).
        RuntimeError outside a running loop."""
        return _asyncio.get_running_loop()

    def asyncio(self) -> "_asyncio.Future[_T]":
        """A new asyncio future of the running loop that settles as this one does (with its
        result or its exception). Cancelling it detaches it only: the GPU work runs on. For
        code that wants an asyncio future of its own. RuntimeError outside a running asyncio
        loop."""
        loop = _asyncio.get_running_loop()
        out: _asyncio.Future[_T] = loop.create_future()

        def settle(fut: GPUFuture) -> None:
            if not out.done():
                if fut._exc is None:
                    out.set_result(fut.value)
                else:
                    out.set_exception(fut._exc)

        self._when_done(_loops.current_port(), settle)
        return out

    def _notify(self, port: Any, fn: Callable[["GPUFuture"], Any]) -> None:
        """Call ``fn(self)`` on ``port`` once done, without asking the backend for an early
        wake-up (safe under the runtime lock, e.g. while the future is being submitted)."""
        with self._hub.state_lock:
            if self._state == PENDING:
                self._add_callback(port, fn)
                return
        self._run_callback(port, fn)

    def _run_callback(self, port: Any, fn: Callable) -> None:
        if port is None:
            fn(self)
        else:
            port.post([_CallbackAwaiter(fn, self)])

    def __await__(self) -> Generator[Any, None, _T]:
        """Wait for the work without blocking the loop; returns ``result()``.

        Under trio every await is a checkpoint, also of a future that is already done (trio's
        rule for library calls: a cancellation point and a schedule point). Under asyncio a
        done future returns at once, as an asyncio future does. On both, an await goes on only
        with a slot of the loop's turn (an asyncio iteration, a trio batch), else in a later
        turn (``_loops.checkpoint`` and the ports: the loop's turns stay short when a burst of
        completions arrives, or a burst of requests finds its GPU work done)."""
        if self._state != PENDING:
            yield from _loops.checkpoint()
            return self.result()
        if self._views is not None:        # this task waits for the work again (see cancel())
            self._views.discard(_viewing_task())
        port = _loops.current_port()
        if port is None:
            raise RuntimeError("await a GPUFuture inside asyncio, uvloop or trio; "
                               "use .wait() in synchronous code")
        hub = self._hub
        seen = ready = parked = False
        hub.awaiting += 1
        try:
            # Spin only while this is the one future awaited: a service with many requests
            # in flight parks them all (the waiter wakes each loop once per batch), so the
            # loop never busy-polls while other tasks wait for the GPU too.
            if hub.spin_s > 0 and hub.awaiting == 1 and isinstance(port, _loops.AsyncioPort):
                # True: the device completed it (read without the lock); the waiter settles
                # and retires it at its next scan, off this loop.
                seen = yield from hub.spin_await(self)
                ready = seen or self._state != PENDING
            if not ready and self._state == PENDING:
                hub.arm(self)
                yield from port.wait(lambda a: self._register(port, a),
                                     lambda a: self._unregister(port, a))
                hub.parked_done(self)
                parked = True
        finally:
            hub.awaiting -= 1
        # The task goes on only once admitted to this turn of the loop (see _loops' ports):
        # woken from the port's queue (on trio the drain that woke it admitted it), or with
        # its result ready, as an await of a done future (_loops.checkpoint).
        if ready or parked:
            yield from port.go_on(woken=parked)
        return self.value if seen else self.result()

    def _add_dependent(self, fut: "GPUFuture") -> None:
        """``fut`` fails when this future fails (call under the lock)."""
        if not self._dependents:
            self._dependents = []
        self._dependents.append(fut)  # type: ignore[union-attr]

    def _add_dep_signal(self, key: int) -> None:
        """A signal our packets name, released when this future retires (call under the lock)."""
        if not self._dep_signals:
            self._dep_signals = []
        self._dep_signals.append(key)  # type: ignore[union-attr]

    def _on_retired(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once this future has retired (call under the lock, before it retired)."""
        if not self._on_retire:
            self._on_retire = []
        self._on_retire.append(fn)  # type: ignore[union-attr]

    def _register(self, port: Any, awaiter: Any) -> None:
        with self._hub.state_lock:
            if self._state == PENDING:
                ports = self._ports
                if ports is None:
                    ports = self._ports = {}
                ports.setdefault(port, []).append(awaiter)
                return
        port.post([awaiter])  # finished meanwhile: wake at once

    def _unregister(self, port: Any, awaiter: Any) -> None:
        with self._hub.state_lock:
            waiters = self._ports.get(port) if self._ports else None
            if waiters and awaiter in waiters:
                waiters.remove(awaiter)

    def __repr__(self) -> str:
        state = ("pending", "done", "failed")[self._state]
        where = f" on {self.queue}" if self.queue else ""
        return f"<GPUFuture {self.label or '?'}{where} {state}>"


# A done-callback delivered through a port in the batch of awaiters (``fn(future)``).
_CallbackAwaiter = _loops.Callback
# The backlog's mark for a queued watchdog check (in ``FutureHub._queued``).
_WATCHDOG = object()


class _InContext:
    """A done-callback run in a given contextvars.Context; equal to the bare callback, so that
    ``remove_done_callback(fn)`` finds it."""

    __slots__ = ("fn", "context")

    def __init__(self, fn: Callable, context: Any):
        self.fn, self.context = fn, context

    def __call__(self, fut: Any) -> Any:
        return self.context.run(self.fn, fut)

    def __eq__(self, other: Any) -> bool:
        return other is self or other is self.fn or other == self.fn

    __hash__ = None  # type: ignore[assignment]


class _TaskCallback:
    """A done-callback registered from an asyncio task (see ``GPUFuture.cancel``); equal to the
    bare callback, so that ``remove_done_callback(fn)`` finds it."""

    __slots__ = ("fn", "task")

    def __init__(self, fn: Callable, task: Any):
        self.fn, self.task = fn, task

    def __call__(self, fut: Any) -> Any:
        return self.fn(fut)

    def as_task(self, fut: Any) -> Any:
        """Run it detached by ``cancel()``: the future looks cancelled to it as to its task."""
        before = getattr(_acting, "task", None)
        _acting.task = self.task
        try:
            return self.fn(fut)
        finally:
            _acting.task = before

    def __eq__(self, other: Any) -> bool:
        return other is self or other is self.fn or other == self.fn

    __hash__ = None  # type: ignore[assignment]


# The task a detached done-callback runs for, on this thread (see _TaskCallback.as_task).
_acting = threading.local()


def _viewing_task() -> Any:
    """The asyncio task whose view of a future counts here: the one a detached done-callback
    runs for, else the current task; None outside a task."""
    task = getattr(_acting, "task", None)
    if task is not None:
        return task
    if _asyncio._get_running_loop() is None:
        return None
    return _asyncio.current_task()


def _being_cancelled(task: Any) -> bool:
    """``task`` has a pending cancellation request (``Task.cancelling()``, Python 3.11+)."""
    cancelling = getattr(task, "cancelling", None)
    return cancelling is not None and not task.done() and cancelling() > 0


def mark_retrieved(exc: BaseException) -> None:
    """Note that ``exc`` and the failures it was caused by (its ``__cause__`` chain: a dependent's
    error names the failure it follows from) have been seen by the program."""
    for e in cause_chain(exc):
        try:
            setattr(e, "_aiogpu_retrieved", True)
        except AttributeError:       # an exception type that takes no attributes: not marked
            pass


def cause_chain(exc: BaseException | None) -> list[BaseException]:
    """``exc`` and the exceptions it was caused by, nearest first."""
    chain: list[BaseException] = []
    while exc is not None and len(chain) < 64 and exc not in chain:
        chain.append(exc)
        exc = exc.__cause__
    return chain


def was_retrieved(exc: BaseException) -> bool:
    """True if the program saw ``exc``, or a failure it was caused by (``mark_retrieved``)."""
    return any(getattr(e, "_aiogpu_retrieved", False) for e in cause_chain(exc))


def _queue_order(fut: GPUFuture) -> tuple:
    """Where ``fut`` stands in its queue or engine: published packets by index, then work not
    yet published (engines: by submission time)."""
    return (fut.packet is None, fut.packet or 0, fut.submitted_at)


def completed_future(hub: "FutureHub | None", label: str = "",
                     exc: BaseException | None = None) -> GPUFuture:
    """A future that is already done (or failed with ``exc``): an operation of ``hub``'s runtime
    that never ran on the device (traced as such)."""
    fut: GPUFuture[Any] = GPUFuture(hub, label)
    fut._state = FAILED if exc is not None else DONE
    fut._exc = exc
    if hub is not None and _trace.active is not None:
        _trace.active.record(fut, None, ran=False)
    return fut


class FutureHub:
    """Pending futures and how they settle; subclasses add the waiter that observes them.

    ``lock`` is the runtime's one lock: it guards the submission state of the layers above and
    everything a future holds until it *retires* (buffers, hazards, signals, host memory), so
    that retirement never happens halfway through a submission. It also holds Ctrl-C back while
    the main thread holds it (``_interrupts.InterruptSafeLock``): a KeyboardInterrupt arrives
    when the ``with`` block ends, so a submission is never left half done; ``lock.raw`` is the
    plain RLock underneath.

    ``state_lock`` is a small leaf lock that guards a future's settling against registrations
    (awaiters, done-callbacks, ``wait``): every holder does O(1) work and takes no other lock
    under it. A future settles exactly once, under it.

    Completion delivery never waits for ``lock``. A completion observed by the waiter (or a
    spin) marks its future done and wakes its awaiters at once; retiring it is queued on the
    *backlog*, which the observer runs itself if it can take ``lock`` at once (``try_run``),
    else the holder runs it when its outermost section begins or ends; the waiter retries it
    at its next wake-up (``retry_backlog``), so nothing stays unretired when nobody submits.
    What must stay under ``lock`` goes through the backlog whole, in order: a failure (it
    spreads to dependents, which submitters register under ``lock``), a join whose members
    failed, the watchdog; while such an item waits, later completions queue behind it rather
    than settle ahead of it.

    The waiter wakes for the work someone *waits for* (``arm``: a parked awaiter, a
    done-callback, a thread in ``wait()``, host work that must follow a completion); work nobody
    waits for is settled and retired by its periodic scan. Either way every wake-up rescans all
    pending work (level-triggered), so arming late never loses a completion.

    A subclass implements ``wake``, ``_wake_for`` (its means of arming), ``_run`` (the waiter
    thread's loop) and ``release_key`` (recycle a completion object).
    """

    def __init__(self, *, watchdog_s: float | None = None, spin_s: float = 0.0):
        self.lock = InterruptSafeLock()
        self.state_lock = threading.Lock()
        # Work for whoever holds ``lock``: (future or None for the watchdog, host-side failure,
        # whether the item was counted in ``_slow``, retire it).
        self._backlog: deque[tuple] = deque()
        self._queued: set = set()     # futures (and _WATCHDOG) with an item in the backlog
        self._slow = 0                # items that must settle under the lock, not yet run
        self.lock.backlog, self.lock.drain = self._backlog, self._drain
        self.watchdog_s = watchdog_s
        self.spin_s = spin_s
        self.awaiting = 0            # futures being awaited now (the spin policy reads it)
        self._pending: dict[int, GPUFuture] = {}
        self._events: deque[Callable[[], None]] = deque()
        self._dirty = True            # the waiter's wait set is stale (a waited future came or went)
        self._woken = False           # a wake-up is on its way to the waiter (see _request_wake)
        self._idle = False            # the waiter sleeps its long guard (see watch)
        self._stop = False
        self.wakeups = 0
        self.leaked: list[GPUFuture] = []   # futures the watchdog failed without aborting them
        self._given_up: "weakref.WeakSet[GPUFuture]" = weakref.WeakSet()   # not timed out again
        self._ready_since: dict[GPUFuture, float] = {}   # when the watchdog saw it could run
        self.owner: Any = None
        # Called under the lock for a future the watchdog gave up on; returns True if the
        # backend failed and retired it itself (e.g. by aborting its queue).
        self.on_timeout: Callable[[GPUFuture, BaseException], bool] | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="aiogpu-waiter", daemon=True)
        self._thread.start()

    # -- for subclasses ----------------------------------------------------------------------------
    def wake(self) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        raise NotImplementedError

    def release_key(self, key: int) -> None:
        """The completion object ``key`` may be reused (nobody reads it any more)."""

    def force_complete(self, key: int) -> None:
        """Make ``key`` read as complete, so device work waiting on it proceeds."""

    def device_times(self, fut: GPUFuture) -> tuple[int, int] | None:
        """(start, end) of ``fut``'s work on the device in host monotonic ns, if known."""
        return None

    def poll(self) -> None:
        """Observe completions now, on the calling thread (where the backend can; else no-op)."""

    def observe(self, fut: GPUFuture) -> None:
        """Settle the pending ``fut`` now if its completion object reads complete, as the
        waiter's scan does (any thread, without waiting for ``lock``): ``done()`` answers from
        the device. Not inside this thread's own section of ``lock``: the layers above call
        ``done()`` there in the middle of a submission (a join whose members are not set yet
        must not settle), and loop-less callbacks never run inside a holder's section."""
        key = fut.signal
        if key and not self.lock.raw._is_owned() and self.is_complete(key):  # type: ignore[attr-defined]
            self._settle([(key, fut)])

    def _wake_for(self, fut: GPUFuture) -> None:
        """Make sure the waiter is woken when ``fut`` (pending device work that ``arm`` just
        marked waited) completes."""

    def spin_await(self, fut: GPUFuture):
        """What an asyncio ``await`` does before parking (a generator; default: ``spin``). It
        returns True when it saw the work complete successfully on the device but left settling
        the future to the waiter (the awaiter then returns ``fut.value``)."""
        yield from self.spin(fut)
        return False

    def parked_done(self, fut: GPUFuture) -> None:
        """A parked await of ``fut`` was woken (backends learn from it)."""

    def close(self) -> None:
        """Stop the waiter and release the completion objects (runtime close)."""
        self.stop()

    # -- used by the layers above --------------------------------------------------------------
    def arm(self, fut: GPUFuture) -> None:
        """Someone waits for ``fut``: a task parked on it (on any loop), a done-callback, a
        thread in ``wait()``, a TaskGroup waiting for its work before it exits, or host work
        that must follow its completion (a queue's back-log, the retirement of a failed future,
        deferred work mirroring it). From now on the waiter is woken when it completes, rather
        than finding it at its next periodic scan.

        The one rule of who is waited for, for every backend (``_wake_for`` is each one's
        means). Safe from any thread, without the lock. Call it *before* the registration that
        wants the wake-up: a completion in between is not lost, because the waiter rescans all
        pending work after every wake-up and a registration on a settled future fires at once.
        Deferred work arms the work it was submitted as: now, or at its submission
        (``deferred.adopt`` reads ``waited``, which is set here before the submitted work is
        read, so one of the two sees the other)."""
        if fut.waited:
            return
        fut.waited = True
        work = fut._submitted_work()
        if work is fut:
            if fut._state == PENDING:
                self._wake_for(fut)
        elif work is not None:
            self.arm(work)

    def _request_wake(self) -> None:
        """Wake the waiter, once until its next scan: that scan (and the wait set it rebuilds
        first) covers every request made before it."""
        if not self._woken:
            self._woken = True
            self.wake()

    def watch(self, fut: GPUFuture) -> GPUFuture:
        """Start watching a pending future whose ``signal`` is set (call under lock).

        The waiter is not woken for it: its periodic scan finds it, or a wake-up as soon as
        someone arms it. Except when the waiter sleeps its long guard (nothing pending was left
        to the scan): then it is woken once, to scan again within the short one."""
        scope = submission_scope.get()
        if scope is not None:
            scope.append(fut)
        self._pending[fut.signal] = fut
        if self._idle:               # (read after the insert: see CompletionHub._run)
            self._idle = False
            self._request_wake()
        return fut

    def post_event(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the waiter thread soon; safe from any thread, including driver threads."""
        self._events.append(fn)
        self.wake()

    def fail(self, fut: GPUFuture, exc: BaseException) -> None:
        """Fail ``fut`` and, transitively, everything that depends on it (call under lock).

        Its resources stay held, and its completion stays watched, until it retires: for a
        future whose work will never run (a dead queue) the caller then uses ``retire_failed``.
        """
        posts: dict[Any, list] = {}
        self._finish(fut, exc, posts)
        self._post(posts)

    def retire_failed(self, fut: GPUFuture) -> None:
        """A failed future whose work can no longer run (its queue is destroyed): mark its
        completion object complete, so that work waiting on it elsewhere proceeds rather than
        stalls (that work's futures have failed already), and free what it held (under lock).

        Not before the work it was ordered after has retired, though: whoever waits on it on
        the device relies on its completion implying theirs (a copy ordered after it must not
        overtake an earlier copy into the same buffer)."""
        if fut._state != FAILED or fut.retired or fut._retiring:
            return
        waiting = [p for p in fut.preds if not p.retired]
        if not waiting:
            self._force_retire(fut)
            return
        left = [len(waiting)]

        def one_retired() -> None:
            left[0] -= 1
            if left[0] == 0:
                self._force_retire(fut)

        fut._retiring = True
        for p in waiting:
            p._on_retired(one_retired)
            self.arm(p)           # the host acts on their retirement: wake for it

    def _force_retire(self, fut: GPUFuture) -> None:
        if not fut.retired:
            if fut.signal:
                self.force_complete(fut.signal)
            self._retire(fut)

    def discard(self, fut: GPUFuture) -> None:
        """Forget a future whose work was never submitted (under lock)."""
        for key in fut._dep_signals:
            self.release_key(key)
        fut._dep_signals = ()
        if fut.signal and fut.signal in self._pending:
            self._unwatch(fut)
            self.release_key(fut.signal)
        fut.signal, fut.retired = 0, True

    def _unwatch(self, fut: GPUFuture) -> None:
        """Stop watching ``fut``. The signal of a waited future is in the waiter's wait set:
        the set is marked stale *before* the future leaves ``_pending`` (the HSA waiter counts
        ``_pending``, then reads ``_dirty``, to learn whether its wait covers everything)."""
        if fut.waited:
            self._dirty = True
        self._pending.pop(fut.signal, None)

    def pending_futures(self) -> list[GPUFuture]:
        with self.lock:
            return list(self._pending.values())

    @property
    def pending_count(self) -> int:
        return len(self._pending)

    def stop(self) -> None:
        """Stop the waiter thread, then retire what it left in the backlog."""
        self._stop = True
        self.wake()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self.lock:               # (its outermost section runs the backlog)
            pass
        while self._events:           # (what was left for the waiter; what they raise is only
            self._run_event(self._events.popleft())   # reported: closing must finish)

    def _run_event(self, fn: Callable[[], None], callback: Any = None) -> BaseException | None:
        """Run ``fn`` (an event for the waiter, or ``callback.run``: a done-callback without a
        loop, a ``_loops.Callback``), reporting whatever it raises, BaseException included,
        through the ``aiogpu`` logger: it never kills the waiter nor stops what comes after
        it. Returns a KeyboardInterrupt or SystemExit it raised on the main thread outside a
        section of ``lock``, for the caller to raise once the rest of its batch has run (it
        may be a real Ctrl-C: it must not be lost); None otherwise (inside a section, raising
        would leave its work half done)."""
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - see the docstring
            if callback is None:
                log.error("waiter event %r failed", fn, exc_info=exc)
            else:
                log.error("GPUFuture done-callback %r of %r raised", callback.fn, callback.arg, exc_info=exc)
            if isinstance(exc, (KeyboardInterrupt, SystemExit)) \
                    and threading.current_thread() is threading.main_thread() \
                    and not self.lock.raw._is_owned():  # type: ignore[attr-defined]
                return exc
        return None

    def _run_callback_later(self, callback: Any) -> None:
        """A loop-less done-callback handed to the waiter (``_post``): run it, reported."""
        self._run_event(callback.run, callback)

    def _settle(self, completed: list[tuple[int, GPUFuture]]) -> None:
        """Settle futures whose completion objects read complete (any thread; never waits for
        ``lock``): see the class doc. Their awaiters reach each loop in one batch."""
        posts: dict[Any, list] = {}
        pending = self._pending
        for key, fut in completed:
            if pending.get(key) is fut:
                self._completed(fut, None, posts)
        self._flush(posts)

    def _completed(self, fut: GPUFuture, exc: BaseException | None, posts: dict, *,
                   retire: bool = True) -> None:
        """The device is done with ``fut``'s work (``exc``: a failure found on the host, e.g. a
        host-side completion step). Settle it now if that needs no lock (it succeeded, nothing
        waits in the backlog to settle before it, and it is no join with an unsuccessful
        member); else queue it to settle under ``lock``. Then queue its retirement (unless not
        ``retire``). Call ``_flush(posts)`` afterwards."""
        if fut in self._queued:       # seen already (a rescan): its item settles and retires it
            return
        slow = False
        if fut._state == PENDING:
            if exc is None and not self._slow and (fut.members is None or all(
                    m._state == DONE for m in fut.members)):
                self._settle_done(fut, posts)
            else:
                slow = True
                with self.state_lock:
                    self._slow += 1
        if slow or retire:
            self._queued.add(fut)
            self._backlog.append((fut, exc, slow, retire))

    @contextlib.contextmanager
    def settling_under_lock(self) -> Iterator[None]:
        """While inside (under ``lock``), completions settle under the lock, once the holder's
        section ends: for state that a submission sets after its future can already complete
        (a join's members, which decide how it settles)."""
        with self.state_lock:
            self._slow += 1
        try:
            yield
        finally:
            with self.state_lock:
                self._slow -= 1

    def _settle_done(self, fut: GPUFuture, posts: dict) -> None:
        """Mark ``fut`` done (successfully) and collect its awaiters, unless settled already."""
        with self.state_lock:
            if fut._state != PENDING:
                return
            fut._state = DONE
            ports, fut._ports = fut._ports, None
            callbacks, fut._callbacks = fut._callbacks, ()
            event = fut._event
        self._wake_awaiters(fut, ports, callbacks, event, posts)

    def _wake_awaiters(self, fut: GPUFuture, ports: dict | None, callbacks: list | tuple, event: Any,
                       posts: dict) -> None:
        if _trace.active is not None and fut.signal:
            try:
                _trace.active.record(fut, self.device_times(fut))
            except Exception:  # noqa: BLE001 - a trace must never cost a wake-up
                log.exception("tracing %r failed", fut)
        if ports:
            for port, awaiters in ports.items():
                posts.setdefault(port, []).extend(awaiters)
        for port, fn in callbacks:
            posts.setdefault(port, []).append(_CallbackAwaiter(fn, fut))
        if event is not None:
            event.set()

    def _flush(self, posts: dict) -> None:
        """Run the backlog now if ``lock`` is free (else its holder does), queueing a watchdog
        check first when one is due; then wake the awaiters in ``posts`` (one batch per loop)."""
        if self.watchdog_s is not None and _WATCHDOG not in self._queued:
            self._queued.add(_WATCHDOG)
            self._backlog.append((None, None, False, False))
        if self._backlog:
            self.lock.try_run(functools.partial(self._drain, posts))
        self._post(posts)

    def retry_backlog(self) -> None:
        """Run what is left in the backlog if ``lock`` is free (the waiter, at each wake-up)."""
        if self._backlog:
            self.lock.try_run(self._drain)

    def _drain(self, posts: dict | None = None) -> None:
        """Run the backlog, in order (under ``lock``, by whoever holds it). With no ``posts``,
        wakes the awaiters of what it settled itself. Never raises."""
        own = posts is None
        if posts is None:
            posts = {}
        backlog, queued = self._backlog, self._queued
        while backlog:
            try:
                fut, exc, slow, retire = backlog.popleft()
            except IndexError:        # (emptied by a nested run)
                break
            try:
                if slow or fut is None:
                    self._run_item(fut, exc, slow, retire, posts)
                else:                 # the common item: a settled future to retire
                    queued.discard(fut)
                    self._retire(fut)
            except Exception as e:  # noqa: BLE001 - one failed item must not stop the others
                log.exception("settling or retiring %r failed", fut)
                if fut is not None and fut._state == PENDING:     # its awaiters must not hang
                    self._finish(fut, GPUError(f"{fut.label}: settling it failed: {e!r}"), posts)
        if own and posts:
            # Callbacks without a loop run on the waiter thread, never inside a lock holder's
            # section (one that waits for another submitting thread would deadlock there).
            waiter = self._thread
            self._post(posts, here=waiter is None or waiter is threading.current_thread()
                       or not waiter.is_alive())

    def _run_item(self, fut: GPUFuture | None, exc: BaseException | None, slow: bool,
                  retire: bool, posts: dict) -> None:
        """Settle (under the lock) and retire an item queued as slow; or run the watchdog."""
        if fut is None:
            self._queued.discard(_WATCHDOG)
            self._check_watchdog(posts)
            return
        self._queued.discard(fut)
        with self.state_lock:
            self._slow -= 1
        if fut._state == PENDING:
            # (exc None: the work completed; ``_finish`` fails a join by its members and
            # retires it.)
            self._finish(fut, exc, posts)
        if retire:
            self._retire(fut)

    def _check_watchdog(self, posts: dict) -> None:
        """Fail work that could run but stays silent for ``watchdog_s`` (a lost completion).

        Silence counts from when the work could first run, as seen by this check: the oldest
        unretired operation of its queue or engine (they run their work in order, so younger
        work may only be waiting behind it) with everything it waits for complete. Work held up
        behind a stuck operation therefore gets its full time once that one is dealt with. A
        completion that arrived since the scan is not a timeout. An operation that has failed
        already (a dependency failed) but whose work is stuck has its queue aborted, so the work
        behind it is not held up for ever; the timeout names that failure as its cause."""
        from .errors import WatchdogTimeout

        now = time.monotonic()
        oldest: dict[Any, GPUFuture] = {}
        for f in self._pending.values():
            current = oldest.get(f.queue)
            if current is None or _queue_order(f) < _queue_order(current):
                oldest[f.queue] = f
        ready, self._ready_since = self._ready_since, {}
        stale = []
        for f in oldest.values():
            if f._retiring or f in self._given_up or not self._runnable(f) or self.is_complete(f.signal):
                continue
            since = self._ready_since[f] = ready.get(f, now)
            if since <= now - (self.watchdog_s or 0.0):
                stale.append(f)                                  # runnable, yet silent
        for fut in stale:
            exc = WatchdogTimeout(f"{fut.label} on {fut.queue}: no completion within "
                                  f"{self.watchdog_s:g} s (lost or stalled completion)",
                                  queue=fut.queue, packet=fut.packet)
            exc.__cause__ = fut._exc
            if self.on_timeout is not None and self.on_timeout(fut, exc):
                continue             # the backend aborted its queue: everything on it retired
            self._given_up.add(fut)
            if fut._state == PENDING:
                # Work that cannot be aborted (a copy on an engine) may still run: fail it for
                # its awaiters but keep watching it, so its memory and signal are reused only
                # once it has really finished.
                self._finish(fut, exc, posts)
                self.leaked.append(fut)

    def _runnable(self, fut: GPUFuture) -> bool:
        """Nothing ``fut``'s work waits for on the device is still outstanding: the signals its
        packets name, and the work it was ordered after (a graph node waits on its lane's)."""
        return (all(self.is_complete(k) for k in fut._dep_signals)
                and all(p.retired or (p.signal and self.is_complete(p.signal)) for p in fut.preds))

    # -- completion ----------------------------------------------------------------------------
    def _finish(self, fut: GPUFuture, exc: BaseException | None, posts: dict) -> None:
        """Settle the user-visible state (call under ``lock``: a failure spreads to the
        dependents registered under it); retire at once when the device completed it (the
        signal said so). A join completed on the device fails then with its first failed
        member's error."""
        if fut._state != PENDING:
            return
        completed = exc is None
        if completed and fut.members is not None:
            exc = next((m._exc for m in fut.members if m._state == FAILED), None)
        with self.state_lock:
            if fut._state != PENDING:
                return
            fut._state = FAILED if exc is not None else DONE
            fut._exc = exc
            ports, fut._ports = fut._ports, None
            callbacks, fut._callbacks = fut._callbacks, ()
            event = fut._event
        self._wake_awaiters(fut, ports, callbacks, event, posts)
        if exc is not None:
            self._propagate(fut, exc, posts)
        if completed:
            self._retire(fut)

    def _retire(self, fut: GPUFuture) -> None:
        """The work has retired on the device: free what it held, recycle its signal."""
        if fut.retired:
            return
        fut.retired = True
        if fut.signal:
            self._unwatch(fut)
        for fn in fut._cleanup:
            try:
                fn()
            except Exception:  # noqa: BLE001 - one failed release must not stop the others
                log.exception("releasing what %r held failed", fut)
        fut._cleanup = ()
        for key in fut._dep_signals:
            self.release_key(key)
        fut._dep_signals = ()
        if fut.signal:
            self.release_key(fut.signal)
        fut.keep = ()
        fut._dependents = ()
        if fut._exc is None:
            fut.preds = []   # it finished after them: nothing to inherit
        callbacks, fut._on_retire = fut._on_retire, ()
        for fn in callbacks:
            fn()

    def _propagate(self, fut: GPUFuture, exc: BaseException, posts: dict) -> None:
        # Dependents fail now; their packets still run (on a released signal) and retire later.
        # Work on a device that was lost is lost with it, whichever failure reaches it first.
        lost = isinstance(exc, DeviceLost)
        for dep in fut._dependents:
            kind = DeviceLost if lost and dep.device is fut.device else GPUError
            err = kind(f"{dep.label}: a dependency failed ({fut.label}: {exc})",
                       status=getattr(exc, "status", None), queue=dep.queue, packet=dep.packet)
            err.__cause__ = exc
            self._finish(dep, err, posts)
        fut._dependents = ()

    def _post(self, posts: dict, here: bool = True) -> None:
        """Wake the awaiters in ``posts``: one call per loop; those without a loop (threads'
        callbacks) run on this thread, or with ``here`` False on the waiter thread. What such
        a callback raises is reported (``_run_event``); a KeyboardInterrupt or SystemExit on
        the main thread, outside a section of ``lock``, is raised here once every loop has its
        batch and every callback ran."""
        interrupt = None
        for port, awaiters in posts.items():
            if port is None:
                for a in awaiters:
                    if here:
                        interrupt = self._run_event(a.run, a) or interrupt
                    else:
                        self.post_event(functools.partial(self._run_callback_later, a))
            else:
                port.post(awaiters)
        if interrupt is not None:
            raise interrupt

    # -- latency: a short spin on the loop before parking on the waiter -------------------------
    def spin(self, fut: GPUFuture):
        """Poll ``fut``'s completion for up to ``spin_s`` seconds on an asyncio loop, yielding to
        the loop in between; settles it at once when done (no thread hand-off)."""
        deadline = time.perf_counter() + self.spin_s
        key = fut.signal
        while fut._state == PENDING and key and time.perf_counter() < deadline and self.awaiting == 1:
            if self.is_complete(key):
                self._settle([(key, fut)])
                break
            yield

    def is_complete(self, key: int) -> bool:
        return False
