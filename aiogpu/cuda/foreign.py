"""Other libraries' streams and events (PyTorch, CuPy, raw handles) as aiogpu futures, and
aiogpu futures as waits on their streams. The core's ``Runtime.stream_future`` and
``Runtime.wait_on`` hold the rules (open runtime, no capture, deferred work); this module turns
the objects into handles and the handles into driver calls.

- A **stream** (``torch.cuda.Stream``/``ExternalStream`` through ``.cuda_stream``, a CuPy
  ``Stream`` through ``.ptr``, a ``CUstream`` or an int handle): a pooled event (timing
  disabled) is recorded on it now; the future completes when everything queued there before
  it has finished. Its lane is a ``streams.ForeignLane`` of the stream's device.
- An **event** (``torch.cuda.Event`` through ``.cuda_event``, a CuPy ``Event`` through
  ``.ptr``, a ``CUevent``): the record it holds now is captured by a device-side wait
  (``cuStreamWaitEvent``) on one of aiogpu's own "ext" streams, after which that stream writes
  its completion word: re-recording the event later does not move the future. An event never
  recorded is complete at once (CUDA's rule for waits on it).
- ``wait_on``: the library's stream waits on the device (``cuStreamWaitEvent`` on the future's
  event, or ``cuStreamWaitValue64`` on its lane's completion word) for the future's work.

The stream's device: its context (``cuStreamGetCtx``) must be the primary context of one of the
runtime's GPUs (torch and CuPy use those), else ValueError. Default-stream handles (0, 1, 2) have
no context of their own: the device comes from the object (torch's ``device_index``, CuPy's
``device_id``), else ``device=``, else the runtime's only GPU.
"""
from __future__ import annotations

from typing import Any

from ..errors import NotOnCudaError
from . import driver as D
from .driver import cu
from .streams import ForeignLane, Lane
from .encode import flush_word

DEFAULT_STREAMS = (0, 1, 2)      # NULL, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD
EXT_LANES = 4                    # aiogpu streams per device that capture foreign events


def classify(obj: Any, *, ints: bool = True) -> tuple[str, int, int | None]:
    """("stream" or "event", handle, device index hint or None) of a foreign object;
    TypeError for anything else (``ints``: accept a bare int as a stream handle)."""
    if hasattr(obj, "cuda_stream"):                       # torch.cuda.Stream / ExternalStream
        return "stream", int(obj.cuda_stream), _index(getattr(obj, "device_index", None))
    if hasattr(obj, "cuda_event"):                        # torch.cuda.Event
        return "event", int(obj.cuda_event), None
    module, name = type(obj).__module__ or "", type(obj).__name__
    if module.startswith("cupy") and hasattr(obj, "ptr"):
        if "Event" in name:
            return "event", int(obj.ptr), None
        if "Stream" in name:
            return "stream", int(obj.ptr), _index(getattr(obj, "device_id", None))
    if isinstance(obj, cu.CUstream):
        return "stream", int(obj), None
    if isinstance(obj, cu.CUevent):
        return "event", int(obj), None
    if ints and isinstance(obj, int) and not isinstance(obj, bool):
        if obj < 0:
            raise ValueError(f"a CUDA stream handle is not negative, got {obj}")
        return "stream", obj, None
    raise TypeError(f"expected a CUDA stream or event (torch.cuda.Stream/Event, cupy.cuda.Stream/Event, "
                    f"CUstream/CUevent{', or an int stream handle' if ints else ''}), got {type(obj).__name__}")


def _index(value: Any) -> int | None:
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None


def stream_device(rt: Any, handle: int, hint: int | None, device: Any) -> Any:
    """The device of the runtime whose context owns stream ``handle`` (ValueError if none)."""
    if device is not None and device.runtime is not rt:
        raise ValueError(f"{device!r} belongs to another runtime")
    if hint is not None:
        if not 0 <= hint < len(rt.devices):
            raise ValueError(f"the stream is on CUDA device {hint}, which this runtime does not have")
        if device is not None and device.index != hint:
            raise ValueError(f"the stream is on CUDA device {hint}, not on {device.name}")
        device = rt.devices[hint]
    if handle in DEFAULT_STREAMS:
        if device is None:
            if len(rt.devices) != 1:
                raise ValueError("a default-stream handle names no device: pass device= "
                                 "(aiogpu.stream_future(handle, device=dev))")
            device = rt.devices[0]
        return device
    for d in rt.devices:                 # seen before: its lane knows the device
        if handle in d.foreign:
            if device is not None and d is not device:
                raise ValueError(f"the stream {handle:#x} is on {d.name}, not on {device.name}")
            return d
    err, ctx = cu.cuStreamGetCtx(cu.CUstream(handle))
    if err != 0:
        raise ValueError(f"not a usable CUDA stream handle {handle:#x} ({D.error_name(err)})")
    owner = next((d for d in rt.devices if d.ctx_handle == int(ctx)), None)
    if owner is None:
        raise ValueError(f"the stream {handle:#x} belongs to a CUDA context that is not the primary "
                         f"context of this runtime's GPUs (torch and CuPy use those; a context of "
                         f"your own is not supported)")
    if device is not None and owner is not device:
        raise ValueError(f"the stream {handle:#x} is on {owner.name}, not on {device.name}")
    return owner


def foreign_lane(device: Any, handle: int) -> Any:
    """The lane of foreign stream ``handle`` on ``device`` (created once, under the lock)."""
    lane = device.foreign.get(handle)
    if lane is None:
        lane = device.foreign[handle] = ForeignLane(device, handle)
        device.lanes.append(lane)
        device.runtime.hub.lanes.append(lane)
    return lane


def ext_lane(device: Any) -> Any:
    """One of the device's own streams that capture foreign events: an idle one, else a new one
    (up to ``EXT_LANES``), else the least busy (so a long wait seldom holds up a short one)."""
    idle = next((lane for lane in device.ext if not lane.pending), None)
    if idle is not None:
        return idle
    if len(device.ext) < EXT_LANES:
        lane = Lane(device, f"{device.name}.ext{len(device.ext)}", "ext")
        device.ext.append(lane)
        device.lanes.append(lane)
        device.runtime.hub.lanes.append(lane)
        return lane
    return min(device.ext, key=lambda lane: len(lane.pending))


def work(rt: Any, obj: Any, device: Any) -> tuple:
    """(device, lane, label, enqueue) of a future for a foreign stream or event (the runtime's
    ``_foreign_work``, under the lock): ``enqueue(stream, word, ticket)`` captures its queued work
    on ``lane``; lane None for an event never recorded (nothing to wait for)."""
    kind, handle, hint = classify(obj)
    if kind == "stream":
        dev = stream_device(rt, handle, hint, device)
        return dev, foreign_lane(dev, handle), f"stream {handle:#x}", _nothing
    if device is not None and device.runtime is not rt:
        raise ValueError(f"{device!r} belongs to another runtime")
    dev = device or rt.devices[0]
    if handle == 0:
        return dev, None, "event (never recorded)", None
    wait = D.HOT.wait_event
    return dev, ext_lane(dev), f"event {handle:#x}", lambda stream, _word, _ticket: wait(stream, handle)


def _nothing(stream: int, word: int, ticket: int) -> int:
    return 0


def wait_on(rt: Any, fut: Any, obj: Any, device: Any) -> None:
    """Make the foreign stream ``obj`` wait, on the device, for ``fut``'s work (under the lock;
    ``fut`` is submitted, unretired work of this runtime)."""
    kind, handle, hint = classify(obj)
    if kind != "stream":
        raise TypeError(f"wait_on takes a stream (an event cannot be made to wait), got {type(obj).__name__}")
    dev = stream_device(rt, handle, hint, device)
    lane = getattr(fut, "lane", None)
    if lane is None:
        raise NotOnCudaError(f"{fut!r} has no CUDA work to wait for")
    if fut.event is None:
        # (its launch may have left the word behind: Lane.lazy)
        D.check((flush_word(lane, fut.ticket),), "cuStreamWriteValue64 (wait_on)")
    dev.make_current()
    target = cu.CUstream(handle)
    if fut.event is not None:
        D.check(cu.cuStreamWaitEvent(target, fut.event, 0), "cuStreamWaitEvent (wait_on)")
    else:
        D.check(cu.cuStreamWaitValue64(target, lane.dptr, fut.ticket, D.WAIT_GEQ), "cuStreamWaitValue64 (wait_on)")
