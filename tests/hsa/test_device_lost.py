"""A GPU memory fault loses the device for the rest of the process (HSA): KFD keeps the
process's queues there evicted, those created later too, and ROCr never recreates its copy
queues. Everything pending there fails with DeviceLost, every later operation on it fails at
once (never waits for a watchdog, never hangs in a kernel load), and the other devices go on."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

import aiogpu
from aiogpu import DeviceLost
from tests import gpu_kernels
from tests.hsa.test_hsa_library_lifetime import share_library, wait_until

SOON = 10.0   # bounds an await that must not wait for the watchdog (the old behaviour hung)


async def fault(rt) -> None:
    dev = rt.devices[0]
    buf = dev.alloc(64)
    rt.api.library.faults.memory_fault_at(1, agent=0)
    with pytest.raises(DeviceLost, match="memory fault"):
        await asyncio.wait_for(dev.launch(gpu_kernels.add_const_n, grid=(8,), block=(8,), args=(buf, 1, 8)), SOON)
    assert isinstance(dev.broken, DeviceLost)


async def later_work_fails_at_once(dev) -> None:
    # Fresh buffers each: one that failed work wrote fails its readers as a failed dependency.
    def fresh():
        return dev.alloc(64)

    checks = [
        ("a loaded kernel", lambda: dev.launch(gpu_kernels.add_const_n, grid=(8,), block=(8,), args=(fresh(), 1, 8))),
        ("a kernel never loaded here", lambda: dev.launch(gpu_kernels.add_into, grid=(8,), block=(8,),
                                                          args=(fresh(), fresh(), 8))),
        ("a load", lambda: dev.load(gpu_kernels.scale)),
        ("a fill", lambda: fresh().fill(0)),
        ("an upload", lambda: aiogpu.copy(fresh(), np.zeros(8, np.int64))),
        ("a download", lambda: fresh().to_numpy(np.int64)),
    ]
    for what, op in checks:
        with pytest.raises(DeviceLost, match="only a new process"):
            await asyncio.wait_for(op(), SOON)
    assert gpu_kernels.scale not in dev._kernels, "nothing is loaded on a lost device"


async def other_device_goes_on(dev) -> None:
    buf = dev.alloc(64)
    await aiogpu.copy(buf, np.arange(8, dtype=np.int64))
    k = dev.launch(gpu_kernels.add_const_n, grid=(8,), block=(8,), args=(buf, 2, 8))
    await dev.runtime.gather([k])
    assert (await buf.to_numpy(np.int64) == np.arange(8) + 2).all()


def test_a_memory_fault_loses_the_device_and_only_it():
    rt = aiogpu.Runtime("emulator", gpus=2)
    try:
        async def go():
            await fault(rt)
            await later_work_fails_at_once(rt.devices[0])
            await other_device_goes_on(rt.devices[1])
        asyncio.run(go())
        assert rt.leaks() == {}
        assert not rt.api.emulator.api_errors, "nothing asked ROCr to load code on the lost device"
    finally:
        rt.close()


def test_pending_work_on_the_lost_device_fails_and_work_depending_on_it_elsewhere():
    rt = aiogpu.Runtime("emulator", gpus=2)
    try:
        async def go():
            d0, d1 = rt.devices
            src, dst = d0.alloc(64), d1.alloc(64)
            # (loaded first: a kernel loaded after the fault has struck cannot load on the lost
            # device, which is not what this test is about)
            for dev in (d0, d1):
                await dev.load(gpu_kernels.add_const_n)
                await dev.load(gpu_kernels.sleep_ms)
            rt.api.library.faults.memory_fault_at(3, agent=0)   # the third: the first two still run
            slow = [d0.launch(gpu_kernels.sleep_ms, grid=(1,), block=(1,), args=(200,)) for _ in range(3)]
            writes = d0.launch(gpu_kernels.add_const_n, grid=(8,), block=(8,), args=(src, 1, 8), after=[slow[0]])
            peer = aiogpu.copy(dst, src)                 # after gpu0's write
            later = d1.launch(gpu_kernels.add_const_n, grid=(8,), block=(8,), args=(dst, 1, 8))  # after the copy
            for fut in slow:
                with pytest.raises(DeviceLost):
                    await asyncio.wait_for(fut, SOON)
            for fut in (writes, peer, later):            # lost itself, or after what was
                with pytest.raises(aiogpu.GPUError, match="lost to a GPU memory fault"):
                    await asyncio.wait_for(fut, SOON)
            await other_device_goes_on(d1)
        asyncio.run(go())
    finally:
        rt.close()


def test_a_later_runtime_of_the_process_finds_the_device_lost(monkeypatch):
    """KFD's eviction outlives the runtime and the library's init cycle: a runtime made later
    in the same process (on the same library) finds the device lost at once."""
    lib = share_library(monkeypatch, "emulator")
    rt = aiogpu.Runtime("emulator")
    asyncio.run(fault(rt))
    rt.close()
    assert not lib.initialized
    later = aiogpu.Runtime("emulator")
    try:
        assert isinstance(later.devices[0].broken, DeviceLost)
        assert later.devices[1].broken is None

        async def go():
            await later_work_fails_at_once(later.devices[0])
            await other_device_goes_on(later.devices[1])
        asyncio.run(go())
    finally:
        later.close()
    assert wait_until(lambda: lib.init_count == 0)


def test_work_queued_behind_failed_work_on_the_lost_device_fails_with_device_lost_too():
    """Work on the lost device whose dependency there failed first (the same queue's previous
    kernel, or an ``after=`` edge) is lost with the device: DeviceLost, not a plain failed
    dependency, whichever of the two the runtime reaches first."""
    rt = aiogpu.Runtime("emulator", gpus=2, queues_per_device=1)
    try:
        async def go():
            d0, d1 = rt.devices
            target = d0.alloc(4096)
            rt.api.emulator.faults.memory_fault_at(3, agent=0)
            slow = [d0.launch(gpu_kernels.sleep_ms, grid=(1,), block=(1,), args=(200,)) for _ in range(3)]
            up = aiogpu.copy(target, np.ones(4096, np.uint8), after=[slow[0]])
            behind = d0.launch(gpu_kernels.sleep_ms, grid=(1,), block=(1,), args=(1,), after=[slow[0]])
            got = await asyncio.wait_for(asyncio.gather(*slow, up, behind, return_exceptions=True), SOON)
            assert all(isinstance(o, DeviceLost) for o in got), [(type(o).__name__, str(o)[:80]) for o in got]
            # offered to the lost device after its failed input: lost too, not a failed input
            with pytest.raises(DeviceLost):
                await asyncio.wait_for(d0.launch(gpu_kernels.sleep_ms, grid=(1,), block=(1,), args=(1,),
                                                 after=[slow[0]]), SOON)
            # elsewhere, a dependent of lost work is a failed dependency, caused by the loss
            across = d1.launch(gpu_kernels.sleep_ms, grid=(1,), block=(1,), args=(1,), after=[slow[1]])
            with pytest.raises(aiogpu.GPUError, match="dependency failed") as info:
                await asyncio.wait_for(across, SOON)
            assert not isinstance(info.value, DeviceLost) and isinstance(info.value.__cause__, DeviceLost)
        asyncio.run(go())
    finally:
        rt.close(5)
