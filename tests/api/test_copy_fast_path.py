"""The common copy submitted at once (``_core.copies.submit``): no ``after=``, the device
working, no copy kernel to compile, and no input that failed or is deferred work. It skips
``submit.guarded``'s general path, and hands everything else to that path unchanged: a failed
input fails the copy without running it, deferred inputs defer it, ``after=`` orders it."""
from __future__ import annotations

import numpy as np
import pytest

import aiogpu
from aiogpu._core import copies
from backends import count_calls
from gpu_kernels import fail_if, scale

pytestmark = pytest.mark.asyncio


@pytest.mark.skipif(copies.COMPILED, reason="compiled, the core's calls are C calls that no spy sees")
async def test_the_common_upload_and_download_skip_the_general_path(any_rt, monkeypatch):
    d0 = any_rt.devices[0]
    x = d0.alloc(64 * 4)
    # Warm: the lanes, the copy kernel where a copy may run as a shader, and the kernel (a
    # launch whose kernel is still compiling is deferred work, which defers what reads it).
    await aiogpu.copy(x, np.zeros(64, np.float32))
    await x.to_numpy(np.float32)
    await d0.launch(scale, (64,), (64,), (x, 1.0, 64))
    general = count_calls(monkeypatch, copies, "guarded")
    host = np.arange(64, dtype=np.float32)
    up = aiogpu.copy(x, host)                                # a destination with history
    d0.launch(scale, (64,), (64,), (x, 2.0, 64))             # the download reads its output
    down = x.to_numpy(np.float32)
    assert general == [], "a common copy went through the general path"
    assert (await down == 2 * host).all() and up.done()
    await aiogpu.copy(x, host, after=[down])                 # after=: the general path
    assert len(general) == 1


async def test_a_download_of_a_failed_write_fails_without_running(any_rt):
    d0 = any_rt.devices[0]
    out = d0.alloc(4)
    await aiogpu.copy(out, np.zeros(1, np.int32))
    failed = d0.launch(fail_if, grid=(1,), block=(1,), args=(out, 1))
    with pytest.raises(aiogpu.GPUError):
        await failed
    with pytest.raises(aiogpu.GPUError, match="dependency failed"):
        await out.to_numpy(np.int32)
    # An upload overwrites the undefined memory: it runs, and what it wrote reads back.
    await aiogpu.copy(out, np.full(1, 7, np.int32))
    assert (await out.to_numpy(np.int32))[0] == 7


async def test_a_download_waits_for_its_pending_writer(any_rt):
    d0 = any_rt.devices[0]
    n = 1 << 16
    x = d0.alloc(n * 4)
    host = np.arange(n, dtype=np.float32)
    aiogpu.copy(x, host)                                     # not awaited: pending inputs
    for _ in range(3):
        d0.launch(scale, (n,), (256,), (x, 2.0, n))
    assert (await x.to_numpy(np.float32) == 8 * host).all()

