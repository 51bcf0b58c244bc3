"""The core's record of a runtime and of a device: the fields that every operation reads,
declared once, typed (C fields where the core is compiled: ``state.pxd``), so that
submission reads them without a lookup. ``aiogpu.runtime.Runtime`` and
``aiogpu.device.Device`` derive from them and set them; the backends and the core read them.

Runtime: ``lock`` (the runtime's ``InterruptSafeLock``), ``hub`` (its FutureHub), ``hazards``
(the host ranges' ordering state), ``pinned`` (the pinned host pool), ``closed`` (``close()``
has begun), ``_replaying`` (> 0 while deferred work is being submitted), ``copy_engines``
(False: every copy is a shader copy), ``shader_copies`` (a count, for stats),
``track_allocations`` (frames recorded per allocation; 0: none).

Device: ``runtime``, ``memory`` (its DeviceMemory), ``broken`` (a GPUError once it is unusable,
else None), ``_kernels`` (loaded kernels by Kernel), ``_shapes`` (validated launch shapes),
``_lane_order`` (the compute lanes in the order the lane choice tries them).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any


class RuntimeState:
    """The fields of a runtime that the core reads per operation (see the module doc)."""

    __slots__ = ("lock", "hub", "hazards", "pinned", "closed", "_replaying", "copy_engines", "shader_copies",
                 "track_allocations")

    if TYPE_CHECKING:
        lock: Any
        hub: Any
        hazards: Any
        pinned: Any
        closed: bool
        _replaying: int
        copy_engines: bool
        shader_copies: int
        track_allocations: int


class DeviceState:
    """The fields of a device that the core reads per operation (see the module doc)."""

    __slots__ = ("runtime", "memory", "broken", "_kernels", "_shapes", "_lane_order")

    if TYPE_CHECKING:
        runtime: Any
        memory: Any
        broken: Any
        _kernels: dict
        _shapes: dict
        _lane_order: Any
