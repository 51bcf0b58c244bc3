"""The CUDA encode of a copy, per copy (compiled: a .pxd beside it): ``CudaRuntime._encode_copy``
and ``CudaRuntime._copy_lane`` are these functions.

The driver module is imported at the first copy, not with this module: importing this one (as
``aiogpu info`` imports every compiled module) needs no cuda-bindings."""
from __future__ import annotations

import functools
from typing import Any, Sequence

from .._core.copies import CopyOp
from .._core.state import RuntimeState
from .encode import Lane, enter_lane, lane_completes

try:
    import cython  # type: ignore[import-untyped,import-not-found,unused-ignore]
except ImportError:            # interpreted, where Cython is not installed (see _core/interrupts.py)
    globals()["cython"] = type("cython", (), {"compiled": False})
if not cython.compiled:
    direct_memcpy: Any = None      # (the .pxd's C function: a lane's own copy call, ``Lane.direct``)

_driver: Any = None          # aiogpu.cuda.driver, once a copy is encoded


def _hot() -> Any:
    """The driver's hot path (``driver.HOT``, read per copy: tests swap it)."""
    global _driver
    if _driver is None:
        from . import driver
        _driver = driver
    return _driver.HOT


def encode_copy(self: Any, fut: Any, op: CopyOp, lane: Any, waits: Sequence, cleanup: list) -> tuple:
    """The copy on ``lane`` (a copy stream of the engine device, or the compute stream of its
    only input: ``_copy_lane``)."""
    dst, src = op.dst, op.src
    dptr, sptr, nbytes = dst.ptr, src.ptr, op.nbytes
    patched = self._patches        # (_take_patches inlined: this runs per copy)
    fusable = False
    foreign = dst.stream is not None or src.stream is not None     # (another library's array)
    mapped = op.direction != "peer" or dst.device.index in src.device.peers     # (_shader_can_copy)
    if patched is not None and patched[0] is op:
        self._patches = None
        copy = self._with_patches(op, functools.partial(_hot().memcpy, dptr, sptr, nbytes), patched[1])
    elif mapped and not foreign:
        memcpy_on_lane(self, fut, lane, dptr, sptr, nbytes, waits, cleanup, op.on_complete, op.staging)
        return ()
    elif mapped:
        # (fusable: passes the word on; a partial of the hot path's memcpy, not a closure:
        # calling it runs no Python frame)
        copy, fusable = functools.partial(_hot().memcpy, dptr, sptr, nbytes), True
    else:
        dctx, sctx = dst.device.ctx, src.device.ctx
        copy = functools.partial(_peer_memcpy, dptr, dctx, sptr, sctx, nbytes)
    if foreign:
        copy = self.with_foreign_waits(op.device, [side.stream for side in (dst, src) if side.stream is not None],
                                       copy)
    return self._encode_on_lane(fut, lane, waits, cleanup, copy, fusable=fusable, on_complete=op.on_complete,
                                nbytes=nbytes, staging=op.staging)


def memcpy_on_lane(runtime: Any, fut: Any, lane: Lane, dptr: int, sptr: int, nbytes: int, waits: Sequence,
                   cleanup: list, on_complete: Any, staging: Any) -> None:
    """A copy that is one ``HotPath.memcpy`` (no patches, no other library's streams, no
    unmapped peer) on ``lane`` after ``waits``: ``CudaRuntime._encode_on_lane`` of it in
    compiled code, as ``encode.launch_on_lane`` for a launch (the same lane entry and
    completion). Raises CudaError where a call failed (nothing then completes ``fut``)."""
    code = enter_lane(lane.device, lane, waits)
    word = lane.fused_word
    ticket = lane.ticket + 1
    if code:
        pass
    elif cython.compiled and lane.direct:
        code = direct_memcpy(lane, dptr, sptr, nbytes, word, ticket if word else 0)
    else:
        code = lane.hot.memcpy(dptr, sptr, nbytes, lane.sh, word, ticket if word else 0)
    lane_completes(runtime, fut, lane, cleanup, code, word, ticket)
    fut.on_complete, fut.staging = on_complete, staging
    if nbytes:
        fut.nbytes = nbytes


def copy_lane(self: Any, op: CopyOp, deps: dict) -> Any:
    """The copy stream of the copy's direction on its device; but a download whose only
    pending input is work on one compute stream of the device goes on that stream: stream
    order then suffices, and no cross-stream wait stalls the downloads queued behind it on
    the shared copy stream (the DMA engine does the copy either way)."""
    device, direction = op.device, op.direction
    if deps and (direction == "d2h" or direction == "d2d"):
        lane = None             # the one lane of the live inputs, if there is one
        for f in deps:
            other = f.lane
            if other is None or f.retired or other is lane:
                continue
            if lane is not None:
                break           # a second lane
            lane = other
        else:
            if lane is not None and lane.device is device and lane.kind == "compute":
                return lane
    if direction == "h2d":
        return device.h2d
    if direction == "d2h":
        return device.d2h
    return device.d2d if direction == "d2d" else device.peer


def _peer_memcpy(dptr: int, dctx: Any, sptr: int, sctx: Any, nbytes: int, stream: int, word: int, ticket: int) -> int:
    """``cuMemcpyPeerAsync`` (the driver stages it: no peer mapping), as an enqueue."""
    _hot()
    return _driver.cu.cuMemcpyPeerAsync(dptr, dctx, sptr, sctx, nbytes, stream)[0]


def bind(runtime: Any) -> None:
    """Compiled: ``runtime``'s copy hooks become this module's C functions, which the core then
    calls as C functions (``aiogpu._core.state``); interpreted, its methods stay the hooks."""
    if cython.compiled:
        state: RuntimeState = runtime
        state._copy_lane_c = _copy_lane_c
        state._encode_copy_c = _encode_copy_c


def _copy_lane_c(runtime: Any, op: Any, deps: Any) -> Any:
    return copy_lane(runtime, op, deps)


def _encode_copy_c(runtime: Any, fut: Any, op: Any, lane: Any, waits: Any, cleanup: list) -> Any:
    return encode_copy(runtime, fut, op, lane, waits, cleanup)
