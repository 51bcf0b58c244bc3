"""The kernarg layout a kernel signature implies on HSA, and packing to and from it.

Shared by the runtime, which writes kernargs, and the emulator, which reads them back: explicit
arguments at their natural C alignment, then, for emulated kernels only, one hidden ``u64`` per
pointer argument holding the byte length of the buffer (as AMD code objects carry hidden
arguments after the explicit ones). The hidden lengths let the emulator hand the NumPy body a
view of exactly the buffer.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from ..signature import Arg, parse_signature  # noqa: F401 - re-exported for the emulator

KERNARG_ALIGN = 16


def _align(offset: int, alignment: int) -> int:
    return (offset + alignment - 1) // alignment * alignment


# Emulated kernels' implicit arguments, after the hidden lengths (offsets relative to their
# start, 8-aligned), with the value kinds and sizes of code object v5's: the dispatch geometry
# that device code reads from the kernarg segment rather than from the packet.
IMPLICIT_ARGS = tuple((f"hidden_{what}_{axis}", off + 4 * i if size == 4 else off + 2 * i, size)
                      for what, off, size in (("block_count", 0, 4), ("group_size", 12, 2), ("remainder", 18, 2))
                      for i, axis in enumerate("xyz")) + (("hidden_grid_dims", 24, 2),)
IMPLICIT_SIZE = 26


@dataclass(frozen=True)
class KernargLayout:
    offsets: tuple[int, ...]          # explicit arguments
    hidden_length_offsets: tuple[int, ...]  # one per pointer argument (emulated kernels)
    size: int
    implicit: tuple[tuple[str, int, int], ...] = ()  # (value kind, offset, size) (emulated kernels)

    @classmethod
    def of(cls, args: tuple[Arg, ...], *, hidden_lengths: bool, implicit: bool = False) -> "KernargLayout":
        offsets, off = [], 0
        for a in args:
            off = _align(off, a.size)
            offsets.append(off)
            off += a.size
        hidden = []
        if hidden_lengths:
            for a in args:
                if a.pointer:
                    off = _align(off, 8)
                    hidden.append(off)
                    off += 8
        extra: tuple = ()
        if implicit:
            off = _align(off, 8)
            extra = tuple((kind, off + rel, size) for kind, rel, size in IMPLICIT_ARGS)
            off += IMPLICIT_SIZE
        return cls(tuple(offsets), tuple(hidden), max(_align(off, KERNARG_ALIGN), KERNARG_ALIGN), extra)


def pack(args: tuple[Arg, ...], layout: KernargLayout, values, lengths=()) -> bytes:
    """Kernarg bytes: pointer values are integer addresses, scalars are Python/NumPy numbers."""
    out = bytearray(layout.size)
    for a, off, v in zip(args, layout.offsets, values):
        if a.pointer:
            struct.pack_into("<Q", out, off, int(v))
        else:
            out[off:off + a.size] = np.asarray(v, dtype=a.dtype).tobytes()
    for off, n in zip(layout.hidden_length_offsets, lengths):
        struct.pack_into("<Q", out, off, int(n))
    return bytes(out)


def unpack(args: tuple[Arg, ...], layout: KernargLayout, data: bytes) -> tuple[list, list[int]]:
    """Inverse of pack: (values, hidden lengths); pointers come back as integer addresses."""
    values = []
    for a, off in zip(args, layout.offsets):
        if a.pointer:
            values.append(struct.unpack_from("<Q", data, off)[0])
        else:
            values.append(np.frombuffer(data, dtype=a.dtype, count=1, offset=off)[0])
    lengths = [struct.unpack_from("<Q", data, off)[0] for off in layout.hidden_length_offsets]
    return values, lengths
