"""Awaited launches of a no-op kernel, quickly: ops/s with 1, 8 and 64 tasks each awaiting its
launches in turn (the best of 5 repetitions), and the median round trip of one awaiter.
For A/B runs of two trees in one device call (``PYTHONPATH=<tree> python bench/quick_ops.py``).

    python bench/quick_ops.py --backend cuda
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import uvloop

import aiogpu

NOOP_CUDA = 'extern "C" __global__ void noop(unsigned n) {}'


def noop(launch, n):
    pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default=None)
    a = ap.parse_args()
    rt = aiogpu.Runtime(backend=a.backend)
    k = aiogpu.kernel("u32", cuda=NOOP_CUDA if rt.backend == "cuda" else None, name="noop")(noop)
    dev = rt.devices[0]

    async def throughput(tasks: int, per: int) -> float:
        async def one() -> None:
            for _ in range(per):
                await dev.launch(k, (1,), (1,), (0,))
        t = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(tasks)))
        return tasks * per / (time.perf_counter() - t)

    async def round_trip(n: int) -> float:
        took = []
        for _ in range(n):
            t = time.perf_counter()
            await dev.launch(k, (1,), (1,), (0,))
            took.append(time.perf_counter() - t)
        return statistics.median(took) * 1e6

    uvloop.run(round_trip(500))                      # warm up: compile, lanes, pools
    best = {tasks: max(uvloop.run(throughput(tasks, max(2000 // tasks, 40))) for _ in range(5))
            for tasks in (1, 8, 64)}
    trips = [uvloop.run(round_trip(3000)) for _ in range(5)]
    print(" ".join(f"{t} tasks {v:,.0f} ops/s" for t, v in best.items()),
          "| one awaiter, median us:", " ".join(f"{x:.1f}" for x in trips))
    rt.close()


if __name__ == "__main__":
    main()
