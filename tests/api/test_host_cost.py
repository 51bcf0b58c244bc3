"""Host cost per operation (issue 12): the steady state of a service makes no driver call for
memory, results land in pinned memory, and awaits do not busy-poll while others are awaited.
Timings are the benchmarks' business (bench/serve.py); these tests count calls and check
contents."""
from __future__ import annotations


import asyncio
import gc
import time

import numpy as np
import pytest

import aiogpu
from gpu_kernels import scale, sleep_ms
from backends import count_calls, on_fake_cuda, run_on_fake_cuda


_count = count_calls


def test_device_memory_is_cached_after_the_first_request(any_rt, monkeypatch):
    d0 = any_rt.devices[0]
    for size in (4096, 3 << 20):             # a small (buddy) and a large (own block) allocation
        warm = [d0.alloc(size), d0.alloc(size)]
        for b in warm:                       # warm: the blocks now sit in the cache
            b.free()
        allocs = _count(monkeypatch, d0.memory, "_raw_alloc")
        frees = _count(monkeypatch, d0.memory, "_raw_free")
        for _ in range(50):
            a, b = d0.alloc(size), d0.alloc(size)
            a.free()
            b.free()
        assert allocs == [] and frees == [], "steady state made driver calls"
        monkeypatch.undo()
    stats = any_rt.stats()
    assert stats["cached_bytes"] > 0
    assert d0.trim() > 0 and any_rt.stats()["cached_bytes"] == sum(
        d.memory.cached_bytes for d in any_rt.devices[1:])


def test_a_refused_allocation_trims_the_cache_and_retries(any_rt, monkeypatch):
    d0 = any_rt.devices[0]
    d0.alloc(3 << 20).free()                 # 4 MiB cached
    assert d0.memory.cached_bytes >= 4 << 20
    real = d0.memory._raw_alloc
    refused = []

    def tight(size):                         # the driver refuses until the cache is given back
        if d0.memory.cached_bytes:
            refused.append(size)
            raise d0._out_of_memory(size, 0)
        return real(size)

    monkeypatch.setattr(d0.memory, "_raw_alloc", tight)
    buf = d0.alloc(8 << 20)
    assert refused and d0.memory.cached_bytes == 0 and buf.nbytes == 8 << 20


def test_the_pinned_pool_pins_once(any_rt, monkeypatch):
    """Blocks given back and taken again (a service's steady state) pin no new memory, small
    and large alike."""
    pool = any_rt.pinned
    for size in (4096, 3 << 20):
        with any_rt.lock:
            *_, release = pool.block(size)
        release()
        pins = _count(monkeypatch, pool, "_pin")
        for _ in range(20):
            with any_rt.lock:
                *_, release = pool.block(size)
            release()
        assert pins == [], f"{len(pins)} slabs pinned for blocks of {size} bytes"
        monkeypatch.undo()


@pytest.mark.asyncio
async def test_to_numpy_results_live_in_pinned_memory_and_outlive_the_runtime(make_any):
    rt = make_any()
    d0 = rt.devices[0]
    data = np.arange(4096, dtype=np.float32)
    buf = d0.alloc(data.nbytes)
    await aiogpu.copy(buf, data)
    out = await buf.to_numpy(np.float32)
    np.testing.assert_array_equal(out, data)
    assert rt.pinned.device_pointer(out.__array_interface__["data"][0], out.nbytes) is not None
    assert rt.stats()["pinned_blocks"] >= 1
    view = out[10:20]
    buf.free()
    rt.close()
    np.testing.assert_array_equal(view, data[10:20])      # still valid memory after close
    view[:] = 7                                            # and writable
    assert (out[10:20] == 7).all()


@pytest.mark.asyncio
async def test_pinned_blocks_return_when_the_arrays_die(any_rt):
    d0 = any_rt.devices[0]
    buf = d0.alloc(1 << 16)
    await buf.fill(3)
    base = any_rt.stats()["pinned_blocks"]
    arrays = [await buf.to_numpy(np.uint32) for _ in range(8)]
    assert any_rt.stats()["pinned_blocks"] == base + 8
    keep = arrays[0][:4]
    del arrays
    await any_rt.leaks_async(buffers=False)   # the waiter has retired the copies (their futures let go)
    gc.collect()
    assert any_rt.stats()["pinned_blocks"] == base + 1          # the kept view's
    assert (keep == 3).all()


@pytest.mark.asyncio
async def test_results_into_pinned_arrays_take_no_host_lock(any_rt):
    """A download into the runtime's pinned memory pins nothing per call."""
    d0 = any_rt.devices[0]
    buf = d0.alloc(1 << 20)
    await buf.fill(9)
    out = await buf.to_numpy(np.uint32)
    locks = []
    hub_before = any_rt.stats()["host_locks"]
    for _ in range(5):
        fut = aiogpu.copy(out, buf)
        locks.append(any_rt.stats()["host_locks"])
        await fut
    assert locks == [hub_before] * 5
    assert (out == 9).all()


@pytest.mark.asyncio
async def test_small_host_sources_are_staged(any_rt):
    """A small upload from a fresh array copies it into pinned memory at submission: no lock of
    the caller's array, and the right bytes arrive."""
    d0 = any_rt.devices[0]
    buf = d0.alloc(4096)
    for i in range(5):
        src = np.full(1024, i, np.float32)
        fut = aiogpu.copy(buf, src)
        assert any_rt.stats()["host_locks"] == 0
        await fut
        assert (await buf.to_numpy(np.float32) == i).all()


@pytest.mark.asyncio
async def test_concurrent_awaits_do_not_spin(make_any):
    """With several futures awaited at once, none busy-polls the loop: they park."""
    rt = make_any(spin_s=0.05)
    d0 = rt.devices[0]
    polls, starts = [], []
    real = rt.hub.spin_await

    def spy(fut):                    # every spin and each of its polls, with how many were awaited
        starts.append(rt.hub.awaiting)
        for step in real(fut):
            polls.append(rt.hub.awaiting)
            yield step

    rt.hub.spin_await = spy
    bufs = [d0.alloc(4096) for _ in range(16)]
    await asyncio.gather(*(asyncio.ensure_future(_sleep_and_wait(d0, b)) for b in bufs))
    assert all(n == 1 for n in polls + starts), "polled while other futures were awaited"
    assert len(starts) < len(bufs)              # 5 ms kernels: the others came while one spun
    assert rt.hub.awaiting == 0
    before = len(starts)
    for _ in range(5):                             # alone, an await spins
        await _launch_and_wait(d0, bufs[0])
    assert len(starts) == before + 5


async def _sleep_and_wait(d0, buf):
    await d0.launch(sleep_ms, grid=(1,), block=(1,), args=(5,))


async def _launch_and_wait(d0, buf):
    # (2 ms: the await must start before the work completes. A tiny kernel may already be
    # settled by then, now that the waiter delivers without waiting for the runtime lock.)
    await d0.launch(sleep_ms, grid=(1,), block=(1,), args=(2,))


@pytest.mark.asyncio
async def test_an_await_that_spins_leaves_settling_to_the_waiter(make_any):
    """On CUDA a spin that reads the work done in the completion word returns without settling
    the future on the loop (no lock); the waiter settles it later. Whatever path an await takes:
    the future reads done at once, a done-callback added before or after the await runs, a
    thread's ``wait`` returns, and the buffers are let go (the fixture checks for leaks)."""
    rt = make_any(spin_s=0.05)
    d0 = rt.devices[0]
    buf = d0.alloc(4096)
    loop = asyncio.get_running_loop()
    for _ in range(20):
        fut = d0.launch(scale, grid=(1024,), block=(256,), args=(buf, 1.0, 1024))
        before = loop.create_future()
        fut.add_done_callback(lambda f, box=before: box.done() or box.set_result(f))
        await fut
        assert fut.done() and fut.exception() is None and fut.result() is None
        after = loop.create_future()
        fut.add_done_callback(lambda f, box=after: box.done() or box.set_result(f))
        assert await asyncio.wait_for(before, 5) is fut
        assert await asyncio.wait_for(after, 5) is fut
        assert await loop.run_in_executor(None, fut.wait, 5)
    out = await buf.to_numpy(np.float32)
    assert out.shape == (1024,)
    buf.free()


FAKE_CUDA_SCRIPT = r"""
import asyncio, aiogpu, numpy as np
rt = aiogpu.Runtime("cuda", spin_s=0.05)
k = aiogpu.kernel("u32", cuda='extern "C" __global__ void noop(unsigned n) {}', name="noop")(lambda launch, n: None)
d0 = rt.devices[0]
fired = []
async def main():
    buf = d0.alloc(1024)
    for i in range(200):
        f = d0.launch(k, (1,), (1,), (i,))
        await f
        assert f.done() and f.exception() is None
        f.add_done_callback(fired.append)
        x = np.full(256, i, np.float32)
        aiogpu.copy(buf, x)
        out = await buf.to_numpy(np.float32)
        assert (out == i).all(), (i, out[:4])     # the fake copies bytes for real
    buf.free()
    for _ in range(500):
        if len(fired) == 200:
            break
        await asyncio.sleep(0.01)
asyncio.run(main())
assert len(fired) == 200, len(fired)
stats = rt.stats()
assert stats["spin_hits"] > 0, stats          # the lock-free spin path really ran
assert rt.leaks(5) == {}, rt.leaks(0)
rt.close()
print("ok", stats["spin_hits"])
"""


FAKE_STREAM_SCRIPT = r"""
import asyncio, aiogpu, numpy as np
rt = aiogpu.Runtime("cuda", spin_s=0.05)
k = aiogpu.kernel("u32", cuda='extern "C" __global__ void noop(unsigned n) {}', name="noop")(lambda launch, n: None)
d0 = rt.devices[0]
class TorchLikeStream:                      # what aiogpu reads of a torch.cuda.Stream
    def __init__(self, handle): self.cuda_stream, self.device_index = handle, 0
streams = [TorchLikeStream(0x7000 + i) for i in range(4)]
async def main():
    for i in range(100):                     # one awaiter: the spin reads the word
        await rt.stream_future(streams[0])
    for i in range(20):                      # many awaiters at once: they park and arm
        await asyncio.gather(*(rt.stream_future(s) for s in streams))
    f = rt.stream_future(streams[1])
    await d0.launch(k, (1,), (1,), (0,), after=[f])
    g = d0.launch(k, (1,), (1,), (1,))
    g.wait_on(streams[2])
    await g
asyncio.run(main())
lane = d0.foreign[0x7000]
assert lane.word is not None and lane.word.value == lane.ticket == 120, (lane.word, lane.ticket)
assert d0.events.created == 0, d0.events.created      # no event per stream future
stats = rt.stats()
assert stats["spin_hits"] > 0 and stats["arms"] > 0, stats
assert rt.leaks(5) == {}, rt.leaks(0)
rt.close()
print("ok")
"""


@on_fake_cuda
def test_cuda_host_paths_on_the_fake_driver():
    """The CUDA backend's host paths (spin without the lock, settling by the waiter, staged
    uploads, pinned downloads) on the instant fake driver (tests/fakes), in a child process: this runs
    the CUDA code on machines without a GPU (kernels do nothing there; copies are real)."""
    proc = run_on_fake_cuda(FAKE_CUDA_SCRIPT)
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stdout + proc.stderr


def test_a_buffer_dropped_in_another_thread_never_waits_for_the_lock(any_rt):
    """A buffer's memory goes back from whatever thread drops its last reference (a garbage
    collection runs finalizers in any thread, even one that the lock's holder waits for, as the
    emulator's engine threads at their start): that must never wait for the runtime lock. The
    memory is reused by the next allocation."""
    import threading

    d0 = any_rt.devices[0]
    box = [d0.alloc(4096)]
    address = box[0].address
    dropper = threading.Thread(target=box.clear)     # the finalizer runs in that thread
    with any_rt.lock:
        dropper.start()
        dropper.join(5)
        assert not dropper.is_alive(), "a buffer's finalizer waited for the runtime lock"
    again = d0.alloc(4096)
    assert again.address == address                  # given back, and reused
    again.free()
    assert any_rt.stats()["small_allocations"] == 0


@pytest.mark.asyncio
async def test_a_request_leaves_no_cyclic_garbage(rt):
    """The README's request shape (alloc, upload, launch, download, free) leaves nothing that
    only the cyclic collector frees: no Buffer (one referred to itself), no ctypes pointer (the
    emulator's argument decoding cast each call's pointer, which ties it to itself). Each would
    be a collection pause in a service."""
    import ctypes

    d0 = rt.devices[0]

    async def request() -> None:
        x = d0.alloc(4096)
        aiogpu.copy(x, np.zeros(1024, np.float32))
        d0.launch(scale, grid=(1024,), block=(256,), args=(x, 2.0, 1024))
        await x.to_numpy(np.float32)
        x.free()

    for _ in range(5):
        await request()
    gc.collect()
    gc.disable()
    try:
        for _ in range(50):
            await request()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        leftovers = [type(o).__name__ for o in gc.garbage
                     if isinstance(o, (aiogpu.Buffer, ctypes._Pointer, aiogpu.GPUFuture))]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert leftovers == []


@on_fake_cuda
def test_stream_futures_on_the_fake_driver_use_completion_words():
    """A foreign stream's futures (``aiogpu.stream_future``) are writes of a completion word on
    that stream: awaited by one task (the spin reads the word) and by many at once (parked
    awaiters arm a stream of aiogpu's own that waits for the word), used in ``after=``, and no
    event is created for them."""
    proc = run_on_fake_cuda(FAKE_STREAM_SCRIPT)
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stdout + proc.stderr


COPY_CALLS_SCRIPT = r"""
import os, sys, numpy as np, aiogpu
rt = aiogpu.Runtime("cuda")
d0 = rt.devices[0]
host = np.ones(256, np.float32)
pkg = os.path.dirname(aiogpu.__file__) + os.sep
# The core's modules and the other compiled ones (hostpool, the CUDA encodes) run compiled
# in a built tree and interpreted elsewhere: counted are the frames of every other aiogpu module.
skip = (pkg + "_core" + os.sep, pkg + "hostpool.py", pkg + os.path.join("cuda", "copies.py"),
        pkg + os.path.join("cuda", "encode.py"))
# The wake-up of a waiter that sleeps its long guard at that moment (the watch's post of its
# semaphore) is left out: whether it happens depends on where the waiter thread is.
wakeup = {os.path.join("cuda", "lanehub.py") + ":_post", os.path.join("cuda", "driver.py") + ":post"}
calls = []
def prof(frame, event, arg):
    name = frame.f_code.co_filename
    if event == "call" and name.startswith(pkg) and not name.startswith(skip):
        where = f"{name[len(pkg):]}:{frame.f_code.co_name}"
        if where not in wakeup:
            calls.append(where)
x = d0.alloc(1024)
for measure in (False, True):
    rt.stats()                              # (settled work retired now, not inside the copy)
    if measure: sys.setprofile(prof)
    up = aiogpu.copy(x, host)
    if measure: sys.setprofile(None)
    up.wait(10)
    rt.stats()
    if measure: upload, calls = calls, []
    if measure: sys.setprofile(prof)
    down = x.to_numpy(np.float32)
    if measure: sys.setprofile(None)
    down.wait(10)
    assert (down.result() == 1).all()
    if measure: download = calls
x.free()
print(len(upload), len(download))
print("upload:", *upload)
print("download:", *download)
rt.close()
"""


@on_fake_cuda
def test_a_copy_front_makes_few_python_calls_outside_the_compiled_modules():
    """A small upload from a fresh array and a ``to_numpy`` (the service's copies) on the
    fake CUDA driver: the copy record, its staging, hazards, lane choice and encode run in the
    compiled modules, so the Python-level calls of the rest (validation, the backend's lane
    completion, the waiter's watch) stay few: no dataclass per side, no closure, no per-copy
    helper layers."""
    proc = run_on_fake_cuda(COPY_CALLS_SCRIPT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    upload, download = map(int, proc.stdout.split("\n")[0].split())
    # (2 and 1 compiled, 5 and 5 interpreted: the copy front is aiogpu.copy alone, the download
    # to_numpy and its body, memory._to_numpy; 16 and 14 before it went straight to the core,
    # 33 and 25 before issue 25)
    assert upload <= 6 and download <= 6, proc.stdout


def test_the_common_launch_makes_no_closure_cells():
    """``Device.launch``'s common case (``submit.launch_plain``) runs in a frame that has no
    cell variables: the general path's closures (deferred submissions) live in a function of
    their own, so a plain launch does not allocate a cell per local at every call."""
    assert aiogpu.Device.launch.__code__.co_cellvars == ()
    assert aiogpu.Device._launch_general.__code__.co_cellvars      # (where the closures went)


def test_a_plain_launch_leaves_no_container_per_future(any_rt):
    """A launch's future holds no list or dict of its own beyond what its backend must release
    when it retires (``_cleanup``: HSA's kernarg slots), pending or retired: its ordering,
    dependents, keys and callbacks are empty tuples until their first entry. Fewer objects per
    operation for the garbage collector to track while a service keeps thousands in flight."""
    dev = any_rt.devices[0]
    dev.launch(sleep_ms, (1,), (1,), (0,)).wait(10)      # (loaded, its shape cached)
    futs = [dev.launch(sleep_ms, (1,), (1,), (0,)) for _ in range(200)]

    def containers() -> int:
        return sum(1 for f in futs for r in gc.get_referents(f)
                   if type(r) in (list, dict) and r is not f._cleanup)

    pending = containers()
    futs[-1].wait(10)
    deadline = time.monotonic() + 10
    while not all(f.retired for f in futs) and time.monotonic() < deadline:
        time.sleep(0.001)
    assert all(f.retired for f in futs)
    retired = sum(1 for f in futs for r in gc.get_referents(f) if type(r) in (list, dict))
    assert pending <= 20 and retired <= 20, (pending, retired)


def test_an_allocation_keeps_its_state_in_fields_not_an_instance_dict(any_rt):
    """Compiled, a Buffer is an extension type: allocating one makes no instance dict (the
    flag that gives its memory back once, the release function and ``allocated_at`` are C
    fields), and freeing one runs no ``__del__`` looked up by name. Interpreted, the flag is a
    dict entry (a dict pop is the atomic step there)."""
    from aiogpu import memory
    dev = any_rt.devices[0]
    dev.alloc(256).free()                             # (a cached piece for the fast path)
    buf = dev.alloc(256)
    compiled = type(memory.alloc_plain).__name__ != "function"
    assert hasattr(buf, "__dict__") is not compiled
    view = buf[0:16]
    assert buf._owns() and not view._owns() and view.allocated_at is None
    buf.free()
    assert buf.released and not buf._owns()


def test_racing_givers_give_the_memory_back_once(any_rt):
    """``free()``, the last user's retirement (the waiter thread) and ``__del__`` may race to
    give an allocation's memory back; exactly one of them does, however slow the release
    function is (it may let other threads run halfway)."""
    import threading
    dev = any_rt.devices[0]
    for _ in range(5):
        buf = dev.alloc(4096)
        release, calls = buf._release, []

        def slow_release(address: int, release=release, calls=calls) -> None:
            calls.append(address)
            time.sleep(0.002)                         # (other givers run meanwhile)
            release(address)

        buf._release = slow_release
        start = threading.Barrier(8)

        def give() -> None:
            start.wait()
            buf._give()

        threads = [threading.Thread(target=give) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert calls == [buf.address]
        assert buf.released
        buf.freed = True                              # (its memory is back: nothing to free)
