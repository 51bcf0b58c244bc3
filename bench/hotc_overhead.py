"""Host cost per call of the C hot path (aiogpu.cuda._hotc) without a GPU, against the Python ways.

    python bench/hotc_overhead.py

The driver entry points are fakes that return 0 at once, either C functions (a stub compiled
here with cc: what the extension itself costs) or Python ctypes callbacks (as in
tests/cuda_backend/test_hotc.py; the callback dominates). The Python comparisons are the fake driver's (tests/fakes)
cuda-bindings stand-ins (a Python function that returns ``(CUresult,)``) and ctypes calls into the
same C stubs. On a GPU the driver's own cost (launch ~1-2 us) comes on top of each.
"""
from __future__ import annotations

import ctypes
import enum
import os
import subprocess
import sys
import sysconfig
import tempfile
import time

import aiogpu.cuda._hotc as hotc

STUB = r"""
int launch(void *f, unsigned a, unsigned b, unsigned c, unsigned d, unsigned e, unsigned g,
           unsigned s, void *st, void **p, void **x) { return 0; }
int memop(void *st, unsigned long long w, unsigned long long v, unsigned fl) { return 0; }
int memcpy_(unsigned long long d, unsigned long long s, unsigned long n, void *st) { return 0; }
int query(void *e) { return 0; }
"""


def per_call(fn, n: int = 200_000) -> float:
    fn()
    best = None
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        dt = (time.perf_counter() - t) / n * 1e6
        best = dt if best is None else min(best, dt)
    return best


def main() -> None:
    d = tempfile.mkdtemp()
    src, so = os.path.join(d, "stub.c"), os.path.join(d, "stub.so")
    open(src, "w").write(STUB)
    subprocess.run([sysconfig.get_config_var("CC").split()[0] or "cc", "-O2", "-shared", "-fPIC", src, "-o", so],
                   check=True)
    lib = ctypes.CDLL(so)
    addr = {k: ctypes.cast(getattr(lib, k), ctypes.c_void_p).value for k in ("launch", "memop", "memcpy_", "query")}

    class CUresult(enum.IntEnum):       # what cuda-bindings returns: an enum in a tuple
        CUDA_SUCCESS = 0

    class CUstream:                     # a handle object converted each call
        def __init__(self, v): self.v = v
        def __int__(self): return self.v

    def cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shm, stream, params, extra):
        int(stream)
        return (CUresult.CUDA_SUCCESS,)

    def cuStreamWriteValue64(stream, dptr, value, flags):
        int(stream), int(dptr)
        return (CUresult.CUDA_SUCCESS,)

    S, W = CUstream(0x5000), CUstream(0xAB00)
    res = {}
    res["python (cuda-bindings-like): launch + write, 2 calls"] = per_call(
        lambda: (cuLaunchKernel(1, 1, 1, 1, 1, 1, 1, 0, S, 0, 0)[0] or cuStreamWriteValue64(S, W, 1, 0)[0]))

    vp, u = ctypes.c_void_p, ctypes.c_uint
    cl = lib.launch
    cl.argtypes = [vp, u, u, u, u, u, u, u, vp, vp, vp]
    cw = lib.memop
    cw.argtypes = [vp, ctypes.c_uint64, ctypes.c_uint64, u]
    res["ctypes into C stubs: launch + write, 2 calls"] = per_call(
        lambda: cl(1, 1, 1, 1, 1, 1, 1, 0, 0x5000, 0, None) or cw(0x5000, 0xAB00, 1, 0))

    saved = hotc.entry_points()
    hotc.init(addr["launch"], addr["memcpy_"], addr["memop"], addr["memop"], 0, 0, addr["query"], 0)
    launch, memcpy, query = hotc.launch, hotc.memcpy, hotc.query
    res["_hotc.launch + write, 1 call (C stub targets)"] = per_call(
        lambda: launch(1, 1, 1, 1, 1, 1, 1, 0, 0x5000, 0, 0xAB00, 1))
    res["_hotc.launch + write, handle objects via __int__"] = per_call(
        lambda: launch(1, 1, 1, 1, 1, 1, 1, 0, S, 0, W, 1))
    res["_hotc.launch alone (C stub)"] = per_call(lambda: launch(1, 1, 1, 1, 1, 1, 1, 0, 0x5000, 0))
    res["_hotc.memcpy + write (C stub)"] = per_call(lambda: memcpy(0x10, 0x20, 4096, 0x5000, 0xAB00, 1))
    res["_hotc.query (C stub)"] = per_call(lambda: query(0xE000))
    res["empty Python lambda (loop floor)"] = per_call(lambda: None)

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "cuda_backend"))
    from test_hotc import FakeDriver    # the tests' CFUNCTYPE fakes
    drv = FakeDriver()
    hotc.init(*(drv.addresses[k] for k in ("launch", "memcpy", "write64", "wait64", "wait_event", "record",
                                           "query", "host_func")))
    res["_hotc.launch + write, CFUNCTYPE (Python) targets"] = per_call(
        lambda: launch(1, 1, 1, 1, 1, 1, 1, 0, 0x5000, 0, 0xAB00, 1), 20_000)
    hotc.init(*saved)
    print(f"Python {sys.version.split()[0]}; microseconds per call (best of 3):")
    for k, v in res.items():
        print(f"  {v:7.3f}  {k}")


if __name__ == "__main__":
    main()
