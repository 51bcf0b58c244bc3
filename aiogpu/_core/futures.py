"""GPU futures: the completion of GPU work, on every backend.

A ``GPUFuture`` settles once (done or failed); its resources are freed when the device has
*retired* its work (which, for a failed future, may be later than its failure). Settling,
retiring and the spread of failures are the hub's (``hub.py``); this module holds the future's
state and the protocols it speaks to awaiters: ``await`` (through the loop bridge, ``_loops``),
asyncio's future protocol, done-callbacks, ``wait()`` for threads. One class serves every
backend: a backend's completion is its ``signal`` key (an HSA signal handle, a CUDA ticket's
key) and the backend fields below, which the backend's encode sets and its hub reads.
"""
from __future__ import annotations

import asyncio as _asyncio
import contextvars
import logging
import threading
import types
import weakref
from time import monotonic as _monotonic   # (per future: a module global, not an attribute of time)
from typing import TYPE_CHECKING, Any, Callable, Generator, TypeVar

from .. import _loops
from .._loops import _Port, current_port
from .interrupts import RawLock
from .. import trace as _trace
from ..errors import BlockingCallError, InvalidStateError

try:
    import cython  # type: ignore[import-untyped,import-not-found,unused-ignore]
except ImportError:            # interpreted, where Cython is not installed (see interrupts.py)
    globals()["cython"] = type("cython", (), {"compiled": False})
if not cython.compiled:
    # The .pxd's C names, used only compiled (here for type checkers).
    clock_gettime: Any = None
    CLOCK_MONOTONIC: Any = None
    ts: Any = None

log = logging.getLogger("aiogpu")

# The futures submitted in this context are appended here when a TaskGroup is active.
submission_scope: contextvars.ContextVar[Any] = contextvars.ContextVar("aiogpu_scope", default=None)
PENDING, DONE, FAILED = 0, 1, 2


_T = TypeVar("_T")


class AwaitHub:
    """What an ``await`` asks of its future's hub, declared beside the future so that the
    await calls it as C functions where the core is compiled (futures.pxd; ``hub.Hub``
    derives from it and implements it, a backend's hub may override its hooks). Fields:
    ``state_lock`` (the leaf lock of a future's settling: see ``FutureHub``), ``spin_s`` (the
    longest spin on the loop before an await parks; 0: none), ``awaiting`` (futures being
    awaited now: the spin policy reads it)."""

    __slots__ = ("state_lock", "spin_s", "awaiting")

    def spin_poll(self, fut: "GPUFuture") -> bool:
        """An asyncio ``await``'s first look at its work, before ``spin_await`` and without
        yielding (short work is done by then): True, as for ``spin_await``, when it saw the
        work complete successfully but left settling the future to the waiter; else False (the
        future may have settled meanwhile). Default: False (``spin_await`` polls)."""
        return False

    def arm(self, fut: "GPUFuture") -> None:
        """Someone waits for ``fut`` (``Hub.arm``)."""
        raise NotImplementedError

    def parked_done(self, fut: "GPUFuture") -> None:
        """A parked await of ``fut`` was woken (backends learn from it; no lock). Default:
        nothing."""


class GPUFuture:
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

    # ``GPUFuture[T]`` at run time, as for the builtin generics (the type parameter is for type
    # checkers, which read futures.pyi: compiled, this class is an extension type whose fields,
    # declared in futures.pxd, are C slots; it can have no Python base).
    __class_getitem__ = classmethod(types.GenericAlias)

    # asyncio's duck-typing marker (asyncio.isfuture): a future, never yielded to a task itself.
    _asyncio_future_blocking = False
    if TYPE_CHECKING:    # our own fields, not asyncio.Future's of the same names
        _state: int  # type: ignore[assignment]
        _callbacks: list[tuple[Any, Callable]] | tuple  # type: ignore[assignment]

    __slots__ = ("_hub", "_state", "_exc", "signal", "_ports", "_event", "_callbacks", "_cleanup",
                 "_dependents", "_dep_signals", "preds", "_on_retire", "_retiring", "retired", "label", "value", "device", "kind", "nbytes", "queue", "packet",
                 "lane", "submitted_at", "keep", "members", "waited", "_views", "ticket", "event", "on_complete",
                 "staging", "host_deps", "__weakref__")
    # (asyncio.gather reads it of a cancelled child: cancel() keeps no message)
    _cancel_message = None

    def __init__(self, hub: Any, label: str = "", signal: int = 0):
        _setup(self, hub, label, signal)

    # -- state -------------------------------------------------------------------------------
    def done(self) -> bool:
        """True once the work has completed or failed. Reads the completion itself (the
        backend's completion object, through the hub) when the waiter has not settled it yet,
        so it is current for work nobody awaits too."""
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
        if self._state == PENDING and not self.done():
            raise self._not_done()
        if self._exc is not None:
            mark_retrieved(self._exc)
            raise self._exc
        return self.value

    def exception(self) -> BaseException | None:
        """The failure (a GPUError), None on success; InvalidStateError while pending
        (CancelledError to a task that cancelled it, see ``cancel()``)."""
        if self._state == PENDING and not self.done():
            raise self._not_done()
        if self._exc is not None:
            mark_retrieved(self._exc)
        return self._exc

    def _not_done(self) -> BaseException:
        """What ``result()`` and ``exception()`` raise while the work is pending: CancelledError
        to a task that cancelled it (see ``cancel()``), else InvalidStateError."""
        if self._views is not None and _viewing_task() in self._views:
            return _asyncio.CancelledError()
        return InvalidStateError(f"{self!r} is not done")

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
        port: _Port = current_port()      # (compiled: C calls of the port's admission)
        if port is None:
            raise RuntimeError("await a GPUFuture inside asyncio, uvloop or trio; "
                               "use .wait() in synchronous code")
        hub: AwaitHub = self._hub
        seen = ready = parked = False
        hub.awaiting += 1
        try:
            # Spin only while this is the one future awaited: a service with many requests
            # in flight parks them all (the waiter wakes each loop once per batch), so the
            # loop never busy-polls while other tasks wait for the GPU too.
            if hub.spin_s > 0 and hub.awaiting == 1 and isinstance(port, _AsyncioPort):
                # True: the device completed it (read without the lock); the waiter settles
                # and retires it at its next scan, off this loop (or, when the waiter has
                # fallen behind, the spin settled it: see the backend's reap).
                seen = hub.spin_poll(self)
                if not seen and self._state == PENDING:
                    seen = yield from hub.spin_await(self)
                ready = seen or self._state != PENDING
            if not ready and self._state == PENDING:
                hub.arm(self)
                yield from port.wait(self)
                hub.parked_done(self)
                parked = True
        finally:
            hub.awaiting -= 1
        # The task goes on only once admitted to this turn of the loop (see _loops' ports):
        # woken from the port's queue (on trio the drain that woke it admitted it), or with
        # its result ready, as an await of a done future (_loops.checkpoint).
        if (ready or parked) and not port.admit(parked):
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
        lock: RawLock = self._hub.state_lock   # (its C calls, compiled: this runs per parked await)
        lock._take(True, -1.0)
        try:
            if self._state == PENDING:
                ports = self._ports
                if ports is None:
                    ports = self._ports = {}
                ports.setdefault(port, []).append(awaiter)
                return
        finally:
            lock._give()
        port.post([awaiter])  # finished meanwhile: wake at once

    def _unregister(self, port: Any, awaiter: Any) -> None:
        lock: RawLock = self._hub.state_lock
        lock._take(True, -1.0)
        try:
            waiters = self._ports.get(port) if self._ports else None
            if waiters and awaiter in waiters:
                waiters.remove(awaiter)
        finally:
            lock._give()

    def __repr__(self) -> str:
        state = ("pending", "done", "failed")[self._state]
        where = f" on {self.queue}" if self.queue else ""
        return f"<GPUFuture {self.label or '?'}{where} {state}>"


def make_future(hub: Any, label: str, signal: Any) -> GPUFuture:
    """``GPUFuture(hub, label, signal)`` without ``__init__``'s argument parsing (compiled, the
    type's allocation and one C call): the hub's per-operation constructor."""
    fut = GPUFuture.__new__(GPUFuture)
    _setup(fut, hub, label, signal)
    return fut


def _setup(fut: Any, hub: Any, label: Any, signal: Any) -> int:
    """A new future's fields (``GPUFuture.__init__``)."""
    fut._hub = hub                    # (None only for futures settled at creation)
    fut._state = PENDING
    fut.signal = signal               # the completion key (an HSA signal handle; 0: none)
    fut.label = label
    fut.retired = signal == 0         # the device is done with it (resources freed)
    fut._retiring = False             # a failed future waiting for its preds to retire
    fut.waited = False                # someone waits for it: the waiter wakes for it (hub.arm)
    fut.kind = ""                     # "dispatch", "copy", "join", "graph" (for traces)
    fut.nbytes = 0                    # bytes moved (copies)
    fut.submitted_at = _now()
    # Empty (an empty tuple) until the first entry: fewer objects per future for the garbage
    # collector to track (a request's futures live across several of its collections).
    fut._callbacks = ()               # (port, fn) to call once settled
    fut._cleanup = ()                 # run once it has retired (under the lock)
    fut._dependents = ()              # futures that fail when it fails
    fut._dep_signals = ()             # keys of other futures that its work names
    fut.preds = ()                    # earlier work it was ordered after (see hazards)
    fut._on_retire = ()               # run once it has retired
    fut.keep = ()                     # buffers and host arrays the GPU work uses
    # Set by backends that order work on lanes by tickets (CUDA): the ticket on ``lane``.
    fut.ticket = 0
    if not cython.compiled:
        # The fields that start as None (compiled, the type's allocation sets every object
        # field to None, so they are not stored again per future).
        fut._exc = None               # the failure
        fut._ports = None             # the loops' ports with awaiters parked on it
        fut._event = None             # a threading.Event for wait()
        fut.value = None              # what result() returns (an array for to_numpy)
        fut.device = None             # the device whose queue or engine runs it
        fut.queue = None              # where the work runs ("gpu0.q1", "gpu0.sdma0", ...)
        fut.packet = None             # packet index of the completion packet in that queue
        fut.lane = None               # the backend's lane object (queue, stream) it runs on
        fut.members = None            # a join's members (see Runtime.gather)
        fut._views = None             # the tasks to which it looks cancelled (see cancel())
        # (CUDA: an event recorded after the work where the lane has no completion word, host
        # steps that complete it (a bounced download's copy-out), its bounce block, and
        # earlier work whose host steps must run first)
        fut.event = None
        fut.on_complete = None
        fut.staging = None
        fut.host_deps = None
    return 0


def _now() -> float:
    """``time.monotonic()`` (CLOCK_MONOTONIC, its clock): compiled, one ``clock_gettime``, not a
    Python call (per future)."""
    if cython.compiled:
        clock_gettime(CLOCK_MONOTONIC, cython.address(ts))
        return ts.tv_sec + ts.tv_nsec * 1e-9
    return _monotonic()


# A done-callback delivered through a port in the batch of awaiters (``fn(future)``).
_CallbackAwaiter = _loops.Callback
_AsyncioPort = _loops.AsyncioPort


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


def completed_future(hub: Any, label: str = "",
                     exc: BaseException | None = None) -> GPUFuture:
    """A future that is already done (or failed with ``exc``): an operation of ``hub``'s runtime
    that never ran on the device (traced as such)."""
    fut: GPUFuture[Any] = GPUFuture(hub, label)
    fut._state = FAILED if exc is not None else DONE
    fut._exc = exc
    if hub is not None and _trace.active is not None:
        _trace.active.record(fut, None, ran=False)
    return fut


def preds_list(fut: Any) -> list:
    """``fut.preds`` as a list to add to (an empty tuple until the first entry: see
    ``GPUFuture.preds``). ``fut``: a GPUFuture, or a graph node at capture."""
    if isinstance(fut, GPUFuture):
        f = fut                       # (compiled, its C field)
        if type(f.preds) is not list:
            f.preds = [*f.preds]
        return f.preds
    if type(fut.preds) is not list:
        fut.preds = [*fut.preds]
    return fut.preds


def add_preds(fut: Any, items: list) -> None:
    """Order ``fut`` after ``items`` as well (``GPUFuture.preds``: what a future that fails
    without running hands on to its readers, and what it retires after)."""
    if items:
        preds_list(fut).extend(items)
