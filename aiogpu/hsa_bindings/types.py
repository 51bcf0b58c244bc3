"""Scalar typedefs, handle structs and enumerations of the HSA API, as ROCr's headers define them.

Values come from ``hsa.h`` and ``hsa_ext_amd.h`` (ROCr 5.2.3); the ABI tests compare the struct
layouts against those headers with a C compiler.
"""
from __future__ import annotations

import ctypes
from ctypes import c_int32, c_int64, c_uint32, c_uint64, c_void_p

hsa_status_t = c_int32  # C enums are int-sized
hsa_signal_value_t = c_int64
hsa_signal_condition_t = c_int32
hsa_wait_state_t = c_int32
hsa_queue_type32_t = c_uint32
hsa_agent_info_t = c_int32
hsa_system_info_t = c_int32
hsa_profile_t = c_int32
hsa_default_float_rounding_mode_t = c_int32
hsa_executable_symbol_info_t = c_int32
hsa_amd_memory_pool_info_t = c_int32
hsa_amd_sdma_engine_id_t = c_int32
hsa_amd_queue_priority_t = c_int32
hsa_amd_event_type_t = c_int32


def _handle(name: str) -> type[ctypes.Structure]:
    """HSA's opaque handles are all ``struct { uint64_t handle; }`` passed by value."""
    cls = type(name, (ctypes.Structure,), {"_fields_": [("handle", c_uint64)]})
    cls.__repr__ = lambda self: f"{name}(0x{self.handle:x})"
    return cls


hsa_agent_t = _handle("hsa_agent_t")
hsa_signal_t = _handle("hsa_signal_t")
hsa_amd_memory_pool_t = _handle("hsa_amd_memory_pool_t")
hsa_code_object_reader_t = _handle("hsa_code_object_reader_t")
hsa_executable_t = _handle("hsa_executable_t")
hsa_loaded_code_object_t = _handle("hsa_loaded_code_object_t")
hsa_executable_symbol_t = _handle("hsa_executable_symbol_t")
hsa_region_t = _handle("hsa_region_t")


class hsa_queue_t(ctypes.Structure):
    """``hsa_queue_t`` in the little-endian small-model-agnostic layout of x86-64 (LARGE_MODEL)."""

    _fields_ = [
        ("type", hsa_queue_type32_t),
        ("features", c_uint32),
        ("base_address", c_void_p),
        ("doorbell_signal", hsa_signal_t),
        ("size", c_uint32),
        ("reserved1", c_uint32),
        ("id", c_uint64),
    ]


# ROCr's ``amd_queue_t`` (``amd_hsa_queue.h``) begins with the ``hsa_queue_t`` and keeps the ring's
# 64-bit write and read indices at these byte offsets; the emulator lays its queues out the same way.
AMD_QUEUE_WRITE_DISPATCH_ID_OFFSET = 56
AMD_QUEUE_READ_DISPATCH_ID_OFFSET = 128


class amd_signal_t(ctypes.Structure):
    """ROCr's in-memory signal (``amd_hsa_signal.h``); a signal handle is this struct's address."""

    _fields_ = [
        ("kind", c_int64),
        ("value", c_int64),
        ("event_mailbox_ptr", c_uint64),
        ("event_id", c_uint32),
        ("reserved1", c_uint32),
        ("start_ts", c_uint64),
        ("end_ts", c_uint64),
        ("queue_ptr", c_uint64),
        ("reserved3", c_uint32 * 2),
    ]
    _align_ = 64


class hsa_amd_gpu_memory_fault_info_t(ctypes.Structure):
    _fields_ = [("agent", hsa_agent_t), ("virtual_address", c_uint64), ("fault_reason_mask", c_uint32)]


class _hsa_amd_event_union(ctypes.Union):
    _fields_ = [("memory_fault", hsa_amd_gpu_memory_fault_info_t)]


class hsa_amd_event_t(ctypes.Structure):
    _anonymous_ = ("u",)
    _fields_ = [("event_type", hsa_amd_event_type_t), ("u", _hsa_amd_event_union)]


class hsa_amd_profiling_dispatch_time_t(ctypes.Structure):
    _fields_ = [("start", c_uint64), ("end", c_uint64)]


# Callback types (C function pointers handed to the library).
queue_error_callback_t = ctypes.CFUNCTYPE(None, hsa_status_t, ctypes.POINTER(hsa_queue_t), c_void_p)
agent_iterate_callback_t = ctypes.CFUNCTYPE(hsa_status_t, hsa_agent_t, c_void_p)
pool_iterate_callback_t = ctypes.CFUNCTYPE(hsa_status_t, hsa_amd_memory_pool_t, c_void_p)
system_event_callback_t = ctypes.CFUNCTYPE(hsa_status_t, ctypes.POINTER(hsa_amd_event_t), c_void_p)
# hsa_amd_signal_handler: bool (*)(hsa_signal_value_t value, void *arg); true keeps it registered.
signal_handler_t = ctypes.CFUNCTYPE(ctypes.c_bool, hsa_signal_value_t, c_void_p)

# ---------------------------------------------------------------------------------------------
# hsa_status_t
HSA_STATUS_SUCCESS = 0x0
HSA_STATUS_INFO_BREAK = 0x1
HSA_STATUS_ERROR = 0x1000
HSA_STATUS_ERROR_INVALID_ARGUMENT = 0x1001
HSA_STATUS_ERROR_INVALID_QUEUE_CREATION = 0x1002
HSA_STATUS_ERROR_INVALID_ALLOCATION = 0x1003
HSA_STATUS_ERROR_INVALID_AGENT = 0x1004
HSA_STATUS_ERROR_INVALID_REGION = 0x1005
HSA_STATUS_ERROR_INVALID_SIGNAL = 0x1006
HSA_STATUS_ERROR_INVALID_QUEUE = 0x1007
HSA_STATUS_ERROR_OUT_OF_RESOURCES = 0x1008
HSA_STATUS_ERROR_INVALID_PACKET_FORMAT = 0x1009
HSA_STATUS_ERROR_RESOURCE_FREE = 0x100A
HSA_STATUS_ERROR_NOT_INITIALIZED = 0x100B
HSA_STATUS_ERROR_REFCOUNT_OVERFLOW = 0x100C
HSA_STATUS_ERROR_INCOMPATIBLE_ARGUMENTS = 0x100D
HSA_STATUS_ERROR_INVALID_INDEX = 0x100E
HSA_STATUS_ERROR_INVALID_ISA = 0x100F
HSA_STATUS_ERROR_INVALID_CODE_OBJECT = 0x1010
HSA_STATUS_ERROR_INVALID_EXECUTABLE = 0x1011
HSA_STATUS_ERROR_FROZEN_EXECUTABLE = 0x1012
HSA_STATUS_ERROR_INVALID_SYMBOL_NAME = 0x1013
HSA_STATUS_ERROR_VARIABLE_ALREADY_DEFINED = 0x1014
HSA_STATUS_ERROR_VARIABLE_UNDEFINED = 0x1015
HSA_STATUS_ERROR_EXCEPTION = 0x1016
HSA_STATUS_ERROR_INVALID_ISA_NAME = 0x1017
HSA_STATUS_ERROR_INVALID_CODE_SYMBOL = 0x1018
HSA_STATUS_ERROR_INVALID_EXECUTABLE_SYMBOL = 0x1019
HSA_STATUS_ERROR_INVALID_FILE = 0x1020
HSA_STATUS_ERROR_INVALID_CODE_OBJECT_READER = 0x1021
HSA_STATUS_ERROR_INVALID_CACHE = 0x1022
HSA_STATUS_ERROR_INVALID_WAVEFRONT = 0x1023
HSA_STATUS_ERROR_INVALID_SIGNAL_GROUP = 0x1024
HSA_STATUS_ERROR_INVALID_RUNTIME_STATE = 0x1025
HSA_STATUS_ERROR_FATAL = 0x1026
HSA_STATUS_ERROR_INVALID_MEMORY_POOL = 40
HSA_STATUS_ERROR_MEMORY_APERTURE_VIOLATION = 41
HSA_STATUS_ERROR_ILLEGAL_INSTRUCTION = 42
HSA_STATUS_ERROR_MEMORY_FAULT = 43

STATUS_NAMES = {v: k for k, v in globals().items() if k.startswith("HSA_STATUS_")}

# hsa_system_info_t
HSA_SYSTEM_INFO_VERSION_MAJOR = 0
HSA_SYSTEM_INFO_VERSION_MINOR = 1
HSA_SYSTEM_INFO_TIMESTAMP = 2
HSA_SYSTEM_INFO_TIMESTAMP_FREQUENCY = 3

# hsa_profile_t, rounding modes
HSA_PROFILE_BASE = 0
HSA_PROFILE_FULL = 1
HSA_DEFAULT_FLOAT_ROUNDING_MODE_DEFAULT = 0

# hsa_device_type_t
HSA_DEVICE_TYPE_CPU = 0
HSA_DEVICE_TYPE_GPU = 1
HSA_DEVICE_TYPE_DSP = 2

# hsa_agent_info_t
HSA_AGENT_INFO_NAME = 0
HSA_AGENT_INFO_VENDOR_NAME = 1
HSA_AGENT_INFO_FEATURE = 2
HSA_AGENT_INFO_PROFILE = 4
HSA_AGENT_INFO_WAVEFRONT_SIZE = 6
HSA_AGENT_INFO_WORKGROUP_MAX_DIM = 7
HSA_AGENT_INFO_WORKGROUP_MAX_SIZE = 8
HSA_AGENT_INFO_GRID_MAX_DIM = 9
HSA_AGENT_INFO_GRID_MAX_SIZE = 10
HSA_AGENT_INFO_QUEUES_MAX = 12
HSA_AGENT_INFO_QUEUE_MIN_SIZE = 13
HSA_AGENT_INFO_QUEUE_MAX_SIZE = 14
HSA_AGENT_INFO_QUEUE_TYPE = 15
HSA_AGENT_INFO_NODE = 16
HSA_AGENT_INFO_DEVICE = 17
HSA_AGENT_INFO_ISA = 19
HSA_AMD_AGENT_INFO_COMPUTE_UNIT_COUNT = 0xA002
HSA_AMD_AGENT_INFO_PRODUCT_NAME = 0xA009

# hsa_agent_feature_t
HSA_AGENT_FEATURE_KERNEL_DISPATCH = 1
HSA_AGENT_FEATURE_AGENT_DISPATCH = 2

# hsa_signal_condition_t / hsa_wait_state_t
HSA_SIGNAL_CONDITION_EQ = 0
HSA_SIGNAL_CONDITION_NE = 1
HSA_SIGNAL_CONDITION_LT = 2
HSA_SIGNAL_CONDITION_GTE = 3
HSA_WAIT_STATE_BLOCKED = 0
HSA_WAIT_STATE_ACTIVE = 1
HSA_AMD_SIGNAL_AMD_GPU_ONLY = 1
HSA_AMD_SIGNAL_IPC = 2

# hsa_queue_type_t
HSA_QUEUE_TYPE_MULTI = 0
HSA_QUEUE_TYPE_SINGLE = 1
HSA_AMD_QUEUE_PRIORITY_LOW = 0
HSA_AMD_QUEUE_PRIORITY_NORMAL = 1
HSA_AMD_QUEUE_PRIORITY_HIGH = 2

# hsa_executable_symbol_info_t
HSA_EXECUTABLE_SYMBOL_INFO_KERNEL_KERNARG_SEGMENT_SIZE = 11
HSA_EXECUTABLE_SYMBOL_INFO_KERNEL_KERNARG_SEGMENT_ALIGNMENT = 12
HSA_EXECUTABLE_SYMBOL_INFO_KERNEL_GROUP_SEGMENT_SIZE = 13
HSA_EXECUTABLE_SYMBOL_INFO_KERNEL_PRIVATE_SEGMENT_SIZE = 14
HSA_EXECUTABLE_SYMBOL_INFO_KERNEL_OBJECT = 22

# hsa_amd_segment_t, global flags, pool info
HSA_AMD_SEGMENT_GLOBAL = 0
HSA_AMD_SEGMENT_READONLY = 1
HSA_AMD_SEGMENT_PRIVATE = 2
HSA_AMD_SEGMENT_GROUP = 3
HSA_AMD_MEMORY_POOL_GLOBAL_FLAG_KERNARG_INIT = 1
HSA_AMD_MEMORY_POOL_GLOBAL_FLAG_FINE_GRAINED = 2
HSA_AMD_MEMORY_POOL_GLOBAL_FLAG_COARSE_GRAINED = 4
HSA_AMD_MEMORY_POOL_INFO_SEGMENT = 0
HSA_AMD_MEMORY_POOL_INFO_GLOBAL_FLAGS = 1
HSA_AMD_MEMORY_POOL_INFO_SIZE = 2
HSA_AMD_MEMORY_POOL_INFO_RUNTIME_ALLOC_ALLOWED = 5
HSA_AMD_MEMORY_POOL_INFO_RUNTIME_ALLOC_GRANULE = 6
HSA_AMD_MEMORY_POOL_INFO_RUNTIME_ALLOC_ALIGNMENT = 7
HSA_AMD_MEMORY_POOL_INFO_ACCESSIBLE_BY_ALL = 15
HSA_AMD_MEMORY_POOL_INFO_ALLOC_MAX_SIZE = 16

# hsa_amd_event_type_t and memory fault reasons
HSA_AMD_GPU_MEMORY_FAULT_EVENT = 0
HSA_AMD_MEMORY_FAULT_PAGE_NOT_PRESENT = 1 << 0
HSA_AMD_MEMORY_FAULT_READ_ONLY = 1 << 1

# hsa_amd_sdma_engine_id_t: one bit per engine (ROCr >= 5.7)
HSA_AMD_SDMA_ENGINE_0 = 0x1
MAX_SDMA_ENGINES = 16


def sdma_engine_bits(mask: int) -> list[int]:
    """The engine-id bits set in a ``copy_engine_status`` mask, lowest first."""
    return [1 << i for i in range(MAX_SDMA_ENGINES) if mask & (1 << i)]


def status_name(status: int) -> str:
    return STATUS_NAMES.get(status, f"HSA_STATUS_0x{status:x}")
