"""A data loader feeding two GPUs: host batches are copied ahead while earlier batches compute.

    python examples/loader_two_gpus.py
"""
from __future__ import annotations

import asyncio
import time

import numpy as np

import aiogpu

N = 1 << 16


MEAN, STD = 1.0, 3.0   # of the synthetic batches below

STANDARDIZE_CU = r"""
extern "C" __global__ void standardize(float* out, const float* x, float mean, float inv_std, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = (x[i] - mean) * inv_std;
}
"""


@aiogpu.kernel("f32*, const f32*, f32, f32, u32", cuda=STANDARDIZE_CU)
def standardize(launch, out, x, mean, inv_std, n):
    out[:n] = (x[:n] - mean) * inv_std


def batches(count: int):
    rng = np.random.default_rng(0)
    for _ in range(count):
        yield rng.standard_normal(N).astype(np.float32) * STD + MEAN


async def main(count: int = 32) -> int:
    devices = aiogpu.devices()[:2]
    outputs = {d.name: d.alloc(N * 4) for d in devices}
    checked, bad = 0, 0
    t0 = time.perf_counter()
    async with aiogpu.Loader(batches(count), devices, prefetch=2) as loader:
        async for batch in loader:
            d = batch.device
            out = outputs[d.name]
            k = d.launch(standardize, grid=(N,), block=(256,), args=(out, batch.data, MEAN, 1 / STD, N),
                         after=[batch.ready])
            batch.release()                 # the next copy into these buffers waits for k on the device
            result = await out.to_numpy(np.float32)
            checked += 1
            bad += not (abs(result.mean()) < 0.02 and abs(result.std() - 1) < 0.02)
    elapsed = time.perf_counter() - t0
    print(f"{checked} batches over {len(devices)} GPU(s) in {elapsed:.2f} s "
          f"({checked * N * 4 / elapsed / 1e6:.1f} MB/s); {loader.allocated} buffers allocated; {bad} bad")
    return 1 if bad or checked != count else 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
