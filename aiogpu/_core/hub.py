"""The hub: the runtime's one lock, the pending futures, and how they settle and retire.

Backend-neutral rules, owned here once: a future settles once; a failure spreads to the futures
that depend on it; a future's resources are freed when the device has *retired* its work;
awaiters are woken in batches, one thread-safe call per event loop (see ``_loops``). A backend
subclasses the hub with the waiter thread that observes its completion objects (HSA signals in
``hsa/signals.py``, CUDA completion words and events in ``cuda/waiter.py``): the hooks are
declared, with their contracts, in ``aiogpu/backend.py`` (``CompletionHooks``).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
import weakref
from collections import deque
from typing import Any, Callable, Iterable, Iterator

from .interrupts import InterruptSafeLock, RawLock
from .. import trace as _trace
from ..backend import CompletionHooks
from ..errors import DeviceLost, GPUError
from . import watchdog
from .futures import DONE, FAILED, PENDING, AwaitHub, GPUFuture, _CallbackAwaiter, make_future, submission_scope

log = logging.getLogger("aiogpu")
# The backlog's mark for a queued watchdog check (in ``FutureHub._queued``).
_WATCHDOG = object()


class Hub(AwaitHub):
    """The compiled part of ``FutureHub`` (see its doc): every rule, no hook. Compiled, this is
    an extension type whose fields, declared in hub.pxd, are C slots; it can have no Python
    base, so ``FutureHub`` joins it to the hooks' declarations."""

    def __init__(self, *, watchdog_s: float | None = None, spin_s: float = 0.0):
        self.lock = InterruptSafeLock()
        self.state_lock = RawLock()
        # Work for whoever holds ``lock``: (future or None for the watchdog, host-side failure,
        # whether the item was counted in ``_slow``, retire it).
        self._backlog: deque[tuple] = deque()
        self._queued: set = set()     # futures (and _WATCHDOG) with an item in the backlog
        self._slow = 0                # items that must settle under the lock, not yet run
        self.lock.backlog, self.lock.drain = self._backlog, self._drain
        self.watchdog_s = watchdog_s
        self.spin_s = spin_s
        # Whether a completion key names a reusable resource (an HSA pool signal): then work
        # naming it retains it and retirement releases it (``retain_key``/``release_key``);
        # a backend whose keys are plain counters (CUDA) sets it False: then neither is
        # called, and the keys are this hub's own count (``_last_key``), not ``_new_key``'s.
        self.keys_are_resources = True
        self._last_key = 0
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
        # Called under the lock for a future the watchdog gave up on: the failure report of
        # what the backend aborted for it (its queue), or None when it could abort nothing.
        self.on_timeout: Callable[[GPUFuture, BaseException], list | None] | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="aiogpu-waiter", daemon=True)
        self._thread.start()

    # -- hooks with a default (see backend.CompletionHooks) ---------------------------------------
    def observe(self, fut: GPUFuture) -> None:
        """Settle the pending ``fut`` now if its completion object reads complete, as the
        waiter's scan does (any thread, without waiting for ``lock``): ``done()`` answers from
        the device. Not inside this thread's own section of ``lock``: the layers above call
        ``done()`` there in the middle of a submission (a join whose members are not set yet
        must not settle), and loop-less callbacks never run inside a holder's section."""
        key = fut.signal
        if key and not self.lock.raw._is_owned() and self.is_complete(key):  # type: ignore[attr-defined]
            self._settle([(key, fut)])

    def spin_await(self, fut: GPUFuture):
        """What an asyncio ``await`` does before parking, when ``spin_poll`` did not see its
        work done (a generator; default: ``spin``). It returns True when it saw the work
        complete successfully on the device but left settling the future to the waiter (the
        awaiter then returns ``fut.value``)."""
        yield from self.spin(fut)
        return False

    def reap(self) -> None:
        """(``CompletionHooks.reap``; declared here too, so that the core calls it as a C method
        where it is compiled.) Default: nothing."""

    def _wake_for(self, fut: GPUFuture) -> None:
        """(``CompletionHooks._wake_for``: each backend's hub implements it; declared here too,
        as ``reap``.)"""
        raise NotImplementedError

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

    def new_future(self, label: str) -> GPUFuture:
        """A pending future with a fresh completion key (``_new_key``, or the next count where
        keys are no resources), not watched yet: the submission watches it once its work is
        encoded (under the lock)."""
        if self.keys_are_resources:
            return make_future(self, label, self._new_key())
        self._last_key += 1
        return make_future(self, label, self._last_key)

    def watch(self, fut: GPUFuture) -> GPUFuture:
        """Start watching a pending future whose ``signal`` is set (call under lock).

        The waiter is not woken for it: its periodic scan finds it, or a wake-up as soon as
        someone arms it. Except when the waiter sleeps its long guard (nothing pending was left
        to the scan): then it is woken once, to scan again within the short one."""
        scope = submission_scope.get()
        if scope is not None:
            scope.append(fut)
        self._pending[fut.signal] = fut
        if fut.waited:               # (armed while it was being encoded: in the wait set now)
            self._dirty = True
        if self._idle:               # (read after the insert: see CompletionHub._run)
            self._idle = False
            self._request_wake()
        return fut

    def depend(self, fut: GPUFuture, on: GPUFuture, *, semantic: bool = True) -> None:
        """Record that the work of ``fut`` names ``on``'s completion key (``retain_key``: kept
        from reuse until ``fut`` retires); when ``semantic``, ``fut`` also fails if ``on``
        fails. Call under lock with ``on`` not yet retired. For work encoded outside
        ``submit`` (an HSA graph replay's futures)."""
        if self.keys_are_resources:
            self.retain_key(on.signal)  # type: ignore[attr-defined]
        fut._add_dep_signal(on.signal)
        if semantic:
            on._add_dependent(fut)

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

    def settle_failed(self, failed: Iterable[tuple]) -> None:
        """Settle the work a backend reports failed (``aiogpu/backend.py``: a failure report,
        ``(future, exception, runs)`` in order; under the lock): each future not done yet fails
        with its exception, and what depends on it with it; then each one whose work will
        never run (``runs`` false: its queue or device is gone) retires once the work it was
        ordered after has (``retire_failed``). One that ``runs`` stays watched until its work
        has finished. A future named twice takes the first exception."""
        failed = list(failed)
        for fut, exc, _runs in failed:
            self.fail(fut, exc)
        for fut, _exc, runs in failed:
            if not runs:
                self.retire_failed(fut)

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
        if self.keys_are_resources:
            for key in fut._dep_signals:
                self.release_key(key)
        fut._dep_signals = ()
        if fut.signal:
            if self._pending.get(fut.signal) is fut:
                self._unwatch(fut)
            if self.keys_are_resources:
                self.release_key(fut.signal)
        fut.signal, fut.retired = 0, True

    def _unwatch(self, fut: GPUFuture) -> None:
        """Stop watching ``fut``. The signal of a waited future is in the waiter's wait set:
        the set is marked stale *before* the future leaves ``_pending`` (the HSA waiter counts
        ``_pending``, then reads ``_dirty``, to learn whether its wait covers everything)."""
        if fut.waited:
            self._dirty = True
        self._pending.pop(fut.signal, None)

    def settle_completed(self, futs: Iterable[GPUFuture]) -> None:
        """Settle those of the pending ``futs`` whose completion objects read complete, as the
        waiter's scan does (any thread; never waits for ``lock``). A backend that is about to
        fail what is left of a queue or a device calls it first: work the device finished before
        the error succeeded, and stays so."""
        self._settle([(f.signal, f) for f in futs if f.signal and self.is_complete(f.signal)])  # type: ignore[attr-defined]

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
            failed = fn()
            if failed:        # a backend's event found work failed: it is settled here
                with self.lock:
                    self.settle_failed(failed)
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

    def _completed(self, fut: GPUFuture, exc: BaseException | None, posts: dict,
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
            if exc is None and not self._slow and (fut.members is None or _members_done(fut)):
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
        lock = self.state_lock          # (its C calls, compiled: this runs per operation)
        lock._take(True, -1.0)
        try:
            if fut._state != PENDING:
                return
            fut._state = DONE
            ports, fut._ports = fut._ports, None
            callbacks, fut._callbacks = fut._callbacks, ()
            event = fut._event
        finally:
            lock._give()
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
            self.lock.try_run(self._drain, posts)
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
        """Fail work that could run but stays silent for ``watchdog_s`` (``watchdog.check``)."""
        watchdog.check(self, posts)

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
        if self.keys_are_resources:
            for key in fut._dep_signals:
                self.release_key(key)
            if fut.signal:
                self.release_key(fut.signal)
        fut._dep_signals = ()
        fut.keep = ()
        fut._dependents = ()
        if fut._exc is None:
            fut.preds = ()   # it finished after them: nothing to inherit
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


def _members_done(join: GPUFuture) -> bool:
    """Whether every member of the join ``join`` succeeded."""
    for m in join.members:
        if m._state != DONE:
            return False
    return True


class FutureHub(CompletionHooks, Hub):
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

    __slots__ = ()
