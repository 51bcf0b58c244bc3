"""Launch, copy and await on the emulator: results, event loops, threads, joins."""
from __future__ import annotations

import asyncio
import threading

import anyio
import numpy as np
import pytest

import aiogpu
from gpu_kernels import saxpy, scale, sleep_ms


async def saxpy_roundtrip(rt, host):
    d0 = rt.devices[0]
    n = 1000
    xs, ys = host(n), host(n)
    x, y = d0.alloc(n * 4), d0.alloc(n * 4)
    f1 = aiogpu.copy(x, xs)
    f2 = aiogpu.copy(y, ys)
    f3 = d0.launch(saxpy, grid=(n,), block=(256,), args=(y, x, 2.0, n), after=[f1, f2])
    await f3
    out = await y.to_numpy(np.float32)
    np.testing.assert_allclose(out, ys + 2.0 * xs, rtol=1e-6)


@pytest.mark.asyncio
async def test_saxpy_on_asyncio(rt, host):
    await saxpy_roundtrip(rt, host)


def test_saxpy_on_uvloop(rt, host):
    uvloop = pytest.importorskip("uvloop")
    uvloop.run(saxpy_roundtrip(rt, host))


def test_saxpy_on_trio_through_anyio(rt, host):
    anyio.run(saxpy_roundtrip, rt, host, backend="trio")


def test_wait_from_plain_threads(rt, host):
    d0 = rt.devices[0]
    errors = []

    def worker(i):
        try:
            buf = d0.alloc(64 * 4)
            data = np.full(64, i, np.float32)
            aiogpu.copy(buf, data)
            f = d0.launch(scale, grid=(64,), block=(64,), args=(buf, 3.0, 64))
            assert f.wait(timeout=10)
            out = np.empty(64, np.float32)
            assert aiogpu.copy(out, buf).wait(timeout=10)
            assert (out == 3.0 * i).all()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_wait_times_out_while_pending(rt):
    f = rt.devices[0].launch(sleep_ms, grid=(1,), block=(1,), args=(300,))
    assert f.wait(timeout=0.01) is False
    assert not f.done()
    assert f.wait(timeout=10) is True
    assert f.result() is None


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
async def test_gather_joins_on_the_device(rt, host):
    d0, d1 = rt.devices
    futs = [d.launch(sleep_ms, grid=(1,), block=(1,), args=(20,)) for d in (d0, d1) for _ in range(4)]
    joined = aiogpu.gather(*futs)
    assert isinstance(joined, aiogpu.GPUFuture)
    assert joined.queue is not None and joined.queue.startswith("gpu")  # a barrier packet on a queue
    await joined
    assert all(f.done() for f in futs)


@pytest.mark.asyncio
async def test_done_callback_runs_on_the_loop(rt):
    loop = asyncio.get_running_loop()
    seen = []
    f = rt.devices[0].launch(sleep_ms, grid=(1,), block=(1,), args=(10,))
    done = asyncio.Event()
    f.add_done_callback(lambda fut: (seen.append((fut, asyncio.get_running_loop())), done.set()))
    await asyncio.wait_for(done.wait(), 10)
    assert seen == [(f, loop)]


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
    """One thread-safe call per loop per waiter wake-up, however many futures completed."""
    loop = asyncio.get_running_loop()
    batches = []
    original = loop.call_soon_threadsafe

    def counting(callback, *args, **kwargs):
        batches.append(len(args[0]) if args and isinstance(args[0], list) else 1)
        return original(callback, *args, **kwargs)

    d0, d1 = rt.devices
    gate = d0.launch(sleep_ms, grid=(1,), block=(1,), args=(300,))
    # 200 launches spread over every queue of both devices, all held back by one gate.
    futs = [d.launch(sleep_ms, grid=(1,), block=(1,), args=(0,), after=[gate])
            for _ in range(100) for d in (d0, d1)]
    awaiting = [asyncio.ensure_future(_await(f)) for f in futs]
    await asyncio.sleep(0.05)            # every task is parked on its future
    wakeups = rt.hub.wakeups
    loop.call_soon_threadsafe = counting
    try:
        await asyncio.gather(*awaiting)
    finally:
        del loop.call_soon_threadsafe
    assert sum(batches) >= 200
    assert len(batches) <= rt.hub.wakeups - wakeups, "more thread-safe calls than waiter wake-ups"
    assert max(batches) > 1, "completions were never batched"


async def _await(f):
    await f
