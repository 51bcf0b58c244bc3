"""The public API on every backend: the emulator, and CUDA where an NVIDIA GPU answers.

Each test takes ``any_rt`` (or ``make_any``), parametrised over the backends in conftest.py; the
CUDA parameters skip cleanly where ``aiogpu.runtime.cuda_available()`` says no. Nothing here
looks at a backend's internals: results are checked against the kernels' NumPy bodies.
"""
from __future__ import annotations

import asyncio
import threading
import time

import anyio
import numpy as np
import pytest

import aiogpu
from backends import TORCH_CUDA, Ticks, backend_runtime
from gpu_kernels import add_const_n, add_into, fail_if, saxpy, scale, sleep_ms, slow_increment


def rng_array(n, dtype=np.float32, seed=0):
    return np.random.default_rng(seed).standard_normal(n).astype(dtype)


async def saxpy_roundtrip(rt):
    d0 = rt.devices[0]
    n = 100_000
    xs, ys = rng_array(n, seed=1), rng_array(n, seed=2)
    x, y = d0.alloc(n * 4), d0.alloc(n * 4)
    f1 = aiogpu.copy(x, xs)
    f2 = aiogpu.copy(y, ys)
    f3 = d0.launch(saxpy, grid=(n,), block=(256,), args=(y, x, 2.0, n), after=[f1, f2])
    assert isinstance(f3, aiogpu.GPUFuture)
    assert await f3 is None
    out = await y.to_numpy(np.float32)
    expect = ys.copy()
    saxpy(None, expect, xs, np.float32(2.0), n)
    np.testing.assert_allclose(out, expect, rtol=1e-6)


# -- event loops and threads ---------------------------------------------------------------------
@pytest.mark.asyncio
async def test_saxpy_on_asyncio(any_rt):
    await saxpy_roundtrip(any_rt)


def test_saxpy_on_uvloop(any_rt):
    uvloop = pytest.importorskip("uvloop")
    uvloop.run(saxpy_roundtrip(any_rt))


def test_saxpy_on_trio(any_rt):
    pytest.importorskip("trio")
    anyio.run(saxpy_roundtrip, any_rt, backend="trio")


def test_wait_from_plain_threads(any_rt):
    d0 = any_rt.devices[0]
    errors = []

    def worker(i):
        try:
            buf = d0.alloc(1024 * 4)
            aiogpu.copy(buf, np.full(1024, i, np.float32))
            f = d0.launch(scale, grid=(1024,), block=(256,), args=(buf, 3.0, 1024))
            assert f.wait(timeout=20)
            out = np.empty(1024, np.float32)
            assert aiogpu.copy(out, buf).wait(timeout=20)
            assert (out == 3.0 * i).all()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_wait_times_out_while_pending(any_rt):
    f = any_rt.devices[0].launch(sleep_ms, grid=(1,), block=(1,), args=(300,))
    assert f.wait(timeout=0.01) is False
    assert not f.done()
    assert f.wait(timeout=20) is True
    assert f.result() is None


@pytest.mark.asyncio
async def test_done_callback_runs_on_the_loop(any_rt):
    loop = asyncio.get_running_loop()
    seen = []
    done = asyncio.Event()
    f = any_rt.devices[0].launch(sleep_ms, grid=(1,), block=(1,), args=(20,))
    f.add_done_callback(lambda fut: (seen.append((fut, asyncio.get_running_loop())), done.set()))
    await asyncio.wait_for(done.wait(), 20)
    assert seen == [(f, loop)]


@pytest.mark.asyncio
async def test_many_concurrent_awaits(any_rt):
    devs = any_rt.devices
    n = 2000

    async def one(i):
        await devs[i % len(devs)].launch(sleep_ms, grid=(1,), block=(1,), args=(0,))

    await asyncio.gather(*(one(i) for i in range(n)))


@pytest.mark.asyncio
async def test_requests_whose_work_is_done_go_on_a_slice_per_loop_iteration(any_rt, monkeypatch):
    """64 tasks each awaiting its own launch, all finished on the device before they await
    (as in a service whose small kernels complete during the submission): at most
    ``WAKE_SLICE`` go on per loop iteration, whether the waiter settled their futures already
    or the await finds the device done first; none is lost."""
    from aiogpu import _loops
    for name in ("WAKE_SLICE", "SLICE_MIN", "SLICE_MAX"):     # exactly 8 per iteration
        monkeypatch.setattr(_loops, name, 8)
    monkeypatch.setattr(_loops, "TURN_BUDGET_S", 0.0)
    dev = any_rt.devices[0]
    futs = [dev.launch(sleep_ms, grid=(1,), block=(1,), args=(0,)) for _ in range(64)]
    await asyncio.to_thread(futs[-1].wait, 30)
    ticks, seen = Ticks(), []

    async def one(f):
        await f
        seen.append(ticks.n)

    tasks = [asyncio.ensure_future(one(f)) for f in futs]
    ticks.start()
    await asyncio.wait_for(asyncio.gather(*tasks), 30)
    ticks.stop()
    assert len(seen) == 64
    assert max(seen.count(t) for t in set(seen)) <= 8


# -- copies --------------------------------------------------------------------------------------
@pytest.mark.asyncio
@pytest.mark.parametrize("nbytes", [4, 4096, 100_000, 8 << 20])
async def test_copies_in_every_direction(any_rt, nbytes):
    d0 = any_rt.devices[0]
    data = np.random.default_rng(nbytes).integers(0, 255, nbytes, dtype=np.uint8)
    a, b = d0.alloc(nbytes), d0.alloc(nbytes)
    await aiogpu.copy(a, data)                        # host -> device
    await aiogpu.copy(b, a)                           # device -> device
    out = np.zeros(nbytes, np.uint8)
    await aiogpu.copy(out, b)                         # device -> host
    np.testing.assert_array_equal(out, data)
    again = await b.to_numpy()                        # the same buffer, a new array
    np.testing.assert_array_equal(again, data)


@pytest.mark.asyncio
async def test_copies_of_arrays_that_share_pages(any_rt):
    """Neighbouring slices of one array (they share memory pages) copied concurrently."""
    d0 = any_rt.devices[0]
    host = np.arange(64 * 1024, dtype=np.int64)
    parts = np.split(host, 16)                        # contiguous views, 32 KiB each
    bufs = [d0.alloc(p.nbytes) for p in parts]
    await aiogpu.gather(*[aiogpu.copy(b, p) for b, p in zip(bufs, parts)])
    fs = [d0.launch(add_const_n, grid=(p.size,), block=(256,), args=(b, i, p.size))
          for i, (b, p) in enumerate(zip(bufs, parts))]
    back = np.zeros_like(host)
    outs = np.split(back, 16)
    await aiogpu.gather(*[aiogpu.copy(o, b, after=[f]) for o, b, f in zip(outs, bufs, fs)])
    expect = np.concatenate([p + i for i, p in enumerate(parts)])
    np.testing.assert_array_equal(back, expect)


@pytest.mark.asyncio
async def test_round_trips_through_arrays_that_share_pages(any_rt):
    """Separate host arrays on shared pages, written by the device and read back by it with
    nothing awaited in between: ordering through host memory holds however they are pinned."""
    d0 = any_rt.devices[0]
    raw = bytearray(16 * 5000)
    views = [np.frombuffer(raw, np.uint8, 5000, i * 5000) for i in range(16)]
    srcs = [d0.alloc(5000) for _ in range(16)]
    dsts = [d0.alloc(5000) for _ in range(16)]
    await aiogpu.gather(*[aiogpu.copy(b, np.full(5000, i, np.uint8)) for i, b in enumerate(srcs)])
    for v, b in zip(views, srcs):
        aiogpu.copy(v, b)                                 # device -> host
    backs = [aiogpu.copy(d, v) for d, v in zip(dsts, views)]   # host -> device (reads it back)
    await aiogpu.gather(*backs)
    for i, v in enumerate(views):
        assert (v == i).all(), i                          # landed by the time the join is done
    for i, d in enumerate(dsts):
        assert (await d.to_numpy() == i).all(), i


@pytest.mark.asyncio
async def test_repeated_copies_of_one_large_array(any_rt):
    d0 = any_rt.devices[0]
    data = rng_array(4 << 20)
    buf = d0.alloc(data.nbytes)
    for i in range(5):
        data[0] = i
        await aiogpu.copy(buf, data)
        out = await buf.to_numpy(np.float32)
        assert out[0] == i
    np.testing.assert_array_equal(out, data)


@pytest.mark.asyncio
async def test_shader_copies_give_the_same_results(make_any):
    rt = make_any(shader_copies=True)
    d0 = rt.devices[0]
    data = rng_array(75_001)
    a, b = d0.alloc(data.nbytes), d0.alloc(data.nbytes)
    await aiogpu.copy(a, data)
    await aiogpu.copy(b, a)
    np.testing.assert_array_equal(await b.to_numpy(np.float32), data)


@pytest.mark.asyncio
async def test_peer_copies_both_ways(any_rt2):
    any_rt = any_rt2
    d0, d1 = any_rt.devices[:2]
    n = 1 << 20
    data = rng_array(n)
    a, b = d0.alloc(n * 4), d1.alloc(n * 4)
    aiogpu.copy(a, data)
    d0.launch(scale, grid=(n,), block=(256,), args=(a, 2.0, n))
    peer = aiogpu.copy(b, a)                          # ordered after the scale (read after write)
    assert peer.queue.startswith("gpu0")              # the SOURCE device's engine
    d1.launch(scale, grid=(n,), block=(256,), args=(b, 3.0, n))
    aiogpu.copy(a, b)
    np.testing.assert_allclose(await a.to_numpy(np.float32), data * 6.0, rtol=1e-6)


@pytest.mark.asyncio
async def test_fill_and_typed_results(any_rt):
    d0 = any_rt.devices[0]
    buf = d0.alloc(4096)
    await buf.fill(0x01020304)
    words = await buf.to_numpy(np.uint32)
    assert words.shape == (1024,) and (words == 0x01020304).all()
    with pytest.raises(ValueError, match="whole number"):
        d0.alloc(12).to_numpy(np.float64)
    for bad in (object, np.dtype("V3"), np.dtype([]), "U4", [("a", "i4")]):
        with pytest.raises(TypeError, match="not numeric"):
            buf.to_numpy(bad)


@pytest.mark.asyncio
async def test_non_numeric_host_arrays_are_refused(any_rt):
    """Raw bytes copied into an object array would overwrite PyObject pointers (a crash)."""
    d0 = any_rt.devices[0]
    buf = d0.alloc(64)
    await buf.fill(7)
    objects = np.empty(64 // np.dtype(object).itemsize, dtype=object)
    with pytest.raises(TypeError, match="not numeric"):
        aiogpu.copy(objects, buf)
    with pytest.raises(TypeError, match="not numeric"):
        aiogpu.copy(buf, objects)
    assert list(objects) == [None] * len(objects)


@pytest.mark.asyncio
async def test_fill_values_are_32_bit_integers(any_rt):
    buf = any_rt.devices[0].alloc(16)
    for bad in ("7", 1.5, 2.0, 1j, True, None):
        with pytest.raises(TypeError):
            buf.fill(bad)
    for bad in (1 << 32, -(1 << 31) - 1, 2 ** 40):
        with pytest.raises(ValueError, match="32 bits"):
            buf.fill(bad)
    await buf.fill(-1)
    assert (await buf.to_numpy(np.uint32) == 0xFFFFFFFF).all()


# -- ordering ------------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_conflicting_launches_from_concurrent_tasks_are_ordered(any_rt):
    d0 = any_rt.devices[0]
    counter = d0.alloc(8)
    await aiogpu.copy(counter, np.zeros(1, np.int64))

    async def bump():
        await asyncio.sleep(0)
        await d0.launch(slow_increment, grid=(1,), block=(1,), args=(counter,))

    await asyncio.gather(*(bump() for _ in range(30)))
    assert (await counter.to_numpy(np.int64))[0] == 30


@pytest.mark.asyncio
async def test_after_chains_and_read_write_hazards(any_rt):
    d0 = any_rt.devices[0]
    n = 4096
    a, b = d0.alloc(n * 8), d0.alloc(n * 8)
    src = np.arange(n, dtype=np.int64)
    up = aiogpu.copy(a, src)
    prev = up
    for _ in range(10):     # an explicit chain; a and b are also hazards
        prev = d0.launch(add_const_n, grid=(n,), block=(128,), args=(a, 1, n), after=[prev])
    cp = aiogpu.copy(b, a)                                    # read after write of a
    last = d0.launch(add_into, grid=(n,), block=(128,), args=(b, a, n), after=[cp])
    await last
    np.testing.assert_array_equal(await b.to_numpy(np.int64), 2 * (src + 10))


@pytest.mark.asyncio
async def test_independent_work_on_other_lanes_is_not_held_back(any_rt):
    d0 = any_rt.devices[0]
    buf = d0.alloc(64)
    # Warm up (CUDA: the first launch of a kernel loads it, which may wait for running kernels).
    await d0.launch(scale, grid=(16,), block=(16,), args=(buf, 2.0, 16))
    slow = d0.launch(sleep_ms, grid=(1,), block=(1,), args=(300,))
    t0 = time.monotonic()
    await aiogpu.copy(buf, np.ones(16, np.float32))
    await d0.launch(scale, grid=(16,), block=(16,), args=(buf, 2.0, 16))
    assert time.monotonic() - t0 < 0.25, "independent work waited for an unrelated slow kernel"
    assert not slow.done()
    await slow


@pytest.mark.asyncio
async def test_gather_joins_on_the_device(any_rt):
    devs = any_rt.devices
    futs = [d.launch(sleep_ms, grid=(1,), block=(1,), args=(20,)) for d in devs for _ in range(4)]
    joined = aiogpu.gather(*futs)
    assert isinstance(joined, aiogpu.GPUFuture)
    assert joined.queue is not None and joined.queue.startswith("gpu")  # waits on a device queue
    await joined
    assert all(f.done() for f in futs)


@pytest.mark.asyncio
async def test_task_group_waits_for_its_gpu_work(any_rt):
    d0 = any_rt.devices[0]
    async with aiogpu.TaskGroup() as tg:
        for _ in range(4):
            tg.start_soon(_launch_and_await, d0)
    assert tg.submitted and all(f.done() for f in tg.submitted)


async def _launch_and_await(d):
    await d.launch(sleep_ms, grid=(1,), block=(1,), args=(5,))


# -- graphs --------------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_graph_replay_with_patches_and_a_thousand_replays(any_rt):
    d0 = any_rt.devices[0]
    n = 256
    a, b, c = d0.alloc(n * 8), d0.alloc(n * 8), d0.alloc(n * 8)
    zeros = np.zeros(n, np.int64)
    await aiogpu.gather(aiogpu.copy(a, zeros), aiogpu.copy(b, zeros), aiogpu.copy(c, zeros))
    with aiogpu.Graph() as g:
        k1 = d0.launch(add_const_n, grid=(n,), block=(64,), args=(a, 1, n))
        cp = aiogpu.copy(b, a, after=[k1])
        k2 = d0.launch(add_const_n, grid=(n,), block=(64,), args=(b, 1, n), after=[cp])
    assert any_rt.stats()["pending"] == 0                     # capture runs nothing
    exe = g.instantiate()
    futs = [exe.launch() for _ in range(1000)]
    await aiogpu.gather(*futs)
    assert (await a.to_numpy(np.int64) == 1000).all()
    assert (await b.to_numpy(np.int64) == 1001).all()
    # Patches apply to one replay only.
    exe.launch(args={k1: (c, 10, n)})
    await exe.launch()
    assert (await c.to_numpy(np.int64) == 10).all()
    assert (await a.to_numpy(np.int64) == 1001).all()
    assert (await b.to_numpy(np.int64) == 1002).all()     # b = a + 1 after each replay
    # A patched grid (and count) covers half the elements.
    await exe.launch(args={k2: (b, 1, n // 2)}, grid={k2: (n // 2,)})
    got = await b.to_numpy(np.int64)
    assert (got[: n // 2] == 1003).all() and (got[n // 2:] == 1002).all()
    # Bad patches are rejected before anything is submitted.
    pending = any_rt.stats()["pending"]
    with pytest.raises(TypeError, match="takes 3 arguments"):
        exe.launch(args={k1: (a, 1)})
    with pytest.raises(ValueError, match="not a node of this graph"):
        exe.launch(args={object(): (a, 1, n)})
    with pytest.raises(ValueError, match="grid entries"):
        exe.launch(grid={k1: (0,)})
    assert any_rt.stats()["pending"] == pending


@pytest.mark.asyncio
async def test_graph_with_host_copies_and_a_join(any_rt):
    d0 = any_rt.devices[-1]
    src = np.arange(64, dtype=np.int64)
    out = np.zeros(64, np.int64)
    a, b = d0.alloc(512), d0.alloc(512)
    with aiogpu.Graph() as g:
        up = aiogpu.copy(a, src)
        up2 = aiogpu.copy(b, src)
        k1 = d0.launch(add_const_n, grid=(64,), block=(64,), args=(a, 1, 64), after=[up])
        k2 = d0.launch(add_const_n, grid=(64,), block=(64,), args=(b, 2, 64), after=[up2])
        j = aiogpu.gather(k1, k2)
        aiogpu.copy(out, a, after=[j])
    exe = g.instantiate()
    await exe.launch()
    np.testing.assert_array_equal(out, src + 1)
    np.testing.assert_array_equal(await b.to_numpy(np.int64), src + 2)


@pytest.mark.asyncio
async def test_replays_run_in_launch_order(any_rt):
    d0 = any_rt.devices[0]
    c = d0.alloc(8)
    await aiogpu.copy(c, np.zeros(1, np.int64))
    with aiogpu.Graph() as g:
        d0.launch(slow_increment, grid=(1,), block=(1,), args=(c,))
    exe = g.instantiate()
    await aiogpu.gather(*[exe.launch() for _ in range(20)])
    assert (await c.to_numpy(np.int64))[0] == 20


# -- bad input -----------------------------------------------------------------------------------
def test_bad_input_raises_before_submission(any_rt):
    d0 = any_rt.devices[0]
    x, y = d0.alloc(64), d0.alloc(64)
    pending = any_rt.stats()["pending"]
    cases = [
        (lambda: d0.launch(saxpy, (16,), (16,), (y, x, 2.0)), TypeError, "takes 4 arguments"),
        (lambda: d0.launch(saxpy, (16,), (16,), (1, x, 2.0, 16)), TypeError, "must be a Buffer"),
        (lambda: d0.launch(saxpy, (16,), (16,), (y, x, "2", 16)), TypeError, "must be a real number"),
        (lambda: d0.launch(saxpy, (16,), (16,), (y, x, 2.0, -1)), ValueError, "out of range"),
        (lambda: d0.launch(saxpy, (0,), (16,), (y, x, 2.0, 16)), ValueError, "grid entries"),
        (lambda: d0.launch(saxpy, (16,), (2048,), (y, x, 2.0, 16)), ValueError, "block entries"),
        (lambda: d0.launch(saxpy, (16, 16), (16,), (y, x, 2.0, 16)), ValueError, "same number"),
        (lambda: d0.launch("saxpy", (16,), (16,), (y, x, 2.0, 16)), TypeError, "aiogpu kernel"),
        (lambda: d0.launch(saxpy, (16,), (16,), (y, x, 2.0, 16), after=[1]), TypeError, "after="),
        (lambda: aiogpu.copy(x, np.zeros(3, np.float32)), ValueError, "sizes differ"),
        (lambda: aiogpu.copy(x, np.zeros((4, 8), np.float32)[:, :4]), ValueError, "C-contiguous"),
        (lambda: aiogpu.copy(x, [1, 2, 3]), TypeError, "must be a Buffer"),
        (lambda: d0.alloc(0), ValueError, "positive"),
    ]
    for call, exc, match in cases:
        with pytest.raises(exc, match=match):
            call()
    assert any_rt.stats()["pending"] == pending


def test_buffers_of_another_device_are_rejected(any_rt2):
    any_rt = any_rt2
    d0, d1 = any_rt.devices[:2]
    x, other = d0.alloc(64), d1.alloc(64)
    with pytest.raises(ValueError, match="not on gpu0"):
        d0.launch(saxpy, (16,), (16,), (other, x, 2.0, 16))


def test_closed_runtime_rejects_work(make_any):
    rt = make_any()
    d0 = rt.devices[0]
    buf = d0.alloc(64)
    rt.close()
    with pytest.raises(aiogpu.RuntimeClosedError):
        d0.launch(scale, (16,), (16,), (buf, 1.0, 16))
    with pytest.raises(aiogpu.RuntimeClosedError):
        d0.alloc(64)


# -- interop ---------------------------------------------------------------------------------------
def test_buffer_interop_is_cuda_only(rt):
    buf = rt.devices[0].alloc(1024 * 4)
    assert not hasattr(buf, "__cuda_array_interface__")
    with pytest.raises(TypeError, match="only CUDA buffers"):
        buf.__dlpack__()


@pytest.mark.cuda
@pytest.mark.skipif(not TORCH_CUDA, reason="needs the CUDA backend and a CUDA build of torch")
@pytest.mark.asyncio
async def test_buffer_interop_with_torch():
    import torch

    any_rt = backend_runtime("cuda")
    d0 = any_rt.devices[0]
    buf = d0.alloc(1024 * 4)
    data = np.arange(1024, dtype=np.float32)
    await aiogpu.copy(buf, data)
    assert buf.__dlpack_device__() == (2, d0.index)
    t = torch.from_dlpack(buf).view(torch.float32)           # zero-copy view of the Buffer
    assert t.device.type == "cuda" and t.numel() == 1024
    np.testing.assert_array_equal(t.cpu().numpy(), data)
    t.mul_(2)                                                 # torch writes the buffer
    torch.cuda.synchronize()
    np.testing.assert_array_equal(await buf.to_numpy(np.float32), data * 2)
    # torch tensors as copy sources and destinations.
    src = torch.arange(1024, dtype=torch.float32, device=f"cuda:{d0.index}") + 5
    await aiogpu.copy(buf, src)
    dst = torch.zeros(1024, dtype=torch.float32, device=f"cuda:{d0.index}")
    await aiogpu.copy(dst, buf)
    assert torch.equal(dst, src)
    cai = buf.__cuda_array_interface__
    assert cai["data"][0] == buf.address and cai["shape"] == (buf.nbytes,) and cai["version"] == 3
    del t
    assert await any_rt.leaks_async(5.0, buffers=False) == {}     # (leaks() refuses on the loop)
    any_rt.close()


@pytest.mark.asyncio
async def test_buffer_interop_with_cupy(any_rt):
    d0 = any_rt.devices[0]
    if any_rt.backend != "cuda":
        assert not hasattr(d0.alloc(8), "__cuda_array_interface__")
        return
    cp = pytest.importorskip("cupy")
    buf = d0.alloc(256 * 8)
    await aiogpu.copy(buf, np.arange(256, dtype=np.int64))
    with cp.cuda.Device(d0.index):
        view = cp.asarray(buf).view(cp.int64)                 # through __cuda_array_interface__
        assert int(view.sum()) == sum(range(256))
        other = cp.full(256, 7, dtype=cp.int64)
        await aiogpu.copy(buf, other)
    assert (await buf.to_numpy(np.int64) == 7).all()


# -- failures --------------------------------------------------------------------------------------
async def kernel_failure_scenario(rt):
    """A failing kernel fails its future and its dependents (read after write, after=) with
    GPUError, promptly; returns the device for further checks."""
    d0 = rt.devices[0]
    out, copy_of = d0.alloc(4), d0.alloc(4)
    bad = d0.launch(fail_if, grid=(1,), block=(1,), args=(out, 1))
    dep_copy = aiogpu.copy(copy_of, out)                      # reads what the failed kernel wrote
    later = d0.launch(fail_if, grid=(1,), block=(1,), args=(copy_of, 0), after=[dep_copy])
    t0 = time.monotonic()
    with pytest.raises(aiogpu.GPUError) as info:
        await bad
    assert info.value.status is not None and info.value.queue
    for dep in (dep_copy, later):
        with pytest.raises(aiogpu.GPUError):
            await dep
    assert time.monotonic() - t0 < 2.0
    return d0


CUDA_FAILURE_SCRIPT = """
import asyncio, sys, time
sys.path[:0] = {paths!r}
import aiogpu, pytest
import test_backends as tb
from gpu_kernels import fail_if

async def main():
    rt = aiogpu.Runtime("cuda")
    d0 = await tb.kernel_failure_scenario(rt)
    # CUDA errors are sticky: later work on the device fails at once instead of hanging.
    t0 = time.monotonic()
    with pytest.raises(aiogpu.GPUError, match="sticky"):
        await d0.launch(fail_if, grid=(1,), block=(1,), args=(d0.alloc(4), 0))
    assert time.monotonic() - t0 < 1.0
    rt.close()
    print("SCENARIO-OK")

asyncio.run(main())
"""


@pytest.mark.asyncio
async def test_kernel_failure_fails_its_future_and_dependents(make_any, any_backend):
    if any_backend == "cuda":
        # A CUDA kernel fault poisons the process's context for good (CUDA recovers only in a
        # new process): run the scenario in a child process, so this one stays usable.
        import os
        import subprocess
        import sys
        here = os.path.dirname(os.path.abspath(__file__))    # test_backends, and gpu_kernels above it
        proc = subprocess.run([sys.executable, "-c", CUDA_FAILURE_SCRIPT.format(paths=[here, os.path.dirname(here)])],
                              capture_output=True, text=True, timeout=120)
        assert "SCENARIO-OK" in proc.stdout, proc.stdout + proc.stderr
        return
    rt = make_any()
    d0 = await kernel_failure_scenario(rt)
    ok = d0.alloc(4)                       # the emulated device stays usable
    await d0.launch(fail_if, grid=(1,), block=(1,), args=(ok, 0))
    assert (await ok.to_numpy(np.int32))[0] == 1
