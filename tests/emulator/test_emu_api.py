"""Agents, pools, system information, status strings, and the never-raise guard."""
from __future__ import annotations

import ctypes

import pytest

from aiogpu.hsa_bindings import types as T
from aiogpu.hsa_bindings.loader import make_emulator

from emu_helpers import ok


def test_agents_cpu_first_then_gpus(hsa):
    kinds, names, products = [], [], []
    for agent in hsa.agents:
        kind, name, product = ctypes.c_int32(), ctypes.create_string_buffer(64), ctypes.create_string_buffer(64)
        ok(hsa.api.hsa_agent_get_info(agent, T.HSA_AGENT_INFO_DEVICE, ctypes.byref(kind)))
        ok(hsa.api.hsa_agent_get_info(agent, T.HSA_AGENT_INFO_NAME, name))
        ok(hsa.api.hsa_agent_get_info(agent, T.HSA_AMD_AGENT_INFO_PRODUCT_NAME, product))
        kinds.append(kind.value)
        names.append(name.value)
        products.append(product.value)
    assert kinds == [T.HSA_DEVICE_TYPE_CPU, T.HSA_DEVICE_TYPE_GPU, T.HSA_DEVICE_TYPE_GPU]
    assert names[1:] == [b"gfx90a", b"gfx90a"]
    assert products[1:] == [b"aiogpu emulated GPU 0", b"aiogpu emulated GPU 1"]


def test_iterate_agents_honours_info_break(hsa):
    seen = []

    @T.agent_iterate_callback_t
    def first_gpu(agent, _data):
        seen.append(agent.handle)
        return T.HSA_STATUS_INFO_BREAK if len(seen) == 2 else T.HSA_STATUS_SUCCESS

    assert hsa.api.hsa_iterate_agents(first_gpu, None) == T.HSA_STATUS_INFO_BREAK
    assert seen == [hsa.cpu.handle, hsa.gpus[0].handle]


def test_gpu_agent_info_values(make_hsa):
    h = make_hsa(compute_units=3, emulator_min_queue_size=8)
    gpu, api = h.gpus[0], h.api

    def get(attr, ctype):
        v = ctype()
        ok(api.hsa_agent_get_info(gpu, attr, ctypes.byref(v)))
        return v.value if hasattr(v, "value") else list(v)

    assert get(T.HSA_AGENT_INFO_WAVEFRONT_SIZE, ctypes.c_uint32) == 64
    assert get(T.HSA_AGENT_INFO_WORKGROUP_MAX_SIZE, ctypes.c_uint32) == 1024
    assert get(T.HSA_AGENT_INFO_WORKGROUP_MAX_DIM, ctypes.c_uint16 * 3) == [1024] * 3
    assert get(T.HSA_AGENT_INFO_GRID_MAX_DIM, ctypes.c_uint32 * 3) == [0xFFFFFFFF] * 3
    assert get(T.HSA_AGENT_INFO_QUEUE_MIN_SIZE, ctypes.c_uint32) == 8
    assert get(T.HSA_AGENT_INFO_QUEUE_MAX_SIZE, ctypes.c_uint32) == 131072
    assert get(T.HSA_AMD_AGENT_INFO_COMPUTE_UNIT_COUNT, ctypes.c_uint32) == 3
    assert get(T.HSA_AGENT_INFO_FEATURE, ctypes.c_int32) == T.HSA_AGENT_FEATURE_KERNEL_DISPATCH
    assert get(T.HSA_AGENT_INFO_NODE, ctypes.c_uint32) == 1
    vendor = ctypes.create_string_buffer(64)
    ok(api.hsa_agent_get_info(gpu, T.HSA_AGENT_INFO_VENDOR_NAME, vendor))
    assert vendor.value == b"AMD"
    assert api.hsa_agent_get_info(gpu, 0x7777, ctypes.byref(ctypes.c_uint64())) == T.HSA_STATUS_ERROR_INVALID_ARGUMENT
    assert api.hsa_agent_get_info(T.hsa_agent_t(12345), T.HSA_AGENT_INFO_NODE,
                                  ctypes.byref(ctypes.c_uint32())) == T.HSA_STATUS_ERROR_INVALID_AGENT


def test_memory_pools_and_their_info(hsa):
    api = hsa.api

    def info(pool, attr, ctype):
        v = ctype()
        ok(api.hsa_amd_memory_pool_get_info(pool, attr, ctypes.byref(v)))
        return v.value

    flags = T.HSA_AMD_MEMORY_POOL_INFO_GLOBAL_FLAGS
    fine, kernarg = T.HSA_AMD_MEMORY_POOL_GLOBAL_FLAG_FINE_GRAINED, T.HSA_AMD_MEMORY_POOL_GLOBAL_FLAG_KERNARG_INIT
    assert info(hsa.kernarg_pool, flags, ctypes.c_uint32) == fine | kernarg
    assert info(hsa.system_pool, flags, ctypes.c_uint32) == fine
    device = hsa.device_pools[0]
    assert info(device, flags, ctypes.c_uint32) == T.HSA_AMD_MEMORY_POOL_GLOBAL_FLAG_COARSE_GRAINED
    assert info(device, T.HSA_AMD_MEMORY_POOL_INFO_SEGMENT, ctypes.c_int32) == T.HSA_AMD_SEGMENT_GLOBAL
    assert info(device, T.HSA_AMD_MEMORY_POOL_INFO_RUNTIME_ALLOC_ALLOWED, ctypes.c_bool) is True
    assert info(device, T.HSA_AMD_MEMORY_POOL_INFO_RUNTIME_ALLOC_GRANULE, ctypes.c_size_t) == 4096
    assert info(device, T.HSA_AMD_MEMORY_POOL_INFO_RUNTIME_ALLOC_ALIGNMENT, ctypes.c_size_t) == 4096
    assert info(device, T.HSA_AMD_MEMORY_POOL_INFO_ACCESSIBLE_BY_ALL, ctypes.c_bool) is False
    assert info(hsa.system_pool, T.HSA_AMD_MEMORY_POOL_INFO_ACCESSIBLE_BY_ALL, ctypes.c_bool) is True
    size = info(device, T.HSA_AMD_MEMORY_POOL_INFO_SIZE, ctypes.c_size_t)
    assert size > 0 and info(device, T.HSA_AMD_MEMORY_POOL_INFO_ALLOC_MAX_SIZE, ctypes.c_size_t) == size


def test_system_info_and_status_string(hsa):
    api = hsa.api
    major, freq, ts = ctypes.c_uint16(), ctypes.c_uint64(), ctypes.c_uint64()
    ok(api.hsa_system_get_info(T.HSA_SYSTEM_INFO_VERSION_MAJOR, ctypes.byref(major)))
    ok(api.hsa_system_get_info(T.HSA_SYSTEM_INFO_TIMESTAMP_FREQUENCY, ctypes.byref(freq)))
    ok(api.hsa_system_get_info(T.HSA_SYSTEM_INFO_TIMESTAMP, ctypes.byref(ts)))
    assert (major.value, freq.value) == (1, 1_000_000_000) and ts.value > 0
    text = ctypes.c_char_p()
    ok(api.hsa_status_string(T.HSA_STATUS_ERROR_INVALID_ARGUMENT, ctypes.byref(text)))
    assert text.value.startswith(b"HSA_STATUS_ERROR_INVALID_ARGUMENT")
    assert api.hsa_status_string(0x7FFF, ctypes.byref(text)) == T.HSA_STATUS_ERROR_INVALID_ARGUMENT


def test_errors_never_escape_into_ctypes(hsa):
    api, emu = hsa.api, hsa.emu
    bogus = T.hsa_signal_t(0xDEAD0)
    assert api.hsa_signal_destroy(bogus) == T.HSA_STATUS_ERROR_INVALID_SIGNAL
    assert api.hsa_signal_load_relaxed(bogus) == 0  # void/value functions: recorded instead
    api.hsa_signal_store_screlease(bogus, 3)
    assert [e.function for e in emu.api_errors] == ["hsa_signal_load_relaxed", "hsa_signal_store_screlease"]
    emu.api_errors.clear()

    # An unexpected exception inside a guarded call (here: a wrong argument type, called directly)
    # becomes HSA_STATUS_ERROR and is recorded.
    assert emu.hsa_agent_get_info(object(), T.HSA_AGENT_INFO_NODE, 0) == T.HSA_STATUS_ERROR
    assert isinstance(emu.api_errors[-1].error, AttributeError)
    emu.api_errors.clear()


def test_not_initialised_and_refcounted_init():
    api = make_emulator("test", gpus=1)
    ok(api.hsa_init())  # second reference
    ok(api.hsa_shut_down())
    assert api.emulator.initialized
    ok(api.hsa_shut_down())
    assert not api.emulator.initialized
    s = T.hsa_signal_t()
    assert api.hsa_signal_create(1, 0, None, ctypes.byref(s)) == T.HSA_STATUS_ERROR_NOT_INITIALIZED
    assert api.hsa_shut_down() == T.HSA_STATUS_ERROR_NOT_INITIALIZED


@pytest.mark.parametrize("size,status", [
    (0, T.HSA_STATUS_ERROR_INVALID_ARGUMENT), (2, T.HSA_STATUS_ERROR_INVALID_ARGUMENT),
    (4, T.HSA_STATUS_ERROR_INVALID_ARGUMENT), (32, T.HSA_STATUS_ERROR_INVALID_ARGUMENT),
    (96, T.HSA_STATUS_ERROR_INVALID_ARGUMENT), (262144, T.HSA_STATUS_ERROR_OUT_OF_RESOURCES)])
def test_queue_create_rejects_sizes_as_rocr_does(hsa, size, status):
    """ROCr (GpuAgent::QueueCreate): not a power of two or below 64 packets is INVALID_ARGUMENT,
    above 0x20000 OUT_OF_RESOURCES; the agent reports those limits."""
    q = ctypes.POINTER(T.hsa_queue_t)()
    got = hsa.api.hsa_queue_create(hsa.gpus[0], size, T.HSA_QUEUE_TYPE_MULTI, T.queue_error_callback_t(), None,
                                   0, 0, ctypes.byref(q))
    assert got == status
    limit = ctypes.c_uint32()
    ok(hsa.api.hsa_agent_get_info(hsa.gpus[0], T.HSA_AGENT_INFO_QUEUE_MIN_SIZE, ctypes.byref(limit)))
    assert limit.value == 64


def test_tiny_rings_need_the_emulator_only_option(make_hsa):
    h = make_hsa(emulator_min_queue_size=4)
    assert h.queue(0, size=4).size == 4
    with pytest.raises(ValueError):
        make_hsa(emulator_min_queue_size=3)


def test_queue_create_on_cpu_agent_fails(hsa):
    q = ctypes.POINTER(T.hsa_queue_t)()
    status = hsa.api.hsa_queue_create(hsa.cpu, 64, T.HSA_QUEUE_TYPE_MULTI, T.queue_error_callback_t(), None,
                                      0, 0, ctypes.byref(q))
    assert status == T.HSA_STATUS_ERROR_INVALID_QUEUE_CREATION


def test_queue_layout_is_amd_queue_t(hsa):
    from aiogpu.hsa_bindings import packets
    q = hsa.queue(0, size=64)
    base = ctypes.cast(q.ptr, ctypes.c_void_p).value
    assert q.size == 64 and q.base % 4096 == 0
    assert all(ctypes.c_uint16.from_address(q.slot(i)).value == packets.INVALID_HEADER for i in range(64))
    ok(hsa.api.hsa_amd_queue_set_priority(q.ptr, T.HSA_AMD_QUEUE_PRIORITY_NORMAL))
    # write index at offset 56, read index at offset 128 (amd_hsa_queue.h)
    assert hsa.api.hsa_queue_add_write_index_scacq_screl(q.ptr, 3) == 0
    assert ctypes.c_uint64.from_address(base + 56).value == 3
    assert hsa.api.hsa_queue_cas_write_index_scacq_screl(q.ptr, 2, 9) == 3  # fails, returns observed
    assert hsa.api.hsa_queue_cas_write_index_scacq_screl(q.ptr, 3, 5) == 3
    assert hsa.api.hsa_queue_load_write_index_relaxed(q.ptr) == 5
    hsa.api.hsa_queue_store_write_index_screlease(q.ptr, 0)
    assert q.write_index() == 0
    assert ctypes.c_uint64.from_address(base + 128).value == q.read_index() == 0
