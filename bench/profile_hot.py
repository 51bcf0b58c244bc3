"""Profile the host-side hot paths with pyinstrument: submitting launches, one awaiter's round
trip and 64 concurrent awaiters, on the chosen backend. Text reports go to DIR.

    python bench/profile_hot.py --backend cuda --out DIR
"""
from __future__ import annotations

import argparse
import asyncio
import os
import time

import aiogpu


@aiogpu.kernel("u32")
def noop(launch, n):
    pass


NOOP_CUDA = 'extern "C" __global__ void noop(unsigned n) {}'


def kernel_for(rt):
    if rt.backend == "cuda":
        return aiogpu.kernel("u32", cuda=NOOP_CUDA, name="noop")(noop.body)
    return noop


def profiled(out: str, name: str, fn) -> float:
    from pyinstrument import Profiler
    p = Profiler(interval=0.0001, async_mode="disabled")
    p.start()
    t = time.perf_counter()
    n = fn()
    dt = time.perf_counter() - t
    p.stop()
    with open(os.path.join(out, f"hot_{name}.txt"), "w") as f:
        f.write(f"{name}: {n} ops in {dt:.3f} s = {dt / n * 1e6:.2f} us/op\n")
        f.write(p.output_text(unicode=False, color=False, show_all=False))
    print(f"{name}: {dt / n * 1e6:.2f} us/op")
    return dt / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default=None)
    ap.add_argument("--out", default="out")
    ap.add_argument("--n", type=int, default=20000)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    import uvloop
    rt = aiogpu.Runtime(backend=a.backend)
    dev, k = rt.devices[0], kernel_for(rt)
    dev.launch(k, (1,), (1,), (0,)).wait(30)

    def submit():
        futs = [dev.launch(k, (1,), (1,), (0,)) for _ in range(a.n)]
        futs[-1].wait(60)
        return a.n

    def one_awaiter():
        async def go():
            for _ in range(a.n // 4):
                await dev.launch(k, (1,), (1,), (0,))
        uvloop.run(go())
        return a.n // 4

    def many_awaiters():
        async def worker():
            for _ in range(a.n // 64):
                await dev.launch(k, (1,), (1,), (0,))

        async def go():
            await asyncio.gather(*(worker() for _ in range(64)))
        uvloop.run(go())
        return (a.n // 64) * 64

    for name, fn in (("submit", submit), ("await1", one_awaiter), ("await64", many_awaiters)):
        fn()  # warm
        profiled(a.out, name, fn)
    rt.close()


if __name__ == "__main__":
    main()
