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
(``const`` ones read-only), scalars NumPy scalars.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .. import packets, signature
from .. import types as T
from ..emulated_code import EmulatedKernel
from .context import Context
from .memory import MemoryFault

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
    """Run the body once; raises MemoryFault for a pointer that does not resolve, or what the body raises."""
    hidden = iter(job.lengths)
    args = [_pointer_view(ctx, job.gpu, a, v, next(hidden)) if a.pointer else v
            for a, v in zip(job.kernel.args, job.values)]
    job.kernel.body(job.launch, *args)


def _pointer_view(ctx: Context, gpu: int, arg: signature.Arg, address: int, nbytes: int) -> np.ndarray:
    raw = ctx.memory.resolve(gpu, address, nbytes, write=not arg.const)
    usable = nbytes - nbytes % arg.dtype.itemsize
    view = raw[:usable].view(arg.dtype)
    if arg.const:
        view.flags.writeable = False
    return view
