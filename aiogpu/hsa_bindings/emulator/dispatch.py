"""Kernel dispatch packets: validation as the command processor does it, and the NumPy body run.

Validation statuses follow ROCr's queue-error mapping (``AqlQueue::DynamicScratchHandler``):
- reserved fields or reserved setup bits not zero: HSA_STATUS_ERROR_INVALID_PACKET_FORMAT
  ("invalid format");
- dimensions outside 1..3, a workgroup or grid size of 0, an unused dimension not 1, or more than
  1024 work-items per workgroup: HSA_STATUS_ERROR_INCOMPATIBLE_ARGUMENTS ("invalid dim");
- a group segment larger than 64 KiB: HSA_STATUS_ERROR_INVALID_ARGUMENT ("group is too large");
- a kernel object not loaded for this agent: HSA_STATUS_ERROR_INVALID_CODE_OBJECT ("invalid or
  NULL code");
- a kernarg segment this GPU cannot read: a GPU memory fault (the device's queues are evicted
  and the system event reported), which is what the kernel's first kernarg load would cause;
- a kernarg segment not aligned to the kernel's kernarg_segment_align: HSA requires the
  alignment and the hardware would silently read shifted arguments; the emulator fails the
  queue with HSA_STATUS_ERROR_INVALID_ARGUMENT instead, so the defect shows.

Emulated kernels are code object v5-like: the dispatch geometry the body sees (``Launch``) is
read from the hidden arguments in the kernarg segment (block counts, group sizes, remainders,
grid dims), as device code reads it, not from the packet. A runtime that leaves them zero gives
the body a zero geometry; every disagreement with the packet is kept in ``kernarg_mismatches``.

The body is called once per dispatch as ``body(launch, *args)``: pointer arguments become NumPy
views of real memory typed by the pointer's dtype and covering exactly the hidden byte length
(``const`` ones read-only), scalars NumPy scalars. The body runs once for the whole grid (it is
vectorised), so what it does is done by every work-item of the dispatch at once.

How a body fails, as a GPU would:
- indexing a pointer view (or an array derived from one) outside its bounds, with an index or
  with a slice bound (where NumPy would silently shorten the slice), is a GPU memory fault
  (``MemoryFault`` at the first address out of bounds): memory-fault event, then the queue fails
  with HSA_STATUS_ERROR_MEMORY_FAULT;
- any other exception, SystemExit and KeyboardInterrupt included, ends the dispatch as a kernel
  exception: the queue fails with HSA_STATUS_ERROR_EXCEPTION and ``KernelError`` (whose
  ``__cause__`` is what the body raised) explains it. The emulator keeps running.
``explanation`` finds the exception that explains a queue error, for ``queue_error_cause``.
"""
from __future__ import annotations

import collections
import math
import operator
import traceback
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import KernelError, MemoryFault
from .. import packets, signature
from .. import types as T
from ..emulated_code import EmulatedKernel
from .context import Context

MAX_GROUP_SEGMENT = 64 * 1024
WORKGROUP_MAX_SIZE = 1024


@dataclass(frozen=True)
class Launch:
    """What a body learns about its dispatch: sizes per used dimension and the GPU index."""

    grid: tuple[int, ...]
    block: tuple[int, ...]
    dims: int
    agent: int


@dataclass(frozen=True)
class Rejection:
    status: int
    detail: str
    fault: MemoryFault | None = None


@dataclass(frozen=True)
class DispatchJob:
    kernel: EmulatedKernel
    launch: Launch
    values: list  # unpacked explicit arguments (pointers as addresses)
    lengths: list[int]  # hidden byte length of each pointer argument
    gpu: int

    @property
    def nbytes(self) -> int:
        """Bytes of memory the dispatch's pointer arguments cover."""
        return sum(self.lengths)


def validate(pkt: packets.hsa_kernel_dispatch_packet_t) -> Rejection | None:
    dims = pkt.setup & 0x3
    block = (pkt.workgroup_size_x, pkt.workgroup_size_y, pkt.workgroup_size_z)
    grid = (pkt.grid_size_x, pkt.grid_size_y, pkt.grid_size_z)
    if pkt.setup >> packets.HSA_KERNEL_DISPATCH_PACKET_SETUP_WIDTH_DIMENSIONS or pkt.reserved0 or pkt.reserved2:
        return Rejection(T.HSA_STATUS_ERROR_INVALID_PACKET_FORMAT, "reserved dispatch-packet field not zero")
    if not 1 <= dims <= 3:
        return Rejection(T.HSA_STATUS_ERROR_INCOMPATIBLE_ARGUMENTS, f"{dims} dimensions")
    if min(block[:dims]) < 1 or min(grid[:dims]) < 1:
        return Rejection(T.HSA_STATUS_ERROR_INCOMPATIBLE_ARGUMENTS, f"empty grid {grid} or workgroup {block}")
    if any(v != 1 for v in block[dims:] + grid[dims:]):
        return Rejection(T.HSA_STATUS_ERROR_INCOMPATIBLE_ARGUMENTS, f"unused dimensions of {grid}/{block} not 1")
    if math.prod(block) > WORKGROUP_MAX_SIZE:
        return Rejection(T.HSA_STATUS_ERROR_INCOMPATIBLE_ARGUMENTS, f"workgroup {block} over {WORKGROUP_MAX_SIZE}")
    if pkt.group_segment_size > MAX_GROUP_SEGMENT:
        return Rejection(T.HSA_STATUS_ERROR_INVALID_ARGUMENT, f"group segment {pkt.group_segment_size} bytes")
    return None


def prepare(ctx: Context, gpu: int, pkt: packets.hsa_kernel_dispatch_packet_t) -> DispatchJob | Rejection:
    """Validate a dispatch and read its kernarg segment (on the packet processor's thread)."""
    rejection = validate(pkt)
    if rejection is not None:
        return rejection
    kernel = ctx.code.kernel(pkt.kernel_object, gpu)
    if kernel is None:
        return Rejection(T.HSA_STATUS_ERROR_INVALID_CODE_OBJECT,
                         f"kernel object 0x{pkt.kernel_object:x} is not loaded for GPU {gpu}")
    try:
        kernargs = bytes(ctx.memory.resolve(gpu, pkt.kernarg_address or 0, kernel.layout.size, write=False))
    except MemoryFault as fault:
        return Rejection(T.HSA_STATUS_ERROR_MEMORY_FAULT, f"kernarg segment of {kernel.name}", fault)
    if pkt.kernarg_address % kernel.kernarg_align:
        return Rejection(T.HSA_STATUS_ERROR_INVALID_ARGUMENT, f"kernarg segment of {kernel.name} at "
                         f"0x{pkt.kernarg_address:x} is not aligned to {kernel.kernarg_align} bytes")
    values, lengths = signature.unpack(kernel.args, kernel.layout, kernargs)
    dims = pkt.setup & 0x3
    grid = (pkt.grid_size_x, pkt.grid_size_y, pkt.grid_size_z)[:dims]
    block = (pkt.workgroup_size_x, pkt.workgroup_size_y, pkt.workgroup_size_z)[:dims]
    launch = _launch_from_kernargs(kernel, kernargs, gpu)
    if (launch.grid, launch.block, launch.dims) != (grid, block, dims):
        ctx.kernarg_mismatches.append(f"{kernel.name} on GPU {gpu}: hidden arguments say grid {launch.grid} "
                                      f"block {launch.block}, the packet grid {grid} block {block}")
    return DispatchJob(kernel, launch, values, lengths, gpu)


def _launch_from_kernargs(kernel: EmulatedKernel, kernargs: bytes, gpu: int) -> Launch:
    """The geometry device code computes: from the hidden (implicit) kernel arguments."""
    imp = {kind: int.from_bytes(kernargs[off:off + size], "little") for kind, off, size in kernel.layout.implicit}
    dims = min(imp.get("hidden_grid_dims", 0), 3)
    block = tuple(imp[f"hidden_group_size_{a}"] for a in "xyz")[:dims]
    grid = tuple(imp[f"hidden_block_count_{a}"] * imp[f"hidden_group_size_{a}"] + imp[f"hidden_remainder_{a}"]
                 for a in "xyz")[:dims]
    return Launch(grid, block, dims, gpu)


def execute(ctx: Context, job: DispatchJob) -> None:
    """Run the body once. Raises MemoryFault for a pointer that does not resolve or an access
    out of bounds, KernelError for anything else the body raises (BaseException included)."""
    hidden = iter(job.lengths)
    try:
        args = [_pointer_view(ctx, job.gpu, i, a, v, next(hidden), job.kernel.name) if a.pointer else v
                for i, (a, v) in enumerate(zip(job.kernel.args, job.values))]
        job.kernel.body(job.launch, *args)
    except MemoryFault as fault:
        _remember(ctx, fault)
        raise
    except BaseException as exc:   # SystemExit/KeyboardInterrupt end the dispatch, not the emulator
        err = KernelError(job.kernel.name, job.launch, exc)
        _remember(ctx, err)
        raise err from exc


def _remember(ctx: Context, exc: BaseException) -> None:
    """Keep a body's failure for ``explanation`` (the last few per emulator). Its traceback keeps
    the lines, not the locals: those hold views of device memory the program may free."""
    for e in (exc, exc.__cause__):
        if e is not None:
            traceback.clear_frames(e.__traceback__)
    recent = _recent.get(ctx)
    if recent is None:
        recent = _recent.setdefault(ctx, collections.deque(maxlen=_RECENT))
    recent.append(exc)


def _pointer_view(ctx: Context, gpu: int, index: int, arg: signature.Arg, address: int, nbytes: int,
                  kernel: str) -> np.ndarray:
    raw = ctx.memory.resolve(gpu, address, nbytes, write=not arg.const)
    usable = nbytes - nbytes % arg.dtype.itemsize
    view = raw[:usable].view(arg.dtype).view(DeviceArray)
    view._where = f"kernel {kernel} argument {index} ({arg})"
    if arg.const:
        view.flags.writeable = False
    return view


class DeviceArray(np.ndarray):
    """A kernel's view of device memory (and the arrays computed from it): an index or slice
    bound outside the array is a GPU memory fault, where NumPy would raise IndexError or
    silently shorten the slice."""

    _where = "kernel array"

    def __array_finalize__(self, obj: Any) -> None:
        if obj is not None:
            self._where = getattr(obj, "_where", DeviceArray._where)

    def __getitem__(self, index: Any) -> Any:
        _check_bounds(self, index, "read")
        try:
            return super().__getitem__(index)
        except IndexError as exc:
            raise _fault(self, None, index, "read", str(exc)) from None

    def __setitem__(self, index: Any, value: Any) -> None:
        _check_bounds(self, index, "write")
        try:
            super().__setitem__(index, value)
        except IndexError as exc:
            raise _fault(self, None, index, "write", str(exc)) from None


def _check_bounds(arr: np.ndarray, index: Any, access: str) -> None:
    """Fault on an integer index or an explicit slice bound outside ``arr`` (per dimension)."""
    parts = index if isinstance(index, tuple) else (index,)
    if len(parts) > arr.ndim or any(p is None or p is Ellipsis for p in parts):
        return      # newaxis/ellipsis: NumPy's own IndexError (mapped to a fault) covers them
    for dim, part in enumerate(parts):
        n = arr.shape[dim]
        if isinstance(part, slice):
            start = None if part.start is None else operator.index(part.start)
            for b in (start, None if part.stop is None else operator.index(part.stop)):
                if b is not None and not -n <= b <= n:
                    # The first element out of bounds: before the array, or at its end (or at
                    # the start of a slice that begins past the end).
                    at = b + n if b < 0 else max(n, start if start is not None else 0)
                    raise _fault(arr, (dim, at), index, access, f"slice bound {b} outside {n} elements")
        elif not isinstance(part, (bool, np.bool_)) and _is_integer(part):
            i = operator.index(part)
            if not -n <= i < n:
                raise _fault(arr, (dim, i if i >= 0 else i + n), index, access,
                             f"index {i} outside {n} elements")


def _is_integer(value: Any) -> bool:
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _fault(arr: np.ndarray, at: tuple[int, int] | None, index: Any, access: str, why: str) -> MemoryFault:
    """A memory fault at the element ``at`` = (dimension, position) of ``arr`` (its end if None)."""
    base = arr.__array_interface__["data"][0]
    address = base + arr.nbytes if at is None else base + at[1] * arr.strides[at[0]]
    return MemoryFault(address, f"{arr._where}: {access} [{_show(index)}] out of bounds ({why})")


def _show(index: Any) -> str:
    parts = index if isinstance(index, tuple) else (index,)

    def one(p: Any) -> str:
        if isinstance(p, slice):
            text = ":".join("" if v is None else str(v) for v in (p.start, p.stop))
            return text + (f":{p.step}" if p.step is not None else "")
        return repr(p) if not _is_integer(p) else str(operator.index(p))

    return ", ".join(one(p) for p in parts)


# -- explanations of queue errors -----------------------------------------------------------------
_RECENT = 256
_recent: "weakref.WeakKeyDictionary[Context, collections.deque]" = weakref.WeakKeyDictionary()


def explanation(ctx: Context, detail: str, fault: Any = None) -> BaseException | None:
    """The body's exception behind a queue error: the KernelError whose text the error's
    ``detail`` quotes, or the MemoryFault that ``fault`` (a memory-fault record) describes."""
    for exc in reversed(list(_recent.get(ctx, ()))):
        if fault is not None:
            if isinstance(exc, MemoryFault) and exc.address == fault.address and exc.reason == fault.reason:
                return exc
        elif isinstance(exc, KernelError) and repr(exc) in detail:
            return exc
    return None
