"""aiogpu.Loader over fresh 64 MiB arrays, with and without the loop's spin, for several
stage_threads: where the time goes.   python bench/probe_loader.py --backend cuda"""
from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np

import aiogpu


async def fresh(dev, arrays, threads: int) -> float:
    t = time.perf_counter()
    async with aiogpu.Loader(iter(arrays), [dev], prefetch=2, stage_threads=threads) as loader:
        async for b in loader:
            await b.ready
            b.release()
    return len(arrays) * arrays[0].nbytes / (time.perf_counter() - t) / 1e9


def main() -> str | None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default=None)
    ap.add_argument("--count", type=int, default=16)
    a = ap.parse_args()
    import uvloop
    arrays = [np.full((64 << 20) // 4, i, np.float32) for i in range(a.count)]
    for spin in (None, 0.0):
        rt = aiogpu.Runtime(a.backend, **({} if spin is None else {"spin_s": spin}))
        dev = rt.devices[0]
        for threads in (4, 8, 12):
            uvloop.run(fresh(dev, arrays[:4], threads))            # warm the pinned pool
            got = uvloop.run(fresh(dev, arrays, threads))
            print(f"spin {'default' if spin is None else spin}, stage_threads {threads}: {got:.1f} GB/s", flush=True)
        rt.close()
    return a.backend




async def phases(dev, arrays) -> None:
    """The Loader's two halves apart: staging 4 MiB pieces on 8 worker threads (anyio), and
    uploading pieces from pinned memory into byte slices of a buffer; and a pinned block."""
    import anyio
    rt, n, piece = dev.runtime, arrays[0].nbytes, 4 << 20
    limiter = anyio.CapacityLimiter(8)
    t = time.perf_counter()
    with rt.lock:
        staging = rt.pinned.empty(n, np.uint8)
    print(f"  pinned block: {(time.perf_counter() - t) * 1e3:.2f} ms")
    for piece in (4 << 20, 8 << 20, 16 << 20):
        t = time.perf_counter()
        for arr in arrays:
            flat = arr.reshape(-1).view(np.uint8)
            async with anyio.create_task_group() as tg:
                for lo in range(0, n, piece):
                    tg.start_soon(lambda lo=lo: anyio.to_thread.run_sync(
                        np.copyto, staging[lo:lo + piece], flat[lo:lo + piece], limiter=limiter))
        print(f"  staging only, anyio threads, {piece >> 20} MiB pieces: "
              f"{len(arrays) * n / (time.perf_counter() - t) / 1e9:.1f} GB/s")
    import concurrent.futures
    loop = asyncio.get_running_loop()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for piece in (4 << 20, 8 << 20):
            t = time.perf_counter()
            for arr in arrays:
                flat = arr.reshape(-1).view(np.uint8)
                await asyncio.gather(*[loop.run_in_executor(pool, np.copyto, staging[lo:lo + piece],
                                                            flat[lo:lo + piece]) for lo in range(0, n, piece)])
            print(f"  staging only, executor, {piece >> 20} MiB pieces: "
                  f"{len(arrays) * n / (time.perf_counter() - t) / 1e9:.1f} GB/s")
    piece = 4 << 20
    buf = dev.alloc(n)
    t = time.perf_counter()
    for _ in arrays:
        await aiogpu.gather(*[aiogpu.copy(buf[lo:lo + piece], staging[lo:lo + piece]) for lo in range(0, n, piece)])
    print(f"  piece uploads only: {len(arrays) * n / (time.perf_counter() - t) / 1e9:.1f} GB/s")
    t = time.perf_counter()
    for _ in arrays:
        await aiogpu.copy(buf, staging)
    print(f"  whole uploads: {len(arrays) * n / (time.perf_counter() - t) / 1e9:.1f} GB/s")
    buf.free()


def phases_main(backend) -> None:
    import uvloop
    arrays = [np.full((64 << 20) // 4, i, np.float32) for i in range(8)]
    rt = aiogpu.Runtime(backend)
    uvloop.run(phases(rt.devices[0], arrays))
    rt.close()


if __name__ == "__main__":
    phases_main(main())
