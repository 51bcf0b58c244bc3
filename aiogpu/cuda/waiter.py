"""CUDA completions: ``CudaHub`` (the spin, the wake-ups, the waiter thread).

A CUDA future is (lane, ticket): after the operation its lane writes the ticket into the lane's
completion word in host memory (streams.py; or records an event, where words are not used). How
a completion reaches an awaiter, fastest first:

1. **Adaptive spin on the loop** (asyncio/uvloop): ``await`` first polls the completion word
   (one memory load; ``cuEventQuery`` where the device lacks stream memory operations) for up to
   the lane's spin window, yielding to the loop between polls so other tasks run. Short work
   completes inside it, so the await costs about the synchronous floor and no thread is
   involved. Each lane adapts its window: it halves after a poll that ran out (long kernels: little
   CPU spent) and grows after a hit, within [``SPIN_MIN_S``, ``spin_s``]. A copy whose end can be
   predicted from the bandwidth its lane has shown first sleeps on the loop (a timer, no CPU)
   until shortly before that end, then spins.
2. **Parked awaiters** (the spin ran out; trio; ``wait()`` from threads; done-callbacks; see
   ``FutureHub.arm`` for who counts as waiting) *arm* their lane: one ``cuLaunchHostFunc`` of
   libc's ``sem_post`` is queued on the lane's stream after its current work (once per lane
   until that point is passed). The driver's callback thread runs ``sem_post`` in C: no Python
   runs on a driver thread. While a wake-up queued on the lane has not run, a park queues none:
   the waiter that wake-up wakes arms the lane again, before its scan, for the tickets parked
   meanwhile (``LaneHub.rearm``), so a burst of parked awaits costs one host function, not one
   each.
3. **The waiter thread** (one per runtime) blocks in ``sem_timedwait`` with the GIL released.
   After any wake-up it rescans every lane (level-triggered): it settles each lane's prefix up to
   its completion word, and queries the stream (or the event) of the first future beyond it
   (errors; lanes without words), handing each event loop its awaiters in one batch. It also
   settles and retires the futures whose completion a spin saw (the spin itself changes no
   state and takes no lock: their buffers, events and host memory are freed here, off the
   awaiters' latency path). A loop busy with requests holds the GIL, though, and the waiter
   then falls behind: so the loop *reaps* itself (``LaneHub.reap``: each lane's completion
   word, one memory load, and the prefix it shows done settled and retired in one batch)
   when a spin's hit finds ``REAP_AT`` futures pending, and at a submission while other work
   is awaited or ``REAP_MAX`` futures are pending (``_core.submit.reap``): parked awaiters of
   a busy loop are woken by its next submission, not by a thread hand-off, and what a request
   held is freed while it is young, before garbage collections promote it. A bounded timeout guards
   against a lost wake-up and retires futures nobody awaits (5 ms while such work is pending,
   else 100 ms), so an idle runtime waiting on a long kernel wakes ~10 times a second; work
   submitted while it sleeps the long guard wakes it once (``watch``), to sleep the short one.

Errors: a stream or event query that returns an error other than NOT_READY means the context
hit a sticky error (illegal address, trap, ...): every pending future of that device fails with a
``GPUError`` naming the CUDA error, and so do their dependents on other devices; the device is
marked broken (later work on it fails at once, never hangs). CUDA does not recover from such
errors inside the process: closing the runtime resets the device's primary context, but on the
H200 driver a new runtime in the same process still gets the error (``CudaError`` naming it);
a new process works (tests/api/test_backends.py runs the CUDA failure case in a child process).
"""
from __future__ import annotations

import threading
from typing import Any, Callable

from ..errors import GPUError
from .._core.futures import DONE, PENDING, GPUFuture, log, submission_scope  # noqa: F401
from .._core.hub import FutureHub
from . import driver as D
from .lanehub import SPIN_MIN_S, LaneHub  # noqa: F401

LOST_WAKEUP_GUARD_S = 0.1
UNCOVERED_GUARD_S = 0.005
DEFAULT_SPIN_S = 1e-3


class CudaHub(LaneHub, FutureHub):
    """Pending CUDA futures, the lanes they run on, and the waiter thread (what it does per
    operation, compiled: ``LaneHub``)."""

    def __init__(self, *, spin_s: float = DEFAULT_SPIN_S, watchdog_s: float | None = None):
        super().__init__(watchdog_s=watchdog_s, spin_s=spin_s)
        self.keys_are_resources = False       # (a key is the hub's count: nothing to retain)
        self.sem = D.Semaphore()
        self.lanes: list[Any] = []
        self.spin_hits = 0
        self.spin_misses = 0
        self.arms = 0
        self.sem_post = D.SEM_POST            # (libc's sem_post, the wake-up host function)
        self._observe = threading.RLock()
        self.start()

    # -- futures ---------------------------------------------------------------------------------
    # (``_wake_for``: LaneHub's, compiled: every parked await of a busy service arms its lane.)

    def wake(self) -> None:
        self.sem.post()

    def force_complete(self, key: int) -> None:
        """A failed future whose work can no longer run (its device hit a sticky error):
        raise its lane's completion word to its ticket, from the host, so that work on other
        devices waiting for it there (``cuStreamWaitValue64``) goes on, as the HSA hub stores
        0 into the signal of such work. The word only grows, and nothing on a dead context
        writes it any more. Lanes without a word (events) cannot be completed from the host:
        a wait on such an event is left to the driver."""
        fut: Any = self._pending.get(key)
        lane = getattr(fut, "lane", None)
        if lane is not None and lane.word is not None and lane.word.value < fut.ticket:
            lane.word.value = fut.ticket

    def is_complete(self, key: int) -> bool:
        fut = self._pending.get(key)
        if fut is None or fut.lane is None:
            return True
        if fut.lane.word is not None and fut.lane.word.value >= fut.ticket:
            return True
        return fut.event is not None and D.HOT.query(fut.event) != D.NOT_READY

    def poll(self) -> None:
        if not self._stop:
            self.scan()

    # -- observing lanes ---------------------------------------------------------------------------
    # (``observed``, ``_settle``: LaneHub's, compiled.)
    def scan(self) -> None:
        """Level-triggered: query every lane's pending events, oldest first."""
        query, stream_query = D.HOT.query, D.cu.cuStreamQuery
        work = [(lane, _snapshot(lane.pending)) for lane in list(self.lanes) if lane.pending]
        for lane, futs in work:
            lane.device.make_current()
            last, code = None, 0
            upto = lane.done_upto()
            idle = False              # (the stream had run all the snapshot's work)
            for f in futs:
                if f.retired or f.ticket <= upto or idle:
                    last = f
                    continue
                if f.event is not None:
                    code = query(f.event)
                else:                 # (beyond the word: a ticket its launch left unwritten)
                    code = stream_query(lane.stream)[0]
                    idle = code == 0
                if code == 0:
                    last = f
                    continue
                break
            if code not in (0, D.NOT_READY):
                self.device_failed(lane.device, code, lane)
            elif last is not None:
                self.observed(lane, last.ticket, 0)
        if self.watchdog_s is not None:
            self._flush({})

    def device_failed(self, device: Any, code: int, lane: Any = None) -> None:
        """A sticky CUDA error on ``device``: fail every pending future of it (and, through
        dependencies, theirs elsewhere); mark the device broken. Takes the runtime lock (a
        failure spreads under it)."""
        name = D.error_name(code)
        posts: dict = {}
        with self.lock:
            if device.broken is None:
                device.broken = GPUError(
                    f"{device.name}: the CUDA context hit a sticky error ({name}); every later "
                    f"operation on this device fails; close the runtime to reset the device",
                    status=code, queue=lane.name if lane is not None else None)
            victims = sorted((f for f in self._pending.values() if f.device is device),
                             key=lambda f: f.signal)
            for f in victims:
                if f._state == PENDING:
                    err = GPUError(f"{f.label} on {f.queue}: {name} (CUDA errors are sticky: the "
                                   f"device's context is unusable until the runtime is closed)",
                                   status=code, queue=f.queue, packet=f.packet)
                    self._finish(f, err, posts)
            for f in victims:
                self.retire_failed(f)
            with self._observe:
                for ln in device.lanes:
                    ln.pending.clear()
        self._post(posts)

    # -- the waiter thread -----------------------------------------------------------------------
    def _guard(self) -> float:
        if self._backlog:             # retirement left for a lock holder: retry soon
            return UNCOVERED_GUARD_S
        for lane in self.lanes:
            if lane.pending and lane.armed < lane.ticket:
                return UNCOVERED_GUARD_S
        return LOST_WAKEUP_GUARD_S

    def _run(self) -> None:
        sem = self.sem
        while not self._stop:
            # Set before the lanes are looked at: work watched after that look wakes us
            # (``watch`` reads ``_idle`` after its append), so the long guard is never slept
            # with work left to the scan.
            self._idle = True
            guard = self._guard()
            if guard != LOST_WAKEUP_GUARD_S:
                self._idle = False
            sem.wait(guard)
            self._idle = False
            sem.drain()
            self.wakeups += 1
            while self._events:
                self._run_event(self._events.popleft())
            try:
                self.rearm()
                self.scan()
                self.retry_backlog()
            except BaseException:  # noqa: BLE001 - the waiter must never die (callbacks are
                # reported where they run; this is the last guard)
                log.exception("CUDA waiter scan failed")

    def close(self) -> None:
        self.stop()
        self.sem.destroy()


def _snapshot(pending: Any) -> list:
    """A list of a lane's pending deque, which submitters append to meanwhile (a deque raises
    rather than skip when it changes during the copy: then copy again)."""
    while True:
        try:
            return list(pending)
        except RuntimeError:
            continue

