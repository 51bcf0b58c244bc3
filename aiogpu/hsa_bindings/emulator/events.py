"""System events (``hsa_amd_register_system_event_handler``): GPU memory faults.

ROCr calls every registered handler with an ``hsa_amd_event_t`` when a GPU faults on memory;
the emulator does the same from the thread that detected the fault (a packet processor or an SDMA
engine), then the queue concerned fails with HSA_STATUS_ERROR_MEMORY_FAULT. Faults are also kept
in ``faults`` with the emulator's explanation (e.g. "use after free"), which the C event cannot
carry.
"""
from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass, field
from typing import Any

from .. import types as T
from ._abi import now_ns
from .memory import MemoryFault


@dataclass(frozen=True)
class MemoryFaultRecord:
    agent: int  # GPU index
    address: int
    reason: str
    mask: int
    source: str  # "queue <id> packet <n>" or "sdma <engine>"
    time_ns: int = field(default_factory=now_ns)


class SystemEvents:
    def __init__(self, faults: list[MemoryFaultRecord]) -> None:
        self._lock = threading.Lock()
        self._handlers: list[tuple[Any, Any]] = []
        self.faults = faults  # owned by the emulator: it outlives hsa_shut_down

    def register(self, callback: Any, data: Any) -> None:
        with self._lock:
            self._handlers.append((callback, data))

    def memory_fault(self, agent_handle: int, gpu: int, fault: MemoryFault, source: str) -> None:
        """Record the fault and deliver HSA_AMD_GPU_MEMORY_FAULT_EVENT to every handler."""
        with self._lock:
            self.faults.append(MemoryFaultRecord(gpu, fault.address, fault.reason, fault.mask, source))
            handlers = list(self._handlers)
        event = T.hsa_amd_event_t()
        event.event_type = T.HSA_AMD_GPU_MEMORY_FAULT_EVENT
        event.memory_fault.agent.handle = agent_handle
        event.memory_fault.virtual_address = fault.address & ((1 << 64) - 1)
        event.memory_fault.fault_reason_mask = fault.mask
        for callback, data in handlers:
            callback(ctypes.pointer(event), data)
