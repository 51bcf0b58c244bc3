"""CUDA interop of views and foreign arrays: CAI and DLPack exports with every numeric dtype and
shape, torch tensors and CuPy arrays as launch arguments (zero-copy, ordered). Skipped cleanly
without CUDA, torch or CuPy; run on the H200."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

import aiogpu
from backends import CUDA_GPUS, CUDA_OK, CUDA_WHY, _close_checked, backend_runtime, needs_cupy, needs_torch
from gpu_kernels import saxpy, scale, slow_increment

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not CUDA_OK, reason=f"CUDA unavailable: {CUDA_WHY}")]

DTYPES = [np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64,
          np.float16, np.float32, np.float64, np.complex64, np.complex128]
TORCH_DTYPES = [np.bool_, np.int8, np.uint8, np.int16, np.int32, np.int64, np.float16, np.float32,
                np.float64, np.complex64, np.complex128]


@pytest.fixture
def crt():
    rt = backend_runtime("cuda")
    yield rt
    _close_checked(rt)


def sample(dtype, n):
    return (np.arange(n) % 2).astype(dtype) if dtype is np.bool_ else (np.arange(n) + 1).astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@needs_cupy
def test_cai_exports_the_views_dtype_and_shape(crt, dtype):
    import cupy as cp
    d = crt.devices[0]
    itemsize = np.dtype(dtype).itemsize
    buf = d.alloc(24 * itemsize)
    v = buf.view(dtype, (4, 6))
    host = sample(dtype, 24).reshape(4, 6)
    assert aiogpu.copy(v, host).wait(20)
    cai = v.__cuda_array_interface__
    assert cai["shape"] == (4, 6) and np.dtype(cai["typestr"]) == np.dtype(dtype)
    got = cp.asarray(v)
    assert got.dtype == np.dtype(dtype) and got.shape == (4, 6)
    cp.cuda.Device(0).synchronize()
    np.testing.assert_array_equal(cp.asnumpy(got), host)
    rows = cp.asarray(v[1:3])
    np.testing.assert_array_equal(cp.asnumpy(rows), host[1:3])
    assert cp.asarray(buf).dtype == np.uint8 and cp.asarray(buf).shape == (buf.nbytes,)


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=lambda d: np.dtype(d).name)
@needs_torch
def test_dlpack_exports_the_views_dtype_and_shape(crt, dtype):
    import torch
    d = crt.devices[0]
    itemsize = np.dtype(dtype).itemsize
    buf = d.alloc(32 * itemsize)
    host = sample(dtype, 32)
    assert aiogpu.copy(buf.view(dtype), host).wait(20)
    part = buf.view(dtype, (2, 8), offset=8 * itemsize)
    assert part.__dlpack_device__() == (2, 0)
    t = torch.from_dlpack(part)
    assert tuple(t.shape) == (2, 8)
    np.testing.assert_array_equal(t.cpu().numpy(), host[8:24].reshape(2, 8))


@needs_torch
def test_dlpack_keeps_the_allocation_until_the_consumer_lets_go(crt):
    import torch
    import gc
    buf = crt.devices[0].alloc(64)
    assert aiogpu.copy(buf.view(np.float32), np.ones(16, np.float32)).wait(20)
    t = torch.from_dlpack(buf.view(np.float32)[4:8])
    del buf
    gc.collect()
    assert crt.stats()["small_allocations"] == 1
    assert t.sum().item() == 4.0
    del t
    gc.collect()
    assert crt.stats()["small_allocations"] == 0


@pytest.mark.asyncio
@needs_torch
async def test_torch_tensors_as_launch_arguments(crt):
    import torch
    d = crt.devices[0]
    n = 4096
    x = torch.arange(n, dtype=torch.float32, device="cuda:0")   # queued on torch's stream
    y = torch.ones(n, dtype=torch.float32, device="cuda:0")
    await d.launch(saxpy, grid=(n,), block=(256,), args=(y, x, 2.0, n))   # zero-copy, in place
    torch.cuda.synchronize()
    np.testing.assert_array_equal(y.cpu().numpy(), 1 + 2 * np.arange(n, dtype=np.float32))
    # Mixed: an aiogpu view as x, the torch tensor as y.
    buf = d.alloc(n * 4)
    await aiogpu.copy(buf.view(np.float32), np.full(n, 3, np.float32))
    await d.launch(saxpy, grid=(n,), block=(256,), args=(y, buf.view(np.float32), 1.0, n))
    torch.cuda.synchronize()
    np.testing.assert_array_equal(y.cpu().numpy(), 4 + 2 * np.arange(n, dtype=np.float32))


@pytest.mark.asyncio
@needs_torch
async def test_launches_on_one_torch_tensor_are_ordered(crt):
    import torch
    d = crt.devices[0]
    counter = torch.zeros(4, dtype=torch.int64, device="cuda:0")
    view = counter[0:1]                      # another tensor over the same bytes
    futs = [d.launch(slow_increment, grid=(1,), block=(1,), args=(counter if i % 2 else view,))
            for i in range(10)]
    await aiogpu.gather(*futs)
    assert counter[0].item() == 10


@pytest.mark.asyncio
@needs_cupy
async def test_cupy_arrays_as_launch_arguments_wait_for_their_stream(crt):
    import cupy as cp
    d = crt.devices[0]
    n = 1 << 20
    with cp.cuda.Stream(non_blocking=True) as s:
        y = cp.ones(n, dtype=cp.float32)
        y *= 5                                # queued on s, not synchronised
        # CuPy names its current stream s in the interface (v3): the launch waits for it.
        fut = d.launch(scale, grid=(n,), block=(256,), args=(y, 2.0, n))
    await fut
    s.synchronize()
    assert float(y.sum()) == 10.0 * n


@needs_torch
def test_foreign_arguments_are_checked_before_submission(crt):
    import torch
    d = crt.devices[0]
    y = torch.ones(16, dtype=torch.float32, device="cuda:0")
    with pytest.raises(ValueError, match="contiguous"):
        d.launch(scale, grid=(8,), block=(8,), args=(y[::2], 2.0, 8))
    with pytest.raises(TypeError, match="argument 0"):
        d.launch(scale, grid=(16,), block=(16,), args=(y.cpu(), 2.0, 16))

    class ReadOnly:
        @property
        def __cuda_array_interface__(self):
            cai = dict(y.__cuda_array_interface__)
            cai["data"] = (cai["data"][0], True)
            return cai

    with pytest.raises(ValueError, match="read-only"):
        d.launch(scale, grid=(16,), block=(16,), args=(ReadOnly(), 2.0, 16))
    with aiogpu.Graph():
        with pytest.raises(TypeError, match="graph"):
            d.launch(scale, grid=(16,), block=(16,), args=(y, 2.0, 16))
    assert crt.stats()["pending"] == 0


@needs_torch
@pytest.mark.skipif(CUDA_GPUS < 2, reason=f"needs two NVIDIA GPUs; {CUDA_GPUS} here")
def test_foreign_argument_on_another_device_is_refused(crt):
    import torch
    y = torch.ones(16, dtype=torch.float32, device="cuda:1")
    with pytest.raises(ValueError, match="gpu1"):
        crt.devices[0].launch(scale, grid=(16,), block=(16,), args=(y, 2.0, 16))


@pytest.mark.asyncio
async def test_views_in_asyncio_wait_on_cuda(crt):
    d = crt.devices[0]
    buf = d.alloc(1024)
    up = aiogpu.copy(buf.view(np.int32), np.arange(256, dtype=np.int32))
    down = buf.view(np.int32)[10:20].to_numpy()
    done, pending = await asyncio.wait([up, down])
    assert done == {up, down} and not pending
    np.testing.assert_array_equal(down.result(), np.arange(10, 20))
