"""SDMA engines: copies, engine choice, exhaustion, engine status, dependencies, copy-time faults."""
from __future__ import annotations

import ctypes
import time

import numpy as np
import pytest

from aiogpu.hsa_bindings import types as T

from emu_helpers import ok


@pytest.fixture
def make_hsa(make_hsa):
    """ROCm 5.7's emulator: these tests call the engine functions, which 5.2.3 lacks."""
    return lambda **options: make_hsa(**{"rocr_version": "5.7", **options})


def copy(hsa, dst, dst_agent, src, src_agent, size, signal, deps=(), engine=None):
    dep_array = (T.hsa_signal_t * len(deps))(*deps) if deps else None
    if engine is None:
        return hsa.api.hsa_amd_memory_async_copy(dst, dst_agent, src, src_agent, size, len(deps), dep_array, signal)
    return hsa.api.hsa_amd_memory_async_copy_on_engine(dst, dst_agent, src, src_agent, size, len(deps), dep_array,
                                                       signal, engine, False)


def test_host_to_device_to_peer_to_host(hsa):
    n = 1 << 16
    src = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    out = np.zeros_like(src)
    hsrc, hout = hsa.lock(src), hsa.lock(out)
    d0, d1 = hsa.device_alloc(0, src.nbytes), hsa.device_alloc(1, src.nbytes)
    hsa.allow(d1, 0)  # the peer copy runs on GPU 0's engine and writes GPU 1's memory
    g0, g1, cpu = hsa.gpus[0], hsa.gpus[1], hsa.cpu
    s1, s2, s3 = hsa.signal(1), hsa.signal(1), hsa.signal(1)
    ok(copy(hsa, d0, g0, hsrc, cpu, src.nbytes, s1))
    ok(copy(hsa, d1, g1, d0, g0, src.nbytes, s2, deps=[s1]))
    ok(copy(hsa, hout, cpu, d1, g1, src.nbytes, s3, deps=[s2]))
    assert hsa.wait_zero(s3)
    assert np.array_equal(out, src)
    names = [(r.agent, r.name) for r in hsa.emu.timeline.records(kind="copy")]
    assert names == [(0, "H2D"), (0, "P2P"), (1, "D2H")]
    history = hsa.emu.engine_history(0)
    assert sum(len(h) for h in history) == 2 and all(r.outcome == "done" for h in history for r in h)
    ok(hsa.api.hsa_amd_memory_unlock(src.ctypes.data))
    ok(hsa.api.hsa_amd_memory_unlock(out.ctypes.data))


def test_unreachable_memory_is_rejected_at_submission(hsa):
    array = np.zeros(64, np.uint8)  # not locked
    dev0, dev1 = hsa.device_alloc(0, 64), hsa.device_alloc(1, 64)
    s = hsa.signal(1)
    assert copy(hsa, dev0, hsa.gpus[0], array.ctypes.data, hsa.cpu, 64, s) == T.HSA_STATUS_ERROR_INVALID_ARGUMENT
    # GPU 0's engine may not write GPU 1's memory before allow_access
    assert copy(hsa, dev1, hsa.gpus[1], dev0, hsa.gpus[0], 64, s) == T.HSA_STATUS_ERROR_INVALID_ARGUMENT
    assert copy(hsa, dev0, hsa.gpus[0], dev0, hsa.gpus[0], 64, T.hsa_signal_t(0)) == T.HSA_STATUS_ERROR_INVALID_SIGNAL
    assert hsa.value(s) == 1


def status(hsa, dst_agent, src_agent):
    mask = ctypes.c_uint32(99)
    got = hsa.api.hsa_amd_memory_copy_engine_status(dst_agent, src_agent, ctypes.byref(mask))
    return got, mask.value


E0, E1, E2, E3 = (T.HSA_AMD_SDMA_ENGINE_0 << i for i in range(4))


def test_engine_status_depends_on_the_direction(make_hsa):
    """ROCr: Runtime::CopyMemoryStatus, GpuAgent::DmaCopyStatus on gfx90a."""
    hsa = make_hsa()
    g0, g1, cpu = hsa.gpus[0], hsa.gpus[1], hsa.cpu
    assert status(hsa, g0, g0)[0] == T.HSA_STATUS_ERROR_INVALID_AGENT
    assert status(hsa, g0, cpu) == (0, E0 | E1)       # host-to-device: both PCIe engines
    assert status(hsa, cpu, g0) == (0, E1)            # device-to-host: gfx90a keeps SDMA0 for H2D
    assert status(hsa, g1, g0) == (0, E1)             # PCIe peer: likewise
    xgmi = make_hsa(xgmi_engines=2)
    g0, g1, cpu = xgmi.gpus[0], xgmi.gpus[1], xgmi.cpu
    assert status(xgmi, g1, g0) == (0, E2 | E3)       # xGMI peer: xGMI engines only
    assert status(xgmi, g0, cpu) == (0, E0 | E1 | E2 | E3)
    assert status(xgmi, cpu, g0) == (0, E1 | E2 | E3)
    single = make_hsa(sdma_engines=1)
    assert status(single, single.cpu, single.gpus[0]) == (0, E0)  # the D2H blit reports ENGINE_0


def test_copy_on_an_engine_that_cannot_serve_the_direction_is_invalid(make_hsa):
    """ROCr: Runtime::CopyMemoryOnEngine, GpuAgent::DmaCopyOnEngine."""
    hsa = make_hsa()
    g0, g1, cpu = hsa.gpus[0], hsa.gpus[1], hsa.cpu
    host, d0, d1 = hsa.alloc(hsa.system_pool, 4096), hsa.device_alloc(0, 4096), hsa.device_alloc(1, 4096)
    hsa.allow(d1, 0)
    s = hsa.signal(3)
    invalid = T.HSA_STATUS_ERROR_INVALID_ARGUMENT
    assert copy(hsa, host, cpu, d0, g0, 4096, s, engine=E0) == invalid   # D2H on SDMA0 (gfx90a)
    assert copy(hsa, d1, g1, d0, g0, 4096, s, engine=E0) == invalid      # peer on SDMA0 (gfx90a)
    for bad in (0, E0 | E1, E2):                                          # not one bit / no such engine
        assert copy(hsa, d0, g0, host, cpu, 4096, s, engine=bad) == invalid
    ok(copy(hsa, d0, g0, host, cpu, 4096, s, engine=E0))
    ok(copy(hsa, host, cpu, d0, g0, 4096, s, engine=E1))
    ok(copy(hsa, d1, g1, d0, g0, 4096, s, engine=E1))
    assert hsa.wait_zero(s)
    xgmi = make_hsa(xgmi_engines=1)
    a, b = xgmi.device_alloc(0, 4096), xgmi.device_alloc(1, 4096)
    xgmi.allow(b, 0)
    s = xgmi.signal(1)
    assert copy(xgmi, b, xgmi.gpus[1], a, xgmi.gpus[0], 4096, s, engine=E1) == invalid  # xGMI on PCIe
    ok(copy(xgmi, b, xgmi.gpus[1], a, xgmi.gpus[0], 4096, s, engine=E2))
    assert xgmi.wait_zero(s)


def test_copy_within_one_gpu_uses_the_blit_kernel_unless_forced(hsa):
    a, b = hsa.device_alloc(0, 4096), hsa.device_alloc(0, 4096)
    s = hsa.signal(3)
    ok(copy(hsa, b, hsa.gpus[0], a, hsa.gpus[0], 4096, s))
    ok(copy(hsa, b, hsa.gpus[0], a, hsa.gpus[0], 4096, s, engine=E1))
    ok(hsa.api.hsa_amd_memory_async_copy_on_engine(b, hsa.gpus[0], a, hsa.gpus[0], 4096, 0, None, s, E1, True))
    assert hsa.wait_zero(s)
    kinds = sorted(r.kind for r in hsa.emu.timeline.records(agent=0))
    assert kinds == ["blit", "blit", "copy"]


def test_busy_engines_are_not_free_and_no_free_engine_is_out_of_resources(hsa):
    g0, cpu = hsa.gpus[0], hsa.cpu
    a, b = hsa.alloc(hsa.system_pool, 4096), hsa.device_alloc(0, 4096)
    gate, s = hsa.signal(1), hsa.signal(2)
    ok(copy(hsa, b, g0, a, cpu, 4096, s, deps=[gate], engine=E0))   # parks on the H2D engine
    assert status(hsa, g0, cpu) == (0, E1)
    ok(copy(hsa, a, cpu, b, g0, 4096, s, deps=[gate], engine=E1))   # parks on the D2H engine
    assert status(hsa, g0, cpu) == (T.HSA_STATUS_ERROR_OUT_OF_RESOURCES, 0)
    hsa.api.hsa_signal_store_screlease(gate, 0)
    assert hsa.wait_zero(s)
    deadline = time.monotonic() + 2
    while status(hsa, g0, cpu)[1] != E0 | E1 and time.monotonic() < deadline:
        time.sleep(0.002)
    assert status(hsa, g0, cpu) == (0, E0 | E1)   # real SDMA queues are free again once idle


def test_dependencies_hold_the_copy_back(hsa):
    a, b = hsa.alloc(hsa.system_pool, 4096), hsa.device_alloc(1, 4096)
    hsa.host_view(a, 4096)[:] = 5
    d1, d2, s = hsa.signal(1), hsa.signal(2), hsa.signal(1)
    ok(copy(hsa, b, hsa.gpus[1], a, hsa.cpu, 4096, s, deps=[d1, d2]))
    hsa.api.hsa_signal_store_relaxed(d1, 0)
    hsa.api.hsa_signal_subtract_relaxed(d2, 1)
    time.sleep(0.02)
    assert hsa.value(s) == 1 and (hsa.host_view(b, 4096) == 0).all()
    hsa.api.hsa_signal_subtract_relaxed(d2, 1)
    assert hsa.wait_zero(s) and (hsa.host_view(b, 4096) == 5).all()


def test_exhausted_sdma_falls_back_to_a_blit_kernel_inside_the_copy_call(make_hsa):
    """ROCr (GpuAgent::InitDma's blit_lambda): an SDMA queue that cannot be created at first use
    becomes a blit kernel and the copy succeeds; only engine status tells: once used, that engine
    is never reported free again."""
    hsa = make_hsa()
    g0, cpu = hsa.gpus[0], hsa.cpu
    a, b = hsa.alloc(hsa.system_pool, 4096), hsa.device_alloc(0, 4096)
    s = hsa.signal(1)
    ok(copy(hsa, a, cpu, b, g0, 4096, s, engine=E1))     # the D2H engine is created as SDMA
    assert hsa.wait_zero(s)
    hsa.host_view(a, 4096)[:] = 1
    hsa.emu.faults.exhaust_sdma(0)
    assert status(hsa, g0, cpu) == (0, E0 | E1)          # never used: reported free regardless
    s = hsa.signal(2)
    ok(copy(hsa, b, g0, a, cpu, 4096, s, engine=E0))     # success: a blit kernel does it
    ok(copy(hsa, b, g0, a, cpu, 4096, s))
    assert hsa.wait_zero(s) and (hsa.host_view(b, 4096) == 1).all()
    assert [f.kind for f in hsa.emu.faults.fired] == ["sdma_exhausted"]
    assert sorted(r.kind for r in hsa.emu.timeline.records(agent=0)) == ["blit", "blit", "copy"]
    hsa.emu.faults.restore_sdma(0)                       # ROCr never recreates the blit
    assert status(hsa, g0, cpu) == (0, E1)               # the kernel-backed H2D blit is never free
    disabled = make_hsa(sdma_engines=0)                  # HSA_ENABLE_SDMA=0: every blit is a kernel
    a, b = disabled.alloc(disabled.system_pool, 64), disabled.device_alloc(0, 64)
    s = disabled.signal(2)
    ok(copy(disabled, b, disabled.gpus[0], a, disabled.cpu, 64, s, engine=E0))  # runs on the D2D kernel
    assert status(disabled, disabled.gpus[0], disabled.cpu) == (0, E0 | E1)
    ok(copy(disabled, b, disabled.gpus[0], a, disabled.cpu, 64, s))              # creates the H2D blit
    assert disabled.wait_zero(s)
    assert status(disabled, disabled.gpus[0], disabled.cpu) == (0, E1)
    assert {r.kind for r in disabled.emu.timeline} == {"blit"}


def test_fault_at_copy_time_evicts_the_engines_and_never_completes(hsa):
    """An SDMA fault is a GPU memory fault: the device's queues, SDMA ones included, are evicted
    (the aborted copy and everything queued behind it never complete) and the system event
    handlers are told."""
    events = []

    @T.system_event_callback_t
    def handler(event, _data):
        e = event.contents
        events.append((e.event_type, e.memory_fault.agent.handle, e.memory_fault.virtual_address))
        return T.HSA_STATUS_SUCCESS

    ok(hsa.api.hsa_amd_register_system_event_handler(handler, None))
    a, b = hsa.alloc(hsa.system_pool, 4096), hsa.device_alloc(0, 4096)
    gate, s, behind = hsa.signal(1), hsa.signal(1), hsa.signal(1)
    ok(copy(hsa, b, hsa.gpus[0], a, hsa.cpu, 4096, s, deps=[gate], engine=E0))
    ok(copy(hsa, b + 64, hsa.gpus[0], a, hsa.cpu, 64, behind, engine=E0))
    hsa.free(b)  # freed while the copy waits: use after free at copy time
    hsa.api.hsa_signal_store_screlease(gate, 0)
    deadline = time.monotonic() + 5
    while not events and time.monotonic() < deadline:
        time.sleep(0.002)
    assert events == [(T.HSA_AMD_GPU_MEMORY_FAULT_EVENT, hsa.gpus[0].handle, b)]
    time.sleep(0.03)
    assert hsa.value(s) == 1 and hsa.value(behind) == 1   # evicted: never completes
    assert "use after free" in hsa.emu.memory_faults[0].reason
    assert hsa.emu.engine_history(0)[0][0].outcome == "fault"
    other = hsa.device_alloc(1, 64)                        # GPU 1's engines are not affected
    s1 = hsa.signal(1)
    ok(copy(hsa, other, hsa.gpus[1], a, hsa.cpu, 64, s1))
    assert hsa.wait_zero(s1)
