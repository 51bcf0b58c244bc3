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
``_last_launch`` (the last shape the plain launch found: (kernel, grid, block, shape), or None),
``_lane_order`` (the compute lanes in the order the lane choice tries them).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

try:
    import cython  # type: ignore[import-untyped,import-not-found,unused-ignore]
except ImportError:            # interpreted, where Cython is not installed (see interrupts.py)
    globals()["cython"] = type("cython", (), {"compiled": False})


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

    __slots__ = ("runtime", "memory", "broken", "_kernels", "_shapes", "_last_launch", "_lane_order")

    if TYPE_CHECKING:
        runtime: Any
        memory: Any
        broken: Any
        _kernels: dict
        _shapes: dict
        _last_launch: tuple | None
        _lane_order: Any


# -- the backend's per-operation hooks ---------------------------------------------------------------
# A compiled backend binds C functions for them into the fields of its runtime and devices
# (``_copy_lane_c``, ``_encode_copy_c``, ``_encode_kernel_c``, declared in state.pxd; the CUDA
# backend's ``bind`` functions): the core's call is then a C call, with no method lookup, no
# bound method and no parsing of its arguments. Otherwise (interpreted, or a backend that binds
# none) the core calls the hook's method (``aiogpu/backend.py``), which subclasses may replace.
def copy_lane(rt: Any, op: Any, deps: Any) -> Any:
    """The runtime's ``_copy_lane(op, deps)``."""
    if cython.compiled:
        if rt._copy_lane_c != cython.NULL:
            return rt._copy_lane_c(rt, op, deps)
    return rt._copy_lane(op, deps)


def encode_copy(rt: Any, fut: Any, op: Any, lane: Any, waits: Any, cleanup: list) -> Any:
    """The runtime's ``_encode_copy(fut, op, lane, waits, cleanup)``."""
    if cython.compiled:
        if rt._encode_copy_c != cython.NULL:
            return rt._encode_copy_c(rt, fut, op, lane, waits, cleanup)
    return rt._encode_copy(fut, op, lane, waits, cleanup)


def encode_kernel(device: Any, fut: Any, lane: Any, loaded: Any, grid: Any, block: Any, values: Any, lengths: Any,
                  waits: Any, cleanup: list, copy: Any, foreign: Any) -> Any:
    """The device's ``_encode_kernel(fut, lane, loaded, grid, block, values, lengths, waits,
    cleanup, copy, foreign)``."""
    if cython.compiled:
        if device._encode_kernel_c != cython.NULL:
            return device._encode_kernel_c(device, fut, lane, loaded, grid, block, values, lengths, waits, cleanup,
                                           copy, foreign)
    return device._encode_kernel(fut, lane, loaded, grid, block, values, lengths, waits, cleanup, copy, foreign)
