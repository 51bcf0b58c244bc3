"""Agents and system information: one CPU agent, then the emulated GPU agents.

``hsa_iterate_agents`` visits them in that order (as ROCr lists the CPU node first). GPU agents
report an MI200-like shape (``gfx90a``, wavefront 64, workgroups of at most 1024 work-items) and
the queue size limits the emulator enforces. Attribute values are written with the C types of
``hsa.h`` / ``hsa_ext_amd.h`` into the caller's buffer.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Callable

from .. import types as T
from ._abi import StatusError, new_handle, now_ns, require, store, store_array, store_chars

QUEUE_MAX_SIZE = 131072  # ROCr: GpuAgent::maxAqlSize_ (0x20000 packets)
QUEUE_MIN_SIZE = 64  # ROCr: GpuAgent::minAqlSize_ (0x40 packets, 4 KiB)
QUEUES_MAX = 128
WORKGROUP_MAX_SIZE = 1024
GRID_MAX = 0xFFFFFFFF
GPU_NAME = "gfx90a"
VERSION_MINOR = 1


@dataclass(eq=False)
class Agent:
    handle: int
    gpu: int | None  # GPU index; None for the CPU agent
    node: int
    compute_units: int

    @property
    def is_gpu(self) -> bool:
        return self.gpu is not None

    @property
    def name(self) -> str:
        return GPU_NAME if self.is_gpu else "aiogpu-emulated-cpu"

    @property
    def product_name(self) -> str:
        return f"aiogpu emulated GPU {self.gpu}" if self.is_gpu else "aiogpu emulated CPU"

    def describe(self) -> str:
        return f"GPU {self.gpu}" if self.is_gpu else "CPU"


class AgentTable:
    """The agents of one emulator, in hsa_iterate_agents order."""

    def __init__(self, gpus: int, compute_units: int) -> None:
        cpu = Agent(new_handle(), None, 0, 1)
        self.gpus = [Agent(new_handle(), i, i + 1, compute_units) for i in range(gpus)]
        self.cpu = cpu
        self.all = [cpu, *self.gpus]
        self._by_handle = {a.handle: a for a in self.all}

    def get(self, handle: int) -> Agent:
        agent = self._by_handle.get(handle)
        require(agent is not None, T.HSA_STATUS_ERROR_INVALID_AGENT, f"unknown agent 0x{handle:x}")
        return agent

    def gpu(self, handle: int) -> Agent:
        agent = self.get(handle)
        require(agent.is_gpu, T.HSA_STATUS_ERROR_INVALID_AGENT, "not a GPU agent")
        return agent

    def iterate(self, callback: Callable[[T.hsa_agent_t, Any], int], data: Any) -> int:
        """Call ``callback`` per agent; a non-SUCCESS status (INFO_BREAK included) stops and is returned."""
        require(callback, T.HSA_STATUS_ERROR_INVALID_ARGUMENT, "NULL callback")
        for agent in self.all:
            status = callback(T.hsa_agent_t(agent.handle), data)
            if status != T.HSA_STATUS_SUCCESS:
                return status
        return T.HSA_STATUS_SUCCESS


def agent_info(agent: Agent, attribute: int, address: int, min_queue_size: int) -> None:
    """``hsa_agent_get_info`` for the attributes aiogpu reads."""
    gpu = agent.is_gpu
    scalars: dict[int, tuple[Any, int]] = {
        T.HSA_AGENT_INFO_FEATURE: (ctypes.c_int32, T.HSA_AGENT_FEATURE_KERNEL_DISPATCH if gpu
                                   else T.HSA_AGENT_FEATURE_AGENT_DISPATCH),
        T.HSA_AGENT_INFO_PROFILE: (ctypes.c_int32, T.HSA_PROFILE_BASE if gpu else T.HSA_PROFILE_FULL),
        T.HSA_AGENT_INFO_WAVEFRONT_SIZE: (ctypes.c_uint32, 64 if gpu else 0),
        T.HSA_AGENT_INFO_WORKGROUP_MAX_SIZE: (ctypes.c_uint32, WORKGROUP_MAX_SIZE if gpu else 0),
        T.HSA_AGENT_INFO_GRID_MAX_SIZE: (ctypes.c_uint32, GRID_MAX if gpu else 0),
        T.HSA_AGENT_INFO_QUEUES_MAX: (ctypes.c_uint32, QUEUES_MAX if gpu else 0),
        T.HSA_AGENT_INFO_QUEUE_MIN_SIZE: (ctypes.c_uint32, min_queue_size if gpu else 0),
        T.HSA_AGENT_INFO_QUEUE_MAX_SIZE: (ctypes.c_uint32, QUEUE_MAX_SIZE if gpu else 0),
        T.HSA_AGENT_INFO_QUEUE_TYPE: (ctypes.c_uint32, T.HSA_QUEUE_TYPE_MULTI),
        T.HSA_AGENT_INFO_NODE: (ctypes.c_uint32, agent.node),
        T.HSA_AGENT_INFO_DEVICE: (ctypes.c_int32, T.HSA_DEVICE_TYPE_GPU if gpu else T.HSA_DEVICE_TYPE_CPU),
        T.HSA_AMD_AGENT_INFO_COMPUTE_UNIT_COUNT: (ctypes.c_uint32, agent.compute_units),
    }
    if attribute in scalars:
        ctype, value = scalars[attribute]
        store(address, ctype, value)
    elif attribute == T.HSA_AGENT_INFO_NAME:
        store_chars(address, agent.name)
    elif attribute == T.HSA_AGENT_INFO_VENDOR_NAME:
        store_chars(address, "AMD" if gpu else "CPU")
    elif attribute == T.HSA_AMD_AGENT_INFO_PRODUCT_NAME:
        store_chars(address, agent.product_name)
    elif attribute == T.HSA_AGENT_INFO_WORKGROUP_MAX_DIM:
        store_array(address, ctypes.c_uint16, [WORKGROUP_MAX_SIZE if gpu else 0] * 3)
    elif attribute == T.HSA_AGENT_INFO_GRID_MAX_DIM:
        store_array(address, ctypes.c_uint32, [GRID_MAX if gpu else 0] * 3)
    else:
        raise StatusError(T.HSA_STATUS_ERROR_INVALID_ARGUMENT, f"agent attribute 0x{attribute:x}")


HSA_SYSTEM_INFO_SIGNAL_MAX_WAIT = 4
HSA_SYSTEM_INFO_ENDIANNESS = 5
HSA_SYSTEM_INFO_MACHINE_MODEL = 6


def system_info(attribute: int, address: int) -> None:
    """``hsa_system_get_info``: version 1.1, timestamps in ns (frequency 1e9)."""
    values: dict[int, tuple[Any, int]] = {
        T.HSA_SYSTEM_INFO_VERSION_MAJOR: (ctypes.c_uint16, 1),
        T.HSA_SYSTEM_INFO_VERSION_MINOR: (ctypes.c_uint16, VERSION_MINOR),
        T.HSA_SYSTEM_INFO_TIMESTAMP: (ctypes.c_uint64, now_ns()),
        T.HSA_SYSTEM_INFO_TIMESTAMP_FREQUENCY: (ctypes.c_uint64, 1_000_000_000),
        HSA_SYSTEM_INFO_SIGNAL_MAX_WAIT: (ctypes.c_uint64, (1 << 64) - 1),
        HSA_SYSTEM_INFO_ENDIANNESS: (ctypes.c_int32, 0),  # HSA_ENDIANNESS_LITTLE
        HSA_SYSTEM_INFO_MACHINE_MODEL: (ctypes.c_int32, 1),  # HSA_MACHINE_MODEL_LARGE
    }
    require(attribute in values, T.HSA_STATUS_ERROR_INVALID_ARGUMENT, f"system attribute {attribute}")
    ctype, value = values[attribute]
    store(address, ctype, value)


_DESCRIPTIONS = {
    T.HSA_STATUS_SUCCESS: "The function has been executed successfully.",
    T.HSA_STATUS_INFO_BREAK: "A traversal over a list of elements has been interrupted by the application.",
    T.HSA_STATUS_ERROR: "A generic error has occurred.",
    T.HSA_STATUS_ERROR_INVALID_ARGUMENT: "One of the actual arguments does not meet a precondition.",
    T.HSA_STATUS_ERROR_INVALID_QUEUE_CREATION: "The requested queue creation is not valid.",
    T.HSA_STATUS_ERROR_INVALID_ALLOCATION: "The requested allocation is not valid.",
    T.HSA_STATUS_ERROR_INVALID_AGENT: "The agent is invalid.",
    T.HSA_STATUS_ERROR_INVALID_SIGNAL: "The signal is invalid.",
    T.HSA_STATUS_ERROR_INVALID_QUEUE: "The queue is invalid.",
    T.HSA_STATUS_ERROR_OUT_OF_RESOURCES: "The runtime failed to allocate the necessary resources.",
    T.HSA_STATUS_ERROR_INVALID_PACKET_FORMAT: "The AQL packet is malformed.",
    T.HSA_STATUS_ERROR_NOT_INITIALIZED: "An API other than hsa_init has been invoked while the runtime is "
                                        "not initialized.",
    T.HSA_STATUS_ERROR_INCOMPATIBLE_ARGUMENTS: "The AQL packet has invalid dimensions or sizes.",
    T.HSA_STATUS_ERROR_INVALID_CODE_OBJECT: "The code object is invalid.",
    T.HSA_STATUS_ERROR_FROZEN_EXECUTABLE: "The executable is frozen.",
    T.HSA_STATUS_ERROR_INVALID_SYMBOL_NAME: "There is no symbol with the given name.",
    T.HSA_STATUS_ERROR_EXCEPTION: "An HSAIL operation resulted in a hardware exception.",
    T.HSA_STATUS_ERROR_MEMORY_FAULT: "Agent attempted to access an inaccessible address.",
}


class StatusStrings:
    """``hsa_status_string``: C strings that stay alive as long as the emulator object."""

    def __init__(self) -> None:
        self._buffers: dict[int, ctypes.Array] = {}

    def address(self, status: int) -> int:
        name = T.STATUS_NAMES.get(status)
        require(name is not None, T.HSA_STATUS_ERROR_INVALID_ARGUMENT, f"unknown status 0x{status:x}")
        if status not in self._buffers:
            text = f"{name}: {_DESCRIPTIONS.get(status, 'see hsa.h.')}"
            self._buffers[status] = ctypes.create_string_buffer(text.encode())
        return ctypes.addressof(self._buffers[status])
