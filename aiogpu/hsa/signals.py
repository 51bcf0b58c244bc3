"""HSA completion signals: the signal pool and the one background waiter thread.

A GPU future is an HSA signal with a condition (value < 1: the packet processor decrements it from
1 to 0). One waiter thread per runtime blocks in ``hsa_amd_signal_wait_any``, never holding the
GIL while it waits, over the wake signal and the signals of the futures someone *waits for*
(``FutureHub.arm``: a task parked on it, a done-callback, a thread in ``wait()``, host work that
must follow it, such as a queue's back-log). It wakes when one of those completes, or when
``wake()`` is called (an arm, a driver callback's event, new work while it sleeps its long
timeout, closing).

Work nobody waits for (most copies and launches of a service: only the result is awaited) does
not wake it: while any pending future is left out of the wait, the wait times out every
``POLL_S`` (5 ms) and the scan settles and retires what completed. 5 ms, as the CUDA hub's
uncovered guard: it bounds how long such work holds its signal, buffers and kernarg space after
it finished (about 500 signals at 100k operations/s, inside the 1,024 interrupt signals), and
costs at most 200 short scans a second, against one wake-up per completion when every signal
was in the wait: an interrupt, a syscall, a scan of all pending work under the GIL, and on ROCr
the next wait's first 200 us, which ``Signal::WaitAny`` spends polling before it sleeps. With
everything pending in the wait, the timeout is ``LOST_WAKEUP_GUARD_S``. ``done()`` does not wait
for the scan: it reads the signal itself (``CompletionHub.observe``).

It is level-triggered: after any wake-up it rescans every pending signal, waited for or not,
then acquire-loads each that reads complete before resolving it. So a future armed just as it
completes is never lost: the arm marks it waited and wakes the waiter, which rebuilds its wait
set and rescans; a completion before the rescan is found by it, one after it ends the wait
(ROCr's ``Signal::WaitAny`` tests every signal's condition before it sleeps, so a signal
already complete when the wait starts returns at once). A missed edge costs at most the
timeout, never a hang.

Interrupt signals are a bounded resource (ROCr: ``hsa_signal_create`` takes one of KFD's ~4,096
signal events per process, and past the limit silently gives a signal without one), and ROCr's
``Signal::WaitAny`` spins for the whole wait if any signal in it lacks an event. So the pool
keeps at most ``MAX_INTERRUPT_SIGNALS`` interrupt signals, checks each really got an event (its
``amd_signal_t.event_mailbox_ptr``), and beyond that hands out busy-wait signals
(``hsa_amd_signal_create`` with AMD_GPU_ONLY, no event). Those are never passed to the wait,
waited for or not: the scan every ``POLL_S`` finds them. The wait therefore has at most
MAX_INTERRUPT_SIGNALS + 1 signals, all with events, and ROCr never spins through it.
"""
from __future__ import annotations

import ctypes
import time
from typing import Any

from ..futures import FutureHub, GPUFuture, log
from ..hsa_bindings import types as T

LOST_WAKEUP_GUARD_S = 0.1
POLL_S = 0.005          # scan period while pending work is left out of the wait (see above)
MAX_INTERRUPT_SIGNALS = 1024
VALUE_OFFSET = T.amd_signal_t.value.offset
MAILBOX_OFFSET = T.amd_signal_t.event_mailbox_ptr.offset


def has_interrupt_event(handle: int) -> bool:
    """Whether a signal has a KFD interrupt event (ROCr's InterruptSignal writes its event's
    mailbox address into the amd_signal_t; without an event it stays 0)."""
    return ctypes.c_uint64.from_address(handle + MAILBOX_OFFSET).value != 0


class SignalPool:
    """HSA signals for completions, recycled only when nobody can read them any more.

    Each signal carries a reference count: one for its owner future (dropped when its completion
    was observed) and one per packet that names it as a dependency (dropped when that packet is
    known to have retired). Only at zero is it reset to 1 and reused; a reset signal can
    therefore never satisfy or stall a packet that still reads it.

    At most ``max_interrupt`` signals with interrupt events exist; when they are all in use (or
    KFD has no event left) ``acquire`` gives a busy-wait signal, which the waiter polls.
    """

    def __init__(self, api: Any, max_interrupt: int = MAX_INTERRUPT_SIGNALS):
        self._api = api
        self.max_interrupt = max_interrupt
        self._free: list[int] = []            # free interrupt signals
        self._free_polled: list[int] = []     # free busy-wait signals
        self._refs: dict[int, int] = {}
        self.interrupt: set[int] = set()      # handles with an interrupt event
        self.views: dict[int, ctypes.c_int64] = {}  # handle -> the value word in memory
        self.created = 0
        self._events_left = True              # False once KFD gave a signal without an event

    def acquire(self) -> int:
        """A signal reading 1: a free interrupt one, else a new interrupt one while fewer than
        ``max_interrupt`` exist and KFD has events, else a busy-wait one."""
        if self._free or self._free_polled and not self._may_create_interrupt():
            handle = (self._free or self._free_polled).pop()
            self._api.hsa_signal_store_relaxed(T.hsa_signal_t(handle), 1)
        else:
            handle = self._create(interrupt=self._may_create_interrupt())
        self._refs[handle] = 1
        return handle

    def _may_create_interrupt(self) -> bool:
        return len(self.interrupt) < self.max_interrupt and self._events_left

    def _create(self, interrupt: bool) -> int:
        sig = T.hsa_signal_t()
        if interrupt:
            self._api.check(self._api.hsa_signal_create(1, 0, None, ctypes.byref(sig)), "hsa_signal_create")
        else:
            self._api.check(self._api.hsa_amd_signal_create(1, 0, None, T.HSA_AMD_SIGNAL_AMD_GPU_ONLY,
                                                            ctypes.byref(sig)), "hsa_amd_signal_create")
        handle = sig.handle
        if interrupt and has_interrupt_event(handle):
            self.interrupt.add(handle)
        elif interrupt:
            self._events_left = False   # KFD's event limit: ROCr gave a signal without an event
        # A signal handle is the address of its amd_signal_t; the value is at offset 8.
        self.views[handle] = ctypes.c_int64.from_address(handle + VALUE_OFFSET)
        self.created += 1
        return handle

    def retain(self, handle: int) -> None:
        self._refs[handle] += 1

    def release(self, handle: int) -> None:
        count = self._refs[handle] - 1
        if count:
            self._refs[handle] = count
        else:
            del self._refs[handle]
            (self._free if handle in self.interrupt else self._free_polled).append(handle)

    @property
    def in_use(self) -> int:
        return len(self._refs)

    def destroy(self) -> None:
        for handle in self._free + self._free_polled + list(self._refs):
            self._api.hsa_signal_destroy(T.hsa_signal_t(handle))
        self._free.clear()
        self._free_polled.clear()
        self._refs.clear()
        self.views.clear()
        self.interrupt.clear()


class CompletionHub(FutureHub):
    """The HSA hub: futures backed by pool signals, observed by ``hsa_amd_signal_wait_any``."""

    def __init__(self, api: Any, *, watchdog_s: float | None = None, spin_s: float = 0.0):
        super().__init__(watchdog_s=watchdog_s, spin_s=spin_s)
        self.api = api
        self.pool = SignalPool(api)
        self._wake = self._create_wake_signal()
        self._wake_interrupt = has_interrupt_event(self._wake)   # False: KFD had no event left
        self._freq = self._timestamp_frequency()
        self.start()

    def _new_key(self) -> int:
        """A fresh pool signal (value 1) for a future about to be encoded (under lock)."""
        return self.pool.acquire()

    def retain_key(self, key: int) -> None:
        self.pool.retain(key)

    def depend(self, fut: GPUFuture, on: GPUFuture, *, semantic: bool = True) -> None:
        """Record that packets of ``fut`` name ``on``'s signal (kept from reuse until ``fut``
        retires); when ``semantic``, ``fut`` also fails if ``on`` fails. Call under lock with
        ``on`` not yet retired."""
        self.pool.retain(on.signal)
        fut._add_dep_signal(on.signal)
        if semantic:
            on._add_dependent(fut)

    def wake(self) -> None:
        self.api.hsa_signal_store_screlease(T.hsa_signal_t(self._wake), 1)

    def release_key(self, key: int) -> None:
        self.pool.release(key)

    def force_complete(self, key: int) -> None:
        self.api.hsa_signal_store_screlease(T.hsa_signal_t(key), 0)

    def device_times(self, fut: GPUFuture) -> tuple[int, int] | None:
        """Dispatch timestamps from the signal (the emulator's clock is the host's monotonic
        clock; ROCr's ticks would need converting, so only the emulator's are used)."""
        if self.api.backend != "emulator" or fut.device is None:
            return None
        t = T.hsa_amd_profiling_dispatch_time_t()
        status = self.api.hsa_amd_profiling_get_dispatch_time(fut.device.agent, T.hsa_signal_t(fut.signal),
                                                               ctypes.byref(t))
        return (t.start, t.end) if status == 0 and t.end else None

    def is_complete(self, key: int) -> bool:
        return self.api.hsa_signal_load_scacquire(T.hsa_signal_t(key)) < 1

    def observe(self, fut: GPUFuture) -> None:
        """``FutureHub.observe``: a cheap read of the signal's value word, then (when it looks
        done) the acquire load the scan does before settling it. A signal recycled meanwhile
        belongs to another future: ``_settle`` then ignores it."""
        key = fut.signal
        view = self.pool.views.get(key)
        owned = self.lock.raw._is_owned  # type: ignore[attr-defined]
        if view is not None and view.value < 1 and not owned() and self.is_complete(key):
            self._settle([(key, fut)])

    def close(self) -> None:
        self.stop()
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

    def _wake_for(self, fut: GPUFuture) -> None:
        """Put ``fut``'s signal in the wait: the waiter's next turn rebuilds its wait set, and
        that turn starts now (else it could sleep out a whole timeout first)."""
        self._dirty = True          # (before the wake-up, so that the turn it starts rebuilds)
        self._request_wake()

    def _run(self) -> None:
        api, arrays = self.api, None
        guard, poll = int(LOST_WAKEUP_GUARD_S * self._freq), int(POLL_S * self._freq)
        while not self._stop:
            # Set before the pending work is counted: work watched after the count wakes us
            # (``watch`` reads ``_idle`` after its insert), so the long timeout is never slept
            # with work left to the scan.
            self._idle = True
            if self._dirty or arrays is None:
                arrays = self._build_arrays()
            n, sigs, conds, vals = arrays
            covered = self._covers_everything(n)
            if not covered:
                self._idle = False
            if self._wake_interrupt:
                # ROCr's Signal::WaitAny (core/runtime/signal.cpp, behind hsa_amd_signal_wait_any)
                # tests every signal's condition before each sleep in hsaKmtWaitOnMultipleEvents,
                # so a signal that completed before this call returns at once: what was armed
                # while we scanned is not lost. It sleeps only if every signal has an event.
                api.hsa_amd_signal_wait_any(n, sigs, conds, vals, guard if covered else poll,
                                            T.HSA_WAIT_STATE_BLOCKED, None)
            else:   # not even the wake signal has an event: poll rather than make ROCr spin
                time.sleep(POLL_S)
            self._idle = False
            # Level-triggered: reset the wake signal first, then look at everything.
            api.hsa_signal_store_relaxed(T.hsa_signal_t(self._wake), 0)
            self._woken = False
            self.wakeups += 1
            try:
                self._scan()
                self.retry_backlog()
            except BaseException:  # noqa: BLE001 - the waiter must never die (callbacks are
                # reported where they run; this is the last guard)
                log.exception("HSA waiter scan failed")

    def _covers_everything(self, n: int) -> bool:
        """Whether the wait's n - 1 signals are all the pending work: nothing is left to the
        periodic scan. They are all pending unless ``_dirty`` (a waited future marks the set
        stale *before* it leaves ``_pending``, see ``_unwatch``): hence ``_pending`` is counted
        first and ``_dirty`` read after. Retirement left in the backlog for a lock holder is
        work left to the scan too (``retry_backlog``)."""
        return len(self._pending) < n and not self._dirty and not self._backlog

    def _build_arrays(self) -> tuple:
        """The wait's arrays: the wake signal, and the interrupt signals of pending futures
        someone waits for (``FutureHub.arm``) that no scan has taken yet (one in ``_queued`` is
        complete: waiting on it would return at once, again and again, until it retired).
        Never a signal without an event: ROCr would spin through the whole wait. Built
        without the lock: ``_dirty`` is cleared before the copy, so an arm or a retirement
        after it rebuilds them."""
        self._dirty = False
        interrupt, queued = self.pool.interrupt, self._queued
        pending = self._pending.copy()     # (one C call: atomic under the GIL)
        handles = [self._wake, *[h for h, f in pending.items()
                                 if f.waited and h in interrupt and f not in queued]]
        n = len(handles)
        sigs = (T.hsa_signal_t * n)()
        ctypes.memmove(sigs, (ctypes.c_uint64 * n)(*handles), 8 * n)
        conds = (T.hsa_signal_condition_t * n)(T.HSA_SIGNAL_CONDITION_NE, *[T.HSA_SIGNAL_CONDITION_LT] * (n - 1))
        vals = (T.hsa_signal_value_t * n)(0, *[1] * (n - 1))
        return n, sigs, conds, vals

    def _scan(self) -> None:
        """Look at every pending signal, waited for or not: a cheap read of each value word
        outside the lock, then an acquire load (``hsa_signal_load_scacquire``) of each that
        looks done before its future is resolved. Never waits for the runtime lock (see
        ``FutureHub``)."""
        while self._events:
            self._run_event(self._events.popleft())
        snapshot = list(self._pending.copy().items())    # (the copy is one C call: atomic)
        views = self.pool.views
        load = self.api.hsa_signal_load_scacquire
        done = [(h, f) for h, f in snapshot if views[h].value < 1 and load(T.hsa_signal_t(h)) < 1]
        if done or self.watchdog_s is not None:
            self._settle(done)
        if any(f.waited for _, f in done):
            self._dirty = True      # taken by this scan: their signals leave the wait
