"""Regressions of issue 13: resource limits, the waiter's robustness, close, the watchdog, joins,
captures, host-range ordering, failed-buffer resets, shader-copy grids and option checks.

Public-API behaviour takes ``any_rt``/``make_any`` (every backend); tests that need the
emulator's fault injection or its internals take ``make_runtime``.
"""
from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

import aiogpu
from backends import wait_until
from gpu_kernels import Gate, add_const_n, sleep_ms


# -- item 4: the kernarg back-log ------------------------------------------------------------------
def test_kernarg_backlog_drains_once_the_head_entry_is_freed(make_runtime, monkeypatch):
    """A long kernel holds the head of its queue's kernarg ring while short ones finish; the
    launch that waits for kernarg room runs once the long kernel retires."""
    import aiogpu.hsa.runtime as hsa_runtime
    monkeypatch.setattr(hsa_runtime, "KERNARG_RING_BYTES", 16 * 64)     # 16 entries
    rt = make_runtime(gpus=1, queues_per_device=1)
    d0 = rt.devices[0]
    gate = Gate()
    held = gate.launch(d0)
    for _ in range(15):                      # the rest of the ring; they finish, the head stays
        assert d0.launch(sleep_ms, grid=(1,), block=(1,), args=(0,)).wait(20)
    waiting = d0.launch(sleep_ms, grid=(1,), block=(1,), args=(0,))
    assert len(d0.queues[0].backlog) == 1, "the launch should wait for kernarg room"
    gate.open()
    assert held.wait(20)
    assert waiting.wait(20), "the back-logged launch never ran"
    assert waiting.exception() is None


# -- item 3: a graph lane longer than the ring; the waiter never dies -----------------------------
@pytest.mark.asyncio
async def test_graph_lane_longer_than_the_ring_replays(any_rt):
    d0 = any_rt.devices[0]
    n = 16
    buf = d0.alloc(n * 8)
    await aiogpu.copy(buf, np.zeros(n, np.int64))
    with aiogpu.Graph() as g:                 # a 1,030-node chain (one buffer: one queue)
        for _ in range(1030):
            d0.launch(add_const_n, grid=(n,), block=(n,), args=(buf, 1, n))
    exe = g.instantiate()
    first = exe.launch()
    second = exe.launch()                     # waits behind the first (the back-log on HSA)
    await asyncio.wait_for(aiogpu.gather(first, second), 120)
    assert (await buf.to_numpy(np.int64) == 2060).all()


def test_waiter_survives_a_group_that_fails_to_publish(make_runtime, monkeypatch):
    """Whatever goes wrong while the waiter drains a back-log fails the work concerned; the
    waiter goes on and later work runs."""
    from aiogpu.hsa import queues
    rt = make_runtime(gpus=1, queues_per_device=1, ring_size=4, emulator_min_queue_size=4)
    d0 = rt.devices[0]
    gate = Gate()
    held = gate.launch(d0)
    # Once the gate's packet is launched its slot is free again (the read index moved past it);
    # behind a barrier the packet processor launches nothing more, so 3 fills and the room mark
    # the queue publishes behind them (it keeps a slot for one) fill the ring.
    # (Wait for that launch: under load the processor may not have taken the packet yet.)
    queue = d0.queues[0]
    while rt.api.hsa_queue_load_read_index_scacquire(queue._q) <= held.packet:
        time.sleep(0.001)
    fill = [d0.launch(sleep_ms, grid=(1,), block=(1,), args=(0,), after=[held]) for _ in range(3)]
    victim = d0.launch(sleep_ms, grid=(1,), block=(1,), args=(0,))
    later = d0.launch(sleep_ms, grid=(1,), block=(1,), args=(0,))
    assert len(d0.queues[0].backlog) == 2
    real = queues.AqlQueue._write_bodies
    calls = []

    def broken_once(self, first, blob, n):
        calls.append(first)
        if len(calls) == 1:
            raise RuntimeError("injected: writing the ring failed")
        return real(self, first, blob, n)

    monkeypatch.setattr(queues.AqlQueue, "_write_bodies", broken_once)
    gate.open()
    assert all(f.wait(20) for f in [held, *fill])
    assert victim.wait(20), "the waiter died draining the back-log"
    assert isinstance(victim.exception(), aiogpu.GPUError)
    assert "injected" in str(victim.exception())
    assert later.wait(20) and later.exception() is None
    assert rt.hub._thread.is_alive()


# -- item 8: an exception inside launch leaves nothing behind -------------------------------------
def test_an_error_while_packing_leaves_no_future_or_lock_behind(make_runtime, monkeypatch):
    """E.g. a RuntimeWarning turned into an error while packing a scalar: the launch (or shader
    copy) raises it before any future exists, no host lock stays held, close does not wait."""
    import time

    import aiogpu.hsa.device as hsa_device
    from gpu_kernels import scale
    rt = make_runtime(copy_engines=False)           # copies are shader copies: they pack too
    d0 = rt.devices[0]
    buf = d0.alloc(64)
    real = hsa_device.pack_args

    def overflowing(*args):
        raise RuntimeWarning("overflow encountered in cast")

    monkeypatch.setattr(hsa_device, "pack_args", overflowing)
    with pytest.raises(RuntimeWarning):
        d0.launch(scale, grid=(16,), block=(16,), args=(buf, 2.0, 16))
    with pytest.raises(RuntimeWarning):
        aiogpu.copy(buf, np.ones(16, np.float32))
    stats = rt.stats()
    assert stats["pending"] == 0 and stats["signals_in_use"] == 0 and stats["host_locks"] == 0
    monkeypatch.setattr(hsa_device, "pack_args", real)
    assert aiogpu.copy(buf, np.ones(16, np.float32)).wait(20)
    assert d0.launch(scale, grid=(16,), block=(16,), args=(buf, 2.0, 16)).wait(20)
    t0 = time.monotonic()
    rt.close()
    assert time.monotonic() - t0 < 5, "close waited for a future that can never complete"


# -- item 18: engine errors other than OUT_OF_RESOURCES ------------------------------------------
@pytest.mark.asyncio
@pytest.mark.parametrize("call", ["hsa_amd_memory_async_copy_on_engine", "hsa_amd_memory_async_copy"])
async def test_copy_engine_error_fails_the_copy_and_releases_its_host_lock(make_runtime, monkeypatch, call):
    from aiogpu.hsa_bindings import types as T
    rt = make_runtime(gpus=1, rocr_version="5.7" if call.endswith("on_engine") else "5.2.3")
    d0 = rt.devices[0]
    host = np.arange(1 << 18, dtype=np.int32)     # 1 MiB: locked, not staged
    buf = d0.alloc(host.nbytes)
    # (INVALID_ARGUMENT is ROCr's answer for an engine that cannot serve the direction: aiogpu
    # then copies with a shader; any other error fails the copy.)
    monkeypatch.setattr(rt.api, call, lambda *args: T.HSA_STATUS_ERROR_INVALID_SIGNAL)
    fut = aiogpu.copy(buf, host)
    with pytest.raises(aiogpu.GPUError, match="INVALID_SIGNAL"):
        await asyncio.wait_for(fut, 20)
    stats = rt.stats()
    assert stats["pending"] == 0 and stats["host_locks"] == 0
    with pytest.raises(aiogpu.GPUError):          # what it would have written reads as failed
        await asyncio.wait_for(buf.to_numpy(), 20)
    monkeypatch.undo()
    await aiogpu.copy(buf, host)                  # a later copy overwrites it
    assert (await buf.to_numpy(np.int32) == host).all()


# -- item 10: overlapping host arrays are ordered by address range --------------------------------
@pytest.mark.asyncio
async def test_upload_after_download_into_an_overlapping_slice_reads_the_new_data(any_rt):
    d0 = any_rt.devices[0]
    n = 16
    a, b = d0.alloc(n * 8), d0.alloc(4 * n * 8)
    await aiogpu.copy(a, np.zeros(n, np.int64))
    slow = d0.launch(sleep_ms, grid=(1,), block=(1,), args=(200,))
    d0.launch(add_const_n, grid=(n,), block=(n,), args=(a, 7, n), after=[slow])
    h = np.zeros(4 * n, np.int64)
    # (A slice that starts where h starts needs the emulator's unlock by address and size.)
    down = aiogpu.copy(h[n:2 * n], a)             # after the slow writer of a
    up = aiogpu.copy(b, h)                        # reads h, which overlaps that slice: after down
    await asyncio.wait_for(aiogpu.gather(down, up), 20)
    got = await b.to_numpy(np.int64)
    assert (got[n:2 * n] == 7).all() and (got[:n] == 0).all() and (got[2 * n:] == 0).all()


@pytest.mark.asyncio
async def test_download_into_an_array_waits_for_uploads_of_overlapping_slices(any_rt):
    d0 = any_rt.devices[0]
    n = 16
    a, b = d0.alloc(n * 8), d0.alloc(4 * n * 8)
    await aiogpu.copy(b, np.full(4 * n, 5, np.int64))
    h = np.arange(4 * n, dtype=np.int64)
    slow = d0.launch(sleep_ms, grid=(1,), block=(1,), args=(200,))
    up = aiogpu.copy(a, h[n:2 * n], after=[slow])  # reads h[n:2n] late
    down = aiogpu.copy(h, b)                      # overwrites all of h: after up has read it
    await asyncio.wait_for(aiogpu.gather(up, down), 20)
    assert (await a.to_numpy(np.int64) == np.arange(n, 2 * n)).all()
    assert (h == 5).all()


def _fake_future():
    from aiogpu.futures import GPUFuture
    f = GPUFuture(None, "fake")
    f.retired = False
    return f


def test_host_hazards_follow_overlapping_address_ranges():
    from aiogpu import ordering
    hz = ordering.Hazards()
    w1, w2, r1 = _fake_future(), _fake_future(), _fake_future()
    ordering.record(w1, [], [hz.host(1000, 100)])           # writes [1000, 1100)
    ordering.record(w2, [], [hz.host(1050, 100)])           # writes [1050, 1150)
    ordering.record(r1, [hz.host(2000, 10)], [])            # reads elsewhere
    deps = ordering.dependencies([hz.host(1000, 60)], [], [])
    assert set(deps) == {w1, w2} and all(deps.values())     # read after both writes
    assert set(ordering.dependencies([hz.host(1100, 10)], [], [])) == {w2}
    assert ordering.dependencies([hz.host(1150, 10)], [], []) == {}   # adjacent: no overlap
    assert set(ordering.dependencies([], [hz.host(1995, 10)], [])) == {r1}   # write after read
    assert hz.host(1050, 100).last_write is w2
    w1.retired = w2.retired = r1.retired = True
    for state in (hz.host(1000, 100), hz.host(1050, 100), hz.host(2000, 10)):
        hz.prune_host(state)
    assert hz.host_ranges == 0


def test_host_hazards_look_up_by_bisection():
    """Thousands of live host ranges: a lookup touches the overlapping ones only, not all."""
    from aiogpu import ordering
    hz = ordering.Hazards()
    futs = [_fake_future() for _ in range(5000)]
    for i, f in enumerate(futs):
        ordering.record(f, [], [hz.host(i * 4096, 1024)])

    class Counting(list):
        touched = 0

        def __getitem__(self, i):
            got = super().__getitem__(i)
            Counting.touched += len(got) if isinstance(i, slice) else 1
            return got

    hz._segs = Counting(hz._segs)
    deps = ordering.dependencies([hz.host(2500 * 4096 + 512, 4096)], [], [])
    assert set(deps) == {futs[2500], futs[2501]}
    assert Counting.touched < 50, f"a lookup touched {Counting.touched} of 5000 host ranges"


def test_capture_orders_copies_of_overlapping_host_arrays(any_rt):
    d0 = any_rt.devices[0]
    a, b = d0.alloc(128), d0.alloc(512)
    h = np.zeros(128, np.int32)
    with aiogpu.Graph():
        down = aiogpu.copy(h[:32], a)
        up = aiogpu.copy(b, h)
        other = aiogpu.copy(a, np.zeros(32, np.int32))
    assert down in up.deps and up.deps[down] is True       # read after write, by address range
    assert up not in other.deps


# -- item 22: a rejected replay leaves no ordering state behind ----------------------------------
def test_rejected_replays_leave_no_ordering_state(make_runtime):
    from gpu_kernels import fail_if
    rt = make_runtime(gpus=1)
    d0 = rt.devices[0]
    a, x = d0.alloc(64), d0.alloc(64)
    h = np.zeros(16, np.int32)
    with aiogpu.Graph() as g:
        aiogpu.copy(h, a)
        d0.launch(add_const_n, grid=(8,), block=(8,), args=(x, 1, 8))
    exe = g.instantiate()
    assert exe.launch().wait(20)
    # The waiter retires a replay just after settling its future: start from nothing pending.
    # (Not wait_for_baseline: the executables keep their host arrays locked while they live.)
    assert wait_until(lambda: rt.stats()["pending"] == 0)
    # Rejected as bad input: a buffer it uses was freed.
    x.free()
    with pytest.raises(ValueError, match="freed"):
        exe.launch()
    assert rt.stats()["host_ranges"] == 0 and rt.stats()["pending"] == 0
    # Rejected because an input failed: it fails without running.
    with aiogpu.Graph() as g2:
        aiogpu.copy(h, a)
    exe2 = g2.instantiate()
    assert d0.launch(fail_if, grid=(1,), block=(1,), args=(a, 1)).wait(20)
    replay = exe2.launch()
    assert replay.wait(20) and isinstance(replay.exception(), aiogpu.GPUError)
    assert wait_until(lambda: rt.stats()["pending"] == 0)
    stats = rt.stats()
    assert stats["host_ranges"] == 0 and stats["pending"] == 0 and stats["signals_in_use"] == 0
    del exe, exe2                    # (executables keep their host arrays locked while they live)
    import gc
    gc.collect()


# -- item 12: the watchdog counts from when the work could start ---------------------------------
@pytest.mark.asyncio
async def test_watchdog_spares_healthy_work_queued_behind_other_work(make_any):
    rt = make_any(watchdog_s=0.5)
    d0 = rt.devices[0]
    await d0.launch(sleep_ms, grid=(1,), block=(1,), args=(0,))     # (CUDA: load the kernel)
    futs, prev = [], []
    for _ in range(8):                   # 8 x 150 ms, each after the previous: 1.2 s in all
        prev = [d0.launch(sleep_ms, grid=(1,), block=(1,), args=(150,), after=prev)]
        futs += prev
    await asyncio.wait_for(aiogpu.gather(*futs), 30)
    assert all(f.exception() is None for f in futs)


def test_watchdog_still_fails_a_lost_completion(make_runtime):
    rt = make_runtime(gpus=2, watchdog_s=0.3)
    d0, d1 = rt.devices
    rt.api.emulator.faults.lose_completion_at(1, agent=d0.index)
    lost = d0.launch(sleep_ms, grid=(1,), block=(1,), args=(0,))
    behind = d1.launch(sleep_ms, grid=(1,), block=(1,), args=(0,), after=[lost])   # waits on its signal
    assert lost.wait(20) and isinstance(lost.exception(), aiogpu.WatchdogTimeout)
    assert behind.wait(20) and isinstance(behind.exception(), aiogpu.GPUError)
    ok = d0.launch(sleep_ms, grid=(1,), block=(1,), args=(0,))
    assert ok.wait(20) and ok.exception() is None


# -- item 13: a join completes when every member has settled -------------------------------------
def test_gather_settles_after_every_member_then_fails_with_the_first_error(make_runtime):
    from gpu_kernels import fail_if
    rt = make_runtime(gpus=2)
    d0, d1 = rt.devices
    gate = Gate()
    slow = gate.launch(d1)
    bad = d0.launch(fail_if, grid=(1,), block=(1,), args=(d0.alloc(4), 1))
    joined = aiogpu.gather(slow, bad)
    assert bad.wait(20) and isinstance(bad.exception(), aiogpu.GPUError)
    assert not joined.wait(0.3), "the join completed while a member was still running"
    later = aiogpu.gather(bad, slow)             # a member failed already: it waits all the same
    assert not later.done()
    gate.open()
    for j in (joined, later):
        assert j.wait(20) and j.exception() is bad.exception()
    assert slow.exception() is None
    assert aiogpu.gather(slow, bad).exception() is bad.exception()   # all settled: at once
    assert aiogpu.gather(slow).wait(20) and aiogpu.gather(slow).exception() is None


# -- item 14: capture belongs to the block, not to the tasks it spawns ----------------------------
async def _capture_and_spawn(rt, spawn):
    """Launches of a task (or thread) started inside ``with Graph()`` run; the block's own are
    captured."""
    import anyio
    from aiogpu.graph import GraphNode
    d0 = rt.devices[0]
    buf = d0.alloc(64)
    await aiogpu.copy(buf, np.zeros(8, np.int64))
    got = []

    async def task():
        got.append(d0.launch(add_const_n, grid=(8,), block=(8,), args=(buf, 1, 8)))

    with aiogpu.Graph() as g:
        node = d0.launch(add_const_n, grid=(8,), block=(8,), args=(buf, 10, 8))
        await spawn(task)
        got.append(await anyio.to_thread.run_sync(
            lambda: d0.launch(add_const_n, grid=(8,), block=(8,), args=(buf, 100, 8))))
    assert isinstance(node, GraphNode) and g.nodes == [node]
    assert len(got) == 2 and not any(isinstance(f, GraphNode) for f in got)
    await aiogpu.gather(*got)
    assert (await buf.to_numpy(np.int64) == 101).all()


@pytest.mark.asyncio
async def test_tasks_spawned_inside_a_capture_are_not_captured_asyncio(any_rt):
    async def spawn(fn):
        await asyncio.create_task(fn())
    await _capture_and_spawn(any_rt, spawn)


def test_tasks_spawned_inside_a_capture_are_not_captured_trio(any_rt):
    import anyio
    pytest.importorskip("trio")

    async def main():
        async with anyio.create_task_group() as tg:
            async def spawn(fn):
                done = anyio.Event()

                async def run():
                    await fn()
                    done.set()
                tg.start_soon(run)
                await done.wait()
            await _capture_and_spawn(any_rt, spawn)

    anyio.run(main, backend="trio")


# -- item 15: a buffer whose write failed is reset by anything that only writes it ---------------
SET_N_CU = r"""
extern "C" __global__ void set_n(long long* x, long long v, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = v;
}
"""


@aiogpu.kernel("out i64*, i64, u32", cuda=SET_N_CU)
def set_n(launch, x, v, n):
    x[:n] = v


def test_out_pointers_are_written_not_read():
    from aiogpu.signature import parse_signature
    args = parse_signature("out i64*, const f32*, u8*")
    assert [(a.out, a.const, a.pointer) for a in args] == [(True, False, True), (False, True, True),
                                                           (False, False, True)]
    assert str(args[0]) == "out i64*"
    assert set_n.writes == [0] and set_n.reads == []
    for bad in ("out i64", "const out i64*", "out const i64*"):
        with pytest.raises(ValueError):
            parse_signature(bad)


@pytest.mark.asyncio
async def test_out_pointer_kernels_are_ordered(any_rt):
    d0 = any_rt.devices[0]
    buf = d0.alloc(8 * 8)
    slow = d0.launch(sleep_ms, grid=(1,), block=(1,), args=(100,))
    d0.launch(set_n, grid=(8,), block=(8,), args=(buf, 1, 8), after=[slow])
    d0.launch(set_n, grid=(8,), block=(8,), args=(buf, 2, 8))         # write after write
    d0.launch(add_const_n, grid=(8,), block=(8,), args=(buf, 3, 8))   # read after write
    assert (await buf.to_numpy(np.int64) == 5).all()


def test_a_failed_buffer_is_reset_by_a_fill_or_a_kernel_that_only_writes_it(make_runtime):
    from gpu_kernels import fail_if
    rt = make_runtime(gpus=1)
    d0 = rt.devices[0]
    buf = d0.alloc(16)

    def poison():
        bad = d0.launch(fail_if, grid=(1,), block=(1,), args=(buf, 1))
        assert bad.wait(20) and bad.exception() is not None
        reader = buf.to_numpy()
        assert reader.wait(20) and isinstance(reader.exception(), aiogpu.GPUError)

    poison()
    rw = d0.launch(add_const_n, grid=(2,), block=(2,), args=(buf, 1, 2))   # reads it: fails
    assert rw.wait(20) and isinstance(rw.exception(), aiogpu.GPUError)
    reset = d0.launch(set_n, grid=(2,), block=(2,), args=(buf, 9, 2))     # only writes it
    assert reset.wait(20) and reset.exception() is None
    out = buf.to_numpy(np.int64)
    assert out.wait(20) and (out.result() == 9).all()
    poison()
    assert buf.fill(3).wait(20)
    out = buf.to_numpy(np.int32)
    assert out.wait(20) and (out.result() == 3).all()


# -- item 17: shader copies and fills of >= 4 GiB -------------------------------------------------
def test_shader_copy_and_fill_grids_fit_a_dispatch_packet(any_rt):
    d0 = any_rt.devices[0]
    for n in (1, 4096, 4 << 30, (5 << 30) + 3, 16 << 30, 1 << 40):
        for grid in (d0._copy_grid(n), d0._fill_grid(max(n // 4, 1))):
            assert len(grid) == 1 and 1 <= grid[0] <= 0xFFFFFFFF, (n, grid)


def test_built_in_opencl_kernels_stride_over_any_grid():
    from aiogpu.kernels import COPY_CL, FILL_CL
    for src in (COPY_CL, FILL_CL):
        assert "get_global_size(0)" in src and "for (" in src


@pytest.mark.asyncio
async def test_shader_copies_and_fills_are_right_with_a_small_grid_cap(make_runtime, monkeypatch):
    """A patched cap stands in for the 4 GiB one: grids stay under it, results stay right."""
    import aiogpu.device as core_device
    from aiogpu.hsa.device import HsaDevice
    from aiogpu.hsa.graph import HsaGraphExec
    monkeypatch.setattr(core_device, "SHADER_GRID_CAP", 1024)
    grids = []
    real_submit, real_args = HsaDevice._encode_kernel, HsaGraphExec._dispatch_args

    def submit(self, fut, lane, loaded, grid, *args, **kw):
        grids.append((fut.label, grid))
        return real_submit(self, fut, lane, loaded, grid, *args, **kw)

    def dispatch_args(self, device, node, args):
        got = real_args(self, device, node, args)
        grids.append((node.label, got[1]))
        return got

    monkeypatch.setattr(HsaDevice, "_encode_kernel", submit)
    monkeypatch.setattr(HsaGraphExec, "_dispatch_args", dispatch_args)
    rt = make_runtime(gpus=1, copy_engines=False)
    d0 = rt.devices[0]
    data = np.random.default_rng(17).integers(0, 255, 10_000, dtype=np.uint8)
    a, b = d0.alloc(data.nbytes), d0.alloc(data.nbytes)
    await aiogpu.copy(a, data)
    await aiogpu.copy(b, a)
    assert (await b.to_numpy() == data).all()
    await b.fill(0x01020304)
    assert (await b.to_numpy(np.uint32) == 0x01020304).all()
    rt.api.emulator.faults.exhaust_sdma()          # graph copies become shader copies too
    with aiogpu.Graph() as g:
        aiogpu.copy(b, a)
        b.fill(7)
    await g.instantiate().launch()
    assert (await b.to_numpy(np.uint32) == 7).all()
    assert len(grids) >= 6 and all(grid[0] <= 1024 for _, grid in grids), grids


# -- item 7: close honours its timeout and fails what it abandons ---------------------------------
@pytest.mark.asyncio
async def test_close_returns_near_its_timeout_and_fails_abandoned_work(make_any):
    import time
    rt = make_any()
    d0 = rt.devices[0]
    await d0.launch(sleep_ms, grid=(1,), block=(1,), args=(0,))     # (CUDA: load the kernel)
    long = d0.launch(sleep_ms, grid=(1,), block=(1,), args=(8000,))
    behind = d0.launch(sleep_ms, grid=(1,), block=(1,), args=(0,), after=[long])
    t0 = time.monotonic()
    rt.close(0.3)
    assert time.monotonic() - t0 < 5.0, "close(0.3) waited for the work it gave up on"
    for fut in (long, behind):
        assert fut.done() and isinstance(fut.exception(), aiogpu.GPUError)
        assert "close" in str(fut.exception())
        with pytest.raises(aiogpu.GPUError):
            await asyncio.wait_for(fut, 5)            # awaiting it after close does not hang
    with pytest.raises(aiogpu.RuntimeClosedError):
        d0.launch(sleep_ms, grid=(1,), block=(1,), args=(0,))


def test_close_with_nothing_pending_releases_at_once(make_runtime):
    rt = make_runtime(gpus=1)
    assert rt.devices[0].launch(sleep_ms, grid=(1,), block=(1,), args=(0,)).wait(20)
    rt.close(0.3)
    assert rt.closed and not rt.hub._thread.is_alive()


# -- item 21: bad options are refused before anything starts --------------------------------------
def _threads():
    import threading
    return {t.ident for t in threading.enumerate() if t.is_alive()}


@pytest.mark.parametrize("option,value,exc", [
    ("watchdog_s", 0, ValueError), ("watchdog_s", -1.0, ValueError), ("watchdog_s", float("nan"), ValueError),
    ("watchdog_s", "1", TypeError), ("spin_s", -1e-3, ValueError), ("spin_s", "x", TypeError),
    ("copy_engines", "no", TypeError), ("queues_per_device", 0, ValueError),
    ("queues_per_device", 1.5, TypeError), ("queues_per_device", True, TypeError),
])
def test_bad_shared_option_values_are_refused_first(any_backend, option, value, exc):
    before = _threads()
    with pytest.raises(exc, match=option):
        aiogpu.Runtime(any_backend, **{option: value})
    assert _threads() <= before, "a failed construction left a thread running"


@pytest.mark.parametrize("ring", [0, -64])
def test_bad_ring_sizes_are_refused_naming_the_option(ring):
    before = _threads()
    with pytest.raises(ValueError, match="ring_size"):
        aiogpu.Runtime("emulator", ring_size=ring)
    assert _threads() <= before, "a failed construction left a thread running"
