"""Can fresh arrays reach the GPU at the pinned rate by registering them (no staging copy)?
Register / unregister cost alone and with k threads, and a pipeline: register in workers, DMA,
unregister after the DMA, in workers.   python bench/probe_register.py [--json FILE]"""
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
    ap.add_argument("--count", type=int, default=24)
    a = ap.parse_args()
    check(cu.cuInit(0))
    ctx = check(cu.cuDevicePrimaryCtxRetain(check(cu.cuDeviceGet(0))))
    check(cu.cuCtxSetCurrent(ctx))
    n = 64 * MB
    res: dict = {}
    dptr = int(check(cu.cuMemAlloc(n)))
    stream = check(cu.cuStreamCreate(1))
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
    print(json.dumps(res, indent=1))
    if a.json:
        json.dump(res, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
