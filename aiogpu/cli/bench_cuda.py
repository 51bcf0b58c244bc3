"""``python -m aiogpu bench --backend cuda``: the CUDA measurements of issue 5, side by side.

In one run, on the first GPU:
- await round trip of a one-thread kernel: the synchronous floor (raw ``cuLaunchKernel`` +
  ``cuStreamSynchronize``; and aiogpu's launch + synchronize), aiogpu on asyncio and uvloop,
  ``run_in_executor(event.synchronize)``, a ``cuLaunchHostFunc`` Python callback calling
  ``call_soon_threadsafe``, polling the event with ``sleep(0)``; and the waiter alternatives:
  aiogpu without the loop spin (host function ``sem_post`` -> waiter thread -> batched hand-off),
  an executor on blocking-sync events, a stream memory write to host-mapped memory polled on the
  loop;
- the cost of single driver calls through cuda-bindings and through ctypes;
- awaited operations per second with 8 and 64 concurrent tasks (aiogpu vs a 64-thread executor);
- graph replay cost per node (100-node chain) against awaited and chained launches;
- H2D / D2H / D2D bandwidth through aiogpu against raw ``cuMemcpy*Async`` on the same memory;
- CPU use of the process while an idle runtime awaits a long kernel.
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import ctypes
import json
import statistics
import time
from typing import Any

import numpy as np

import aiogpu

from .bench import graph_costs, loader_throughput, median_us, progress

NOOP_CU = r"""
extern "C" __global__ void bench_noop(unsigned int n) { }
"""
SPIN_CU = r"""
extern "C" __global__ void bench_spin_ms(unsigned int ms) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { __nanosleep(100000); asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); }
    while (t - t0 < 1000000ull * ms);
}
"""


@aiogpu.kernel("u32", cuda=NOOP_CU, name="bench_noop")
def noop(launch, n):
    pass


@aiogpu.kernel("u32", cuda=SPIN_CU, name="bench_spin_ms")
def spin_ms(launch, ms):
    pass


def _uvloop_run(coro: Any) -> Any:
    import uvloop
    return uvloop.run(coro)


# -- round trips -----------------------------------------------------------------------------------
class Raw:
    """The raw driver path on the first device: our own stream, the loaded bench kernels."""

    def __init__(self, rt: Any):
        from aiogpu.cuda.driver import check, cu
        self.cu, self.check = cu, check
        self.dev = dev = rt.devices[0]
        dev.make_current()
        self.stream = check(cu.cuStreamCreate(1), "cuStreamCreate")
        self.noop = dev._loaded_kernel(noop)
        self.params = self.noop.pack([0])

    def launch(self) -> None:
        cu = self.cu
        cu.cuLaunchKernel(self.noop.func, 1, 1, 1, 1, 1, 1, 0, self.stream, self.params, 0)

    def close(self) -> None:
        self.cu.cuStreamDestroy(self.stream)


def rt_floor_raw(raw: Raw, n: int) -> list[float]:
    sync, out = raw.cu.cuStreamSynchronize, []
    for _ in range(n):
        t = time.perf_counter()
        raw.launch()
        sync(raw.stream)
        out.append(time.perf_counter() - t)
    return out


def rt_floor_aiogpu(dev: Any, n: int) -> list[float]:
    from aiogpu.cuda.driver import cu
    out = []
    for _ in range(n):
        t = time.perf_counter()
        f = dev.launch(noop, (1,), (1,), (0,))
        cu.cuStreamSynchronize(f.lane.stream)
        out.append(time.perf_counter() - t)
    return out


async def rt_aiogpu(dev: Any, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        await dev.launch(noop, (1,), (1,), (0,))
        out.append(time.perf_counter() - t)
    return out


def _sync_event(event: Any) -> None:
    from aiogpu.cuda.driver import cu
    cu.cuEventSynchronize(event)


async def rt_executor(dev: Any, n: int, pool: Any) -> list[float]:
    loop, out = asyncio.get_running_loop(), []
    for _ in range(n):
        t = time.perf_counter()
        f = dev.launch(noop, (1,), (1,), (0,))
        await loop.run_in_executor(pool, _sync_event, f.event)
        out.append(time.perf_counter() - t)
    return out


async def rt_executor_blocking(raw: Raw, n: int, pool: Any) -> list[float]:
    """Blocking-sync events, each waited on by a pool thread (a waiter per completion)."""
    cu, loop, out = raw.cu, asyncio.get_running_loop(), []
    ev = raw.check(cu.cuEventCreate(1 | 2), "cuEventCreate")   # BLOCKING_SYNC | DISABLE_TIMING
    for _ in range(n):
        t = time.perf_counter()
        raw.launch()
        cu.cuEventRecord(ev, raw.stream)
        await loop.run_in_executor(pool, cu.cuEventSynchronize, ev)
        out.append(time.perf_counter() - t)
    cu.cuEventDestroy(ev)
    return out


_HOSTFN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
# Runs of each throughput figure (the median is reported): on the shared GPU hosts one run of
# 64 tasks has read anywhere from 26k to 66k ops/s between calls.
TP_RUNS = 3


async def rt_hostfunc(dev: Any, n: int) -> list[float]:
    """What users do today: a Python host function calling call_soon_threadsafe."""
    import aiogpu.cuda.driver as D
    loop, out, pending = asyncio.get_running_loop(), [], {}

    @_HOSTFN
    def callback(key: int) -> None:             # runs on the driver's callback thread
        fut = pending.pop(key)
        loop.call_soon_threadsafe(fut.set_result, None)

    fn = ctypes.cast(callback, ctypes.c_void_p).value
    for i in range(n):
        t = time.perf_counter()
        f = dev.launch(noop, (1,), (1,), (0,))
        waiter = loop.create_future()
        pending[i + 1] = waiter
        D.HOT.host_func(f.lane.sh, fn, i + 1)
        await waiter
        out.append(time.perf_counter() - t)
    return out


async def rt_poll(dev: Any, n: int) -> list[float]:
    from aiogpu.cuda import driver as D
    query, out = D.HOT.query, []
    for _ in range(n):
        t = time.perf_counter()
        f = dev.launch(noop, (1,), (1,), (0,))
        while query(f.event) == D.NOT_READY:
            await asyncio.sleep(0)
        out.append(time.perf_counter() - t)
    return out


async def rt_memop_poll(raw: Raw, n: int) -> list[float]:
    """A stream memory write into host-mapped memory, polled on the loop (no driver call per poll)."""
    cu, check = raw.cu, raw.check
    host = check(cu.cuMemHostAlloc(8, 1 | 2), "cuMemHostAlloc")    # PORTABLE | DEVICEMAP
    word = ctypes.c_uint32.from_address(int(host))
    word.value = 0
    dptr = check(cu.cuMemHostGetDevicePointer(host, 0), "cuMemHostGetDevicePointer")
    out = []
    try:
        for i in range(1, n + 1):
            t = time.perf_counter()
            raw.launch()
            (err,) = cu.cuStreamWriteValue32(raw.stream, dptr, i, 0)
            if err:
                raise RuntimeError(f"cuStreamWriteValue32: {err}")
            while word.value < i:
                await asyncio.sleep(0)
            out.append(time.perf_counter() - t)
    finally:
        cu.cuStreamSynchronize(raw.stream)
        cu.cuMemFreeHost(host)
    return out


def _noop_handler(signum: int, frame: Any) -> None:
    pass


def call_costs(rt: Any, raw: Raw) -> dict:
    """Microseconds per call of the hot driver calls on each hot-path implementation,
    cuda-bindings and the C extension (where it is built), and of aiogpu's launch() submission
    on each."""
    import aiogpu.cuda.driver as D
    res, cu = {}, raw.cu
    ev = raw.check(cu.cuEventCreate(2), "cuEventCreate")
    cu.cuEventRecord(ev, raw.stream)
    cu.cuStreamSynchronize(raw.stream)
    hots: dict[str, Any] = {"bindings": D._BindingsHot()}
    try:
        hots["c"] = D._CHot()
    except (ImportError, OSError, AttributeError):
        pass
    evh, f, s, p = int(ev), int(raw.noop.func), int(raw.stream), raw.params
    t = time.perf_counter()       # the floor: cuda-bindings' own call, with its handle objects
    for _ in range(2000):
        cu.cuLaunchKernel(raw.noop.func, 1, 1, 1, 1, 1, 1, 0, raw.stream, p, 0)
    res["call_us_launch_raw_bindings"] = (time.perf_counter() - t) / 2000 * 1e6
    cu.cuStreamSynchronize(raw.stream)
    n = 20000
    for name, hot in hots.items():
        t = time.perf_counter()
        for _ in range(n):
            hot.query(evh)
        res[f"call_us_event_query_{name}"] = (time.perf_counter() - t) / n * 1e6
        t = time.perf_counter()
        for _ in range(2000):
            hot.launch(f, 1, 1, 1, 1, 1, 1, 0, s, p)
        res[f"call_us_launch_{name}"] = (time.perf_counter() - t) / 2000 * 1e6
        cu.cuStreamSynchronize(raw.stream)
        t = time.perf_counter()
        for _ in range(2000):
            hot.record(evh, s)
        res[f"call_us_event_record_{name}"] = (time.perf_counter() - t) / 2000 * 1e6
        cu.cuStreamSynchronize(raw.stream)
    dev = rt.devices[0]
    lane = dev.compute[0]
    if lane.dptr is not None:
        w = lane.wordp
        for name, hot in hots.items():      # the word write alone, and a launch with its write
            t = time.perf_counter()
            for i in range(2000):
                hot.write64(s, w, 0)
            res[f"call_us_write_value64_{name}"] = (time.perf_counter() - t) / 2000 * 1e6
            cu.cuStreamSynchronize(raw.stream)
            t = time.perf_counter()
            for i in range(2000):
                hot.launch(f, 1, 1, 1, 1, 1, 1, 0, s, p, w, 0)
            res[f"call_us_launch_write_{name}"] = (time.perf_counter() - t) / 2000 * 1e6
            cu.cuStreamSynchronize(raw.stream)
        lane.word.value = lane.ticket
    # Each lane keeps the hot path it was made with (``Lane.hot``): swapping ``D.HOT`` alone
    # changes only the calls made through the module (copies, event queries), not launches.
    for name, hot in hots.items():
        saved, saved_lanes = D.HOT, [lane.hot for lane in dev.lanes]
        D.HOT = hot
        for lane in dev.lanes:
            lane.use_hot(hot)
        try:
            futs, t = [], time.perf_counter()
            for _ in range(2000):
                futs.append(dev.launch(noop, (1,), (1,), (0,)))
            res[f"submit_us_aiogpu_launch_{name}"] = (time.perf_counter() - t) / 2000 * 1e6
            futs[-1].wait(30)
        finally:
            D.HOT = saved
            for lane, lane_hot in zip(dev.lanes, saved_lanes):
                lane.use_hot(lane_hot)

    # The same submissions from a coroutine: on a running loop the Ctrl-C hold's handler swap
    # happens once per loop iteration, not twice per launch (``aiogpu._core.interrupts``).
    async def in_loop() -> float:
        futs, t = [], time.perf_counter()
        for _ in range(2000):
            futs.append(dev.launch(noop, (1,), (1,), (0,)))
        us = (time.perf_counter() - t) / 2000 * 1e6
        await futs[-1]
        return us

    res["submit_us_aiogpu_launch_in_loop"] = _uvloop_run(in_loop())
    # What one handler swap pair costs here: two sigaction calls, through the C module that
    # the hold calls (``signal.signal`` adds an enum conversion each way).
    import _signal  # type: ignore[import-not-found]
    handler = _signal.getsignal(_signal.SIGINT)
    if callable(handler):
        t = time.perf_counter()
        for _ in range(2000):
            _signal.signal(_signal.SIGINT, _noop_handler)
            _signal.signal(_signal.SIGINT, handler)
        res["call_us_sigint_swap_pair"] = (time.perf_counter() - t) / 2000 * 1e6
    cu.cuEventDestroy(ev)
    return res


# -- throughput ------------------------------------------------------------------------------------
async def tp_aiogpu(dev: Any, tasks: int, per_task: int) -> float:
    async def worker() -> None:
        for _ in range(per_task):
            await dev.launch(noop, (1,), (1,), (0,))

    t = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(tasks)))
    return tasks * per_task / (time.perf_counter() - t)


async def tp_executor(dev: Any, tasks: int, per_task: int, pool: Any) -> float:
    loop = asyncio.get_running_loop()

    async def worker() -> None:
        for _ in range(per_task):
            f = dev.launch(noop, (1,), (1,), (0,))
            await loop.run_in_executor(pool, _sync_event, f.event)

    t = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(tasks)))
    return tasks * per_task / (time.perf_counter() - t)


# -- bandwidth ---------------------------------------------------------------------------------------
def bandwidth(rt: Any, raw: Raw, nbytes: int, reps: int) -> dict:
    cu, check = raw.cu, raw.check
    dev = rt.devices[0]
    host = np.ones(nbytes, np.uint8)
    host_raw = np.ones(nbytes, np.uint8)
    a, b = dev.alloc(nbytes), dev.alloc(nbytes)
    res: dict[str, float] = {}

    async def timed(make) -> float:
        """One copy at a time, each awaited: latency included."""
        await make()                                  # warm-up (registration, first touch)
        samples = []
        for _ in range(reps):
            t = time.perf_counter()
            await make()
            samples.append(time.perf_counter() - t)
        return nbytes / statistics.median(samples) / 1e9

    async def streamed(make) -> float:
        """``reps`` copies submitted back to back, then one await: what a pipeline sees."""
        await make()
        t = time.perf_counter()
        futs = [make() for _ in range(reps)]
        await aiogpu.gather(*futs)
        return reps * nbytes / (time.perf_counter() - t) / 1e9

    async def run_aiogpu() -> None:
        for d, make in (("h2d", lambda: aiogpu.copy(a, host)), ("d2h", lambda: aiogpu.copy(host, a)),
                        ("d2d", lambda: aiogpu.copy(b, a))):
            res[f"{d}_GBs_aiogpu"] = await streamed(make)
            res[f"{d}_GBs_aiogpu_awaited_each"] = await timed(make)

    _uvloop_run(run_aiogpu())
    dev.make_current()
    ptr = host_raw.__array_interface__["data"][0]
    check(cu.cuMemHostRegister(ptr, nbytes, 1), "cuMemHostRegister")   # PORTABLE: page-locked
    try:
        for key, call in (("h2d_GBs_raw", lambda: cu.cuMemcpyHtoDAsync(a.address, ptr, nbytes, raw.stream)),
                          ("d2h_GBs_raw", lambda: cu.cuMemcpyDtoHAsync(ptr, a.address, nbytes, raw.stream)),
                          ("d2d_GBs_raw", lambda: cu.cuMemcpyDtoDAsync(b.address, a.address, nbytes, raw.stream))):
            call()
            cu.cuStreamSynchronize(raw.stream)
            t = time.perf_counter()
            for _ in range(reps):                     # back to back on one stream, one sync
                call()
            cu.cuStreamSynchronize(raw.stream)
            res[key] = reps * nbytes / (time.perf_counter() - t) / 1e9
            samples = []
            for _ in range(reps):
                t = time.perf_counter()
                call()
                cu.cuStreamSynchronize(raw.stream)
                samples.append(time.perf_counter() - t)
            res[key + "_synced_each"] = nbytes / statistics.median(samples) / 1e9
    finally:
        cu.cuMemHostUnregister(ptr)
    # D2D moves the bytes once; report it like cuMemcpy's bandwidth tests (bytes copied / s).
    return res


# -- idle CPU ----------------------------------------------------------------------------------------
def graph_raw(dev: Any, nodes: int, reps: int) -> float:
    """us per node of a raw CUDA graph of ``nodes`` chained no-op kernels, launched with
    ``cuGraphLaunch`` and synchronised each replay (what ``graph_replay_us_per_node`` measures
    through aiogpu, which awaits each replay)."""
    from aiogpu.cuda.driver import check, cu
    loaded = dev._loaded_kernel(noop)
    dev.make_current()
    graph = check(cu.cuGraphCreate(0), "cuGraphCreate")
    keep, prev = [], []
    for _ in range(nodes):
        address, k = loaded.packed_copy([0])
        keep.append(k)
        p = cu.CUDA_KERNEL_NODE_PARAMS()
        p.func = loaded.func
        p.gridDimX = p.gridDimY = p.gridDimZ = p.blockDimX = p.blockDimY = p.blockDimZ = 1
        p.sharedMemBytes = 0
        p.kernelParams = address
        prev = [check(cu.cuGraphAddKernelNode(graph, prev, len(prev), p), "cuGraphAddKernelNode")]
    exe = check(cu.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
    stream = check(cu.cuStreamCreate(1), "cuStreamCreate")
    try:
        cu.cuGraphLaunch(exe, stream)
        cu.cuStreamSynchronize(stream)
        t = time.perf_counter()
        for _ in range(reps):
            cu.cuGraphLaunch(exe, stream)
            cu.cuStreamSynchronize(stream)
        return (time.perf_counter() - t) / reps / nodes * 1e6
    finally:
        cu.cuStreamDestroy(stream)
        cu.cuGraphExecDestroy(exe)
        cu.cuGraphDestroy(graph)


async def loader_fresh(dev: Any, count: int, nbytes: int) -> float:
    """GB/s of ``aiogpu.Loader`` over ``count`` fresh (never pinned) host arrays on one GPU,
    the consumer doing nothing but release: staging off the loop plus the upload."""
    arrays = [np.full(nbytes // 4, i, np.float32) for i in range(count)]     # touched, unpinned
    t = time.perf_counter()
    async with aiogpu.Loader(iter(arrays), [dev], prefetch=2) as loader:
        async for b in loader:
            await b.ready
            b.release()
    return count * nbytes / (time.perf_counter() - t) / 1e9


def idle_cpu(dev: Any, seconds: float) -> float:
    async def main() -> float:
        f = dev.launch(spin_ms, (1,), (1,), (int(seconds * 1000),))
        await asyncio.sleep(0.05)
        c0, t0 = time.process_time(), time.perf_counter()
        await f
        return (time.process_time() - c0) / (time.perf_counter() - t0) * 100

    return _uvloop_run(main())


# -- other libraries' streams (issue 15) --------------------------------------------------------------
def torch_stream_costs(rt: Any, n: int) -> dict:
    """Awaiting a PyTorch stream after a one-thread torch kernel: ``stream_future`` on uvloop
    against ``torch.cuda.synchronize()`` (the floor, no loop) and ``run_in_executor`` of it.
    Empty where torch (with CUDA) is absent."""
    try:
        import torch
        if not torch.cuda.is_available():
            return {}
    except ImportError:
        return {}
    dev = rt.devices[0]
    torch.cuda.set_device(dev.index)
    x = torch.zeros(1, device=f"cuda:{dev.index}")
    stream = torch.cuda.current_stream()

    def launch() -> None:
        x.add_(1.0)                       # one element: a one-thread kernel

    for _ in range(200):
        launch()
    torch.cuda.synchronize()
    floor = []
    for _ in range(n):
        t = time.perf_counter()
        launch()
        torch.cuda.synchronize()
        floor.append(time.perf_counter() - t)

    async def awaited(count: int) -> list[float]:
        out = []
        for _ in range(count):
            t = time.perf_counter()
            launch()
            await aiogpu.stream_future(stream, runtime=rt)
            out.append(time.perf_counter() - t)
        return out

    async def executor(count: int) -> list[float]:
        loop, out = asyncio.get_running_loop(), []
        for _ in range(count):
            t = time.perf_counter()
            launch()
            await loop.run_in_executor(None, torch.cuda.synchronize)
            out.append(time.perf_counter() - t)
        return out

    _uvloop_run(awaited(100))
    res = {"torch_sync_floor_us": median_us(floor), "stream_await_us": median_us(_uvloop_run(awaited(n)))}
    _uvloop_run(executor(50))
    res["torch_executor_await_us"] = median_us(_uvloop_run(executor(n)))
    res["stream_await_us_asyncio"] = median_us(asyncio.run(awaited(n)))
    torch.cuda.synchronize()
    return res


def first_launch_stall(dev: Any) -> dict:
    """The largest event-loop gap (a 0.5 ms heartbeat) while a kernel never compiled before
    (a unique source: NVRTC's disk cache misses) is launched and awaited on uvloop."""
    import os
    name = f"bench_fresh_{os.getpid()}_{time.time_ns()}"
    src = NOOP_CU.replace("bench_noop", name) + f"// {name}\n"
    fresh = aiogpu.Kernel(lambda launch, n: None, "u32", cuda=src, name=name)
    period = 0.0005

    async def main() -> dict:
        gaps: list[float] = []
        stop = [False]

        async def beat() -> None:
            while not stop[0]:
                t = time.perf_counter()
                await asyncio.sleep(period)
                gaps.append(time.perf_counter() - t - period)

        task = asyncio.ensure_future(beat())
        await asyncio.sleep(0.05)
        gaps.clear()
        t = time.perf_counter()
        fut = dev.launch(fresh, (1,), (1,), (0,))
        call = time.perf_counter() - t
        await fut
        total = time.perf_counter() - t
        await asyncio.sleep(0.01)
        stop[0] = True
        await task
        return {"first_launch_loop_stall_ms": max(gaps) * 1e3, "first_launch_call_ms": call * 1e3,
                "first_launch_total_ms": total * 1e3, "first_launch_heartbeats": len(gaps)}

    return _uvloop_run(main())


# -- driver ------------------------------------------------------------------------------------------
def measure(quick: bool) -> dict:
    import aiogpu.cuda.driver as D
    n = 300 if quick else 3000
    per_task = 30 if quick else 400
    rt = aiogpu.Runtime("cuda")
    res: dict[str, Any] = {"backend": rt.backend, "reason": rt.reason, "quick": quick,
                           "device": rt.devices[0].product, "hot_path": D.HOT.name,
                           "spin_s": rt.hub.spin_s, "write_path": rt.write_path,
                           "core": aiogpu._core.summary()}
    import cuda.bindings
    res["cuda_bindings"] = cuda.bindings.__version__
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=64)
    raw = Raw(rt)
    # The baselines wait on an event per launch, as users do: their launches record one.
    rt_ev = aiogpu.Runtime("cuda", event_waits=True)
    try:
        dev, dev_ev = rt.devices[0], rt_ev.devices[0]
        dev._loaded_kernel(spin_ms)
        progress(f"round trips, {n} each")
        rt_floor_raw(raw, 50)
        res["floor_sync_us"] = median_us(rt_floor_raw(raw, n))
        res["floor_sync_aiogpu_launch_us"] = median_us(rt_floor_aiogpu(dev, n))
        asyncio.run(rt_aiogpu(dev, 50))
        res["aiogpu_await_us_asyncio"] = median_us(asyncio.run(rt_aiogpu(dev, n)))
        res["aiogpu_await_us_uvloop"] = median_us(_uvloop_run(rt_aiogpu(dev, n)))
        res["executor_await_us"] = median_us(_uvloop_run(rt_executor(dev_ev, n, pool)))
        res["hostfunc_await_us"] = median_us(_uvloop_run(rt_hostfunc(dev, n)))
        res["poll_await_us"] = median_us(_uvloop_run(rt_poll(dev_ev, n)))
        _uvloop_run(rt_aiogpu(dev_ev, 50))
        res["alt_event_waits_aiogpu_us"] = median_us(_uvloop_run(rt_aiogpu(dev_ev, n)))
        progress("waiter alternatives")
        res["alt_executor_blocking_sync_us"] = median_us(_uvloop_run(rt_executor_blocking(raw, n, pool)))
        res["alt_memop_poll_us"] = median_us(_uvloop_run(rt_memop_poll(raw, n)))
        spin, rt.hub.spin_s = rt.hub.spin_s, 0.0
        try:
            res["alt_no_spin_hostfunc_sem_waiter_us"] = median_us(_uvloop_run(rt_aiogpu(dev, n)))
        finally:
            rt.hub.spin_s = spin
        rt_query = aiogpu.Runtime("cuda", completion_words=False)   # spin on cuEventQuery instead
        try:
            _uvloop_run(rt_aiogpu(rt_query.devices[0], 50))
            res["alt_spin_event_query_us"] = median_us(_uvloop_run(rt_aiogpu(rt_query.devices[0], n)))
        finally:
            rt_query.close()
        res.update(call_costs(rt, raw))
        for k in (8, 64):
            progress(f"throughput, {k} tasks x {per_task} awaited launches, median of {TP_RUNS}")
            _uvloop_run(tp_aiogpu(dev, k, 5))
            runs = [_uvloop_run(tp_aiogpu(dev, k, per_task)) for _ in range(TP_RUNS)]
            res[f"aiogpu_ops_per_s_{k}"], res[f"aiogpu_ops_per_s_{k}_runs"] = statistics.median(runs), runs
            runs = [_uvloop_run(tp_executor(dev_ev, k, per_task, pool)) for _ in range(TP_RUNS)]
            res[f"executor_ops_per_s_{k}"], res[f"executor_ops_per_s_{k}_runs"] = statistics.median(runs), runs
        res["aiogpu_ops_per_s_64_asyncio"] = asyncio.run(tp_aiogpu(dev, 64, per_task))
        progress("graph replay: 100-node chain")
        res.update(_uvloop_run(graph_costs([dev], 100, 5 if quick else 50)))
        res["graph_raw_us_per_node"] = graph_raw(dev, 100, 5 if quick else 50)
        progress("bandwidth")
        res.update(bandwidth(rt, raw, (64 << 20) if quick else (1 << 30), 5 if quick else 10))
        small = bandwidth(rt, raw, 256 << 20, 5 if quick else 20)
        res.update({f"{k}_256MiB": v for k, v in small.items()})
        res["bandwidth_bytes"] = (64 << 20) if quick else (1 << 30)
        progress("data loading: serial vs aiogpu.Loader")
        res.update(_uvloop_run(loader_throughput(rt.devices, 16 if quick else 64, 1 << 24, iters=1500)))
        progress("data loading: fresh 64 MiB host arrays")
        res["loader_fresh_GBs"] = _uvloop_run(loader_fresh(dev, 8 if quick else 24, 64 << 20))
        progress("awaiting PyTorch streams; a first launch compiling off the loop")
        res.update(torch_stream_costs(rt, n))
        res.update(first_launch_stall(dev))
        progress("idle CPU while awaiting a long kernel")
        res["idle_cpu_percent"] = idle_cpu(dev, 1.0 if quick else 3.0)
        res["stats"] = rt.stats()
    finally:
        pool.shutdown()
        raw.close()
        rt_ev.close()
        rt.close()
    floor = res["floor_sync_us"]
    res["await_over_floor_uvloop"] = res["aiogpu_await_us_uvloop"] / floor
    res["ops_ratio_64"] = res["aiogpu_ops_per_s_64"] / res["executor_ops_per_s_64"]
    for d in ("h2d", "d2h", "d2d"):
        res[f"{d}_fraction_of_raw"] = res[f"{d}_GBs_aiogpu"] / res[f"{d}_GBs_raw"]
    res["loader_fresh_fraction_of_raw"] = res["loader_fresh_GBs"] / res["h2d_GBs_raw"]
    res["graph_over_raw"] = res["graph_replay_us_per_node"] / res["graph_raw_us_per_node"]
    res["submit_over_launch"] = res["submit_us_aiogpu_launch_bindings"] / res["call_us_launch_raw_bindings"]
    if "submit_us_aiogpu_launch_c" in res:    # the target: <= 2x a raw cuda-bindings launch
        res["submit_c_over_launch"] = res["submit_us_aiogpu_launch_c"] / res["call_us_launch_raw_bindings"]
    if "stream_await_us" in res:
        res["stream_await_over_torch_floor"] = res["stream_await_us"] / res["torch_sync_floor_us"]
        res["torch_executor_over_stream_await"] = res["torch_executor_await_us"] / res["stream_await_us"]
    return res


ROWS = [
    ("await round trip, one-thread kernel (us, median)", None),
    ("  sync floor: raw cuLaunchKernel + cuStreamSynchronize", "floor_sync_us"),
    ("  sync: aiogpu launch + cuStreamSynchronize", "floor_sync_aiogpu_launch_us"),
    ("  aiogpu await, asyncio", "aiogpu_await_us_asyncio"),
    ("  aiogpu await, uvloop", "aiogpu_await_us_uvloop"),
    ("  run_in_executor(event.synchronize)", "executor_await_us"),
    ("  cuLaunchHostFunc -> call_soon_threadsafe", "hostfunc_await_us"),
    ("  poll cuEventQuery with sleep(0)", "poll_await_us"),
    ("waiter alternatives (uvloop, us)", None),
    ("  no spin: host fn sem_post -> waiter -> batch", "alt_no_spin_hostfunc_sem_waiter_us"),
    ("  executor on blocking-sync events", "alt_executor_blocking_sync_us"),
    ("  stream write to host memory, polled", "alt_memop_poll_us"),
    ("  aiogpu spin on cuEventQuery (no completion words)", "alt_spin_event_query_us"),
    ("  aiogpu recording an event per operation too", "alt_event_waits_aiogpu_us"),
    ("driver call cost (us): raw cuda-bindings launch", "call_us_launch_raw_bindings"),
    ("  hot path bindings/c: event query", ("call_us_event_query_bindings", "call_us_event_query_c")),
    ("  launch", ("call_us_launch_bindings", "call_us_launch_c")),
    ("  event record", ("call_us_event_record_bindings", "call_us_event_record_c")),
    ("  write value64", ("call_us_write_value64_bindings", "call_us_write_value64_c")),
    ("  launch + word write", ("call_us_launch_write_bindings", "call_us_launch_write_c")),
    ("  aiogpu launch() submit", ("submit_us_aiogpu_launch_bindings", "submit_us_aiogpu_launch_c")),
    ("awaited ops/s, 8 tasks: aiogpu / executor", ("aiogpu_ops_per_s_8", "executor_ops_per_s_8")),
    ("awaited ops/s, 64 tasks: aiogpu / executor", ("aiogpu_ops_per_s_64", "executor_ops_per_s_64")),
    ("100-node chain, us/node: graph replay / raw cuGraphLaunch", ("graph_replay_us_per_node",
                                                                    "graph_raw_us_per_node")),
    ("  individually awaited / chained launches", ("awaited_launch_us_per_node", "chained_launch_us_per_node")),
    ("H2D GB/s (1 GiB copies): aiogpu / raw", ("h2d_GBs_aiogpu", "h2d_GBs_raw")),
    ("D2H GB/s: aiogpu / raw", ("d2h_GBs_aiogpu", "d2h_GBs_raw")),
    ("D2D GB/s: aiogpu / raw", ("d2d_GBs_aiogpu", "d2d_GBs_raw")),
    ("  same at 256 MiB: H2D, D2H, D2D aiogpu / raw", ("h2d_GBs_aiogpu_256MiB", "h2d_GBs_raw_256MiB",
                                                    "d2h_GBs_aiogpu_256MiB", "d2h_GBs_raw_256MiB",
                                                    "d2d_GBs_aiogpu_256MiB", "d2d_GBs_raw_256MiB")),
    ("batches/s (64 MiB): copy then compute / aiogpu.Loader", ("loader_serial_batches_per_s",
                                                             "loader_pipelined_batches_per_s")),
    ("fresh 64 MiB arrays through aiogpu.Loader, GB/s", "loader_fresh_GBs"),
    ("idle runtime awaiting a long kernel, CPU %", "idle_cpu_percent"),
    ("await a torch stream after a one-thread kernel (us)", None),
    ("  torch.cuda.synchronize() floor / stream_future uvloop", ("torch_sync_floor_us", "stream_await_us")),
    ("  stream_future asyncio / run_in_executor(synchronize)", ("stream_await_us_asyncio", "torch_executor_await_us")),
    ("first launch compiling off the loop: stall / call / total ms", ("first_launch_loop_stall_ms",
                                                                     "first_launch_call_ms", "first_launch_total_ms")),
]


def table(res: dict) -> str:
    lines = [f"aiogpu bench on {res['backend']} ({res['reason']}); hot path: {res['hot_path']}"]
    for name, key in ROWS:
        if key is None:
            shown = ""
        elif isinstance(key, tuple):
            shown = " / ".join(_fmt(res.get(k)) for k in key)
        else:
            shown = _fmt(res.get(key))
        lines.append(f"{name:<58}{shown}")
    lines.append(f"targets (uvloop): await/floor {res['await_over_floor_uvloop']:.2f}x (<= 2), "
                 f"ops ratio at 64 tasks {res['ops_ratio_64']:.2f}x (>= 3), copies "
                 + ", ".join(f"{d} {res[f'{d}_fraction_of_raw']:.0%}" for d in ("h2d", "d2h", "d2d"))
                 + f" (>= 95%), idle CPU {res['idle_cpu_percent']:.2f}% (< 5)")
    if "stream_await_over_torch_floor" in res:
        lines.append(f"issue 15: stream await / torch floor {res['stream_await_over_torch_floor']:.2f}x (<= 1.5), "
                     f"executor / stream await {res['torch_executor_over_stream_await']:.2f}x (>= 3), "
                     f"first-launch loop stall {res['first_launch_loop_stall_ms']:.2f} ms (<= 2)")
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    if v is None:
        return "n/a"
    return f"{v:,.1f}" if abs(v) >= 10 else f"{v:.2f}"


def run(args: argparse.Namespace) -> int:
    res = measure(args.quick)
    print(table(res))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=2)
        print(f"wrote {args.json}")
    return 0
