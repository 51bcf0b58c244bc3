"""Launch and await on the emulator: loops in several threads, thousands of futures, batched
wake-ups, pending-state errors. (Results on every backend are in test_backends.py.)"""
from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

import aiogpu
from aiogpu import _loops
from aiogpu.futures import PENDING
from gpu_kernels import Gate, scale, sleep_ms
from aiogpu.kernels import fill_kernel


@pytest.mark.asyncio
async def test_result_and_exception_before_done_raise(rt):
    f = rt.devices[0].launch(sleep_ms, grid=(1,), block=(1,), args=(100,))
    with pytest.raises(aiogpu.InvalidStateError):
        f.result()
    with pytest.raises(aiogpu.InvalidStateError):
        f.exception()
    await f
    assert f.exception() is None


@pytest.mark.asyncio
async def test_two_event_loops_in_two_threads(rt, host):
    results = []

    def run_loop(i):
        async def main():
            d = rt.devices[i % 2]
            buf = d.alloc(16 * 4)
            await aiogpu.copy(buf, np.full(16, float(i), np.float32))
            await d.launch(scale, grid=(16,), block=(16,), args=(buf, 2.0, 16))
            results.append((i, (await buf.to_numpy(np.float32))[0]))
        asyncio.run(main())

    threads = [threading.Thread(target=run_loop, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [(i, 2.0 * i) for i in range(4)]


@pytest.mark.asyncio
async def test_thousands_of_concurrent_futures(rt):
    d0, d1 = rt.devices
    n_tasks = 2000

    async def one(i):
        d = (d0, d1)[i % 2]
        await d.launch(sleep_ms, grid=(1,), block=(1,), args=(0,))

    await asyncio.gather(*(one(i) for i in range(n_tasks)))
    stats = rt.stats()
    assert stats["signals_in_use"] == 0
    assert rt.hub.pool.created < n_tasks  # signals are recycled, not one per operation


@pytest.mark.asyncio
async def test_completions_reach_a_loop_in_batches(rt):
    """No thread-safe call to a loop while it has a drain of earlier completions queued: 200
    futures that complete while the loop is busy reach it with one call, however many waiter
    wake-ups settle them (and never more calls than wake-ups)."""
    loop = asyncio.get_running_loop()
    port = _loops.current_port()
    calls = []
    original = loop.call_soon_threadsafe

    def counting(callback, *args, **kwargs):
        if getattr(callback, "__self__", None) is port:     # (the port's drains only)
            calls.append(callback)
        return original(callback, *args, **kwargs)

    d0, d1 = rt.devices
    gate = Gate()
    held = gate.launch(d0)
    # 200 launches spread over every queue of both devices, all held back by the gate.
    futs = [d.launch(sleep_ms, grid=(1,), block=(1,), args=(0,), after=[held])
            for _ in range(100) for d in (d0, d1)]
    awaiting = [asyncio.ensure_future(_await(f)) for f in futs]
    while rt.hub.awaiting < len(futs):     # every task parked on its future
        await asyncio.sleep(0)
    wakeups = rt.hub.wakeups
    loop.call_soon_threadsafe = counting
    try:
        gate.open()
        # The loop stays busy (this thread blocks) until the waiter has settled all 200: the
        # first settled ones queue a drain, the rest find it queued.
        # (The state itself, not done(): done() would settle them here, on the loop's thread.)
        deadline = time.monotonic() + 60
        while any(f._state == PENDING for f in futs) and time.monotonic() < deadline:
            time.sleep(0.001)
        assert not any(f._state == PENDING for f in futs)
        await asyncio.gather(*awaiting)
    finally:
        del loop.call_soon_threadsafe
    assert len(calls) == 1, "completions were not batched"
    assert len(calls) <= rt.hub.wakeups - wakeups, "more thread-safe calls than waiter wake-ups"


async def _await(f):
    await f


@pytest.mark.asyncio
async def test_waiter_never_makes_rocr_spin_when_kfd_events_run_out(make_runtime):
    """Issue 14.5: KFD gives a process a limited number of signal events and ROCr then makes
    signals without one; a wait that includes such a signal spins throughout. The waiter waits
    only on signals with events and polls the rest."""
    rt = make_runtime(gpus=1, emulator_event_limit=64)
    d0 = rt.devices[0]
    gate = Gate()
    held = gate.launch(d0)
    futs = [d0.launch(sleep_ms, grid=(1,), block=(1,), args=(0,), after=[held]) for _ in range(150)]
    await asyncio.sleep(0.05)
    gate.open()
    for f in futs:
        await f
    stats = rt.api.emulator.signal_stats()
    assert stats["busy_waits"] == 0, stats
    assert stats["max_wait_signals"] <= 64 and stats["events_peak"] <= 64


@pytest.mark.asyncio
async def test_a_thousand_graph_replays_stay_within_the_interrupt_signal_bound(make_runtime):
    """Issue 14.5: 1,000 replays in flight used to hold ~4,900 interrupt signals (KFD allows
    ~4,096 events); now the waiter waits on at most MAX_INTERRUPT_SIGNALS + 1."""
    from aiogpu.hsa.signals import MAX_INTERRUPT_SIGNALS
    rt = make_runtime(gpus=2)
    d0, d1 = rt.devices
    x, y = d0.alloc(4096), d1.alloc(4096)
    with aiogpu.Graph() as g:
        a = d0.launch(scale, grid=(1024,), block=(256,), args=(x, 1.0, 1024))
        aiogpu.copy(y, x, after=[a])
    exe = g.instantiate()
    replays = [exe.launch() for _ in range(1000)]
    await replays[-1]
    await aiogpu.gather(*replays)
    stats = rt.api.emulator.signal_stats()
    assert stats["busy_waits"] == 0 and stats["max_wait_signals"] <= MAX_INTERRUPT_SIGNALS + 1, stats
    assert len(rt.hub.pool.interrupt) <= MAX_INTERRUPT_SIGNALS
    assert stats["events_peak"] < stats["event_limit"]


GEOMETRY = []


@aiogpu.kernel("u8*")
def record_geometry(launch, buf):
    GEOMETRY.append((launch.grid, launch.block, launch.dims))


@pytest.mark.asyncio
async def test_hidden_geometry_arguments_are_filled(rt):
    """Issue 14.8: code object v5 kernels read grid and work-group sizes from hidden kernel
    arguments; the emulated kernels do too, so arguments left zero show as a zero geometry."""
    d0 = rt.devices[0]
    buf = d0.alloc(64)
    GEOMETRY.clear()
    await d0.launch(record_geometry, grid=(1000, 3), block=(64, 2), args=(buf,))
    with aiogpu.Graph() as g:
        node = d0.launch(record_geometry, grid=(10,), block=(4,), args=(buf,))
    exe = g.instantiate()
    await exe.launch()
    await exe.launch(grid={node: (7, 7, 7)}, block={node: (2, 2, 2)})
    assert GEOMETRY == [((1000, 3), (64, 2), 2), ((10,), (4,), 1), ((7, 7, 7), (2, 2, 2), 3)]
    assert rt.api.emulator.kernarg_mismatches == []


class _AlignedKernel(aiogpu.kernels.Kernel):
    """An emulated kernel whose code object asks for 256-byte kernarg alignment."""

    def code_object(self, backend, isa):
        from aiogpu.hsa_bindings import emulated_code
        if self._token is None:
            self._token = emulated_code.register(self.body)
        return emulated_code.code_object([(self.name, self.signature, self._token)], kernarg_align=256)


@pytest.mark.asyncio
async def test_kernarg_segments_follow_the_kernels_alignment(rt):
    """Issue 14.9: the kernarg segment must be aligned to the kernel's kernarg_segment_align
    (the emulator fails a misaligned dispatch; hardware would read shifted arguments)."""
    d0 = rt.devices[0]

    def fill(launch, buf, value):
        buf[:] = value

    k = _AlignedKernel(fill, "u32*, u32", name="aligned_fill")
    buf = d0.alloc(64)
    await aiogpu.gather(*[d0.launch(k, grid=(1,), block=(1,), args=(buf, i)) for i in range(8)])
    with aiogpu.Graph() as g:
        d0.launch(k, grid=(1,), block=(1,), args=(buf, 99))
        d0.launch(fill_kernel, grid=(16,), block=(16,), args=(buf, 98, 16))
    await g.instantiate().launch()
    assert rt.api.emulator.queue_errors == []
    assert (await buf.to_numpy(np.uint32)).tolist() == [98] * 16
