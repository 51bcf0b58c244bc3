"""The only event-loop-specific code: how a GPU completion reaches an asyncio loop or a trio run.

A *port* is one event loop. The waiter thread hands each port a batch of completions with one
thread-safe call per wake-up (``post``), never one call per future. A batch holds awaiters
(parked tasks) and ``Callback`` items (done-callbacks). Both ports hand them on a few per turn
of the loop (an asyncio iteration, a trio batch): every aiogpu await that goes on in a turn
takes one of its *slots* (``_Slots``), so that a burst of completions never makes one long turn
(see ``AsyncioPort`` and ``TrioPort``). A callback that raises stops nothing else: on asyncio
its exception goes to the loop's exception handler, as for any asyncio callback; on trio, which
has no such handler, it is logged on the ``aiogpu`` logger. KeyboardInterrupt and SystemExit
from a callback propagate: on asyncio out of the loop, as asyncio does, after the rest of the
batch has been handed to the loop again; on trio a KeyboardInterrupt goes to the run as a Ctrl-C
does (to its main task, so that ``trio.run`` raises it), the rest of the batch handed on at once,
and a SystemExit ends the run as its ``TrioInternalError`` (trio's way with a failing
``run_sync_soon`` callback). Posting to a loop that has closed, or a trio run
that has finished, is dropped silently: the waiter thread never raises.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import sys
import threading
import time
import weakref
from typing import Any, Callable, Generator

Batch = list[Any]
log = logging.getLogger("aiogpu")


class Callback:
    """A done-callback in a batch: ``fn(arg)`` on the loop that registered it."""

    __slots__ = ("fn", "arg")

    def __init__(self, fn: Callable[[Any], Any], arg: Any):
        self.fn, self.arg = fn, arg

    def run(self) -> None:
        self.fn(self.arg)

    def set_result(self, _value: Any) -> None:  # callbacks with no loop run on the waiter thread
        self.run()


# Slots per turn of a loop (an asyncio iteration, a trio batch): a woken task runs in the next
# turn and may do a request's whole host-side work there; waking hundreds at once would make one
# long turn in which no timer fires and no socket is read (the loop's lag is the turn's length).
TURN_BUDGET_S = 0.001          # the turn length the slots aim at (see bench/serve.py)
SLICE_MIN, SLICE_MAX = 2, 256
WAKE_SLICE = 8                 # slots at first
COST_WEIGHT = 0.25             # of the last turn in the moving average of the cost per slot
BACKLOG_ITERATIONS = 16        # a backlog of awaits gets through in about this many turns


class _Slots:
    """The slot accounting of one event loop, the same for both ports: how many aiogpu awaits
    may go on in one *turn* of the loop (an asyncio iteration, a trio batch).

    ``slice`` slots per turn, of which ``used`` are taken in the turn being counted. ``slice``
    is ``TURN_BUDGET_S`` over the loop time per slot taken, a moving average over the last
    turns (a turn's length over the slots it used: what the resumed tasks cost, and the work
    they bring in, such as the next requests of the clients they answered), between
    ``SLICE_MIN`` and ``SLICE_MAX``. Other work in the loop makes that cost look higher; so
    that it never starves aiogpu's awaits, a backlog still gets through in about
    ``BACKLOG_ITERATIONS`` turns."""

    __slots__ = ("slice", "used", "_cost", "_floor")

    def __init__(self) -> None:
        self.slice = WAKE_SLICE
        self.used = 0
        self._cost = 0.0                  # loop seconds per slot taken (a moving average)
        self._floor = 0                   # slots the current backlog needs at least

    def take(self) -> bool:
        """Take a slot of the counted turn; False when none is left."""
        if self.used >= self.slice:
            return False
        self.used += 1
        return True

    def next_turn(self, seconds: float, used: int, backlog: int) -> None:
        """A turn in which ``used`` slots went on lasted ``seconds`` (0: not measured), and
        ``backlog`` awaits still wait: fresh slots for the next one."""
        if seconds and used:
            per = seconds / used
            self._cost = per if not self._cost else self._cost + (per - self._cost) * COST_WEIGHT
            fit = int(TURN_BUDGET_S / self._cost)
            self.slice = min(SLICE_MAX, max(SLICE_MIN, fit, self._floor))
        # (The floor holds while the backlog lasts: it drains at the pace it started with.)
        self._floor = max(self._floor, backlog // BACKLOG_ITERATIONS) if backlog else 0
        self.used = 0


class _Port:
    """What the two ports share: the queue of completions (and of awaits waiting for a slot),
    handed over to drains on the loop, and the loop's slots (``_Slots``)."""

    def __init__(self) -> None:
        self._queue: collections.deque = collections.deque()
        self._lock = threading.Lock()     # guards the queue's hand-over with ``_scheduled``
        self._scheduled = False           # a drain is queued on the loop
        self._slots = _Slots()

    @property
    def slice(self) -> int:
        """Slots per turn of the loop, as adapted so far."""
        return self._slots.slice

    def _hand_on(self, items: Batch) -> None:
        """On the loop: run the done-callbacks and wake the awaiters in ``items``, in order. A
        callback that raises stops nothing else (``_report``); KeyboardInterrupt and SystemExit
        propagate once the items after it are first in line again (``_requeue``)."""
        for i, item in enumerate(items):
            if type(item) is Callback:
                try:
                    item.run()
                except (SystemExit, KeyboardInterrupt) as exc:
                    if self._deliver(exc):
                        continue
                    self._requeue(items[i + 1:])
                    raise
                except BaseException as exc:
                    self._report(item, exc)
            else:
                self._wake(item)

    def _report(self, callback: Callback, exc: BaseException) -> None:
        raise NotImplementedError

    def admit(self, woken: bool = False) -> bool:
        """May an await go on in this turn of the loop (each port's rule)?"""
        raise NotImplementedError

    def _deliver(self, exc: BaseException) -> bool:
        """A callback raised KeyboardInterrupt or SystemExit: True if the loop was handed it
        its own way (the rest goes on); False: it propagates from here."""
        return False

    def _wake(self, awaiter: Any) -> None:
        raise NotImplementedError

    def _requeue(self, rest: Batch) -> None:
        raise NotImplementedError

    def _put(self, items: Batch, first: bool = False) -> bool:
        """Queue ``items`` (``first``: at the front, in their order); True when the caller
        must schedule a drain (none is queued on the loop yet)."""
        lock = self._lock                 # (two calls, not a with statement: per post)
        lock.acquire()
        try:
            if first:
                self._queue.extendleft(reversed(items))
            else:
                self._queue.extend(items)
            if self._scheduled or not self._queue:
                return False
            self._scheduled = True
            return True
        finally:
            lock.release()


class AsyncioPort(_Port):
    """An asyncio (or uvloop) event loop. Awaiters are asyncio futures of that loop.

    Posts from any thread go into one queue per loop, drained on the loop (one
    ``call_soon_threadsafe`` while a drain is scheduled, however many posts arrive). Every
    aiogpu await that goes on in an iteration of the loop takes one of its ``slice`` *slots*:
    a task woken from the queue and an await whose result was ready alike; the rest wait, in
    order, for the next iteration. The slots are ``TURN_BUDGET_S`` over the measured loop
    time per slot taken (between ``SLICE_MIN`` and ``SLICE_MAX``). A service whose requests
    each do a few hundred microseconds of host work (on resuming, and on arriving, which the
    slots hold back in turn) so keeps its loop's iterations, and its timers' lateness, near
    the budget, while cheap awaits are not slowed down by extra iterations. (``TrioPort``
    has the same slots per trio batch.)"""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        super().__init__()
        self._loop = weakref.ref(loop)
        self._marked = False              # ``_new_iteration`` is queued on the loop
        self._mark = 0.0                  # when it last ran, if in the previous iteration

    def post(self, awaiters: Batch) -> None:
        loop = self._loop()
        if loop is None or loop.is_closed():
            return
        if not self._put(awaiters):
            return
        try:
            loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # closed between the check and the call: nothing will run
            with self._lock:
                self._queue.clear()
                self._scheduled = False

    def _drain(self) -> None:
        """On the loop: wake as many as the next iteration has slots for."""
        queue = self._queue
        lock = self._lock                 # (as in _put)
        lock.acquire()
        try:
            batch = [queue.popleft() for _ in range(min(self._slots.slice, len(queue)))]
            more = self._scheduled = bool(queue)
        finally:
            lock.release()
        loop = _get_running_loop()
        self._count(loop)
        if more:
            loop.call_soon(self._drain)
        self._hand_on(batch)

    def _report(self, callback: Callback, exc: BaseException) -> None:
        """A done-callback raised: the loop's exception handler hears of it, as for any
        asyncio callback."""
        asyncio.get_running_loop().call_exception_handler(
            {"message": f"Exception in GPUFuture done-callback {callback.fn!r}",
             "exception": exc, "future": callback.arg})

    def _wake(self, awaiter: Any) -> None:
        if not awaiter.done():            # (cancelled meanwhile: nothing to wake)
            awaiter.set_result(None)

    def admit(self, woken: bool = False) -> bool:
        """On the loop: may an await go on in this iteration (a slot taken)? ``woken``: its
        task was woken from the queue (else its result was ready, and it must not overtake
        the tasks queued). (``_Slots.take`` and ``_count``, written out: once per await.)"""
        slots = self._slots
        if (self._queue and not woken) or slots.used >= slots.slice:
            return False
        slots.used += 1
        if not self._marked:
            self._count(_get_running_loop())
        return True

    def _count(self, loop: asyncio.AbstractEventLoop) -> None:
        """The port is busy in this iteration: ``_new_iteration`` runs early in the next."""
        if not self._marked:
            self._marked = True
            loop.call_soon(self._new_iteration)

    def _new_iteration(self) -> None:
        """Early in each iteration while the port is busy (queued before the tasks a drain
        woke in the last one): fresh slots (``_Slots.next_turn``), the last iteration measured
        from this call to the next."""
        now = time.perf_counter()
        used = self._slots.used
        self._slots.next_turn(now - self._mark if self._mark else 0.0, used, len(self._queue))
        if used or self._queue:            # measure the next iteration too
            self._mark = now
            _get_running_loop().call_soon(self._new_iteration)
        else:
            self._mark, self._marked = 0.0, False

    def go_on(self, woken: bool = False) -> Generator:
        """An await's last step on the loop: go on now if ``admit(woken)``, else wait in the
        queue (a woken task first in line) until admitted in a later iteration."""
        loop: Any = None
        while not self.admit(woken):
            loop = loop or self._loop()
            fut = loop.create_future()
            if self._put([fut], first=woken):  # (on the loop's thread: no thread-safe call)
                loop.call_soon(self._drain)
            try:
                yield from fut.__await__()
            finally:
                if not fut.done():
                    fut.cancel()
            woken = True

    def _requeue(self, rest: Batch) -> None:
        """The items after a callback that raised KeyboardInterrupt: first in line again."""
        if self._put(rest, first=True):
            asyncio.get_running_loop().call_soon(self._drain)

    def wait(self, work: Any) -> Generator:
        """Park until a completion of ``work`` (a GPUFuture: its ``_register(port, awaiter)``
        and ``_unregister``) is posted; the caller then goes on with ``go_on(woken=True)``."""
        loop: Any = self._loop()
        fut = loop.create_future()
        work._register(self, fut)
        try:
            yield from fut.__await__()
        finally:
            # Cancelled: detach this awaiter only. A task destroyed after its loop was closed
            # also gets here; cancelling would schedule on the closed loop, so it is left be.
            # Woken (a result, set only by a post), it is detached already: the settling took
            # the work's awaiters before posting them, or ``_register`` posted it unregistered.
            if not fut.done() or fut.cancelled():
                if not fut.done() and not loop.is_closed():
                    fut.cancel()
                work._unregister(self, fut)


class _TrioAwaiter:
    """A trio task parked in ``wait_task_rescheduled`` until a drain hands it on; ``done`` once
    handed on, or cancelled (a drain then skips it)."""

    __slots__ = ("task", "done")

    def __init__(self, task: Any):
        self.task, self.done = task, False


class TrioPort(_Port):
    """A trio run. Awaiters are trio tasks parked with ``wait_task_rescheduled``.

    The slots of ``AsyncioPort``, per *batch*: trio runs the tasks runnable when a batch
    starts in that batch, and a task rescheduled during it in the next. Posts from any thread
    go into one queue per run, drained by ``run_sync_soon`` callbacks (in the run's system
    task). Every aiogpu await that goes on in a batch takes one of its ``slice`` slots, in
    the batch before, as its task is rescheduled into it: a drain hands on a completion (wakes
    its task, or runs a done-callback) only while the next batch has a slot left, and an await
    whose result was ready is a checkpoint into the next batch only while it has a slot left
    and no one waits in line. The rest wait, in order, for later batches. A task waiting for a
    slot is cancellable there: it raises ``Cancelled`` alone, and its place goes to the next in
    line. The slots per batch adapt as ``AsyncioPort``'s per iteration (``_Slots``): the port
    is a trio instrument of its run, measuring each batch in which slots went on."""

    def __init__(self, token: Any):
        import trio

        super().__init__()
        self._token = token
        self._lowlevel = trio.lowlevel
        self._finished = trio.RunFinishedError
        self._running = 0                 # slots of the batch under way (taken in the last)
        self._began = 0.0                 # when that batch began, if it is measured
        self._ended = 0.0                 # when the last measured batch ended
        # Two hook calls per turn of the run, from now until it ends: cheaper than adding and
        # removing an instrument as the port turns busy and idle (``add_instrument`` reads the
        # instrument's whole ``dir()``, and takes the hooks found there: an instrument need
        # not subclass ``trio.abc.Instrument``, which this module cannot import up front).
        trio.lowlevel.add_instrument(self)  # type: ignore[arg-type]

    def post(self, awaiters: Batch) -> None:
        if self._put(awaiters) and not self._drain_soon():
            with self._lock:              # the run has finished: nothing will run
                self._queue.clear()
                self._scheduled = False

    def _drain_soon(self) -> bool:
        """Queue a drain on the run; False when the run has finished.

        Queued from a ``run_sync_soon`` callback (a drain), it runs in the system task's next
        pass, in the next batch: trio's ``EntryQueue.task`` (trio/_core/_entry_queue.py) runs,
        in one pass, the callbacks queued when the pass began (``run_all_bounded``), then
        checkpoints when more were queued meanwhile."""
        try:
            self._token.run_sync_soon(self._drain)
        except self._finished:
            return False
        return True

    def _drain(self) -> None:
        """In the run's system task: hand on as many completions as the next batch has slots
        left; a drain in the next batch goes on with the rest."""
        queue, slots, items = self._queue, self._slots, []
        with self._lock:
            while queue and slots.used < slots.slice:
                item = queue.popleft()
                if type(item) is Callback or not item.done:  # (a cancelled task: no slot)
                    slots.used += 1
                    items.append(item)
            more = self._scheduled = bool(queue)
        if more and not self._drain_soon():
            # The system task's last pass, as the run ends: no batch comes after it.
            with self._lock:
                items.extend(queue)
                queue.clear()
                self._scheduled = False
        self._hand_on(items)

    def _report(self, callback: Callback, exc: BaseException) -> None:
        """A done-callback raised: trio has no exception handler, so it is logged."""
        log.error("exception in GPUFuture done-callback %r", callback.fn, exc_info=exc)

    def _deliver(self, exc: BaseException) -> bool:
        """A KeyboardInterrupt goes to the run as a Ctrl-C does: trio's SIGINT handler, inside
        KI-protected code such as this drain, calls the runner's ``deliver_ki``
        (trio/_core/_ki.py, ``KIManager.install``; trio/_core/_run.py, ``Runner.deliver_ki``),
        which raises it in the main task at its next checkpoint (or out of ``trio.run`` as it
        ends). Raised from here instead, trio would end the run with TrioInternalError. Where
        the runner has no ``deliver_ki`` (a trio that changed it), and for SystemExit, it
        propagates (TrioInternalError)."""
        if not isinstance(exc, KeyboardInterrupt):
            return False
        runner = getattr(getattr(sys.modules.get("trio._core._run"), "GLOBAL_RUN_CONTEXT", None),
                         "runner", None)
        deliver = getattr(runner, "deliver_ki", None)
        if deliver is None:
            return False
        deliver()
        return True

    def _wake(self, awaiter: "_TrioAwaiter") -> None:
        if not awaiter.done:              # (not cancelled by a callback before it)
            awaiter.done = True
            self._lowlevel.reschedule(awaiter.task)

    def _requeue(self, rest: Batch) -> None:
        """The items after a callback that raised KeyboardInterrupt: first in line again.
        (trio makes the exception of a ``run_sync_soon`` callback a ``TrioInternalError`` of
        the run and ends it; the drains of the system task's remaining passes, the last one
        as the run ends, hand the rest on.)"""
        if self._put(rest, first=True):
            self._drain_soon()

    def admit(self, woken: bool = False) -> bool:
        """May an await go on at once, without a checkpoint? Only when a drain woke its task
        (``woken``: its slot taken then); else ``go_on``."""
        return woken

    def go_on(self, woken: bool = False) -> Generator:
        """An await's last step in the run. ``woken``: a drain woke the task and took its slot
        then; it goes on. Else its result was ready: a checkpoint (trio's rule: a cancellation
        point and a schedule point) into the next batch, taking a slot of it, when it has one
        left and no one waits in line; otherwise a wait in line until a drain hands it on."""
        if woken:
            return
        if not self._queue and self._slots.take():
            yield from self._lowlevel.checkpoint().__await__()
            return
        awaiter = _TrioAwaiter(self._lowlevel.current_task())
        if self._put([awaiter]):
            self._drain_soon()            # (the run is running: it cannot have finished)
        yield from self._park(awaiter)

    def wait(self, work: Any) -> Generator:
        """Park until a completion of ``work`` (as for ``AsyncioPort.wait``) is posted and a
        drain hands it on (its slot taken: the caller's ``go_on(woken=True)`` then has nothing
        to do)."""
        awaiter = _TrioAwaiter(self._lowlevel.current_task())
        work._register(self, awaiter)
        try:
            yield from self._park(awaiter)
        finally:
            work._unregister(self, awaiter)

    def _park(self, awaiter: _TrioAwaiter) -> Generator:
        """Until a drain hands ``awaiter`` on. Cancelled before, it is marked done, so that a
        drain skips it (no slot taken, no one else's wake-up spent), and raises Cancelled."""
        lowlevel = self._lowlevel

        def abort(_raise_cancel: Any) -> Any:
            awaiter.done = True
            return lowlevel.Abort.SUCCEEDED

        yield from lowlevel.wait_task_rescheduled(abort).__await__()

    # -- the port's trio instrument hooks, called by trio's run loop (``unrolled_run`` in
    # trio/_core/_run.py) around its I/O wait: ``before_io_wait`` just after a batch has run,
    # ``after_io_wait`` just before the next is taken from the run queue.

    def after_io_wait(self, _timeout: float) -> None:
        """A batch begins: the slots taken in the last batch are this one's; fresh slots for
        the next (``_Slots.next_turn``), the last batch measured if slots went on in it."""
        slots = self._slots
        if not (slots.used or self._running):
            # No slot taken of this batch or the last: nothing to count or measure. (A backlog
            # posted meanwhile counts from its first drain on, as on asyncio.)
            self._began = 0.0
            return
        now = time.perf_counter()
        ran, self._running = self._running, slots.used
        slots.next_turn(self._ended - self._began if self._began else 0.0, ran, len(self._queue))
        self._began = now

    def before_io_wait(self, _timeout: float) -> None:
        """A batch has run (its length excludes the I/O wait: idle time is not a slot's cost)."""
        if self._began:
            self._ended = time.perf_counter()


def checkpoint() -> Generator:
    """The last step of an await whose result is ready: the running loop's ``go_on``. On trio
    a checkpoint (a cancellation point and a schedule point: trio's rule for library calls)
    that takes a slot of the next batch, or waits in line for one (see ``TrioPort``). On
    asyncio nothing (asyncio has no such rule), unless this loop iteration has no slot left
    for aiogpu awaits (see ``AsyncioPort``): then a wait for one in a later iteration."""
    port = current_port()
    if port is not None:
        yield from port.go_on()


_asyncio_ports: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncioPort]" = weakref.WeakKeyDictionary()
# Each trio run's port, in a ``trio.lowlevel.RunVar`` (made once trio runs): it lasts as long as
# its run, however many runs there are.
_trio_port_var: Any = None
_trio_port_var_lock = threading.Lock()


def _in_trio() -> Any:
    """The current trio run's token, or None. Reads ``trio.lowlevel`` only once trio is fully
    imported: while another thread imports it, ``sys.modules["trio"]`` is half-built (and no
    trio run can exist yet). ``in_trio_run`` (trio >= 0.23) answers "no" without raising."""
    lowlevel = getattr(sys.modules.get("trio"), "lowlevel", None)
    if lowlevel is None:
        return None
    in_run = getattr(lowlevel, "in_trio_run", None)
    if in_run is not None and not in_run():
        return None
    current = getattr(lowlevel, "current_trio_token", None)
    if current is None:
        return None
    try:
        return current()
    except RuntimeError:
        return None


# The port of the loop asked about last: a service asks for the same loop again and again.
_last_port: AsyncioPort | None = None


_modules = sys.modules
_get_running_loop: Callable[[], Any] = asyncio._get_running_loop   # (on the loop: its loop)


def current_port() -> AsyncioPort | TrioPort | None:
    """The port of the running event loop, or None in plain synchronous code."""
    if "trio" in _modules:
        token = _in_trio()
        if token is not None:
            return _trio_port(token)
    loop = _get_running_loop()
    if loop is None:
        return None
    last = _last_port
    if last is not None and last._loop() is loop:     # (a weak reference: no loop kept alive)
        return last
    return _asyncio_port(loop)


def _asyncio_port(loop: asyncio.AbstractEventLoop) -> AsyncioPort:
    global _last_port
    last = _last_port
    if last is not None and last._loop() is loop:     # (a weak reference: no loop kept alive)
        return last
    asyncio_port = _asyncio_ports.get(loop)
    if asyncio_port is None:
        asyncio_port = _asyncio_ports[loop] = AsyncioPort(loop)
    _last_port = asyncio_port
    return asyncio_port


def _trio_port(token: Any) -> TrioPort:
    """The port of the trio run whose token is ``token`` (the running one)."""
    global _trio_port_var
    var = _trio_port_var
    if var is None:
        with _trio_port_var_lock:              # (runs may start in several threads at once)
            if _trio_port_var is None:
                import trio

                _trio_port_var = trio.lowlevel.RunVar("aiogpu._loops.port")
            var = _trio_port_var
    port = var.get(None)
    if port is None:
        port = TrioPort(token)
        var.set(port)
    return port
