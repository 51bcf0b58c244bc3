"""HSA completion signals: the signal pool and the one background waiter thread.

A GPU future is an HSA signal with a condition (value < 1: the packet processor decrements it from
1 to 0). One waiter thread per runtime blocks in ``hsa_amd_signal_wait_any`` over a wake signal and
every pending signal, never holding the GIL while it waits. It is level-triggered: after any
wake-up it rescans every pending signal, then acquire-loads each that reads complete before
resolving it; a missed edge costs at most ``LOST_WAKEUP_GUARD_S``, never a hang.
"""
from __future__ import annotations

import ctypes
from typing import Any

from .futures import FutureHub, GPUFuture
from .hsa_bindings import types as T

LOST_WAKEUP_GUARD_S = 0.1
VALUE_OFFSET = T.amd_signal_t.value.offset


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


class CompletionHub(FutureHub):
    """The HSA hub: futures backed by pool signals, observed by ``hsa_amd_signal_wait_any``."""

    def __init__(self, api: Any, *, watchdog_s: float | None = None, spin_s: float = 0.0):
        super().__init__(watchdog_s=watchdog_s, spin_s=spin_s)
        self.api = api
        self.pool = SignalPool(api)
        self._wake = self._create_wake_signal()
        self._freq = self._timestamp_frequency()
        self.start()

    def new_future(self, label: str) -> GPUFuture:
        """A pending future backed by a fresh pool signal, watched from now on (call under lock)."""
        return self.watch(GPUFuture(self, label, signal=self.pool.acquire()))

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
        sigs = (T.hsa_signal_t * n)()
        ctypes.memmove(sigs, (ctypes.c_uint64 * n)(*handles), 8 * n)
        conds = (T.hsa_signal_condition_t * n)(T.HSA_SIGNAL_CONDITION_NE, *[T.HSA_SIGNAL_CONDITION_LT] * (n - 1))
        vals = (T.hsa_signal_value_t * n)(0, *[1] * (n - 1))
        return n, sigs, conds, vals

    def _scan(self) -> None:
        """Look at every pending signal: a cheap read of each value word outside the lock, then
        an acquire load (``hsa_signal_load_scacquire``) of each that looks done before its
        future is resolved."""
        while self._events:
            self._run_event(self._events.popleft())
        with self.lock:
            snapshot = list(self._pending.items())
        views = self.pool.views
        load = self.api.hsa_signal_load_scacquire
        done = [(h, f) for h, f in snapshot if views[h].value < 1 and load(T.hsa_signal_t(h)) < 1]
        if done or self.watchdog_s is not None:
            self._settle(done)
