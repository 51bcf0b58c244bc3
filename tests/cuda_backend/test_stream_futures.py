"""Other libraries' CUDA work as aiogpu futures (issue 15): ``aiogpu.stream_future`` of a
PyTorch or CuPy stream or event, such streams and events in ``after=`` (a wait on the device),
and ``fut.wait_on(stream)`` the other way. The CUDA tests need torch or CuPy with a GPU and skip
cleanly elsewhere; the emulator tests check the errors of a backend without CUDA streams."""
from __future__ import annotations

import numpy as np
import pytest

import aiogpu
from backends import _close_checked, needs_cupy, needs_torch


class FakeTorchStream:
    """Looks like a torch.cuda.Stream (duck typing is how aiogpu recognises one)."""
    cuda_stream = 0
    device_index = 0


class FakeTorchEvent:
    cuda_event = 0


# -- backends without CUDA streams ---------------------------------------------------------------
@pytest.mark.asyncio
async def test_stream_apis_on_the_emulator_raise_not_on_cuda(make_runtime):
    rt = make_runtime()
    d0 = rt.devices[0]
    for obj in (FakeTorchStream(), FakeTorchEvent(), 0):
        with pytest.raises(aiogpu.NotOnCudaError, match="emulator backend has no CUDA streams"):
            aiogpu.stream_future(obj, runtime=rt)
    buf = d0.alloc(64)
    fut = buf.fill(0)
    with pytest.raises(aiogpu.NotOnCudaError):
        d0.launch(_touch, (16,), (16,), (buf,), after=[FakeTorchStream()])
    with pytest.raises(aiogpu.NotOnCudaError):
        aiogpu.copy(buf, np.zeros(16, np.float32), after=FakeTorchEvent())
    with pytest.raises(TypeError, match="after= takes GPUFutures"):
        d0.launch(_touch, (16,), (16,), (buf,), after=[42])
    with pytest.raises(aiogpu.NotOnCudaError):
        fut.wait_on(FakeTorchStream())
    await fut
    with pytest.raises(aiogpu.NotOnCudaError):
        fut.wait_on(FakeTorchStream())          # also once done: the call is wrong here
    assert isinstance(aiogpu.NotOnCudaError("x"), TypeError)


def test_stream_future_after_close_raises(make_runtime):
    rt = make_runtime()
    rt.close()
    with pytest.raises(aiogpu.RuntimeClosedError):
        aiogpu.stream_future(FakeTorchStream(), runtime=rt)


@aiogpu.kernel("u32*")
def _touch(launch, x):
    x[0] += 1


# -- CUDA -------------------------------------------------------------------------------------------

SLOW_FILL_CU = r"""
extern "C" __global__ void slow_fill(float* y, float v, unsigned int n, unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = v;
}
"""
PLUS_ONE_CU = r"""
extern "C" __global__ void plus_one(float* y, const float* x, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] + 1.0f;
}
"""


@aiogpu.kernel("f32*, f32, u32, u64", cuda=SLOW_FILL_CU)
def slow_fill(launch, y, v, n, ns):
    y[:n] = v


@aiogpu.kernel("f32*, const f32*, u32", cuda=PLUS_ONE_CU)
def plus_one(launch, y, x, n):
    y[:n] = x[:n] + 1


@pytest.fixture
def cuda_rt():
    rt = aiogpu.Runtime("cuda")    # (its tests are marked needs_torch / needs_cupy)
    yield rt
    _close_checked(rt)


def _torch_sleep_cycles(torch, ms: float) -> int:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)
    torch.cuda.synchronize()
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return int(10_000_000 / start.elapsed_time(end) * ms)


@needs_torch
@pytest.mark.asyncio
async def test_stream_future_completes_after_the_torch_work_queued_before_it(cuda_rt):
    import torch
    d0 = cuda_rt.devices[0]
    torch.cuda.set_device(d0.index)
    s = torch.cuda.Stream()
    host = torch.empty(1024, dtype=torch.float32, pin_memory=True)
    host.fill_(-1)
    cycles = _torch_sleep_cycles(torch, 50)
    with torch.cuda.stream(s):
        a = torch.randn(2048, 2048, device="cuda")
        x = a
        for _ in range(30):                       # a long chain of matmuls
            x = torch.tanh(x @ a) * 0.5
        result = x[0, :1024] + 1000.0
        host.copy_(result, non_blocking=True)     # (this torch build waits here for the stream)
        torch.cuda._sleep(cycles)                 # then 50 ms of GPU time, queued last
    assert not s.query(), "the torch work is still queued"
    fut = aiogpu.stream_future(s, runtime=cuda_rt)
    assert not fut.done(), "the torch work takes 50 ms at least"
    await fut
    assert s.query(), "everything queued before the future has finished"
    got = host.numpy().copy()                     # read without any torch synchronisation
    torch.cuda.synchronize()
    np.testing.assert_array_equal(got, result.cpu().numpy())
    assert got.min() > 900


@needs_torch
@pytest.mark.asyncio
async def test_torch_current_stream_default_stream_and_events(cuda_rt):
    import torch
    d0 = cuda_rt.devices[0]
    torch.cuda.set_device(d0.index)
    cycles = _torch_sleep_cycles(torch, 30)
    torch.cuda._sleep(cycles)                                   # on the default stream
    fut = aiogpu.stream_future(torch.cuda.current_stream(), runtime=cuda_rt)
    assert not fut.done()
    await fut
    assert torch.cuda.current_stream().query()
    # A raw handle (the default stream is 0) with device=.
    torch.cuda._sleep(cycles)
    await aiogpu.stream_future(0, device=d0, runtime=cuda_rt)
    assert torch.cuda.current_stream().query()
    # An event: its record now, not a later one.
    s = torch.cuda.Stream()
    ev = torch.cuda.Event()
    with torch.cuda.stream(s):
        torch.cuda._sleep(cycles)
        ev.record()
    efut = aiogpu.stream_future(ev, runtime=cuda_rt)
    assert not efut.done()
    await efut
    assert ev.query()
    assert aiogpu.stream_future(torch.cuda.Event(), runtime=cuda_rt).done(), "never recorded: nothing to wait for"
    torch.cuda.synchronize()


@needs_torch
@pytest.mark.asyncio
async def test_after_a_torch_stream_is_a_wait_on_the_device(cuda_rt):
    """torch writes a buffer (through DLPack) on a side stream after 50 ms of GPU sleep; an
    aiogpu kernel reading it with after= (the future, the stream itself, an event) sees what
    torch wrote, and the launch returned without waiting on the host."""
    import torch
    d0 = cuda_rt.devices[0]
    torch.cuda.set_device(d0.index)
    n = 4096
    cycles = _torch_sleep_cycles(torch, 50)
    for how in ("future", "stream", "event"):
        x, y = d0.alloc(n * 4), d0.alloc(n * 4)
        await x.fill(0)
        tx = torch.from_dlpack(x).view(torch.float32)
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            torch.cuda._sleep(cycles)
            tx.fill_(41.0)
            ev = torch.cuda.Event()
            ev.record()
        after = {"future": aiogpu.stream_future(s, runtime=cuda_rt), "stream": s, "event": ev}[how]
        k = d0.launch(plus_one, (n,), (256,), (y, x, n), after=[after])
        assert not k.done(), "submitted at once, waiting on the device"
        np.testing.assert_array_equal(await y.to_numpy(np.float32), np.full(n, 42, np.float32), err_msg=how)
        s.synchronize()
        del tx
        x.free()
        y.free()


@needs_torch
@pytest.mark.asyncio
async def test_wait_on_makes_a_torch_stream_wait_for_aiogpu_work(cuda_rt):
    import torch
    d0 = cuda_rt.devices[0]
    torch.cuda.set_device(d0.index)
    n = 4096
    for words in (True, False):
        rt = cuda_rt if words else aiogpu.Runtime("cuda", completion_words=False)
        try:
            dev = rt.devices[0]
            y = dev.alloc(n * 4)
            await y.fill(0)
            await dev.load(slow_fill)       # wait_on needs submitted work, not a compiling kernel
            fut = dev.launch(slow_fill, (n,), (256,), (y, 7.0, n, 50_000_000))   # 50 ms, then writes
            s = torch.cuda.Stream()
            fut.wait_on(s)
            ty = torch.from_dlpack(y).view(torch.float32)
            with torch.cuda.stream(s):
                seen = ty.clone()                 # queued after the wait
            s.synchronize()
            assert torch.equal(seen, torch.full((n,), 7.0, device="cuda")), f"words={words}"
            await fut
            fut.wait_on(s)                        # done: nothing to wait for
            del ty
        finally:
            if rt is not cuda_rt:
                rt.close()


@needs_torch
@pytest.mark.asyncio
async def test_stream_future_errors_on_cuda(cuda_rt):
    import torch
    d0 = cuda_rt.devices[0]
    with pytest.raises(TypeError, match="expected a CUDA stream or event"):
        aiogpu.stream_future(object(), runtime=cuda_rt)
    other = aiogpu.Runtime("emulator", gpus=1)
    try:
        with pytest.raises(ValueError, match="another runtime"):
            aiogpu.stream_future(torch.cuda.current_stream(), device=other.devices[0], runtime=cuda_rt)
    finally:
        other.close()
    f = d0.alloc(64).fill(0)
    with pytest.raises(TypeError, match="wait_on takes a stream"):
        f.wait_on(torch.cuda.Event())
    await f
    with aiogpu.Graph():
        with pytest.raises(ValueError, match="graph cannot capture"):
            aiogpu.stream_future(torch.cuda.current_stream(), runtime=cuda_rt)
    cuda_rt.close()
    with pytest.raises(aiogpu.RuntimeClosedError):
        aiogpu.stream_future(torch.cuda.current_stream(), runtime=cuda_rt)


@needs_cupy
@pytest.mark.asyncio
async def test_cupy_streams_and_events(cuda_rt):
    import cupy as cp
    d0 = cuda_rt.devices[0]
    with cp.cuda.Device(d0.index):
        s = cp.cuda.Stream(non_blocking=True)
        spin = cp.RawKernel(SLOW_FILL_CU, "slow_fill")
        y = cp.zeros(1024, dtype=cp.float32)
        with s:
            spin((4,), (256,), (y, np.float32(5.0), np.uint32(1024), np.uint64(50_000_000)))
            ev = cp.cuda.Event()
            ev.record(s)
        fut = aiogpu.stream_future(s, runtime=cuda_rt)
        efut = aiogpu.stream_future(ev, runtime=cuda_rt)
        assert not fut.done() and not efut.done()
        await fut
        assert s.done
        await efut
        assert ev.done
        assert float(y.sum()) == 5.0 * 1024
        # The other way: a CuPy stream waits for aiogpu work.
        buf = d0.alloc(1024 * 4)
        await buf.fill(0)
        k = d0.launch(slow_fill, (1024,), (256,), (buf, 3.0, 1024, 50_000_000))
        s2 = cp.cuda.Stream(non_blocking=True)
        k.wait_on(s2)
        view = cp.from_dlpack(buf).view(cp.float32)
        with s2:
            total = view.sum()
        s2.synchronize()
        assert float(total) == 3.0 * 1024
        await k
        del view
