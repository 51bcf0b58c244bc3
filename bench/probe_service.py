"""Diagnostics for the service benchmark's aiogpu path (run on a GPU machine).

    python bench/probe_service.py --json out.json

1. GPU concurrency: 64 one-thread kernels of 1 ms each, launched with no dependencies: how long
   until all are done (1 ms x 64 / lanes when the lanes overlap, 64 ms when they serialise).
2. The host cost of each step a request makes (median us over many, one task, no profiler):
   alloc+free pair, a 4 KiB upload, a launch, a download into a new array, the await.
3. A request's steps, awaited, with 64 concurrent tasks: requests per second without HTTP.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

import numpy as np

import aiogpu

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from serve import SPIN_NS, _aiogpu_kernels  # noqa: E402


def timed(fn, n=2000):
    samples = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples) * 1e6


async def concurrency(dev, spin, lanes_used):
    bufs = [dev.alloc(64) for _ in range(64)]
    for b in bufs:
        await dev.launch(spin, grid=(1,), block=(1,), args=(b, 1000))      # warm
    t = time.perf_counter()
    futs = [dev.launch(spin, grid=(1,), block=(1,), args=(b, SPIN_NS)) for b in bufs]
    await aiogpu.gather(*futs)
    lanes_used.update(f.queue for f in futs)
    return (time.perf_counter() - t) * 1e3


async def steps(dev, affine):
    n = 1024
    host = np.ones(n, np.float32)
    x, y = dev.alloc(4 * n), dev.alloc(4 * n)
    out = {}
    out["alloc_free_pair_us"] = timed(lambda: dev.alloc(4 * n).free())
    out["upload_4k_us"] = timed(lambda: aiogpu.copy(x, host))
    out["launch_us"] = timed(lambda: dev.launch(affine, grid=(n,), block=(256,), args=(y, x, n)))
    out["to_numpy_submit_us"] = timed(lambda: y.to_numpy(np.float32))
    samples = []
    for _ in range(2000):
        f = dev.launch(affine, grid=(n,), block=(256,), args=(y, x, n))
        t = time.perf_counter()
        await f
        samples.append(time.perf_counter() - t)
    out["await_us"] = statistics.median(samples) * 1e6
    return out


async def requests(devs, affine, spin, work, tasks=64, seconds=3.0):
    count = [0]
    deadline = time.perf_counter() + seconds

    async def one(i):
        rng = np.random.default_rng(i)
        body = rng.standard_normal(1024).astype(np.float32).tobytes()
        while time.perf_counter() < deadline:
            x_host = np.frombuffer(body, np.float32)
            dev = devs[(count[0] + i) % len(devs)]
            x, y = dev.alloc(x_host.nbytes), dev.alloc(x_host.nbytes)
            aiogpu.copy(x, x_host)
            dev.launch(affine, grid=(1024,), block=(256,), args=(y, x, 1024))
            if work == "1ms":
                dev.launch(spin, grid=(1,), block=(1,), args=(y, SPIN_NS))
            await y.to_numpy(np.float32)
            x.free()
            y.free()
            count[0] += 1

    t = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(tasks)))
    return count[0] / (time.perf_counter() - t)


async def main(args):
    devs = aiogpu.devices(args.backend)
    affine, spin = _aiogpu_kernels()
    lanes = set()
    out = {"concurrency_64x1ms_ms": await concurrency(devs[0], spin, lanes)}
    out["concurrency_lanes"] = sorted(lanes)
    out.update(await steps(devs[0], affine))
    for work in ("trivial", "1ms"):
        out[f"requests_per_s_{work}_no_http"] = await requests(devs, affine, spin, work)
    out["stats"] = {k: v for k, v in aiogpu.runtime().stats().items() if isinstance(v, (int, float))}
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default=None)
    p.add_argument("--json", default=None)
    import uvloop
    uvloop.run(main(p.parse_args()))
