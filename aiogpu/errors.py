"""The exceptions of aiogpu. Device failures are GPUError; bad input is ValueError/TypeError."""
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


class RuntimeClosedError(RuntimeError, ValueError):
    """The runtime (or one of its devices) was closed; nothing was submitted."""


class WatchdogTimeout(GPUError):
    """A completion did not arrive within the runtime's watchdog timeout."""
