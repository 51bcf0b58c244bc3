"""HSA signals as ROCr lays them out: an ``amd_signal_t`` in real memory, handle = its address.

The 64-bit value lives at offset 8 of the 64-byte aligned struct, and every operation reads and
writes that memory, so a runtime that peeks at ``handle + 8`` sees what the emulator sees.
Read-modify-write operations are atomic under the signal's lock.

Waiting blocks on threading primitives (the GIL is released, no CPU is burnt): a signal keeps
the set of ``Waiter`` objects registered on it and wakes them on every value change and when it
is destroyed. ``hsa_amd_signal_wait_any`` registers one waiter on all its signals; the packet
processors and SDMA engines wait the same way. Values must change through the API (as with
ROCr's interrupt signals): a direct store to the value in memory wakes nobody.

Interrupt events, as ROCr and KFD hand them out (``hsa_amd_signal_create``,
``InterruptSignal::EventPool``): a signal made by ``hsa_signal_create`` (or
``hsa_amd_signal_create`` without attributes, with the CPU among its consumers or none named)
is an interrupt signal and takes a KFD signal event, which ``event_id``/``event_mailbox_ptr`` of
its ``amd_signal_t`` name; AMD_GPU_ONLY, IPC, or consumers without the CPU make a busy-wait
signal without one. KFD allows a process about 4,096 events (``KFD_SIGNAL_EVENT_LIMIT``); ROCr
itself takes two at start-up, one per AQL queue and two per SDMA queue. Past the limit ROCr
still succeeds but the signal has no event. Events of destroyed signals are reused.

``wait_any`` follows ``Signal::WaitAny``: a destroyed signal (or an unknown condition) ends the
wait with UINT32_MAX. ROCr spins for the first 200 us of every call, and for the whole wait when
the hint is ACTIVE or any signal lacks an event; the emulator blocks instead and counts both
(``stats``: ``wait_calls``, ``busy_waits``, ``max_wait_signals``), so tests can assert a runtime
never makes ROCr spin.
"""
from __future__ import annotations

import ctypes
import mmap
import threading
import time
from collections import deque
from typing import Callable, Sequence, TypeVar

from .. import atomics
from .. import types as T
from ._abi import UINT32_MAX, UINT64_MAX, StatusError, to_int64

SIGNAL_SIZE = ctypes.sizeof(T.amd_signal_t)  # 64
VALUE_OFFSET = T.amd_signal_t.value.offset  # 8
START_TS_OFFSET = T.amd_signal_t.start_ts.offset
END_TS_OFFSET = T.amd_signal_t.end_ts.offset
AMD_SIGNAL_KIND_USER = 1
SLAB_BYTES = 64 * 1024
MAX_BLOCK_S = 3600.0  # Event.wait slices for "forever"
EVENT_LIMIT = 4096  # KFD_SIGNAL_EVENT_LIMIT: signal events per process
ROCR_START_EVENTS = 2  # ROCr: Runtime::InitializeVmFaultHandler's VM-fault and HW-exception events
MAILBOX_BASE = 0x7F00_0000_0000  # fake event mailbox addresses: nonzero, never dereferenced

R = TypeVar("R")


class Waiter:
    """The wake-up of one blocked thread: any signal it is registered on sets it."""

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event = threading.Event()

    def wake(self) -> None:
        self._event.set()

    def clear(self) -> None:
        self._event.clear()

    def wait(self, timeout: float | None) -> None:
        self._event.wait(MAX_BLOCK_S if timeout is None else min(timeout, MAX_BLOCK_S))


class Signal:
    """One ``amd_signal_t`` slot; ``alive`` is False once destroyed (memory then not touched)."""

    def __init__(self, address: int, initial: int, event_id: int = 0) -> None:
        self.address = address
        self.event_id = event_id  # 0: no interrupt event (a busy-wait signal)
        self.alive = True
        self._lock = threading.Lock()
        self._waiters: dict[Waiter, int] = {}
        self._last = initial
        self.peak = initial  # highest value ever stored (a doorbell's high-water mark)
        ctypes.memset(address, 0, SIGNAL_SIZE)
        ctypes.c_int64.from_address(address).value = AMD_SIGNAL_KIND_USER
        if event_id:
            struct = T.amd_signal_t.from_address(address)
            struct.event_id, struct.event_mailbox_ptr = event_id, MAILBOX_BASE + 8 * event_id
        self._write(initial)

    @property
    def interrupt(self) -> bool:
        return self.event_id != 0

    # ---- value -----------------------------------------------------------------------------
    def load(self) -> int:
        with self._lock:
            return self._read() if self.alive else self._last

    def store(self, value: int) -> None:
        self.modify(lambda _old: value)

    def add(self, delta: int) -> int:
        return self.modify(lambda old: old + delta)

    def modify(self, fn: Callable[[int], int]) -> int:
        """Atomically replace the value with ``fn(old)``; returns the old value; wakes waiters."""
        with self._lock:
            if not self.alive:
                raise StatusError(T.HSA_STATUS_ERROR_INVALID_SIGNAL, "signal destroyed")
            old = self._read()
            new = to_int64(fn(old))
            self._write(new)
            self.peak = max(self.peak, new)
            waiters = list(self._waiters)
        for w in waiters:
            w.wake()
        return old

    def set_timestamps(self, start_ns: int, end_ns: int) -> None:
        with self._lock:
            if self.alive:
                ctypes.c_uint64.from_address(self.address + START_TS_OFFSET).value = start_ns
                ctypes.c_uint64.from_address(self.address + END_TS_OFFSET).value = end_ns

    def timestamps(self) -> tuple[int, int]:
        with self._lock:
            if not self.alive:
                raise StatusError(T.HSA_STATUS_ERROR_INVALID_SIGNAL, "signal destroyed")
            return (ctypes.c_uint64.from_address(self.address + START_TS_OFFSET).value,
                    ctypes.c_uint64.from_address(self.address + END_TS_OFFSET).value)

    def set_queue_ptr(self, queue_address: int) -> None:
        ctypes.c_uint64.from_address(self.address + T.amd_signal_t.queue_ptr.offset).value = queue_address

    # ---- waiters ---------------------------------------------------------------------------
    def add_waiter(self, waiter: Waiter) -> None:
        with self._lock:
            self._waiters[waiter] = self._waiters.get(waiter, 0) + 1
            dead = not self.alive
        if dead:
            waiter.wake()

    def remove_waiter(self, waiter: Waiter) -> None:
        with self._lock:
            count = self._waiters.get(waiter, 0) - 1
            if count > 0:
                self._waiters[waiter] = count
            else:
                self._waiters.pop(waiter, None)

    def kill(self) -> None:
        """Destroy: remember the last value, stop touching memory, wake every waiter."""
        with self._lock:
            if self.alive:
                self._last = self._read()
            self.alive = False
            waiters = list(self._waiters)
        for w in waiters:
            w.wake()

    def _read(self) -> int:
        return to_int64(atomics.load_u64_acquire(self.address + VALUE_OFFSET))

    def _write(self, value: int) -> None:
        atomics.store_u64_release(self.address + VALUE_OFFSET, value & UINT64_MAX)


def condition_met(cond: int, value: int, compare: int) -> bool:
    if cond == T.HSA_SIGNAL_CONDITION_EQ:
        return value == compare
    if cond == T.HSA_SIGNAL_CONDITION_NE:
        return value != compare
    if cond == T.HSA_SIGNAL_CONDITION_LT:
        return value < compare
    if cond == T.HSA_SIGNAL_CONDITION_GTE:
        return value >= compare
    raise StatusError(T.HSA_STATUS_ERROR_INVALID_ARGUMENT, f"unknown signal condition {cond}")


def timeout_seconds(timeout_hint: int) -> float | None:
    """HSA timeout ticks (ns: TIMESTAMP_FREQUENCY is 1e9) to seconds; UINT64_MAX is forever."""
    return None if timeout_hint >= UINT64_MAX else timeout_hint / 1e9


def wait_for(waiter: Waiter, signals: Sequence[Signal], predicate: Callable[[], R | None],
             timeout: float | None = None) -> R | None:
    """Block until ``predicate()`` returns something other than None/False, or ``timeout``.

    ``waiter`` is registered on ``signals`` for the duration; other threads may also wake it.
    Clearing before evaluating the predicate means a wake-up between the check and the block is
    never lost.
    """
    for s in signals:
        s.add_waiter(waiter)
    try:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            waiter.clear()
            result = predicate()
            if result is not None and result is not False:
                return result
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return None
            waiter.wait(remaining)
    finally:
        for s in signals:
            s.remove_waiter(waiter)


class EventPool:
    """KFD signal events of one process (ROCr: InterruptSignal::EventPool over hsaKmtCreateEvent)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._next = 1
        self._free: list[int] = []
        self.in_use = 0
        self.peak = 0

    def take(self) -> int:
        """An event id, or 0 when KFD has none left (the caller goes on without one)."""
        with self._lock:
            if self._free:
                event = self._free.pop()
            elif self._next <= self.limit:
                event, self._next = self._next, self._next + 1
            else:
                return 0
            self.in_use += 1
            self.peak = max(self.peak, self.in_use)
            return event

    def give(self, event: int) -> None:
        if event:
            with self._lock:
                self._free.append(event)
                self.in_use -= 1


class SignalTable:
    """Every live signal of one emulator, carved out of mmap'ed slabs of 64-byte slots."""

    def __init__(self, event_limit: int = EVENT_LIMIT) -> None:
        self._lock = threading.Lock()
        self._signals: dict[int, Signal] = {}
        self._slabs: list[mmap.mmap] = []
        self._free: deque[int] = deque()  # FIFO: a destroyed handle is reused as late as possible
        self.events = EventPool(event_limit)
        for _ in range(ROCR_START_EVENTS):
            self.events.take()
        self.stats = {"wait_calls": 0, "busy_waits": 0, "max_wait_signals": 0}

    def create(self, initial: int, interrupt: bool = False) -> Signal:
        """A signal; ``interrupt``: with a KFD event if one is left (ROCr: InterruptSignal)."""
        event = self.events.take() if interrupt else 0
        with self._lock:
            if not self._free:
                self._new_slab()
            address = self._free.popleft()
            signal = Signal(address, to_int64(initial), event)
            self._signals[address] = signal
            return signal

    def get(self, handle: int) -> Signal:
        signal = self._signals.get(handle)
        if signal is None:
            raise StatusError(T.HSA_STATUS_ERROR_INVALID_SIGNAL, f"unknown signal 0x{handle:x}")
        return signal

    def lookup(self, handle: int) -> Signal | None:
        return self._signals.get(handle)

    def destroy(self, handle: int) -> None:
        with self._lock:
            signal = self._signals.pop(handle, None)
        if signal is None:
            raise StatusError(T.HSA_STATUS_ERROR_INVALID_SIGNAL, f"unknown signal 0x{handle:x}")
        signal.kill()
        self.events.give(signal.event_id)
        with self._lock:
            self._free.append(handle)

    def account_wait(self, signals: Sequence[Signal | None], active_hint: bool) -> None:
        """ROCr (Signal::WaitAny) spins at the start of every call, and for the whole wait when
        the hint is ACTIVE or a signal has no interrupt event: count what ROCr would do."""
        with self._lock:
            self.stats["wait_calls"] += 1
            self.stats["max_wait_signals"] = max(self.stats["max_wait_signals"], len(signals))
            if active_hint or any(s is not None and not s.interrupt for s in signals):
                self.stats["busy_waits"] += 1

    def wait_any(self, signals: Sequence[Signal], conds: Sequence[int], values: Sequence[int],
                 timeout: float | None) -> tuple[int, int] | None:
        """(index, value) of the first satisfied signal, (UINT32_MAX, 0) if a signal before it is
        destroyed (or a condition is unknown), None on timeout (ROCr: Signal::WaitAny)."""
        if any(c not in CONDITIONS for c in conds):
            return UINT32_MAX, 0

        def first_satisfied() -> tuple[int, int] | None:
            for i, (s, c, v) in enumerate(zip(signals, conds, values)):
                if not s.alive:
                    return UINT32_MAX, 0
                value = s.load()
                if condition_met(c, value, v):
                    return i, value
            return None

        return wait_for(Waiter(), list(dict.fromkeys(signals)), first_satisfied, timeout)

    def shutdown(self) -> None:
        """Destroy every signal (waking their waiters) and unmap the slabs."""
        with self._lock:
            signals, self._signals = list(self._signals.values()), {}
            slabs, self._slabs = self._slabs, []
            self._free.clear()
        for s in signals:
            s.kill()
        for slab in slabs:
            slab.close()

    def _new_slab(self) -> None:
        slab = mmap.mmap(-1, SLAB_BYTES)
        holder = ctypes.c_char.from_buffer(slab)
        base = ctypes.addressof(holder)
        del holder
        self._slabs.append(slab)
        self._free.extend(range(base, base + SLAB_BYTES, SIGNAL_SIZE))


CONDITIONS = (T.HSA_SIGNAL_CONDITION_EQ, T.HSA_SIGNAL_CONDITION_NE, T.HSA_SIGNAL_CONDITION_LT,
               T.HSA_SIGNAL_CONDITION_GTE)
