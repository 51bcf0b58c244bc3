"""``done()`` answers from the completion itself, not from the waiter's last look: work nobody
awaits reads done as soon as its signal says so, even while the waiter has not scanned it (the
HSA waiter leaves such work to a scan every few milliseconds), as CUDA events and asyncio do."""
from __future__ import annotations

import threading

from gpu_kernels import sleep_ms


def _hold_the_waiter(rt):
    """Keep the waiter thread busy in an event until the returned Event is set."""
    busy, go = threading.Event(), threading.Event()
    rt.hub.post_event(lambda: (busy.set(), go.wait(30)))
    assert busy.wait(10)
    return go


def test_done_reads_the_signal_of_unawaited_work_before_the_waiter_scans(rt):
    d0 = rt.devices[0]
    go = _hold_the_waiter(rt)
    try:
        fut = d0.launch(sleep_ms, grid=(1,), block=(1,), args=(1,))
        for _ in range(1000):
            if rt.hub.is_complete(fut.signal):
                break
            threading.Event().wait(0.01)
        assert rt.hub.is_complete(fut.signal), "the kernel never completed"
        assert fut.done(), "done() waited for the waiter's scan"
        assert fut.exception() is None and fut.result() is None
    finally:
        go.set()
    assert rt.leaks(10, buffers=False) == {}


def test_done_is_false_while_the_work_runs(rt):
    d0 = rt.devices[0]
    gate = threading.Event()
    go = _hold_the_waiter(rt)
    try:
        from aiogpu import kernel

        @kernel("u32")
        def held(launch, _):
            gate.wait(30)

        fut = d0.launch(held, grid=(1,), block=(1,), args=(0,))
        assert not fut.done()
    finally:
        gate.set()
        go.set()
    assert fut.wait(10)
