"""Every exception aiogpu raises (a leaf module: every layer may import it, it imports nothing).

- Failures on the device are ``GPUError`` (backend failures subclass it: ``HsaError``,
  ``CudaError``, ``WatchdogTimeout``, ``OutOfMemoryError``, ``DeviceLost``).
- Bad input is ``ValueError``/``TypeError``, raised before anything is submitted.
- ``RuntimeClosedError``: work offered to a closed runtime (also a ``ValueError``: bad input).
- ``BackendUnavailable``: a backend asked for by name cannot run here; says why and the fix.
- ``InvalidStateError``: ``result()``/``exception()`` of a future that is still pending.
- ``NotOnCudaError``: CUDA interop asked of a buffer of another backend.
- ``BlockingCallError``: a blocking call (``GPUFuture.wait``, ``Runtime.leaks``) on the thread of
  a running event loop (asyncio, uvloop or trio), which it would stall.
- ``DeviceFault`` and its subclasses ``KernelError``, ``MemoryFault``, ``InjectedFault``: what
  happened on the device, found as a GPUError's ``__cause__`` where the backend can tell (the
  emulator does); never raised by an aiogpu call itself.
"""
from __future__ import annotations

import math
from typing import Any


class GPUError(RuntimeError):
    """An operation failed on the device.

    ``status`` is the backend's status code (an HSA status, or a CUDA result), ``queue`` names the
    queue or engine where it happened, ``packet`` the packet index (or None where the backend has
    none). A future that depends on a failed one fails with a GPUError whose ``__cause__`` is the
    original failure.
    """

    def __init__(self, message: str, *, status: int | None = None, queue: str | None = None,
                 packet: int | None = None):
        super().__init__(message)
        self.status, self.queue, self.packet = status, queue, packet


class DeviceLost(GPUError):
    """The device is lost to this process: nothing more runs on it until the process exits.

    On HSA a GPU memory fault does this: KFD keeps the process's queues on that device evicted
    (those created later too) and ROCr never recreates its copy queues. Everything pending on
    the device fails with it, and so does every later operation on it, at once; other devices
    go on. Only a new process gets the device back."""


class WatchdogTimeout(GPUError):
    """A completion did not arrive within the runtime's watchdog timeout."""


class OutOfMemoryError(GPUError, MemoryError):
    """A device (or host) allocation failed for lack of memory.

    ``requested`` is the byte count asked for (after rounding), ``free`` what the device reported
    free at that moment (None where the backend cannot tell).
    """

    def __init__(self, message: str, *, requested: int, free: int | None = None,
                 status: int | None = None, queue: str | None = None):
        super().__init__(message, status=status, queue=queue)
        self.requested, self.free = requested, free


class HsaError(GPUError):
    """An HSA call returned an error status (``status`` is the ``hsa_status_t``)."""


class CudaError(GPUError):
    """A CUDA driver call failed (``status`` is the ``CUresult``)."""


class RuntimeClosedError(RuntimeError, ValueError):
    """The runtime (or one of its devices) was closed; nothing was submitted."""


class BackendUnavailable(RuntimeError):
    """The backend that was asked for by name cannot run here.

    ``backend`` names it, ``reason`` says why, ``fix`` what would make it available.
    """

    def __init__(self, backend: str, reason: str, fix: str = ""):
        message = f"the {backend} backend cannot run here: {reason}"
        if fix:
            message += f" ({fix})"
        super().__init__(message)
        self.backend, self.reason, self.fix = backend, reason, fix


class InvalidStateError(RuntimeError):
    """``result()``/``exception()`` of a future that is still pending."""


class NotOnCudaError(TypeError, AttributeError):
    """CUDA interop asked of a buffer of another backend (an AttributeError too, so that
    ``hasattr(buf, "__cuda_array_interface__")`` answers False there)."""


class BlockingCallError(RuntimeError):
    """A blocking call made on the thread of a running event loop (asyncio, uvloop or trio),
    which it would stall: ``GPUFuture.wait()`` there; ``await`` the future instead."""


class DeviceFault(Exception):
    """What went wrong on the device behind a GPUError: its ``__cause__``, where the backend can
    tell (the emulator raises these; HSA's queue callback and CUDA's result codes carry only a
    status). Not a GPUError itself: ``except GPUError`` catches the failure, this explains it."""


class KernelError(DeviceFault):
    """A kernel body raised ``error`` (also the ``__cause__``): ``kernel`` names the kernel,
    ``launch`` its dispatch (``grid``, ``block``, ``dims``, ``agent``: the GPU index), and the
    message the work-items it ran for (the whole grid: a body runs once per dispatch)."""

    def __init__(self, kernel: str, launch: Any, error: BaseException):
        self.kernel, self.launch, self.error = kernel, launch, error
        items = math.prod(launch.grid)
        super().__init__(f"kernel {kernel} raised {type(error).__name__}: {error} (work-items 0..{items - 1}: "
                         f"grid {launch.grid}, block {launch.block}, on GPU {launch.agent})")


# hsa_amd_memory_fault_reason_t's HSA_AMD_MEMORY_FAULT_PAGE_NOT_PRESENT (a leaf module: no HSA types here).
_PAGE_NOT_PRESENT = 1 << 0


class MemoryFault(DeviceFault):
    """A GPU access that faulted: ``address`` (the first faulting byte), ``reason`` (why: a
    pointer that names no memory, an access past a buffer's end, a use after free) and ``mask``
    (the memory-fault event's ``hsa_amd_memory_fault_reason_t`` bits)."""

    def __init__(self, address: int, reason: str, mask: int = _PAGE_NOT_PRESENT):
        self.address, self.reason, self.mask = address, reason, mask
        super().__init__(f"GPU memory fault at 0x{address:x}: {reason}")


class InjectedFault(DeviceFault):
    """A queue error or memory fault that fault injection asked for: the failure was meant to
    happen. ``record`` says what fired, where and when (the emulator's ``FaultRecord``:
    ``kind``, ``agent``, ``queue``, ``packet``)."""

    def __init__(self, record: Any):
        self.record = record
        super().__init__(f"injected {record.kind} on GPU {record.agent}, queue {record.queue}, "
                         f"packet {record.packet}")
