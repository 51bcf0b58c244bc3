"""Awaited launches of a no-op kernel, quickly: ops/s with 1, 8 and 64 tasks each awaiting its
launches in turn (the best of 5 repetitions), and the median round trip of one awaiter.
For A/B runs of two trees in one device call (``PYTHONPATH=<tree> python bench/quick_ops.py``).

    python bench/quick_ops.py --backend cuda
"""
from __future__ import annotations

import argparse

import uvloop

import aiogpu
from aiogpu.cli.bench import median_us
from aiogpu.cli.bench_cuda import rt_aiogpu, tp_aiogpu   # the CUDA bench's awaited no-op launches


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default=None)
    a = ap.parse_args()
    rt = aiogpu.Runtime(backend=a.backend)
    dev = rt.devices[0]

    uvloop.run(rt_aiogpu(dev, 500))                  # warm up: compile, lanes, pools
    best = {tasks: max(uvloop.run(tp_aiogpu(dev, tasks, max(2000 // tasks, 40))) for _ in range(5))
            for tasks in (1, 8, 64)}
    trips = [median_us(uvloop.run(rt_aiogpu(dev, 3000))) for _ in range(5)]
    print(" ".join(f"{t} tasks {v:,.0f} ops/s" for t, v in best.items()),
          "| one awaiter, median us:", " ".join(f"{x:.1f}" for x in trips))
    rt.close()


if __name__ == "__main__":
    main()
