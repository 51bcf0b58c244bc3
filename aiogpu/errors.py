"""Every exception aiogpu raises (a leaf module: every layer may import it, it imports nothing).

- Failures on the device are ``GPUError`` (backend failures subclass it: ``HsaError``,
  ``CudaError``, ``WatchdogTimeout``, ``OutOfMemoryError``, ``DeviceLost``).
- Bad input is ``ValueError``/``TypeError``, raised before anything is submitted.
- ``RuntimeClosedError``: work offered to a closed runtime (also a ``ValueError``: bad input).
- ``BackendUnavailable``: a backend asked for by name cannot run here; says why and the fix.
- ``InvalidStateError``: ``result()``/``exception()`` of a future that is still pending.
- ``NotOnCudaError``: CUDA interop asked of a buffer of another backend.
- ``BlockingCallError``: a blocking call (``GPUFuture.wait``) on the thread of a running event
  loop (asyncio, uvloop or trio), which it would stall.
"""
from __future__ import annotations


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
