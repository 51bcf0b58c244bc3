"""SDMA engines: copies, engine choice, exhaustion, engine status, dependencies, copy-time faults."""
from __future__ import annotations

import ctypes
import time

import numpy as np

from aiogpu.hsa_bindings import types as T

from emu_helpers import ok


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


def test_engine_choice_status_mask_and_bad_engine(hsa):
    g0, cpu = hsa.gpus[0], hsa.cpu
    a, b = hsa.alloc(hsa.system_pool, 4096), hsa.device_alloc(0, 4096)
    mask = ctypes.c_uint32()
    ok(hsa.api.hsa_amd_memory_copy_engine_status(g0, cpu, ctypes.byref(mask)))
    assert mask.value == 0b11
    gate, s = hsa.signal(1), hsa.signal(1)
    ok(copy(hsa, b, g0, a, cpu, 4096, s, deps=[gate]))  # parks on engine 0
    ok(hsa.api.hsa_amd_memory_copy_engine_status(g0, cpu, ctypes.byref(mask)))
    assert mask.value == 0b10
    s2 = hsa.signal(1)
    ok(copy(hsa, b, g0, a, cpu, 4096, s2))  # the free engine: 1
    assert hsa.wait_zero(s2) and hsa.value(s) == 1
    assert len(hsa.emu.engine_history(0)[1]) == 1
    s3 = hsa.signal(1)
    ok(copy(hsa, b, g0, a, cpu, 4096, s3, engine=T.HSA_AMD_SDMA_ENGINE_0 << 1))
    assert hsa.wait_zero(s3) and len(hsa.emu.engine_history(0)[1]) == 2
    for bad in (1 << 2, 0b11, 0):
        assert copy(hsa, b, g0, a, cpu, 4096, s3, engine=bad) == T.HSA_STATUS_ERROR_INVALID_ARGUMENT
    hsa.api.hsa_signal_store_screlease(gate, 0)
    assert hsa.wait_zero(s)
    assert [len(h) for h in hsa.emu.engine_history(0)] == [1, 2]


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


def test_exhausted_or_absent_engines_are_out_of_resources(make_hsa):
    hsa = make_hsa()
    a, b = hsa.alloc(hsa.system_pool, 4096), hsa.device_alloc(0, 4096)
    hsa.host_view(a, 4096)[:] = 1
    s = hsa.signal(1)
    hsa.emu.faults.exhaust_sdma(0)
    assert copy(hsa, b, hsa.gpus[0], a, hsa.cpu, 4096, s) == T.HSA_STATUS_ERROR_OUT_OF_RESOURCES
    assert copy(hsa, b, hsa.gpus[0], a, hsa.cpu, 4096, s, engine=1) == T.HSA_STATUS_ERROR_OUT_OF_RESOURCES
    mask = ctypes.c_uint32(99)
    ok(hsa.api.hsa_amd_memory_copy_engine_status(hsa.gpus[0], hsa.cpu, ctypes.byref(mask)))
    assert mask.value == 0
    time.sleep(0.01)
    assert hsa.value(s) == 1 and (hsa.host_view(b, 4096) == 0).all()  # nothing was done
    assert any(f.kind == "sdma_exhausted" for f in hsa.emu.faults.fired)
    other = hsa.device_alloc(1, 4096)  # GPU 1 is not exhausted
    ok(copy(hsa, other, hsa.gpus[1], a, hsa.cpu, 4096, s))
    assert hsa.wait_zero(s)
    hsa.emu.faults.restore_sdma(0)
    s2 = hsa.signal(1)
    ok(copy(hsa, b, hsa.gpus[0], a, hsa.cpu, 4096, s2))
    assert hsa.wait_zero(s2)

    none = make_hsa(sdma_engines=0)
    a, b = none.alloc(none.system_pool, 4096), none.device_alloc(0, 4096)
    assert copy(none, b, none.gpus[0], a, none.cpu, 4096, none.signal(1)) == T.HSA_STATUS_ERROR_OUT_OF_RESOURCES


def test_fault_at_copy_time_is_an_event_and_leaves_the_signal(hsa):
    events = []

    @T.system_event_callback_t
    def handler(event, _data):
        e = event.contents
        events.append((e.event_type, e.memory_fault.agent.handle, e.memory_fault.virtual_address))
        return T.HSA_STATUS_SUCCESS

    ok(hsa.api.hsa_amd_register_system_event_handler(handler, None))
    a, b = hsa.alloc(hsa.system_pool, 4096), hsa.device_alloc(0, 4096)
    gate, s = hsa.signal(1), hsa.signal(1)
    ok(copy(hsa, b, hsa.gpus[0], a, hsa.cpu, 4096, s, deps=[gate]))
    hsa.free(b)  # freed while the copy waits: use after free at copy time
    hsa.api.hsa_signal_store_screlease(gate, 0)
    deadline = time.monotonic() + 5
    while not events and time.monotonic() < deadline:
        time.sleep(0.002)
    assert events == [(T.HSA_AMD_GPU_MEMORY_FAULT_EVENT, hsa.gpus[0].handle, b)]
    assert hsa.wait_zero(s)   # the aborted copy retires after its fault was reported
    assert "use after free" in hsa.emu.memory_faults[0].reason
    assert hsa.emu.engine_history(0)[0][0].outcome == "fault"
