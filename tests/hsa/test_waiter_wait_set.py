"""The HSA waiter's wait: the wake signal and each armed signal with its condition, no failing
scans, and polling when even the wake signal got no KFD event."""
from __future__ import annotations

import logging

import numpy as np

import aiogpu
from aiogpu.hsa_bindings import types as T
from gpu_kernels import Gate, add_const_n

try:                                    # the HSA signal pool and waiter, wherever they live
    import aiogpu.hsa.signals as S
except ImportError:
    import aiogpu.signals as S

N = 8


def test_the_wait_holds_the_wake_signal_and_each_armed_signal_until_it_drops_below_one(make_runtime):
    rt = make_runtime(gpus=1)
    d0, hub = rt.devices[0], rt.hub
    gate = Gate()
    futs = [gate.launch(d0) for _ in range(3)]
    try:
        with rt.lock:
            for fut in futs:
                hub.arm(fut)
            n, sigs, conds, vals = hub._build_arrays()
            hub._dirty = True           # the waiter rebuilds its own at its next turn
        assert n == 1 + len(futs)
        assert sigs[0].handle == hub._wake
        assert (conds[0], vals[0]) == (T.HSA_SIGNAL_CONDITION_NE, 0)   # woken when set to non-zero
        assert sorted(sigs[i].handle for i in range(1, n)) == sorted(f.signal for f in futs)
        assert [(conds[i], vals[i]) for i in range(1, n)] == [(T.HSA_SIGNAL_CONDITION_LT, 1)] * len(futs)
    finally:
        gate.open()
    assert all(f.wait(20) and f.exception() is None for f in futs)


def test_the_waiters_scans_never_fail_in_ordinary_work(make_runtime, caplog):
    rt = make_runtime(gpus=1)
    d0 = rt.devices[0]
    buf = d0.alloc(N * 8)
    with caplog.at_level(logging.ERROR, logger="aiogpu"):
        assert aiogpu.copy(buf, np.zeros(N, np.int64)).wait(20)
        futs = [d0.launch(add_const_n, grid=(N,), block=(N,), args=(buf, 1, N)) for _ in range(5)]
        assert all(f.wait(20) for f in futs)
        got = buf.to_numpy(np.int64)
        assert got.wait(20) and (got.result() == 5).all()
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []


def test_without_a_kfd_event_for_the_wake_signal_the_waiter_polls(make_runtime, monkeypatch):
    """KFD out of events for the runtime's very first signal: no signal waits on an interrupt,
    so the waiter never blocks in hsa_amd_signal_wait_any (ROCr would spin) and polls instead."""
    monkeypatch.setattr(S, "has_interrupt_event", lambda handle: False)
    rt = make_runtime(gpus=1)
    assert rt.hub._wake_interrupt is False
    d0 = rt.devices[0]
    buf = d0.alloc(N * 8)
    assert aiogpu.copy(buf, np.zeros(N, np.int64)).wait(20)
    fut = d0.launch(add_const_n, grid=(N,), block=(N,), args=(buf, 2, N))
    assert fut.wait(20) and fut.exception() is None
    assert rt.hub._thread.is_alive()
    assert rt.hub.pool.interrupt == set()
