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
    assert not waiter.is_alive() and result[0][0] == 1


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
