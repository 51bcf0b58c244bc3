"""Allocations in real memory, access rules, resolve(), use after free."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from aiogpu.hsa_bindings import types as T
from aiogpu.hsa_bindings.emulator import MemoryFault

from emu_helpers import ok

MIB2 = 2 << 20


def test_allocations_are_real_and_aligned(hsa):
    small = hsa.device_alloc(0, 100)
    big = hsa.device_alloc(0, 2 * MIB2)
    assert small % 4096 == 0 and big % MIB2 == 0
    hsa.host_view(big, 2 * MIB2)[:] = 7  # it is real, writable memory
    view = hsa.emu.resolve(0, big + 10, 16, write=True)
    assert view.dtype == np.uint8 and (view == 7).all()
    view[:] = 9
    assert hsa.host_view(big + 10, 16).tolist() == [9] * 16
    assert hsa.api.hsa_amd_memory_pool_allocate(hsa.device_pools[0], 0, 0, ctypes.byref(ctypes.c_void_p())) \
        == T.HSA_STATUS_ERROR_INVALID_ARGUMENT
    hsa.free(small)
    hsa.free(big)
    assert hsa.api.hsa_amd_memory_pool_free(big) == T.HSA_STATUS_ERROR_INVALID_ARGUMENT


def test_resolve_faults_say_why(hsa):
    dev = hsa.device_alloc(0, 4096)
    with pytest.raises(MemoryFault, match="past the end"):
        hsa.emu.resolve(0, dev + 4000, 200)
    with pytest.raises(MemoryFault, match="allow_access"):
        hsa.emu.resolve(1, dev, 16)
    hsa.allow(dev, 1)
    assert hsa.emu.resolve(1, dev, 16).size == 16
    hsa.free(dev)
    with pytest.raises(MemoryFault, match="use after free"):
        hsa.emu.resolve(0, dev, 16)
    with pytest.raises(MemoryFault, match="unknown address"):
        hsa.emu.resolve(0, 0x10, 16)


def test_system_pool_is_visible_to_every_gpu(hsa):
    host = hsa.alloc(hsa.system_pool, 8192)
    kern = hsa.alloc(hsa.kernarg_pool, 64)
    for gpu in (0, 1):
        assert hsa.emu.resolve(gpu, host, 8192).size == 8192
        assert hsa.emu.resolve(gpu, kern, 64).size == 64


def lock(hsa, address, size, gpus=None):
    out = ctypes.c_void_p()
    agents = (T.hsa_agent_t * len(gpus))(*[hsa.gpus[g] for g in gpus]) if gpus else None
    ok(hsa.api.hsa_amd_memory_lock(address, size, agents, len(gpus or ()), ctypes.byref(out)))
    return out.value


def test_locked_host_memory_is_reached_through_its_agent_address(hsa):
    """ROCr returns an agent address for locked memory that may differ from the host address
    (libhsakmt's alternate VA); GPUs must use it, and the host address faults on a GPU."""
    array = np.arange(1000, dtype=np.float32)
    host = array.ctypes.data
    with pytest.raises(MemoryFault):
        hsa.emu.resolve(0, host, array.nbytes)
    agent_ptr = hsa.lock(array)
    assert agent_ptr != host and agent_ptr % 4096 == host % 4096
    view = hsa.emu.resolve(1, agent_ptr, array.nbytes).view(np.float32)
    assert np.array_equal(view, array)
    with pytest.raises(MemoryFault, match="agent address"):
        hsa.emu.resolve(0, host, array.nbytes)
    assert hsa.emu.resolve(None, host, 16).size == 16          # the CPU uses the host address
    ok(hsa.api.hsa_amd_memory_unlock(host))
    with pytest.raises(MemoryFault):
        hsa.emu.resolve(0, agent_ptr, array.nbytes)
    ok(hsa.api.hsa_amd_memory_unlock(host))                     # ROCr: unlocking again is a no-op


def test_overlapping_locks_as_rocr_registers_them(hsa):
    """Issue 13.10 / 14.6: the same range locked twice is counted; a different range with the same
    start is a registration of its own, and unlock(start) then finds two and unlocks neither."""
    h = np.zeros(8192, np.uint8)
    a = h.ctypes.data
    whole, again = lock(hsa, a, h.nbytes), lock(hsa, a, h.nbytes)
    assert whole == again
    ok(hsa.api.hsa_amd_memory_unlock(a))
    assert hsa.emu.resolve(0, whole, h.nbytes).size == h.nbytes   # one count left
    head = lock(hsa, a, 16)                                        # h[:16]: same start, other size
    assert head != whole
    ok(hsa.api.hsa_amd_memory_unlock(a))                           # two registrations start at a:
    assert hsa.emu.resolve(0, whole, h.nbytes).size == h.nbytes    # neither is unlocked
    assert hsa.emu.resolve(0, head, 16).size == 16
    tail = lock(hsa, a + 4096, 4096)                               # another start: its own unlock
    ok(hsa.api.hsa_amd_memory_unlock(a + 4096))
    with pytest.raises(MemoryFault):
        hsa.emu.resolve(0, tail, 16)
    assert len(hsa.emu.locked_ranges()) == 2


def test_lock_for_one_agent_only(hsa):
    array = np.zeros(64, np.uint8)
    agents = (T.hsa_agent_t * 1)(hsa.gpus[1])
    out = ctypes.c_void_p()
    ok(hsa.api.hsa_amd_memory_lock(array.ctypes.data, array.nbytes, agents, 1, ctypes.byref(out)))
    assert hsa.emu.resolve(1, out.value, 64).size == 64
    with pytest.raises(MemoryFault, match="other agents"):
        hsa.emu.resolve(0, out.value, 64)
    ok(hsa.api.hsa_amd_memory_unlock(array.ctypes.data))
