"""aiogpu: an asyncio-native GPU runtime. Every GPU completion is an awaitable.

    devs = aiogpu.devices()
    x = devs[0].alloc(n * 4)
    await aiogpu.copy(x, host_array)
    await devs[0].launch(saxpy, grid=(n,), block=(256,), args=(y, x, 2.0, n))
"""
from __future__ import annotations

from typing import Any, Iterable

import numpy as _np

# First: its import finder decides, for every compiled module of aiogpu, whether the extension or
# the .py is loaded (stale builds, AIOGPU_PURE_CORE): it must be in place before any of them.
from . import _core  # noqa: F401
from .errors import (BackendUnavailable, BlockingCallError, CudaError, DeviceFault, DeviceLost, GPUError, HsaError,
                     InjectedFault, InvalidStateError, KernelError, MemoryFault, NotOnCudaError, OutOfMemoryError,
                     RuntimeClosedError, WatchdogTimeout)
from .kernels import Kernel, kernel
from .memory import Buffer
from .device import Device
from .runtime import Runtime, runtime
from .runtime import _HOST_DTYPES
from . import capture as _capture
from ._core import copies as _copies
from .runtime import runtime as _default_runtime
from .futures import GPUFuture
from .structured import TaskGroup
from .graph import Graph, GraphExec, GraphNode
from .dataloader import Batch, Loader
from .trace import trace

__all__ = ["devices", "runtime", "Runtime", "Device", "Buffer", "Kernel", "kernel", "GPUFuture", "Graph",
           "GraphExec", "GraphNode", "TaskGroup", "Loader", "Batch", "trace", "copy", "gather", "stream_future",
           "GPUError", "HsaError", "CudaError", "OutOfMemoryError", "WatchdogTimeout", "DeviceLost", "RuntimeClosedError",
           "BackendUnavailable", "BlockingCallError", "InvalidStateError", "NotOnCudaError", "DeviceFault",
           "KernelError", "MemoryFault", "InjectedFault", "__version__"]
__version__ = "0.1.0"


def devices(backend: str | None = None) -> list[Device]:
    """The GPUs of the default runtime (``backend``: "hsa", "emulator", "cuda" or None for auto)."""
    return list(runtime(backend).devices)


def _runtime_of(*sides: Any) -> Runtime:
    for side in sides:
        if isinstance(side, Buffer):
            return side.device.runtime
    raise TypeError("copy needs at least one Buffer (host-to-host copies are NumPy's job)")


def copy(dst: Any, src: Any, *, after: Iterable[GPUFuture[Any]] = ()) -> GPUFuture[None]:
    """Copy ``src`` into ``dst`` (each a Buffer or a C-contiguous NumPy array of a numeric dtype,
    of equal byte sizes; on CUDA also another library's CUDA array).

    Returns a GPUFuture at once; bad input raises TypeError/ValueError before anything is
    submitted. A copy between GPUs runs on the source device's SDMA engine,
    host-to-device on the destination's, device-to-host on the source's; with no free engine it
    runs as a shader copy on a compute queue. A host array must not be touched until the future
    completes (the future keeps it alive).
    """
    if type(dst) is Buffer:
        rt = dst.device.runtime
        if type(src) is _np.ndarray and not after and _capture._active.get() is None:
            fut = _copies.upload_plain(rt, dst, src, _HOST_DTYPES)    # (the common upload, compiled)
            if fut is not None:
                return fut
        return rt.copy(dst, src, after)
    return _runtime_of(dst, src).copy(dst, src, after)


def stream_future(stream: Any, *, device: Device | None = None, runtime: Runtime | None = None) -> GPUFuture[None]:
    """A GPUFuture for everything queued so far on another library's CUDA stream, or for the
    record an event holds now: await PyTorch or CuPy work without ``torch.cuda.synchronize``
    in a thread.

    ``stream``: a ``torch.cuda.Stream``/``ExternalStream`` (or a ``torch.cuda.Event``), a CuPy
    ``Stream``/``Event``, a ``CUstream``/``CUevent``, or an int stream handle. An event recorded
    on the stream now (timing disabled, from a pool) is watched by the runtime's waiter: the
    future completes once the work queued before this call has finished, and later work on the
    stream is not waited for. For an event, its current record is captured on the device:
    recording it again later does not move the future; an event never recorded is complete.
    Nothing blocks the loop, and the future can be passed in ``after=`` (a wait on the device).
    ``after=`` also takes such streams and events directly.

    ``device``: the GPU of a default-stream handle (0, 1, 2) when the runtime has several (torch
    and CuPy stream objects say theirs). ``runtime``: default ``aiogpu.runtime()``.

    Raises NotOnCudaError on a backend without CUDA streams (the emulator, HSA), TypeError for
    an object that is not a stream or event, ValueError for a stream of another GPU context (or
    a device that does not match it), RuntimeClosedError after ``close()``; ValueError inside a
    graph capture.
    """
    rt = runtime if runtime is not None else _default_runtime()
    return rt.stream_future(stream, device=device)


def gather(*futures: GPUFuture[Any] | GraphNode) -> GPUFuture[None]:
    """One future that settles when every one of ``futures`` has settled and the device is
    done with its work (a device-side join; as trio's nurseries wait for every child, unlike
    ``asyncio.gather``): work ordered after it never overlaps a member. It then fails with the
    error of the first member, in argument order, that failed, else completes."""
    for f in futures:
        if not isinstance(f, (GPUFuture, GraphNode)):
            raise TypeError(f"gather takes GPUFutures, got {f!r}")
    graph = next((f.graph for f in futures if isinstance(f, GraphNode)), None)
    if graph is not None:          # graph nodes: a join node, inside their capture only
        return graph.runtime.gather(futures)
    live = [f for f in futures if isinstance(f, GPUFuture)]    # (here: all of them)
    hubs = {id(f._hub): f._hub for f in live if f._hub is not None}
    if not hubs:
        from .futures import completed_future
        failed = next((f._exc for f in live if f._exc is not None), None)
        return completed_future(None, "gather", failed)
    if len(hubs) > 1:
        raise ValueError("gather takes futures of one runtime")
    owner = next(iter(hubs.values())).owner
    if owner is None:
        raise ValueError("these futures do not belong to a live runtime")
    return owner.gather(live)


