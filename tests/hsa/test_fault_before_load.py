"""A kernel loaded after a GPU memory fault was reported, but before the runtime had handled
the report: the device is lost first, so the launch fails with DeviceLost and asks ROCr to load
nothing (on the real ROCr, ``hsa_executable_freeze`` on the evicted device would never return;
the emulator refuses it instead)."""
from __future__ import annotations

import time

import pytest

import aiogpu
from aiogpu import DeviceLost
from tests import gpu_kernels


def test_a_launch_after_a_reported_fault_fails_with_device_lost_and_loads_nothing():
    rt = aiogpu.Runtime("emulator", gpus=1)
    try:
        dev = rt.devices[0]
        dev._loaded_kernel(gpu_kernels.add_const_n)
        buf = dev.alloc(64)
        rt.api.library.faults.memory_fault_at(1, agent=0)
        faults = rt.api.emulator.memory_faults
        # The waiter handles the report under the runtime lock: holding it leaves the report
        # arrived (the handler ran) but not handled, as a launch racing the waiter finds it.
        with rt.lock:
            faulting = dev.launch(gpu_kernels.add_const_n, grid=(8,), block=(8,), args=(buf, 1, 8))
            deadline = time.monotonic() + 10
            while not (faults and faults[-1].handled) and time.monotonic() < deadline:
                time.sleep(0.001)
            assert faults and faults[-1].handled, "the emulator reported the fault"
            assert dev.broken is None, "(the report is not handled yet)"
            with pytest.raises(DeviceLost, match="only a new process"):
                dev.launch(gpu_kernels.add_into, grid=(8,), block=(8,), args=(dev.alloc(64), dev.alloc(64), 8))
            assert isinstance(dev.broken, DeviceLost)
        with pytest.raises(DeviceLost):
            faulting.wait(10)
            faulting.result()
        assert gpu_kernels.add_into not in dev._kernels
        assert not rt.api.emulator.api_errors, "nothing asked ROCr to load code on the lost device"
    finally:
        rt.close()
