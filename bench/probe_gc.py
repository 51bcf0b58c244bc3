"""What the README's request shape (alloc x2, upload, launch, ``await to_numpy``, free x2) costs
the cyclic garbage collector: the garbage-collected objects each phase leaves alive (net, one
request at a time, collector off) and the collections per 1,000 requests with 64 in flight.

    python bench/probe_gc.py --backend emulator
    PYTHONPATH=bench/fakecuda:. python bench/probe_gc.py --backend cuda   # no GPU: fake driver
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import gc

import numpy as np
import uvloop

import aiogpu
from hostcost import K2_CUDA, k2       # (bench/: the same two-buffer kernel as hostcost's service shape)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default=None)
    ap.add_argument("--n", type=int, default=2000)
    a = ap.parse_args()
    rt = aiogpu.Runtime(backend=a.backend)
    kernel = aiogpu.kernel("f32*, const f32*, u32", cuda=K2_CUDA, name="k2")(k2)
    dev, host = rt.devices[0], np.ones(256, np.float32)
    phases: collections.Counter = collections.Counter()

    async def one(measure: bool) -> None:
        count = [gc.get_count()[0]]

        def mark(name: str) -> None:
            now = gc.get_count()[0]
            if measure:
                phases[name] += now - count[0]
            count[0] = now
        x, y = dev.alloc(1024), dev.alloc(1024)
        mark("alloc")
        aiogpu.copy(x, host)
        mark("copy")
        dev.launch(kernel, (256,), (256,), (y, x, 256))
        mark("launch")
        out = y.to_numpy(np.float32)
        mark("to_numpy")
        await out
        del out
        x.free()
        y.free()

    async def sequential(measure: bool) -> None:
        for _ in range(a.n):
            await one(measure)

    async def concurrent() -> None:
        slots = asyncio.Semaphore(64)

        async def guarded() -> None:
            async with slots:
                await one(False)
        await asyncio.gather(*(guarded() for _ in range(a.n)))

    uvloop.run(sequential(False))
    gc.disable()
    uvloop.run(sequential(True))
    gc.enable()
    gc.collect()
    per = {k: round(v / a.n, 1) for k, v in phases.items()}
    print(f"objects left alive per phase (net, one request at a time): {per}, total {sum(per.values()):.1f}")
    collections_by_gen = [0, 0, 0]

    def watch(phase: str, info: dict) -> None:
        if phase == "start":
            collections_by_gen[info["generation"]] += 1
    uvloop.run(concurrent())
    gc.callbacks.append(watch)
    uvloop.run(concurrent())
    gc.callbacks.remove(watch)
    print("collections per 1,000 requests, 64 in flight (gen0, gen1, gen2):",
          [round(c * 1000 / a.n, 1) for c in collections_by_gen])
    rt.close()


if __name__ == "__main__":
    main()
