"""An async GPU test suite using aiogpu's pytest plugin (installed with aiogpu).

    pytest examples/test_with_aiogpu_plugin.py                  # on the emulator
    pytest examples/test_with_aiogpu_plugin.py --aiogpu-gpus=4   # four emulated GPUs
"""
from __future__ import annotations

import numpy as np
import pytest

import aiogpu


SCALE_CU = r"""
extern "C" __global__ void scale(float* y, float a, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] *= a;
}
"""


@aiogpu.kernel("f32*, f32, u32", cuda=SCALE_CU)
def scale(launch, y, a, n):
    y[:n] *= a


@pytest.mark.asyncio
async def test_scale_on_the_first_gpu(gpu):
    buf = gpu.alloc(64 * 4)
    await aiogpu.copy(buf, np.arange(64, dtype=np.float32))
    await gpu.launch(scale, grid=(64,), block=(64,), args=(buf, 2.0, 64))
    assert (await buf.to_numpy(np.float32) == np.arange(64) * 2).all()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_peer_copy_under_anyio(gpus, anyio_backend):
    if len(gpus) < 2:
        pytest.skip("a peer copy needs two GPUs")
    a, b = gpus[0].alloc(256), gpus[1].alloc(256)
    await aiogpu.copy(a, np.full(256, 7, np.uint8))
    await aiogpu.copy(b, a)
    assert (await b.to_numpy() == 7).all()


@pytest.mark.asyncio
async def test_a_queue_error_surfaces_as_gpu_error(gpu, inject):
    buf = gpu.alloc(64 * 4)
    inject.queue_error(at=1)
    with pytest.raises(aiogpu.GPUError):
        await gpu.launch(scale, grid=(64,), block=(64,), args=(buf, 2.0, 64))


@pytest.mark.asyncio
async def test_copies_still_work_with_sdma_exhausted(gpu, inject):
    inject.exhaust_sdma()
    buf = gpu.alloc(128)
    await aiogpu.copy(buf, np.arange(128, dtype=np.uint8))      # a shader copy now
    assert (await buf.to_numpy() == np.arange(128)).all()


@pytest.mark.aiogpu(gpus=4)                 # emulator options for this test's runtime
def test_marker_options_and_plain_threads(gpu_runtime, gpus):
    assert len(gpus) == 4 or gpu_runtime.backend != "emulator"
    buf = gpus[-1].alloc(64)
    assert aiogpu.copy(buf, np.zeros(64, np.uint8)).wait(10)
