"""Kernel metadata of a code object, and the hidden kernel arguments a dispatch must fill.

AMD code objects (ELF) carry their kernels' metadata in an ``NT_AMDGPU_METADATA`` note
(MessagePack, ``amdhsa.kernels``): every argument with its ``.offset``, ``.size`` and
``.value_kind``, the kernarg segment's size and alignment. From code object v5 (the default of
newer comgr/hipcc) the hidden arguments after the explicit ones include the dispatch geometry
that device code reads instead of the dispatch packet: ``hidden_block_count_*`` (number of whole
work-groups), ``hidden_group_size_*``, ``hidden_remainder_*`` (work-items of the last partial
work-group) and ``hidden_grid_dims``; ``get_local_size``/``get_global_id`` are wrong if they are
left zero. v4 kernels have ``hidden_global_offset_*`` (zero here) and nothing that must be set.

Emulated code objects (``emulated_code``) describe their hidden arguments the same way, so one
path fills both. Other hidden arguments (printf/hostcall buffers, heap, default queue, ...) are
left zero: kernels that use those services are not supported.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

from . import emulated_code

NT_AMDGPU_METADATA = 32
PT_NOTE, SHT_NOTE = 4, 7


@dataclass(frozen=True)
class HiddenArg:
    kind: str     # the metadata's .value_kind, e.g. "hidden_group_size_x"
    offset: int
    size: int


@dataclass(frozen=True)
class KernelMeta:
    version: int                    # code object version (4, 5, ...); 0 if unknown
    kernarg_size: int
    kernarg_align: int
    hidden: tuple[HiddenArg, ...]   # hidden arguments the runtime fills


def kernel_metadata(code: bytes, name: str) -> KernelMeta:
    """The metadata of kernel ``name`` in ``code`` (an AMD ELF or an emulated code object).
    Raises ValueError when the code object has no metadata for it."""
    if code.startswith(emulated_code.MAGIC):
        return _from_kernel(emulated_code.metadata(code, name), emulated_code.CODE_OBJECT_VERSION)
    doc = unpackb(_metadata_note(code))
    version = _version(doc.get("amdhsa.version", []))
    for kernel in doc.get("amdhsa.kernels", []):
        if kernel.get(".name") == name or kernel.get(".symbol") == name + ".kd":
            return _from_kernel(kernel, version)
    raise ValueError(f"no metadata for kernel {name!r} in the code object")


def fill_hidden(hidden: tuple[HiddenArg, ...], data: bytes, grid: tuple, block: tuple) -> bytes:
    """``data`` (kernarg bytes) with the dispatch-geometry hidden arguments written for a
    dispatch of ``grid`` work-items in work-groups of ``block`` (1 to 3 dimensions)."""
    if not hidden:
        return data
    dims = len(grid)
    grid3, block3 = tuple(grid) + (1,) * (3 - dims), tuple(block) + (1,) * (3 - dims)
    values = {"hidden_grid_dims": dims}
    for i, axis in enumerate("xyz"):
        values[f"hidden_block_count_{axis}"] = grid3[i] // block3[i]
        values[f"hidden_group_size_{axis}"] = block3[i]
        values[f"hidden_remainder_{axis}"] = grid3[i] % block3[i]
        values[f"hidden_global_offset_{axis}"] = 0
    out = bytearray(data)
    for arg in hidden:
        if arg.kind in values and arg.offset + arg.size <= len(out):
            out[arg.offset:arg.offset + arg.size] = values[arg.kind].to_bytes(arg.size, "little")
    return bytes(out)


def _from_kernel(kernel: dict, version: int) -> KernelMeta:
    hidden = tuple(HiddenArg(a[".value_kind"], a[".offset"], a[".size"]) for a in kernel.get(".args", [])
                   if str(a.get(".value_kind", "")).startswith("hidden_"))
    return KernelMeta(version, kernel.get(".kernarg_segment_size", 0), kernel.get(".kernarg_segment_align", 16),
                      hidden)


def _version(pair: list) -> int:
    """amdhsa.version [1, 0] is code object v3, [1, 1] v4, [1, 2] v5 ..."""
    return pair[1] + 3 if len(pair) == 2 and pair[0] == 1 else 0


# ---- ELF notes ----------------------------------------------------------------------------------
def _metadata_note(elf: bytes) -> bytes:
    if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF code object")
    for start, size in _note_ranges(elf):
        for owner, kind, desc in _notes(elf[start:start + size]):
            if owner == b"AMDGPU" and kind == NT_AMDGPU_METADATA:
                return desc
    raise ValueError("the code object has no NT_AMDGPU_METADATA note")


def _note_ranges(elf: bytes) -> list[tuple[int, int]]:
    phoff, = struct.unpack_from("<Q", elf, 0x20)
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", elf, 0x36)
    ranges = []
    for i in range(phnum):
        p_type, _flags, p_offset = struct.unpack_from("<IIQ", elf, phoff + i * phentsize)
        if p_type == PT_NOTE:
            ranges.append((p_offset, struct.unpack_from("<Q", elf, phoff + i * phentsize + 32)[0]))
    for i in range(shnum if not ranges else 0):
        base = shoff + i * shentsize
        if struct.unpack_from("<I", elf, base + 4)[0] == SHT_NOTE:
            ranges.append(struct.unpack_from("<QQ", elf, base + 24))
    return ranges


def _notes(blob: bytes):
    pos = 0
    while pos + 12 <= len(blob):
        namesz, descsz, kind = struct.unpack_from("<III", blob, pos)
        pos += 12
        name = blob[pos:pos + namesz].rstrip(b"\0")
        pos += (namesz + 3) & ~3
        yield name, kind, blob[pos:pos + descsz]
        pos += (descsz + 3) & ~3


# ---- MessagePack (the subset code object metadata uses) ----------------------------------------
def unpackb(data: bytes):
    value, _end = _unpack(data, 0)
    return value


def _unpack(d: bytes, i: int):  # noqa: C901 - one branch per MessagePack type
    b = d[i]
    i += 1
    if b <= 0x7F:
        return b, i
    if b >= 0xE0:
        return b - 0x100, i
    if 0x80 <= b <= 0x8F:
        return _map(d, i, b & 0x0F)
    if 0x90 <= b <= 0x9F:
        return _array(d, i, b & 0x0F)
    if 0xA0 <= b <= 0xBF:
        n = b & 0x1F
        return d[i:i + n].decode(), i + n
    fixed = {0xC0: None, 0xC2: False, 0xC3: True}
    if b in fixed:
        return fixed[b], i
    sizes = {0xCC: "<B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q", 0xD0: ">b", 0xD1: ">h", 0xD2: ">i", 0xD3: ">q",
             0xCA: ">f", 0xCB: ">d"}
    if b in sizes:
        fmt = sizes[b]
        return struct.unpack_from(fmt, d, i)[0], i + struct.calcsize(fmt)
    lengths = {0xD9: ">B", 0xDA: ">H", 0xDB: ">I", 0xC4: ">B", 0xC5: ">H", 0xC6: ">I",
               0xDC: ">H", 0xDD: ">I", 0xDE: ">H", 0xDF: ">I"}
    if b in lengths:
        fmt = lengths[b]
        n = struct.unpack_from(fmt, d, i)[0]
        i += struct.calcsize(fmt)
        if b in (0xD9, 0xDA, 0xDB):
            return d[i:i + n].decode(), i + n
        if b in (0xC4, 0xC5, 0xC6):
            return bytes(d[i:i + n]), i + n
        return (_array if b in (0xDC, 0xDD) else _map)(d, i, n)
    raise ValueError(f"unsupported MessagePack type 0x{b:02x}")


def _array(d: bytes, i: int, n: int):
    out = []
    for _ in range(n):
        value, i = _unpack(d, i)
        out.append(value)
    return out, i


def _map(d: bytes, i: int, n: int):
    out = {}
    for _ in range(n):
        key, i = _unpack(d, i)
        out[key], i = _unpack(d, i)
    return out, i
