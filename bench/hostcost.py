"""Host cost per operation on the calling thread, without a profiler's distortion: Python and C
function calls per operation (deterministic: compare commits with it on a busy machine), the
best thread CPU time per operation over 7 runs, and the waiter thread's wake-ups per operation
(over those runs: each wake-up is a syscall and a scan under the GIL that the loop does not
see in its own CPU time), for four shapes of work:

- ``submit``: ``dev.launch`` of a no-op kernel, nothing awaited;
- ``await1``: one task awaiting each launch in turn (uvloop);
- ``buffers``: launches with two buffer arguments (the hazard path), nothing awaited;
- ``service``: what bench/serve.py's handler does, minus aiohttp: two allocs, an upload from a
  fresh array, a launch, ``await to_numpy``, two frees.

    python bench/hostcost.py --backend cuda
    PYTHONPATH=tests/fakes:. python bench/hostcost.py --backend cuda   # no GPU: fake driver
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import uvloop

import aiogpu

NOOP_CUDA = 'extern "C" __global__ void noop(unsigned n) {}'
K2_CUDA = 'extern "C" __global__ void k2(float* a, const float* b, unsigned n) {}'


def noop(launch, n):
    pass


def k2(launch, a, b, n):
    a[:n] = 2 * b[:n] + 1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default=None)
    ap.add_argument("--n", type=int, default=2000)
    a = ap.parse_args()
    rt = aiogpu.Runtime(backend=a.backend)
    cuda = rt.backend == "cuda"
    k = aiogpu.kernel("u32", cuda=NOOP_CUDA if cuda else None, name="noop")(noop)
    kb = aiogpu.kernel("f32*, const f32*, u32", cuda=K2_CUDA if cuda else None, name="k2")(k2)
    dev, n = rt.devices[0], a.n

    def submit() -> None:
        futs = [dev.launch(k, (1,), (1,), (0,)) for _ in range(n)]
        futs[-1].wait(60)

    def await1() -> None:
        async def go() -> None:
            for _ in range(n):
                await dev.launch(k, (1,), (1,), (0,))
        uvloop.run(go())

    def buffers() -> None:
        x, y = dev.alloc(4096), dev.alloc(4096)
        futs = [dev.launch(kb, (1,), (1,), (x, y, 0)) for _ in range(n)]
        futs[-1].wait(60)
        x.free()
        y.free()

    def service() -> None:
        async def go() -> None:
            host = np.ones(256, np.float32)
            for _ in range(n):
                x, y = dev.alloc(1024), dev.alloc(1024)
                aiogpu.copy(x, host)
                dev.launch(kb, (256,), (256,), (y, x, 256))
                await y.to_numpy(np.float32)
                x.free()
                y.free()
        uvloop.run(go())

    count = [0]

    def prof(frame, event, arg) -> None:
        if event in ("call", "c_call"):
            count[0] += 1

    def cpu(fn) -> float:
        t = time.thread_time()
        fn()
        return (time.thread_time() - t) / n * 1e6

    runs = 7

    print(f"host cost per operation on {rt.backend} ({rt.devices[0]!r})")
    for name, fn in (("submit", submit), ("await1", await1), ("buffers", buffers), ("service", service)):
        fn()                                   # warm: kernels loaded, pools filled
        count[0] = 0
        sys.setprofile(prof)
        fn()
        sys.setprofile(None)
        woke = rt.hub.wakeups
        best = min(cpu(fn) for _ in range(runs))
        wakeups = (rt.hub.wakeups - woke) / (runs * n)
        print(f"  {name:8s} calls/op {count[0] / n:7.1f}   best thread CPU us/op {best:8.2f}"
              f"   waiter wake-ups/op {wakeups:5.2f}")
    rt.close()


if __name__ == "__main__":
    main()
