"""A two-GPU pipeline: host batch -> GPU0 kernel -> peer copy -> GPU1 kernel -> host.

Several batches are in flight at once (bounded), each stage waits for the previous one on the
device, and every result is checked against NumPy.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import time

import numpy as np

import aiogpu
from aiogpu.cli import closing

N = 1 << 16


SAXPY_CU = r"""
extern "C" __global__ void saxpy(float* y, const float* x, float a, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] += a * x[i];
}
"""

SCALE_CU = r"""
extern "C" __global__ void scale(float* y, float a, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] *= a;
}
"""

# The same kernels in OpenCL C, which comgr compiles for AMD agents (the hsa backend).
SAXPY_CL = r"""
__kernel void saxpy(__global float* y, __global const float* x, float a, uint n) {
    size_t i = get_global_id(0);
    if (i < n) y[i] += a * x[i];
}
"""

SCALE_CL = r"""
__kernel void scale(__global float* y, float a, uint n) {
    size_t i = get_global_id(0);
    if (i < n) y[i] *= a;
}
"""


@aiogpu.kernel("f32*, const f32*, f32, u32", cuda=SAXPY_CU, opencl=SAXPY_CL)
def saxpy(launch, y, x, a, n):
    y[:n] += a * x[:n]


@aiogpu.kernel("f32*, f32, u32", cuda=SCALE_CU, opencl=SCALE_CL)
def scale(launch, y, a, n):
    y[:n] *= a


async def pipeline(rt: aiogpu.Runtime, batches: int, in_flight: int = 4, devices: list | None = None) -> dict:
    devices = devices or rt.devices
    d0, d1 = devices[0], devices[min(1, len(devices) - 1)]
    where = collections.Counter()
    limit = asyncio.Semaphore(in_flight)
    rng = np.random.default_rng(7)
    mismatches = 0
    ops = 0

    async def one(i: int) -> None:
        nonlocal mismatches, ops
        async with limit:
            xs = rng.standard_normal(N).astype(np.float32)
            x, y = d0.alloc(N * 4), d0.alloc(N * 4)
            z = d1.alloc(N * 4)
            up = aiogpu.copy(x, xs)
            zero = y.fill(0)
            k0 = d0.launch(saxpy, grid=(N,), block=(256,), args=(y, x, 3.0, N), after=[up, zero])
            peer = aiogpu.copy(z, y, after=[k0])
            k1 = d1.launch(scale, grid=(N,), block=(256,), args=(z, 0.5, N), after=[peer])
            out = z.to_numpy(np.float32)
            result = await out
            for f in (up, peer, out):
                where[f"{f.label.split(' ')[1]} on {f.queue}"] += 1
            ops += len((up, zero, k0, peer, k1, out))     # the GPU operations of one batch
            if not np.allclose(result, xs * 1.5, rtol=1e-6):
                mismatches += 1
            for b in (x, y, z):
                b.free()

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(batches)))
    elapsed = time.perf_counter() - t0
    return {"batches": batches, "ops": ops, "seconds": elapsed, "mismatches": mismatches,
            "copies": dict(where)}


def run(args: argparse.Namespace) -> int:
    import contextlib

    rt = aiogpu.Runtime(args.backend)
    tracing = aiogpu.trace(args.trace) if args.trace else contextlib.nullcontext()
    with closing(rt):
        print(f"aiogpu demo on {rt.backend} ({rt.reason}); {len(rt.devices)} GPU(s)")
        with tracing:
            summary = asyncio.run(pipeline(rt, args.batches))
    if args.trace:
        print(f"trace written to {args.trace} (open it in ui.perfetto.dev)")
    mb = summary["batches"] * N * 4 / 1e6
    print(f"{summary['batches']} batches, {summary['ops']} GPU operations in {summary['seconds']:.2f} s "
          f"({summary['ops'] / summary['seconds']:.0f} ops/s, {mb / summary['seconds']:.1f} MB/s of input)")
    print("where the copies ran:")
    for where, count in sorted(summary["copies"].items()):
        print(f"  {count:4d} x {where}")
    ok = summary["mismatches"] == 0
    print("results: all match NumPy" if ok else f"results: {summary['mismatches']} MISMATCHES")
    return 0 if ok else 1
