"""What the Loader tests feed a Loader and do with each batch."""
from __future__ import annotations

import numpy as np

import aiogpu
from gpu_kernels import scale


def batches(n: int, size: int = 256):
    """``n`` host arrays of ``size`` float32s; array ``i`` holds ``i`` everywhere."""
    for i in range(n):
        yield np.full(size, float(i), np.float32)


async def use_batch(batch) -> float:
    """Doubles the first 256 values of ``batch`` on its device once it is ready, releases it,
    and returns the first doubled value (copied back after the kernel)."""
    d = batch.device
    f = d.launch(scale, grid=(256,), block=(256,), args=(batch.data, 2.0, 256), after=[batch.ready])
    out = np.empty(256, np.float32)
    done = aiogpu.copy(out, batch.data, after=[f])
    batch.release()
    await done
    return float(out[0])
