"""Cyclic garbage per request: the README's request shape (alloc, copy in, launch, to_numpy,
free) run N times with the collector off, then one collection: how many objects only the cyclic
collector frees, by type. Each is work for a collection pause in a service.

    python bench/probe_garbage.py [--backend cuda] [--n 500]
"""
from __future__ import annotations

import argparse
import asyncio
import gc
from collections import Counter

import numpy as np

import aiogpu

ADD_CU = r"""
extern "C" __global__ void probe_add(float* x, float c, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += c;
}
"""


@aiogpu.kernel("f32*, f32, u32", cuda=ADD_CU, name="probe_add")
def probe_add(launch, x, c, n):
    x[:n] += c


async def request(dev, n: int) -> None:
    x = dev.alloc(n * 4)
    aiogpu.copy(x, np.zeros(n, np.float32))
    dev.launch(probe_add, (n,), (256,), (x, 1.0, n))
    await x.to_numpy(np.float32)
    x.free()


async def main(args: argparse.Namespace) -> None:
    rt = aiogpu.Runtime(backend=args.backend)
    dev = rt.devices[0]
    for _ in range(50):
        await request(dev, 1024)
    gc.collect()
    gc.disable()
    for _ in range(args.n):
        await request(dev, 1024)
    gc.set_debug(gc.DEBUG_SAVEALL)
    found = gc.collect()
    print(f"{rt.backend}: {found / args.n:.2f} objects of cyclic garbage per request")
    for name, count in Counter(type(o).__name__ for o in gc.garbage).most_common(12):
        print(f"  {name:30s} {count / args.n:6.2f} per request")
    gc.set_debug(0)
    gc.garbage.clear()
    rt.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default=None)
    ap.add_argument("--n", type=int, default=500)
    asyncio.run(main(ap.parse_args()))
