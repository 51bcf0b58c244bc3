"""The parts of one initialised emulator that its threads share (built by hsa_init)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .agents import AgentTable
from .code_objects import CodeObjects
from .compute_units import ComputeUnits
from .events import SystemEvents
from .faults import FaultInjector
from .memory import MemoryManager
from .signals import SignalTable
from .timeline import Timeline


@dataclass(eq=False)
class Context:
    agents: AgentTable
    memory: MemoryManager
    signals: SignalTable
    code: CodeObjects
    events: SystemEvents
    faults: FaultInjector
    timeline: Timeline
    compute: list[ComputeUnits]  # one per GPU
    report_bug: Callable[[str, BaseException], None]  # an emulator thread hit an internal error
    min_queue_size: int
    name: str  # thread-name prefix, unique per emulator
    queue_errors: list[Any]  # packet_processor.QueueErrorRecord, in the order they were reported
    kernarg_mismatches: list[str]  # dispatches whose hidden geometry arguments disagree with the packet
