"""A copy being submitted: its record (``CopyOp``, with a ``CopySide`` per side), the
direction rule, staging of small host sources, and its submission.

The layer above (``Runtime.copy``, ``aiogpu.copy``, ``Buffer.to_numpy``) validates and makes
the two sides, or hands the common upload and the download of ``to_numpy`` here whole
(``upload_plain``, ``download``); here a copy is routed (host-to-device on the destination's
engine, device-to-host, device-to-device and peer copies on the SOURCE device's), given its
dependencies from its hazards, and submitted (``submit_copy``): on the backend's copy lane,
else as a shader copy. A copy that nothing fails or defers is submitted at once; the others go
through ``submit.guarded``, the record itself being the submission callable (no closure per
copy). Its label is built when first read (errors, traces, the future), from a small
cache.

Under the runtime's lock, like all of submission.
"""
from __future__ import annotations

import ctypes
from typing import Any

from .submit import _refused, _submitted, any_deferred, guarded, launch, live, reap
from ..errors import GPUError
from ..kernels import copy_kernel
from .state import copy_lane, encode_copy
# (BufferState: memory.Buffer's base; the core does not import memory)
from .hazards import BufferState, HostRange, dependencies, failed_dependency

# Host sources up to this size are copied into pinned memory at submission (a memcpy on the
# loop costs less than pinning the caller's array, and the array is free again at once).
STAGE_LIMIT = 256 << 10
# Labels kept, by (source, destination, bytes); a service copies few distinct shapes.
LABELS = 256
_labels: dict = {}


def _probe() -> None:
    """(Its type says whether this module runs compiled: no Cython import at run time.)"""


COMPILED = type(_probe).__name__ == "cython_function_or_method"


class CopySide:
    """One side of a copy: a device buffer, a host array, or a foreign device array.
    ``state``: its ordering state (the Buffer or view, or a HostRange); ``ptr``: its
    device-visible address (host sides outside the pinned pool: None until staged or set by
    the backend's ``_host_pointers``); ``stream``: a foreign array's stream to order after."""

    __slots__ = ("obj", "host", "device", "state", "ptr", "stream")

    def __init__(self, obj: Any, host: bool, device: Any, state: Any, ptr: Any, stream: Any = None):
        self.obj = obj
        self.host = host
        self.device = device
        self.state = state
        self.ptr = ptr
        self.stream = stream


class CopyOp:
    """A validated copy: its sides, route (``direction``: "h2d", "d2h", "d2d" or "peer";
    ``device``: whose engine or compute lane runs it), what it keeps alive, the cleanup run once
    it has retired, host steps before it completes (``on_complete``), a bounce block the backend
    used (``staging``). ``stage``: its host source is to be copied into a pinned block at
    submission; ``staged``: it was (the caller's array is then not read after submission).
    Calling it with the resolved dependencies submits it (``submit_copy``)."""

    __slots__ = ("rt", "dst", "src", "nbytes", "direction", "device", "keep", "cleanup", "on_complete",
                 "staging", "staged", "stage", "_label")

    def __init__(self, rt: Any, dst: CopySide, src: CopySide, nbytes: int, direction: str, device: Any,
                 keep: Any):
        self.rt = rt
        self.dst = dst
        self.src = src
        self.nbytes = nbytes
        self.direction = direction
        self.device = device
        self.keep = keep
        self.cleanup: list = []
        self.on_complete = None
        self.staging = None
        self.staged = False
        self.stage = False
        self._label: str | None = None

    @property
    def label(self) -> str:
        """``copy SRC->DST N B`` (each side "host", its device's name, or a foreign array's type)."""
        return op_label(self)

    @property
    def reads(self) -> list:
        """The ordering states the copy reads: none once its host source was staged (the
        caller's array is not read after submission, so later writers of it need not wait)."""
        return [] if self.staged else [self.src.state]

    def writes(self) -> list:
        """The ordering states the copy writes."""
        return [self.dst.state]

    def stage_source(self) -> None:
        """Copy the small host source into a pinned block now (``submit`` chose to). A
        deferred copy stages only if still nothing pending writes the source (else the
        backend's ``_host_pointers`` handles it, as any host side whose ``ptr`` is None)."""
        rt = self.rt
        src = self.src
        if rt._replaying and not unwritten(src.state):
            self.stage = False
            return
        address, src.ptr, release = rt.pinned.block(self.nbytes)
        # (A host side's state is its byte range by address.)
        host_memcpy(address, src.state.start, self.nbytes)
        self.cleanup.append(release)
        self.staged = True

    def __call__(self, deps: dict) -> Any:
        return submit_copy(self.rt, self, deps)


def op_label(op: CopyOp) -> str:
    """``op.label``, made once (a C call where this module is compiled)."""
    label = op._label
    if label is None:
        label = op._label = label_of(op.src, op.dst, op.nbytes)
    return label


def _where(side: CopySide) -> str:
    if side.host:
        return "host"
    return side.device.name if isinstance(side.obj, BufferState) else type(side.obj).__name__


def label_of(src: CopySide, dst: CopySide, nbytes: int) -> str:
    """A copy's label, from the cache when it holds it."""
    key = (_where(src), _where(dst), nbytes)
    label = _labels.get(key)
    if label is None:
        label = f"copy {key[0]}->{key[1]} {nbytes} B"
        if len(_labels) >= LABELS:
            _labels.clear()
        _labels[key] = label
    return label


def unwritten(state: Any) -> bool:
    """Whether no unretired work writes the memory of ``state`` (a HostRange)."""
    if type(state) is HostRange:          # (the common case, its fields read as C fields)
        r = state
        writer = r.hazards._newest_writer(r.start, r.end)
    else:
        writer = state.last_write
    return writer is None or writer.retired


def host_address(arr: Any) -> int:
    """The address of the first byte of a C-contiguous NumPy array (validated as such)."""
    if COMPILED:
        return _buffer_address(arr)  # type: ignore[name-defined]  # noqa: F821 - the buffer protocol (copies.pxd)
    return arr.__array_interface__["data"][0]


def host_memcpy(dst: int, src: int, nbytes: int) -> None:
    """``nbytes`` bytes from host address ``src`` to host address ``dst``."""
    if COMPILED:
        _memcpy(dst, src, nbytes)  # type: ignore[name-defined]  # noqa: F821 - libc's memcpy (copies.pxd)
    else:
        ctypes.memmove(dst, src, nbytes)


def route(d: CopySide, s: CopySide) -> tuple:
    """The copy-direction rule: (direction, the device whose engine runs the copy)."""
    if s.host:
        return "h2d", d.device
    if d.host:
        return "d2h", s.device
    if d.device is s.device:
        return "d2d", s.device
    return "peer", s.device          # between GPUs: the SOURCE device's engine


def side(rt: Any, obj: Any, nbytes: int) -> CopySide:
    """The side of a validated copy for a Buffer (or view) or a C-contiguous NumPy array
    (``Runtime._side`` makes the others): a host array in the runtime's pinned pool has its
    device pointer (used in place), other host arrays None (staged, or the backend's
    ``_host_pointers``)."""
    if isinstance(obj, BufferState):
        buf = obj
        return CopySide(buf, False, buf.device, buf, buf.address)
    address = host_address(obj)
    hz = rt.hazards
    return CopySide(obj, True, None, hz.host(address, nbytes), rt.pinned.device_pointer(address, nbytes))


def plain_upload_bytes(rt: Any, dst: Any, src: Any, host_dtypes: Any) -> int:
    """The byte count of an upload into ``dst``, a Buffer (or view), from ``src``, a NumPy
    array (the caller tests both types), when it is the common case whose every check passes:
    ``dst`` of ``rt``, usable; ``src`` of a dtype copies accepted before (``host_dtypes``),
    C-contiguous, of ``dst``'s byte size; ``rt`` open. Else 0 (the general validation then
    names what is wrong)."""
    root = dst if dst._base is None else dst._base
    nbytes = dst.nbytes
    if root.freed or dst.device.runtime is not rt or rt.closed or src.nbytes != nbytes or not nbytes \
            or src.dtype not in host_dtypes or not src.flags.c_contiguous:
        return 0
    return nbytes


def upload_plain(rt: Any, dst: Any, src: Any, host_dtypes: Any) -> Any:
    """``aiogpu.copy(dst, src)`` of the common case (``plain_upload_bytes``) in one call, with
    no ``after=`` and no capture (the caller tests those two). None, having done nothing, for
    anything else: the caller's general path then validates it (and names what is wrong) and
    submits it. Raises only what the submission raises."""
    nbytes = plain_upload_bytes(rt, dst, src, host_dtypes)
    if not nbytes:
        return None
    reap(rt)
    lock = rt.lock
    lock.enter()
    try:
        if rt.closed:
            return None
        return submit(rt, side(rt, dst, nbytes), side(rt, src, nbytes), nbytes, [], [dst, src])
    finally:
        lock.exit()


def download(rt: Any, buf: Any, out: Any, address: int, ptr: int) -> Any:
    """``buf``'s bytes copied into ``out``, a new array of the pinned pool at host ``address``
    and device pointer ``ptr`` (``Buffer.to_numpy``; under the lock, the runtime open, no
    capture): the copy of ``copy(out, buf)`` without its validation, which holds by
    construction."""
    n = buf.nbytes
    hz = rt.hazards
    return submit(rt, CopySide(out, True, None, hz.host(address, n), ptr), side(rt, buf, n), n, [], [out], True)


def submit(rt: Any, d: CopySide, s: CopySide, nbytes: int, after: list, keep: Any,
           fresh_dst: bool = False) -> Any:
    """Route and submit a validated copy (under the lock). A small host source that nothing
    pending writes and that is not in the pinned pool is staged (copied into a pinned block) when
    it is submitted: the copy then does not read the caller's array, so it is no reader of it
    and waits for no writer of it. ``fresh_dst``: the destination is memory just taken from the
    pinned pool, which no unretired work touches (nothing to wait for there; the copy is still
    recorded as its writer)."""
    direction, device = route(d, s)
    op = CopyOp(rt, d, s, nbytes, direction, device, keep)
    reads = [s.state]
    writes = [d.state]
    rw = None
    if s.host and s.ptr is None and nbytes <= STAGE_LIMIT and unwritten(s.state):
        op.stage = True
        rw = (reads, writes)
        reads = []
    if fresh_dst:
        rw = (reads, writes)
        writes = []
    compile = None
    if not (rt.copy_engines and rt.engines_take_every_copy) and copy_kernel not in device._kernels:
        compile = rt._copy_kernel_compile(op)
    if compile is None and not after and device.broken is None:
        # The common copy, which nothing defers or fails: submitted here, as ``guarded``
        # would (its dependencies are the same), without its general path.
        deps = dependencies(reads, writes, ())
        if not deps or failed_dependency(deps) is None and not any_deferred(deps):
            return submit_copy(rt, op, deps)
    return guarded(rt, device, op_label(op), reads, writes, after, op, compile, rw)


def submit_copy(rt: Any, op: CopyOp, deps: dict) -> Any:
    """Submit ``op`` (validated, its route decided) after ``deps`` (resolved, none failed):
    its small host source staged, or host pointers from the backend where a host side has none
    yet, then an engine when one can take it, else a shader copy (the built-in copy kernel on a
    compute lane). What the host sides locked, or the pinned blocks staged, is released here if
    submitting raises."""
    try:
        if op.stage:
            op.stage_source()
        src, dst = op.src, op.dst
        if (src.host and src.ptr is None) or (dst.host and dst.ptr is None):
            rt._host_pointers(op)
        fut = None
        if rt.copy_engines or not rt._shader_can_copy(op):
            fut = _engine_copy(rt, op, deps)
        if fut is None:
            dev, n = op.device, op.nbytes
            fut = launch(rt, dev, dev._loaded_kernel(copy_kernel), op_label(op) + " (shader)", dev._copy_grid(n),
                         (256,), [dst.ptr, src.ptr, n], [n, n], deps, op.reads, op.writes(),
                         op.keep, op.cleanup, op)
            rt.shader_copies += 1
    except BaseException:
        for fn in op.cleanup:
            fn()
        raise
    fut.kind, fut.nbytes = "copy", op.nbytes
    return fut


def _engine_copy(rt: Any, op: CopyOp, deps: dict) -> Any:
    """``op`` on the copy lane the backend gives it; None when none takes it."""
    lane = copy_lane(rt, op, deps)
    if lane is None:
        return None
    hub = rt.hub
    fut = hub.new_future(op_label(op))
    fut.device, fut.kind, fut.nbytes = op.device, "copy", op.nbytes
    waits = live(deps)
    todo = op.cleanup
    try:
        keys = encode_copy(rt, fut, op, lane, waits, todo)
    except GPUError as exc:
        op.cleanup = []                      # (run by _refused: not again by ``submit_copy``)
        return _refused(rt, fut, exc, todo, op.writes())
    except BaseException:
        hub.discard(fut)
        raise
    if keys is None:                         # refused after all: a shader copies it
        hub.discard(fut)
        return None
    _submitted(rt, fut, deps, waits, keys, op.reads, op.writes(), op.keep, todo)
    return fut

