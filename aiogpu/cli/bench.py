"""``python -m aiogpu bench``: aiogpu against what users do today, side by side in one run.

Measured on whichever backend the runtime picks (the emulator here): the awaited round trip of
a trivial dispatch through aiogpu (asyncio, uvloop) against a thread pool running the blocking
wait, polling the signal with ``sleep(0)``, and the synchronous floor (launch + blocking wait);
awaited operations per second with many concurrent tasks; graph replay cost per node against
individually awaited launches and launches chained with ``after=``.
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import statistics
import sys
import time
from typing import Any

import numpy as np

import aiogpu
from aiogpu.cli import INTERRUPTED_CLOSE_S
from aiogpu.hsa_bindings import types as T


NOOP_CU = r"""extern "C" __global__ void noop(unsigned int n) {}"""


@aiogpu.kernel("u32", cuda=NOOP_CU)
def noop(launch, n):
    pass


def progress(msg: str) -> None:
    print(f"  .. {msg}", file=sys.stderr, flush=True)


def median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


# -- round trip --------------------------------------------------------------------------------
async def rt_aiogpu(dev: Any, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        await dev.launch(noop, (1,), (1,), (0,))
        out.append(time.perf_counter() - t)
    return out


async def rt_executor(dev: Any, n: int, pool: Any) -> list[float]:
    loop, out = asyncio.get_running_loop(), []
    for _ in range(n):
        t = time.perf_counter()
        f = dev.launch(noop, (1,), (1,), (0,))
        await loop.run_in_executor(pool, _blocking_wait, dev.runtime.api, f)
        out.append(time.perf_counter() - t)
    return out


def _blocking_wait(api: Any, fut: Any) -> None:
    """What users do today: block a pool thread in the driver on the completion signal."""
    api.hsa_signal_wait_scacquire(T.hsa_signal_t(fut.signal), T.HSA_SIGNAL_CONDITION_LT, 1,
                                  0xFFFFFFFFFFFFFFFF, T.HSA_WAIT_STATE_BLOCKED)


async def rt_poll(dev: Any, n: int) -> list[float]:
    load, out = dev.runtime.api.hsa_signal_load_scacquire, []
    for _ in range(n):
        t = time.perf_counter()
        f = dev.launch(noop, (1,), (1,), (0,))
        sig = T.hsa_signal_t(f.signal)
        while load(sig) >= 1:
            await asyncio.sleep(0)
        out.append(time.perf_counter() - t)
        await f
    return out


def rt_floor(dev: Any, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        f = dev.launch(noop, (1,), (1,), (0,))
        _blocking_wait(dev.runtime.api, f)
        out.append(time.perf_counter() - t)
        f.wait()
    return out


# -- throughput --------------------------------------------------------------------------------
async def tp_aiogpu(devs: list, tasks: int, per_task: int) -> float:
    async def worker(i: int) -> None:
        dev = devs[i % len(devs)]
        for _ in range(per_task):
            await dev.launch(noop, (1,), (1,), (0,))

    t = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(tasks)))
    return tasks * per_task / (time.perf_counter() - t)


async def tp_executor(devs: list, tasks: int, per_task: int, pool: Any) -> float:
    loop = asyncio.get_running_loop()

    async def worker(i: int) -> None:
        dev = devs[i % len(devs)]
        for _ in range(per_task):
            f = dev.launch(noop, (1,), (1,), (0,))
            await loop.run_in_executor(pool, _blocking_wait, dev.runtime.api, f)

    t = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(tasks)))
    return tasks * per_task / (time.perf_counter() - t)


# -- graphs ------------------------------------------------------------------------------------
async def graph_costs(devs: list, nodes: int, reps: int) -> dict:
    d0 = devs[0]
    with aiogpu.Graph() as g:
        prev = None
        for _ in range(nodes):
            prev = d0.launch(noop, (1,), (1,), (0,), after=[prev] if prev else [])
    exe = g.instantiate()
    await exe.launch()
    t = time.perf_counter()
    for _ in range(reps):
        await exe.launch()
    replay = (time.perf_counter() - t) / reps / nodes
    t = time.perf_counter()
    for _ in range(reps):
        for _ in range(nodes):
            await d0.launch(noop, (1,), (1,), (0,))
    awaited = (time.perf_counter() - t) / reps / nodes
    t = time.perf_counter()
    for _ in range(reps):
        prev = None
        for _ in range(nodes):
            prev = d0.launch(noop, (1,), (1,), (0,), after=[prev] if prev else [])
        await prev
    chained = (time.perf_counter() - t) / reps / nodes
    out = {"graph_replay_us_per_node": replay * 1e6, "awaited_launch_us_per_node": awaited * 1e6,
           "chained_launch_us_per_node": chained * 1e6}
    if len(devs) > 1:
        out["graph2_replay_us_per_node"] = await two_device_graph(devs, reps)
    return out


async def two_device_graph(devs: list, reps: int) -> float:
    d0, d1 = devs[0], devs[1]
    a, b = d0.alloc(1 << 16), d1.alloc(1 << 16)
    with aiogpu.Graph() as g:
        prev = None
        for i in range(10):
            k = d0.launch(noop, (1,), (1,), (0,), after=[prev] if prev else [])
            c = aiogpu.copy(b, a, after=[k])
            prev = d1.launch(noop, (1,), (1,), (0,), after=[c])
    exe = g.instantiate()
    await exe.launch()
    t = time.perf_counter()
    for _ in range(reps):
        await exe.launch()
    return (time.perf_counter() - t) / reps / 30 * 1e6


# -- data loading: copies overlapping compute ---------------------------------------------------
WORK_CU = r"""
extern "C" __global__ void busy(float* y, const float* x, unsigned int n, unsigned int iters) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) { float v = x[i]; for (unsigned int k = 0; k < iters; ++k) v = v * 0.999f + 0.001f; y[i] = v; }
}
"""


@aiogpu.kernel("f32*, const f32*, u32, u32", cuda=WORK_CU)
def busy(launch, y, x, n, iters):
    v = x[:n].copy()
    for _ in range(8):            # the emulator's stand-in for a few ms of compute
        v = np.sqrt(v * v + 1.0)
    y[:n] = v


def host_batches(arrays: list, count: int):
    """``count`` batches cycling over ``arrays`` (made once, outside the timed region)."""
    for i in range(count):
        yield arrays[i % len(arrays)]


async def loader_throughput(devs: list, count: int, n: int, iters: int = 0) -> dict:
    """Batches/s: copy then compute, one batch at a time, against aiogpu.Loader (prefetch 2).
    ``iters`` sizes the CUDA kernel's work to about the copy's time (the emulator ignores it)."""
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(n, dtype=np.float32) for _ in range(4)]
    outs = {d.name: d.alloc(n * 4) for d in devs}
    ins = {d.name: d.alloc(n * 4) for d in devs}
    for arr in arrays:                 # first touch and host-memory registration, untimed
        await aiogpu.copy(ins[devs[0].name], arr)
    t = time.perf_counter()
    for i, batch in enumerate(host_batches(arrays, count)):
        d = devs[i % len(devs)]
        await aiogpu.copy(ins[d.name], batch)
        await d.launch(busy, (n,), (256,), (outs[d.name], ins[d.name], n, iters))
    serial = count / (time.perf_counter() - t)
    t = time.perf_counter()
    pending = []
    async with aiogpu.Loader(host_batches(arrays, count), devs, prefetch=2) as loader:
        async for b in loader:
            d = b.device
            pending.append(d.launch(busy, (n,), (256,), (outs[d.name], b.data, n, iters), after=[b.ready]))
            b.release()
            if len(pending) > 2 * len(devs):
                await pending.pop(0)
    await aiogpu.gather(*pending)
    pipelined = count / (time.perf_counter() - t)
    return {"loader_serial_batches_per_s": serial, "loader_pipelined_batches_per_s": pipelined}


# -- driver ------------------------------------------------------------------------------------
def measure(backend: str | None, quick: bool) -> dict:
    n = 200 if quick else 1000
    per_task = 50 if quick else 1000
    reps = 3 if quick else 20
    rt = aiogpu.Runtime(backend)
    res: dict[str, Any] = {"backend": rt.backend, "reason": rt.reason, "quick": quick}
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=64)
    interrupted = False
    try:
        dev, devs = rt.devices[0], rt.devices
        progress(f"round trip, {n} awaits each")
        res["floor_sync_us"] = median_us(rt_floor(dev, n))
        res["aiogpu_await_us_asyncio"] = median_us(asyncio.run(rt_aiogpu(dev, n)))
        try:
            import uvloop
            res["aiogpu_await_us_uvloop"] = median_us(uvloop.run(rt_aiogpu(dev, n)))
        except ImportError:
            res["aiogpu_await_us_uvloop"] = None
        res["executor_await_us"] = median_us(asyncio.run(rt_executor(dev, n, pool)))
        res["poll_await_us"] = median_us(asyncio.run(rt_poll(dev, n)))
        for k in (8, 64):
            progress(f"throughput, {k} tasks x {per_task} awaited dispatches over {len(devs)} GPU(s)")
            res[f"aiogpu_ops_per_s_{k}"] = asyncio.run(tp_aiogpu(devs, k, per_task))
            res[f"executor_ops_per_s_{k}"] = asyncio.run(tp_executor(devs, k, per_task, pool))
        progress("graph replay: 100-node chain, and a 2-GPU graph with copies")
        res.update(asyncio.run(graph_costs(devs, 100, reps)))
        progress(f"data loading over {len(devs)} GPU(s): serial vs aiogpu.Loader")
        res.update(asyncio.run(loader_throughput(devs, 16 if quick else 48, 1 << 18)))
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        # After Ctrl-C: drop the queued blocking waits and do not wait for the GPU's work.
        pool.shutdown(wait=not interrupted, cancel_futures=interrupted)
        rt.close(timeout=INTERRUPTED_CLOSE_S if interrupted else 10.0)
    return res


def table(res: dict) -> str:
    rows = [
        ("await round trip (us, median)", ""),
        ("  sync floor: launch + blocking wait", res["floor_sync_us"]),
        ("  aiogpu await, asyncio", res["aiogpu_await_us_asyncio"]),
        ("  aiogpu await, uvloop", res["aiogpu_await_us_uvloop"]),
        ("  run_in_executor(blocking wait)", res["executor_await_us"]),
        ("  poll signal with sleep(0)", res["poll_await_us"]),
        ("awaited ops/s, 8 tasks: aiogpu", res["aiogpu_ops_per_s_8"]),
        ("awaited ops/s, 8 tasks: executor", res["executor_ops_per_s_8"]),
        ("awaited ops/s, 64 tasks: aiogpu", res["aiogpu_ops_per_s_64"]),
        ("awaited ops/s, 64 tasks: executor", res["executor_ops_per_s_64"]),
        ("100-node chain, us per node: graph replay", res["graph_replay_us_per_node"]),
        ("  100 individually awaited launches", res["awaited_launch_us_per_node"]),
        ("  100 launches chained with after=", res["chained_launch_us_per_node"]),
        ("2-GPU graph with copies, us per node", res.get("graph2_replay_us_per_node")),
        ("batches/s, copy then compute, one at a time", res["loader_serial_batches_per_s"]),
        ("batches/s, aiogpu.Loader pipelined", res["loader_pipelined_batches_per_s"]),
    ]
    lines = [f"aiogpu bench on {res['backend']} ({res['reason']})"]
    for name, value in rows:
        shown = "" if value == "" else ("n/a" if value is None else f"{value:12.1f}")
        lines.append(f"{name:<46}{shown}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from ..runtime import resolve_backend
    if resolve_backend(args.backend) == "cuda":      # the CUDA measurements (issue 5)
        from . import bench_cuda
        return bench_cuda.run(args)
    res = measure(args.backend, args.quick)
    print(table(res))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=2)
        print(f"wrote {args.json}")
    return 0
