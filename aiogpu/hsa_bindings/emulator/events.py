"""System events (``hsa_amd_register_system_event_handler``): GPU memory faults.

Modelled on KFD and ROCr (``Runtime::VMFaultHandler``): when a GPU faults on memory, KFD evicts
every queue of the process on that device (AQL and SDMA alike: nothing on them runs or completes
any more; ``kfd_dqm_evict_pasid``), then signals the memory event, and ROCr calls every
registered handler with an ``hsa_amd_event_t``. No queue error callback is called. The
emulator does the same, from the thread that detected the fault (a packet processor, a compute
unit or an SDMA engine). When no handler returns HSA_STATUS_SUCCESS, ROCr prints the fault and
aborts the process; the emulator records that (``MemoryFaultRecord.handled`` False) instead.
Faults are kept in ``faults`` with the emulator's explanation (e.g. "use after free"), which the
C event cannot carry.

The eviction lasts for the life of the process (the emulator instance): queues created later
on that device are created evicted and never run, across hsa_shut_down/hsa_init too, as KFD
does while ``qpd->evicted`` (see ``_State.evict``).

Not modelled: ROCr's handler is one-shot (VMFaultHandler returns false, so later faults of the
process are not reported); here every fault is reported.
"""
from __future__ import annotations

import ctypes
import dataclasses
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

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
    handled: bool = True  # False: no handler returned SUCCESS (ROCr would abort the process)
    time_ns: int = field(default_factory=now_ns)


class SystemEvents:
    def __init__(self, faults: list[MemoryFaultRecord]) -> None:
        self._lock = threading.Lock()
        self._handlers: list[tuple[Any, Any]] = []
        self.faults = faults  # owned by the emulator: it outlives hsa_shut_down
        self.evict: Callable[[int], None] = lambda gpu: None  # set by the emulator: KFD's eviction

    def register(self, callback: Any, data: Any) -> None:
        with self._lock:
            self._handlers.append((callback, data))

    def memory_fault(self, agent_handle: int, gpu: int, fault: MemoryFault, source: str) -> None:
        """Evict the device's queues, then deliver HSA_AMD_GPU_MEMORY_FAULT_EVENT to every
        handler and record the fault (and whether a handler took it)."""
        self.evict(gpu)
        with self._lock:
            handlers = list(self._handlers)
        event = T.hsa_amd_event_t()
        event.event_type = T.HSA_AMD_GPU_MEMORY_FAULT_EVENT
        event.memory_fault.agent.handle = agent_handle
        event.memory_fault.virtual_address = fault.address & ((1 << 64) - 1)
        event.memory_fault.fault_reason_mask = fault.mask
        # Recorded before the handlers run: a handler may look the fault up at once.
        record = MemoryFaultRecord(gpu, fault.address, fault.reason, fault.mask, source, False)
        with self._lock:
            self.faults.append(record)
        handled = False
        for callback, data in handlers:
            handled = callback(ctypes.pointer(event), data) == T.HSA_STATUS_SUCCESS or handled
        if handled:
            with self._lock:
                self.faults[self.faults.index(record)] = dataclasses.replace(record, handled=True)
