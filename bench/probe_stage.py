"""What the host can do for fresh (unpinned) arrays on their way to the GPU, raw, without aiogpu:
- memcpy into pinned memory: GB/s with 1..16 threads (numpy.copyto releases the GIL);
- the driver's own pageable cuMemcpyHtoD, with 1..8 threads each copying a slice;
- chunked pipelines: k threads, each copying chunks into pinned staging and queueing the DMA;
- cuMemHostRegister / Unregister of fresh arrays, with 1..8 threads, and as a pipeline.

    python bench/probe_stage.py [--json FILE]
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import time

import numpy as np
from cuda.bindings import driver as cu

MB = 1 << 20


def check(r):
    err = r[0] if isinstance(r, tuple) else r
    if int(err) != 0:
        raise RuntimeError(str(err))
    return r[1] if isinstance(r, tuple) and len(r) == 2 else r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--mb", type=int, default=64)
    ap.add_argument("--count", type=int, default=12)
    a = ap.parse_args()
    check(cu.cuInit(0))
    devh = check(cu.cuDeviceGet(0))
    ctx = check(cu.cuDevicePrimaryCtxRetain(devh))
    check(cu.cuCtxSetCurrent(ctx))
    n = a.mb * MB
    fresh = [np.full(n // 4, i, np.float32) for i in range(a.count)]
    flat = [f.view(np.uint8) for f in fresh]
    pin_ptr = check(cu.cuMemHostAlloc(2 * n, 0))
    pinned = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * (2 * n)).from_address(int(pin_ptr)))
    dptr = int(check(cu.cuMemAlloc(2 * n)))
    streams = [check(cu.cuStreamCreate(1)) for _ in range(8)]
    res: dict = {}

    def rate(total, dt):
        return round(total / dt / 1e9, 2)

    # raw DMA from pinned
    check(cu.cuMemcpyHtoDAsync(dptr, int(pin_ptr), n, streams[0])); check(cu.cuStreamSynchronize(streams[0]))
    t = time.perf_counter()
    for _ in range(a.count):
        check(cu.cuMemcpyHtoDAsync(dptr, int(pin_ptr), n, streams[0]))
    check(cu.cuStreamSynchronize(streams[0]))
    res["h2d_pinned_GBs"] = rate(a.count * n, time.perf_counter() - t)

    for threads in (1, 2, 4, 8, 12, 16):
        with cf.ThreadPoolExecutor(threads) as pool:
            def part(i, lo, hi):
                np.copyto(pinned[lo:hi], flat[i][lo:hi])
            list(pool.map(lambda k: part(0, 0, 1), range(threads)))
            t = time.perf_counter()
            for i in range(a.count):
                step = n // threads
                list(pool.map(lambda k: part(i, k * step, (k + 1) * step), range(threads)))
            res[f"memcpy_to_pinned_GBs_{threads}t"] = rate(a.count * n, time.perf_counter() - t)
    print(res, flush=True)

    for threads in (1, 2, 4, 8):
        with cf.ThreadPoolExecutor(threads) as pool:
            def pg(i, k, step):
                src = flat[i].ctypes.data + k * step
                check(cu.cuMemcpyHtoDAsync(dptr + k * step, src, step, streams[k]))
                check(cu.cuStreamSynchronize(streams[k]))
            t = time.perf_counter()
            for i in range(a.count):
                step = n // threads
                list(pool.map(lambda k: pg(i, k, step), range(threads)))
            res[f"pageable_h2d_GBs_{threads}t"] = rate(a.count * n, time.perf_counter() - t)
    print(res, flush=True)

    for threads in (4, 8, 12):
        for chunk_mb in (2, 4, 8):
            chunk = chunk_mb * MB
            with cf.ThreadPoolExecutor(threads) as pool:
                def piped(i, c):
                    lo = c * chunk
                    slot = (i % 2) * n + lo
                    np.copyto(pinned[slot:slot + chunk], flat[i][lo:lo + chunk])
                    s = streams[c % 8]
                    check(cu.cuMemcpyHtoDAsync(dptr + slot, int(pin_ptr) + slot, chunk, s))
                t = time.perf_counter()
                for i in range(a.count):
                    list(pool.map(lambda c: piped(i, c), range(n // chunk)))
                for s in streams:
                    check(cu.cuStreamSynchronize(s))
                res[f"pipelined_GBs_{threads}t_{chunk_mb}MiB"] = rate(a.count * n, time.perf_counter() - t)
    print(res, flush=True)

    t = time.perf_counter()
    for i in range(4):
        p = flat[i].ctypes.data
        check(cu.cuMemHostRegister(p, n, 0))
        check(cu.cuMemHostUnregister(p))
    res["register_unregister_ms_per_64MiB"] = round((time.perf_counter() - t) / 4 * 1e3 * (64 * MB / n), 2)
    registration(a, ctx, n, dptr, streams, res)
    print(json.dumps(res, indent=1))
    if a.json:
        json.dump(res, open(a.json, "w"), indent=1)


def registration(a, ctx, n: int, dptr: int, streams: list, res: dict) -> None:
    """Registering fresh arrays instead of staging them: register / unregister alone with k
    threads, and a pipeline (register in workers, DMA, unregister after the DMA in workers)."""
    stream = streams[0]
    for threads in (1, 2, 4, 8):
        arrays = [np.full(n // 4, i, np.float32) for i in range(a.count)]

        def reg(arr):
            cu.cuCtxSetCurrent(ctx)
            check(cu.cuMemHostRegister(arr.ctypes.data, n, 0))

        def unreg(arr):
            cu.cuCtxSetCurrent(ctx)
            check(cu.cuMemHostUnregister(arr.ctypes.data))
        with cf.ThreadPoolExecutor(threads) as pool:
            t = time.perf_counter()
            list(pool.map(reg, arrays))
            res[f"register_GBs_{threads}t"] = round(a.count * n / (time.perf_counter() - t) / 1e9, 2)
            t = time.perf_counter()
            list(pool.map(unreg, arrays))
            res[f"unregister_GBs_{threads}t"] = round(a.count * n / (time.perf_counter() - t) / 1e9, 2)
        print(res, flush=True)
    for threads in (2, 4, 8):
        arrays = [np.full(n // 4, i, np.float32) for i in range(a.count)]
        with cf.ThreadPoolExecutor(threads) as pool, cf.ThreadPoolExecutor(2) as upool:
            def reg(arr):
                cu.cuCtxSetCurrent(ctx)
                check(cu.cuMemHostRegister(arr.ctypes.data, n, 0))
                return arr

            def unreg_after(arr, ev):
                cu.cuCtxSetCurrent(ctx)
                check(cu.cuEventSynchronize(ev))
                check(cu.cuMemHostUnregister(arr.ctypes.data))
                cu.cuEventDestroy(ev)
            t = time.perf_counter()
            done = []
            for arr in pool.map(reg, arrays):        # registered ahead by the workers, in order
                check(cu.cuMemcpyHtoDAsync(dptr, arr.ctypes.data, n, stream))
                ev = check(cu.cuEventCreate(2))
                check(cu.cuEventRecord(ev, stream))
                done.append(upool.submit(unreg_after, arr, ev))
            for d in done:
                d.result()
            res[f"register_pipeline_GBs_{threads}t"] = round(a.count * n / (time.perf_counter() - t) / 1e9, 2)
        print(res, flush=True)


if __name__ == "__main__":
    main()
