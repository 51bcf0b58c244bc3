"""Compilation off the loop (issue 15): a first launch of a kernel still compiling returns at
once and is submitted when the compile finishes, with its ordering fixed at the call; the
on-disk cache of compiled code. Runs on the emulator with a fake slow compiler."""
from __future__ import annotations

import asyncio
import os
import threading
import time

import numpy as np
import pytest

import aiogpu
from aiogpu import compile_cache
from aiogpu.deferred import Deferred
from aiogpu.hsa.device import HsaDevice


@pytest.fixture
def slow_compiler(monkeypatch):
    """Kernels named ``slow_*`` need a compile that takes ``delay[0]`` seconds (or fails with
    ``fail[0]``); ``gate`` (a threading.Event), when set in ``hold``, keeps the compile from
    finishing until the test sets it. Records which threads compiled."""
    state = {"delay": 0.3, "fail": None, "hold": None, "threads": [], "done": set(), "count": 0}

    def needs(self, kernel):
        return kernel.name.startswith("slow_") and (kernel, self.index) not in state["done"]

    def compile_(self, kernel):
        state["threads"].append(threading.current_thread().name)
        state["count"] += 1
        if state["hold"] is not None:
            assert state["hold"].wait(30)
        else:
            time.sleep(state["delay"])
        if state["fail"] is not None:
            raise state["fail"]
        state["done"].add((kernel, self.index))

    monkeypatch.setattr(HsaDevice, "_needs_compile", needs)
    monkeypatch.setattr(HsaDevice, "_compile", compile_)
    return state


def make_kernels():
    @aiogpu.kernel("f32*, u32", name="slow_add_one")
    def slow_add_one(launch, y, n):
        y[:n] += 1

    @aiogpu.kernel("f32*, const f32*, u32", name="slow_double_into")
    def slow_double_into(launch, y, x, n):
        y[:n] = 2 * x[:n]

    @aiogpu.kernel("f32*, u32")
    def times_ten(launch, y, n):
        y[:n] *= 10

    return slow_add_one, slow_double_into, times_ten


@pytest.mark.asyncio
async def test_first_launch_returns_at_once_and_the_loop_runs_during_the_compile(make_runtime, slow_compiler):
    rt = make_runtime()
    d0 = rt.devices[0]
    slow_add_one, _, _ = make_kernels()
    n = 256
    y = d0.alloc(n * 4)
    await aiogpu.copy(y, np.zeros(n, np.float32))
    ticks = []
    stop = asyncio.Event()

    async def heartbeat():
        while not stop.is_set():
            ticks.append(slow_compiler["count"])
            await asyncio.sleep(0.005)

    beat = asyncio.ensure_future(heartbeat())
    await asyncio.sleep(0)
    fut = d0.launch(slow_add_one, (n,), (64,), (y, n))
    assert isinstance(fut, Deferred) and not fut.done(), "returned before the compile finished"
    await fut
    stop.set()
    await beat
    assert slow_compiler["threads"] == ["aiogpu-compile_0"] or all(
        t.startswith("aiogpu-compile") for t in slow_compiler["threads"]), "compiled on a worker thread"
    assert ticks.count(1) >= 3, f"the loop ran while the compile ran ({ticks})"
    np.testing.assert_array_equal(await y.to_numpy(np.float32), np.ones(n, np.float32))
    # Compiled now: the next launch is submitted at once.
    again = d0.launch(slow_add_one, (n,), (64,), (y, n))
    assert not isinstance(again, Deferred)
    await again
    assert slow_compiler["count"] == 1


@pytest.mark.asyncio
async def test_work_after_a_deferred_launch_keeps_call_order(make_runtime, slow_compiler):
    """Hazards are recorded at the call: a copy into the buffer, a kernel reading it, a kernel
    writing it, a download: each orders after the deferred launch, also across devices and
    with after=, although the compile finishes after they were all called."""
    rt = make_runtime()
    d0, d1 = rt.devices
    slow_add_one, slow_double_into, times_ten = make_kernels()
    n = 512
    gate = slow_compiler["hold"] = threading.Event()
    x, y = d0.alloc(n * 4), d0.alloc(n * 4)
    z = d1.alloc(n * 4)
    await aiogpu.copy(x, np.arange(n, dtype=np.float32))
    a = d0.launch(slow_add_one, (n,), (64,), (x, n))           # x += 1 (deferred)
    b = d0.launch(times_ten, (n,), (64,), (x, n))              # x *= 10: write after write
    c = aiogpu.copy(z, x)                                      # peer copy reads x
    w = d0.launch(times_ten, (n,), (64,), (y, n), after=[c])   # unrelated buffer, after= edge
    down = x.to_numpy(np.float32)
    g = aiogpu.gather(a, b, c)
    for f in (a, b, c, w, down, g):
        assert not f.done(), f
    assert rt.stats()["deferred"] >= 5
    gate.set()
    got = await down
    await g
    await w
    expect = (np.arange(n, dtype=np.float32) + 1) * 10
    np.testing.assert_array_equal(got, expect)
    np.testing.assert_array_equal(await z.to_numpy(np.float32), expect)
    assert rt.stats()["deferred"] == 0


@pytest.mark.asyncio
async def test_work_after_a_deferred_launch_was_submitted_waits_for_its_work(make_runtime, slow_compiler):
    """Once submitted, a deferred launch's future stands for its work in the hazards: later
    work on its buffers waits on the device for that work (not for the Deferred itself)."""
    rt = make_runtime()
    d0 = rt.devices[0]

    @aiogpu.kernel("f32*, u32", name="slow_then_add")
    def slow_then_add(launch, y, n):
        time.sleep(0.3)
        y[:n] += 1

    @aiogpu.kernel("f32*, u32")
    def times_ten(launch, y, n):
        y[:n] *= 10

    slow_compiler["delay"] = 0.05
    n = 64
    y = d0.alloc(n * 4)
    await y.fill(0)
    k = d0.launch(slow_then_add, (n,), (n,), (y, n))
    while k.real is None:
        await asyncio.sleep(0.005)
    assert not k.done(), "its work runs for 0.3 s"
    t = d0.launch(times_ten, (n,), (n,), (y, n))
    assert not isinstance(t, Deferred)
    await t
    assert k.done()
    np.testing.assert_array_equal(await y.to_numpy(np.float32), np.full(n, 10, np.float32))


@pytest.mark.asyncio
async def test_a_launch_reading_a_buffer_a_later_call_overwrites(make_runtime, slow_compiler):
    """Write after read: a deferred kernel reading x, then an immediate copy into x: the copy
    waits for the deferred kernel (it is deferred behind it), so the kernel reads the old x."""
    rt = make_runtime()
    d0 = rt.devices[0]
    _, slow_double_into, _ = make_kernels()
    n = 128
    gate = slow_compiler["hold"] = threading.Event()
    x, y = d0.alloc(n * 4), d0.alloc(n * 4)
    await aiogpu.copy(x, np.full(n, 3, np.float32))
    k = d0.launch(slow_double_into, (n,), (64,), (y, x, n))
    over = aiogpu.copy(x, np.full(n, 100, np.float32))
    assert isinstance(over, Deferred), "the overwrite waits for the deferred reader"
    gate.set()
    await over
    await k
    np.testing.assert_array_equal(await y.to_numpy(np.float32), np.full(n, 6, np.float32))
    np.testing.assert_array_equal(await x.to_numpy(np.float32), np.full(n, 100, np.float32))


@pytest.mark.asyncio
async def test_load_warms_up_and_launches_are_immediate_after(make_runtime, slow_compiler):
    rt = make_runtime()
    d0 = rt.devices[0]
    slow_add_one, _, _ = make_kernels()
    f = d0.load(slow_add_one)
    assert d0.load(slow_add_one) is f, "one compile per kernel and device"
    await slow_add_one.compile(d0)
    assert f.done() and slow_compiler["count"] == 1
    y = d0.alloc(64)
    fut = d0.launch(slow_add_one, (16,), (16,), (y, 16))
    assert not isinstance(fut, Deferred)
    await fut
    assert (await d0.load(slow_add_one)) is None


@pytest.mark.asyncio
async def test_a_failed_compile_fails_the_deferred_work_and_later_launches_raise(make_runtime, slow_compiler):
    rt = make_runtime()
    d0 = rt.devices[0]
    slow_add_one, _, times_ten = make_kernels()
    slow_compiler["fail"] = ValueError("NVRTC could not compile: expected a ';'")
    slow_compiler["delay"] = 0.05
    y = d0.alloc(64)
    k = d0.launch(slow_add_one, (16,), (16,), (y, 16))
    after = d0.launch(times_ten, (16,), (16,), (y, 16))       # reads what k failed to write
    with pytest.raises(aiogpu.GPUError, match="did not compile") as info:
        await k
    assert isinstance(info.value.__cause__, ValueError)
    with pytest.raises(aiogpu.GPUError):
        await after
    with pytest.raises(ValueError, match="expected a ';'"):
        d0.launch(slow_add_one, (16,), (16,), (y, 16))
    with pytest.raises(ValueError, match="expected a ';'"):
        await d0.load(slow_add_one)
    await y.fill(0)          # overwriting defines the buffer again


def test_close_waits_for_deferred_work(make_runtime, slow_compiler):
    rt = make_runtime()
    d0 = rt.devices[0]
    slow_add_one, _, _ = make_kernels()
    slow_compiler["delay"] = 0.2
    y = d0.alloc(64)
    y.fill(0).wait(10)
    k = d0.launch(slow_add_one, (16,), (16,), (y, 16))
    rt.close()
    assert k.done() and k.exception() is None


def test_close_abandons_deferred_work_past_its_timeout(make_runtime, slow_compiler):
    rt = make_runtime()
    d0 = rt.devices[0]
    slow_add_one, _, _ = make_kernels()
    gate = slow_compiler["hold"] = threading.Event()
    y = d0.alloc(64)
    k = d0.launch(slow_add_one, (16,), (16,), (y, 16))
    warm = d0.load(slow_add_one)
    rt.close(timeout=0.2)
    gate.set()
    assert k.done()
    with pytest.raises(aiogpu.RuntimeClosedError):
        warm.result()
    with pytest.raises(aiogpu.GPUError, match="abandoned"):
        k.result()


@pytest.mark.asyncio
async def test_deferred_work_belongs_to_its_task_group(make_runtime, slow_compiler):
    rt = make_runtime()
    d0 = rt.devices[0]
    slow_add_one, _, _ = make_kernels()
    slow_compiler["fail"] = ValueError("broken kernel")
    slow_compiler["delay"] = 0.05
    y = d0.alloc(64)
    with pytest.raises(BaseExceptionGroup) as info:
        async with aiogpu.TaskGroup():
            d0.launch(slow_add_one, (16,), (16,), (y, 16))
    assert info.group_contains(aiogpu.GPUError)
    await y.fill(0)


# -- the disk cache --------------------------------------------------------------------------------
def test_disk_cache_hit_miss_and_corruption(tmp_path, monkeypatch):
    monkeypatch.setenv("AIOGPU_CACHE_DIR", str(tmp_path))
    name = compile_cache.key("nvrtc", "12.4", "90", "--std=c++17", "source")
    assert name != compile_cache.key("nvrtc", "12.4", "80", "--std=c++17", "source")
    assert name != compile_cache.key("nvrtc", "12.5", "90", "--std=c++17", "source")
    assert compile_cache.get(name) is None
    calls = []
    produce = lambda: calls.append(1) or b"\x7fELF code"   # noqa: E731
    assert compile_cache.cached(name, produce) == b"\x7fELF code"
    assert compile_cache.cached(name, produce) == b"\x7fELF code" and len(calls) == 1, "a hit"
    path = next(p for p in tmp_path.rglob("*") if p.is_file())
    path.write_bytes(path.read_bytes()[:-3] + b"XYZ")                       # corrupted
    assert compile_cache.get(name) is None
    assert compile_cache.cached(name, produce) == b"\x7fELF code" and len(calls) == 2
    assert compile_cache.get(name) == b"\x7fELF code", "rewritten"
    path.write_bytes(b"")                                                   # truncated
    assert compile_cache.get(name) is None
    assert not [p for p in tmp_path.rglob(".tmp-*")], "no temporary files left"


def test_disk_cache_off_and_unwritable(tmp_path, monkeypatch):
    monkeypatch.setenv("AIOGPU_CACHE_DIR", "")
    assert compile_cache.directory() is None and not compile_cache.put("ab", b"x")
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    monkeypatch.setenv("AIOGPU_CACHE_DIR", str(blocker / "sub"))
    assert compile_cache.put("abcd", b"x") is False
    assert compile_cache.cached("abcd", lambda: b"y") == b"y"
    monkeypatch.delenv("AIOGPU_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.directory() == str(tmp_path / "xdg" / "aiogpu")


def test_disk_cache_concurrent_writers(tmp_path, monkeypatch):
    """Many threads and processes writing one entry: readers only ever see whole entries."""
    import multiprocessing
    monkeypatch.setenv("AIOGPU_CACHE_DIR", str(tmp_path))
    name = compile_cache.key("x")
    payload = os.urandom(1 << 20)
    seen, stop = [], threading.Event()

    def reader():
        while not stop.is_set():
            got = compile_cache.get(name)
            if got is not None:
                seen.append(got == payload)

    readers = [threading.Thread(target=reader) for _ in range(2)]
    for t in readers:
        t.start()
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_write_many, args=(str(tmp_path), name, payload)) for _ in range(3)]
    for p in procs:
        p.start()
    _write_many(str(tmp_path), name, payload)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    stop.set()
    for t in readers:
        t.join()
    assert compile_cache.get(name) == payload
    assert seen and all(seen), "a reader saw a partial entry"
    assert not [p for p in tmp_path.rglob(".tmp-*")]


def _write_many(directory, name, payload):
    os.environ["AIOGPU_CACHE_DIR"] = directory
    for _ in range(20):
        assert compile_cache.put(name, payload)


def _comgr_missing() -> str | None:
    """Why comgr cannot compile OpenCL C here, or None."""
    from aiogpu.hsa_bindings import comgr
    ok, why = comgr.available()
    return None if ok and comgr.opencl_header_dir() is not None else why or "no OpenCL headers"


_COMGR_MISSING = _comgr_missing()


@pytest.mark.skipif(_COMGR_MISSING is not None,
                    reason=f"needs libamd-comgr2 and clang's OpenCL headers ({_COMGR_MISSING})")
def test_comgr_code_objects_come_from_the_disk_cache(tmp_path, monkeypatch):
    from aiogpu.hsa_bindings import comgr
    monkeypatch.setenv("AIOGPU_CACHE_DIR", str(tmp_path))
    src = "__kernel void cached_k(__global int* x) { x[get_global_id(0)] = %d; }" % os.getpid()
    first = comgr.compile_opencl(src, "gfx90a")
    entries = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(entries) == 1
    calls = []
    monkeypatch.setattr(comgr, "_compile", lambda *a: calls.append(a) or b"")
    assert comgr.compile_opencl(src, "gfx90a") == first and not calls, "a hit compiles nothing"
    entries[0].write_bytes(b"garbage")
    monkeypatch.undo()
    monkeypatch.setenv("AIOGPU_CACHE_DIR", str(tmp_path))
    assert comgr.compile_opencl(src, "gfx90a") == first, "a corrupted entry is compiled again"
    assert compile_cache.get(entries[0].name) == first, "and rewritten"
    assert comgr.compile_opencl(src, "gfx908") != first, "keyed by the ISA"


def test_deferred_work_stays_deferred_until_it_is_submitted(make_runtime, slow_compiler, monkeypatch):
    """``close`` waits while work is deferred or pending, reading both without the lock: deferred
    work must still be in the deferred set while it is being submitted (it used to leave the
    set first, and a close in that window abandoned work that was just being submitted)."""
    rt = make_runtime()
    d0 = rt.devices[0]
    slow_add_one, _, _ = make_kernels()
    slow_compiler["delay"] = 0.05
    seen = []
    submit = HsaDevice._encode_kernel

    def watching(self, *args, **kwargs):
        if threading.current_thread().name.startswith("aiogpu-compile"):
            seen.append(len(rt._deferred))
        return submit(self, *args, **kwargs)

    monkeypatch.setattr(HsaDevice, "_encode_kernel", watching)
    y = d0.alloc(64)
    k = d0.launch(slow_add_one, (16,), (16,), (y, 16))
    assert k.wait(10) and k.exception() is None
    assert seen == [1] and not rt._deferred
