"""Signals in amd_signal_t memory; wait, wait_any (blocking, timeout, destroy wakes)."""
from __future__ import annotations

import ctypes
import threading
import time

from aiogpu.hsa_bindings import types as T

from emu_helpers import NS, UINT64_MAX, ok

UINT32_MAX = 0xFFFFFFFF


def wait_any(hsa, signals, conds, values, timeout_ns):
    n = len(signals)
    sig = (T.hsa_signal_t * n)(*signals)
    cnd = (ctypes.c_int32 * n)(*conds)
    val = (ctypes.c_int64 * n)(*values)
    out = ctypes.c_int64(-99)
    index = hsa.api.hsa_amd_signal_wait_any(n, sig, cnd, val, timeout_ns, T.HSA_WAIT_STATE_BLOCKED,
                                            ctypes.byref(out))
    return index, out.value


def test_signal_value_lives_in_amd_signal_t(hsa):
    api = hsa.api
    s = hsa.signal(5)
    assert s.handle % 64 == 0
    value = ctypes.c_int64.from_address(s.handle + 8)
    assert value.value == 5 and ctypes.c_int64.from_address(s.handle).value == 1  # kind USER
    api.hsa_signal_add_relaxed(s, 3)
    api.hsa_signal_subtract_scacq_screl(s, 10)
    assert value.value == api.hsa_signal_load_relaxed(s) == -2
    api.hsa_signal_store_screlease(s, 1 << 62)
    api.hsa_signal_add_scacq_screl(s, 1 << 62)  # wraps like int64_t
    assert api.hsa_signal_load_scacquire(s) == -(1 << 63)
    ok(api.hsa_signal_destroy(s))
    assert api.hsa_signal_destroy(s) == T.HSA_STATUS_ERROR_INVALID_SIGNAL
    s2 = T.hsa_signal_t()
    ok(api.hsa_amd_signal_create(7, 0, None, T.HSA_AMD_SIGNAL_AMD_GPU_ONLY, ctypes.byref(s2)))
    assert api.hsa_signal_load_relaxed(s2) == 7


def test_conditions(hsa):
    s = hsa.signal(3)
    cases = [(T.HSA_SIGNAL_CONDITION_EQ, 3, True), (T.HSA_SIGNAL_CONDITION_EQ, 4, False),
             (T.HSA_SIGNAL_CONDITION_NE, 4, True), (T.HSA_SIGNAL_CONDITION_LT, 4, True),
             (T.HSA_SIGNAL_CONDITION_LT, 3, False), (T.HSA_SIGNAL_CONDITION_GTE, 3, True),
             (T.HSA_SIGNAL_CONDITION_GTE, 4, False)]
    for cond, compare, met in cases:
        index, _ = wait_any(hsa, [s], [cond], [compare], 0)
        assert (index == 0) == met, (cond, compare)


def test_wait_any_returns_first_satisfied_and_its_value(hsa):
    a, b, c = hsa.signal(1), hsa.signal(0), hsa.signal(0)
    eq0 = T.HSA_SIGNAL_CONDITION_EQ
    assert wait_any(hsa, [a, b, c], [eq0] * 3, [0] * 3, UINT64_MAX) == (1, 0)
    assert wait_any(hsa, [a, c], [T.HSA_SIGNAL_CONDITION_GTE, eq0], [1, 0], UINT64_MAX) == (0, 1)


def test_wait_any_times_out_with_uint32_max_without_burning_cpu(hsa):
    s = hsa.signal(1)
    cpu0, t0 = time.process_time(), time.monotonic()
    index, value = wait_any(hsa, [s], [T.HSA_SIGNAL_CONDITION_EQ], [0], int(0.3 * NS))
    elapsed, cpu = time.monotonic() - t0, time.process_time() - cpu0
    assert index == UINT32_MAX and value == -99
    assert 0.28 <= elapsed < 2.0
    assert cpu < 0.1 * elapsed, f"waiting burnt {cpu:.3f}s of CPU in {elapsed:.3f}s"


def test_wait_blocks_until_another_thread_changes_the_value(hsa):
    s = hsa.signal(1)
    t0 = time.monotonic()  # before the timer starts: a descheduled test thread cannot shorten the wait
    threading.Timer(0.05, lambda: hsa.api.hsa_signal_subtract_relaxed(s, 1)).start()
    got = hsa.api.hsa_signal_wait_scacquire(s, T.HSA_SIGNAL_CONDITION_LT, 1, UINT64_MAX, T.HSA_WAIT_STATE_BLOCKED)
    assert got == 0 and time.monotonic() - t0 >= 0.04
    # timeout: returns the current value
    assert hsa.api.hsa_signal_wait_scacquire(s, T.HSA_SIGNAL_CONDITION_EQ, 5, int(0.01 * NS), 0) == 0


def test_destroy_wakes_waiters(hsa):
    a, b = hsa.signal(1), hsa.signal(1)
    result = []
    waiter = threading.Thread(target=lambda: result.append(
        wait_any(hsa, [a, b], [T.HSA_SIGNAL_CONDITION_EQ] * 2, [0, 0], UINT64_MAX)))
    waiter.start()
    time.sleep(0.05)
    assert waiter.is_alive()
    ok(hsa.api.hsa_signal_destroy(b))
    waiter.join(2)
    assert not waiter.is_alive() and result[0][0] == UINT32_MAX  # ROCr: Signal::WaitAny, !IsValid()
    assert wait_any(hsa, [a, b], [T.HSA_SIGNAL_CONDITION_EQ] * 2, [0, 0], 0)[0] == UINT32_MAX


def test_many_waiters_on_one_signal(hsa):
    s = hsa.signal(1)
    done = []
    threads = [threading.Thread(target=lambda: done.append(hsa.wait_zero(s, 5))) for _ in range(8)]
    for t in threads:
        t.start()
    time.sleep(0.02)
    hsa.api.hsa_signal_store_screlease(s, 0)
    for t in threads:
        t.join(2)
    assert done == [True] * 8


def amd_signal(hsa, attributes=0, consumers=()):
    s = T.hsa_signal_t()
    arr = (T.hsa_agent_t * len(consumers))(*consumers) if consumers else None
    status = hsa.api.hsa_amd_signal_create(1, len(consumers), arr, attributes, ctypes.byref(s))
    return status, s


def has_event(signal) -> bool:
    sig = T.amd_signal_t.from_address(signal.handle)
    return sig.event_id != 0 and sig.event_mailbox_ptr != 0


def test_interrupt_events_follow_the_attributes(hsa):
    """ROCr (hsa_amd_signal_create): hsa_signal_create gives an interrupt signal with a KFD
    event; AMD_GPU_ONLY, IPC and consumer lists without the CPU give busy-wait signals."""
    assert has_event(hsa.signal(1))
    for attributes, consumers, expected in [(T.HSA_AMD_SIGNAL_AMD_GPU_ONLY, (), False),
                                            (T.HSA_AMD_SIGNAL_IPC, (), False),
                                            (0, (hsa.gpus[0],), False),
                                            (0, (hsa.gpus[0], hsa.cpu), True),
                                            (0, (), True)]:
        status, s = amd_signal(hsa, attributes, consumers)
        ok(status)
        assert has_event(s) == expected, (attributes, consumers)
    assert amd_signal(hsa, 0, (hsa.cpu, hsa.cpu))[0] == T.HSA_STATUS_ERROR_INVALID_ARGUMENT


def test_kfd_event_limit_gives_signals_without_events(make_hsa):
    """KFD limits a process's signal events; past it ROCr still creates the signal, without
    an event, and a wait on it spins (counted as a busy wait)."""
    hsa = make_hsa(emulator_event_limit=16)
    stats = hsa.emu.signal_stats()
    assert stats["events_in_use"] == 2 and stats["event_limit"] == 16   # ROCr's own two
    signals = [hsa.signal(1) for _ in range(20)]
    assert [has_event(s) for s in signals] == [True] * 14 + [False] * 6
    wait_any(hsa, signals[:2], [T.HSA_SIGNAL_CONDITION_EQ] * 2, [0, 0], 0)
    assert hsa.emu.signal_stats()["busy_waits"] == 0
    wait_any(hsa, signals[-2:], [T.HSA_SIGNAL_CONDITION_EQ] * 2, [0, 0], 0)
    stats = hsa.emu.signal_stats()
    assert stats["busy_waits"] == 1 and stats["wait_calls"] == 2 and stats["events_peak"] == 16
    ok(hsa.api.hsa_signal_destroy(signals[0]))
    ok(hsa.api.hsa_signal_destroy(signals[1]))
    assert hsa.emu.signal_stats()["events_in_use"] == 14
    assert has_event(hsa.signal(1))                                     # a freed event is reused
    hsa.queue(0)                                                        # an AQL queue takes one too
    assert hsa.emu.signal_stats()["events_in_use"] == 16
