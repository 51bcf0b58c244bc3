"""A two-stage GPU pipeline over two Ray actors, checked against NumPy.

    python examples/ray_pipeline.py                         # a local Ray: ray.init(num_cpus=2)
    python examples/ray_pipeline.py --address HEAD_IP:6379   # a running cluster (ray start --head ...)

Stage one (``Transform``) computes ``y = A*x + B`` on its GPUs; stage two (``Consume``) pulls stage
one's results through ``aiogpu.Loader`` (source: ``aiogpu.ray.batches_from_refs``, so at most two
batches are asked of stage one ahead of what stage two has taken) and computes ``z = y*y + bias``
on its own GPUs. Host data travels between the driver and the actors through Ray's object store;
each actor copies it into its GPUs. Without GPUs, each stage runs the emulator with the GPUs Ray
assigned it as the custom resource ``emulated_gpu``; on a cluster with GPUs (Ray's ``GPU``
resource) the same code asks Ray for real ones. The last line printed ends with ``N mismatches``.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import time
from typing import Any

import numpy as np
import ray

import aiogpu
import aiogpu.ray

N = 1 << 14            # floats per batch
A, B = 2.0, 0.5        # stage one: y = A*x + B

AFFINE_CU = r"""
extern "C" __global__ void affine(float* y, const float* x, float a, float b, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + b;
}
"""
AFFINE_CL = """
__kernel void affine(__global float* y, __global const float* x, float a, float b, uint n) {
    uint i = get_global_id(0);
    if (i < n) y[i] = a * x[i] + b;
}
"""
SQUARE_ADD_CU = r"""
extern "C" __global__ void square_add(float* z, const float* y, const float* bias, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) z[i] = y[i] * y[i] + bias[i];
}
"""
SQUARE_ADD_CL = """
__kernel void square_add(__global float* z, __global const float* y, __global const float* bias, uint n) {
    uint i = get_global_id(0);
    if (i < n) z[i] = y[i] * y[i] + bias[i];
}
"""


@aiogpu.kernel("f32*, const f32*, f32, f32, u32", cuda=AFFINE_CU, opencl=AFFINE_CL)
def affine(launch, y, x, a, b, n):
    y[:n] = np.float32(a) * x[:n] + np.float32(b)


@aiogpu.kernel("f32*, const f32*, const f32*, u32", cuda=SQUARE_ADD_CU, opencl=SQUARE_ADD_CL)
def square_add(launch, z, y, bias, n):
    z[:n] = y[:n] * y[:n] + bias[:n]


def make_batch(i: int, n: int = N) -> tuple[np.ndarray, np.ndarray]:
    """Batch ``i``'s input ``x`` and its stage-two ``bias``."""
    rng = np.random.default_rng(i)
    return rng.standard_normal(n, dtype=np.float32), rng.standard_normal(n, dtype=np.float32)


def reference(x: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """What the two stages compute, in NumPy."""
    y = np.float32(A) * x + np.float32(B)
    return y * y + bias


@ray.remote
class Transform(aiogpu.ray.GPUActor):
    """Stage one: ``y = A*x + B`` on this actor's GPUs, batches spread round-robin over them."""

    def __init__(self, delay_s: float = 0.0):
        self.delay_s = delay_s      # tests slow the stage down to kill it mid-pipeline
        self.turn = 0

    async def transform(self, x: np.ndarray) -> np.ndarray:
        devices = self.devices
        dev = devices[self.turn % len(devices)]
        self.turn += 1
        n = x.size
        xb, yb = dev.alloc(x.nbytes), dev.alloc(x.nbytes)
        aiogpu.copy(xb, x)          # x is the object store's read-only array: a fine copy source
        dev.launch(affine, grid=(n,), block=(256,), args=(yb, xb, A, B, n))   # ordered after the copy
        y = await yb.to_numpy(np.float32)
        xb.free()
        yb.free()
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        return y


@ray.remote
class Consume(aiogpu.ray.GPUActor):
    """Stage two: pulls stage one's results through ``aiogpu.Loader``; ``z = y*y + bias`` on its GPUs."""

    def __init__(self) -> None:
        self.done = 0

    async def progress(self) -> int:
        """Batches finished so far (callable while ``consume`` runs: the actor is async)."""
        return self.done

    async def consume(self, upstream: Any, boxed: list[list[ray.ObjectRef]]) -> list[np.ndarray]:
        x_refs, bias_refs = boxed   # refs inside a list reach us as refs: we await them ourselves

        async def stage_one_results():
            for x_ref in x_refs:    # each call is submitted only when the loader asks for more
                yield upstream.transform.remote(x_ref)

        results: list[np.ndarray] = []
        source = aiogpu.ray.batches_from_refs(stage_one_results(), max_in_flight=2)
        async with aiogpu.Loader(source, self.devices, prefetch=2) as loader:
            async for batch in loader:
                dev, y = batch.device, batch.data
                n = y.nbytes // 4
                # The batch's bias (an ObjectRef) and its upload to the GPU (a GPUFuture), awaited
                # together; a failure of either raises here.
                bias, _ = await aiogpu.ray.gather(bias_refs[batch.index], batch.ready)
                bb, zb = dev.alloc(bias.nbytes), dev.alloc(bias.nbytes)
                aiogpu.copy(bb, bias)
                dev.launch(square_add, grid=(n,), block=(256,), args=(zb, y, bb, n))
                batch.release()     # the loader's next copy into y waits for the launch on the device
                results.append(await zb.to_numpy(np.float32))
                bb.free()
                zb.free()
                self.done += 1
        return results


def stage_gpus(per_stage: float) -> float:
    """GPUs to ask per stage: ``per_stage``, or a share where the cluster has fewer real GPUs."""
    real = ray.cluster_resources().get("GPU", 0)
    if real and real < 2 * per_stage:
        return real / 2                       # e.g. one GPU: each stage gets half of it
    return per_stage


def start_stages(per_stage: float = 2, *, delay_s: float = 0.0) -> tuple[Any, Any]:
    """The two stage actors, each asking Ray for ``per_stage`` GPUs (real, else emulated)."""
    per_stage = stage_gpus(per_stage)
    stage1 = Transform.options(**aiogpu.ray.gpu_options(per_stage)).remote(delay_s)
    stage2 = Consume.options(**aiogpu.ray.gpu_options(per_stage)).remote()
    return stage1, stage2


async def placed(actor: Any, timeout: float = 120.0) -> dict:
    """Where ``actor`` runs and what it drives; a clear error if Ray cannot place it in time."""
    try:
        return await asyncio.wait_for(actor.aiogpu_info.remote(), timeout)
    except asyncio.TimeoutError:
        raise RuntimeError(f"Ray did not place {actor} within {timeout:.0f} s: does the cluster have the GPUs "
                           f"(or {aiogpu.ray.EMULATED_GPU} resources) it asks for? {ray.available_resources()}") from None


async def run_pipeline(stage1: Any, stage2: Any, batches: int, n: int = N) -> tuple[list[np.ndarray], int]:
    """Push ``batches`` batches through the stages; (stage two's outputs, mismatches against NumPy)."""
    inputs = [make_batch(i, n) for i in range(batches)]
    x_refs = [ray.put(x) for x, _ in inputs]
    bias_refs = [ray.put(bias) for _, bias in inputs]
    outputs = await stage2.consume.remote(stage1, [x_refs, bias_refs])
    mismatches = abs(len(outputs) - batches)
    for z, (x, bias) in zip(outputs, inputs):
        mismatches += not np.allclose(z, reference(x, bias), rtol=1e-5, atol=1e-5)
    return outputs, mismatches


def describe(info: dict) -> str:
    node = (info["node_id"] or "?")[:8]
    return f"node {node} ({info['gpus']} GPU(s), {info['backend']})"


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", help="a running Ray cluster (default: start a local one)")
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--gpus-per-stage", type=float, default=2)
    args = parser.parse_args(argv)
    if args.address:
        ray.init(address=args.address, logging_level=logging.WARNING)
    else:
        # Declaring emulated GPUs costs nothing where real ones exist: gpu_options prefers Ray's GPU.
        ray.init(num_cpus=2, resources={aiogpu.ray.EMULATED_GPU: 2 * args.gpus_per_stage},
                 object_store_memory=100 << 20, include_dashboard=False, logging_level=logging.WARNING)
    try:
        stage1, stage2 = start_stages(args.gpus_per_stage)
        info1, info2 = await placed(stage1), await placed(stage2)
        t0 = time.perf_counter()
        outputs, mismatches = await run_pipeline(stage1, stage2, args.batches)
        elapsed = time.perf_counter() - t0
        print(f"ray pipeline: {len(outputs)} batches of {N} floats; stage 1 on {describe(info1)}, "
              f"stage 2 on {describe(info2)}; {elapsed:.2f} s; {mismatches} mismatches")
        return 1 if mismatches else 0
    finally:
        ray.shutdown()


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
