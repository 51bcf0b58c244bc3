"""Struct layouts, constants and enum sizes of the ctypes bindings against ROCr's headers, by a C
program generated from the ctypes declarations themselves (a new field or constant is checked
without touching this file)."""
from __future__ import annotations

import ctypes
import re

import pytest

from abi_support import C_INCLUDES, compile_c, header_constants, header_text, header_typedefs
from abi_support import HAVE_HEADERS, needs_compiler, needs_headers
from aiogpu.hsa_bindings import packets as P
from aiogpu.hsa_bindings import types as T

pytestmark = [pytest.mark.abi, needs_headers, needs_compiler]

MODULES = (T, P)

# Every struct (and union) declared in ctypes, under its C typedef name.
STRUCTS = {name: obj for mod in MODULES for name, obj in vars(mod).items()
           if isinstance(obj, type) and issubclass(obj, (ctypes.Structure, ctypes.Union))
           and obj.__module__ == mod.__name__ and not name.startswith("_")}

# The ones the brief names: discovery must not lose any of them.
EXPECTED_STRUCTS = {
    "hsa_queue_t", "hsa_kernel_dispatch_packet_t", "hsa_barrier_and_packet_t", "hsa_barrier_or_packet_t",
    "hsa_amd_barrier_value_packet_t", "hsa_amd_vendor_packet_header_t", "amd_signal_t", "hsa_amd_event_t",
    "hsa_amd_gpu_memory_fault_info_t", "hsa_amd_profiling_dispatch_time_t", "hsa_agent_t", "hsa_signal_t",
    "hsa_amd_memory_pool_t", "hsa_code_object_reader_t", "hsa_executable_t", "hsa_loaded_code_object_t",
    "hsa_executable_symbol_t", "hsa_region_t",
}

# HSA_* (and AMD_*) integer constants of the bindings.
CONSTANTS = {name: value for mod in MODULES for name, value in vars(mod).items()
             if name.startswith(("HSA_", "AMD_")) and type(value) is int}

# Enum/scalar typedef aliases (hsa_status_t = c_int32, ...) used as argument and field types.
SCALAR_TYPEDEFS = {name: obj for name, obj in vars(T).items()
                   if name.startswith("hsa_") and isinstance(obj, type)
                   and issubclass(obj, ctypes._SimpleCData)}

# Offsets into amd_queue_t that the emulator relies on (it lays its queues out like ROCr's).
AMD_QUEUE_OFFSETS = {"AMD_QUEUE_WRITE_DISPATCH_ID_OFFSET": "write_dispatch_id",
                     "AMD_QUEUE_READ_DISPATCH_ID_OFFSET": "read_dispatch_id"}

# Not in ROCr 5.2.3's headers (newer ROCr defines them); any other name missing there is a typo.
NEWER_THAN_HEADERS = {"HSA_AMD_SDMA_ENGINE_0", "hsa_amd_sdma_engine_id_t"}

HEADER_TEXT = header_text() if HAVE_HEADERS else ""
IN_HEADERS = header_constants(HEADER_TEXT) | header_typedefs(HEADER_TEXT)


def members(cls, base: int = 0):
    """(C member name, ctypes offset, ctypes size) of every field; anonymous ctypes members are
    replaced by their own members, which C reaches directly (C11 anonymous unions/structs)."""
    for name, *_ in cls._fields_:
        field = getattr(cls, name)
        if name in getattr(cls, "_anonymous_", ()):
            yield from members(field_type(cls, name), base + field.offset)
        else:
            yield name, base + field.offset, field.size


def field_type(cls, name):
    return next(f[1] for f in cls._fields_ if f[0] == name)


def declared_alignment(cls) -> int:
    """ctypes' alignment, or ``_align_`` where a struct asks for more (Python < 3.13 ignores it)."""
    return max(ctypes.alignment(cls), getattr(cls, "_align_", 0))


def layout_program() -> str:
    out = [C_INCLUDES, "#include <stdio.h>", "int main(void) {"]
    emit = lambda fmt, *args: out.append(f'  printf("{fmt}\\n", {", ".join(args)});')  # noqa: E731
    for s, cls in STRUCTS.items():
        emit("S %s %zu %zu", f'"{s}"', f"sizeof({s})", f"_Alignof({s})")
        for m, _, _ in members(cls):
            emit("F %s %s %zu %zu", f'"{s}"', f'"{m}"', f"offsetof({s}, {m})", f"sizeof((({s}*)0)->{m})")
    for name in sorted(CONSTANTS):
        if name in IN_HEADERS:
            emit("C %s %lld", f'"{name}"', f"(long long)({name})")
    for name in sorted(SCALAR_TYPEDEFS):
        if name in IN_HEADERS:
            emit("E %s %zu %d", f'"{name}"', f"sizeof({name})", f"(int)(({name})-1 < ({name})0)")
    for const, member in AMD_QUEUE_OFFSETS.items():
        emit("Q %s %zu", f'"{const}"', f"offsetof(amd_queue_t, {member})")
    emit("Q %s %zu", '"hsa_queue"', "offsetof(amd_queue_t, hsa_queue)")
    return "\n".join(out + ["  return 0;", "}", ""])


@pytest.fixture(scope="module")
def c_says(abi_workdir) -> dict:
    """What the C compiler says: {('S', struct): (size, align), ('F', struct, field): (offset, size),
    ('C', name): value, ('E', typedef): (size, signed), ('Q', constant): offset}."""
    result = {}
    for line in compile_c(layout_program(), abi_workdir, "layout", run=True).splitlines():
        kind, *words = line.split()
        keys = {"S": 1, "F": 2, "C": 1, "E": 1, "Q": 1}[kind]
        result[(kind, *words[:keys])] = tuple(int(w) for w in words[keys:])
    return result


def test_every_expected_struct_is_declared():
    assert EXPECTED_STRUCTS <= set(STRUCTS), f"not found in types/packets: {EXPECTED_STRUCTS - set(STRUCTS)}"


@pytest.mark.parametrize("name", sorted(STRUCTS))
def test_struct_layout(c_says, name):
    cls = STRUCTS[name]
    c_size, c_align = c_says[("S", name)]
    problems = []
    if ctypes.sizeof(cls) != c_size:
        problems.append(f"sizeof: ctypes {ctypes.sizeof(cls)}, C {c_size}")
    if declared_alignment(cls) != c_align:
        problems.append(f"alignment: ctypes {declared_alignment(cls)}, C {c_align}")
    for member, offset, size in members(cls):
        c_offset, c_msize = c_says[("F", name, member)]
        if (offset, size) != (c_offset, c_msize):
            problems.append(f".{member}: ctypes offset {offset} size {size}, C offset {c_offset} size {c_msize}")
    assert not problems, f"{name} differs from the header:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("name", sorted(n for n in CONSTANTS if n in IN_HEADERS))
def test_constant_value(c_says, name):
    (c_value,) = c_says[("C", name)]
    assert CONSTANTS[name] == c_value, f"{name} = {CONSTANTS[name]:#x} in ctypes, {c_value:#x} in the header"


def test_constants_missing_from_headers_are_known():
    missing = {n for n in CONSTANTS if n not in IN_HEADERS} - set(AMD_QUEUE_OFFSETS)
    assert missing <= NEWER_THAN_HEADERS, f"not defined by ROCr's headers (typo?): {sorted(missing - NEWER_THAN_HEADERS)}"


@pytest.mark.parametrize("name", sorted(SCALAR_TYPEDEFS))
def test_scalar_typedef_size(c_says, name):
    if name not in IN_HEADERS:
        assert name in NEWER_THAN_HEADERS, f"{name} is not a typedef of ROCr's headers (typo?)"
        assert ctypes.sizeof(SCALAR_TYPEDEFS[name]) == 4, f"{name}: an enum is int-sized"
        return
    c_size, c_signed = c_says[("E", name)]
    ctype = SCALAR_TYPEDEFS[name]
    assert ctypes.sizeof(ctype) == c_size, f"sizeof({name}): ctypes {ctypes.sizeof(ctype)}, C {c_size}"
    if not re.search(rf"}}\s*{name}\s*;", HEADER_TEXT):  # not an enum (whose signedness is gcc's choice)
        assert (ctype(-1).value < 0) == bool(c_signed), f"{name}: signedness differs from the header's"


@pytest.mark.parametrize("const", sorted(AMD_QUEUE_OFFSETS))
def test_amd_queue_offsets(c_says, const):
    (c_offset,) = c_says[("Q", const)]
    assert getattr(T, const, None) == c_offset, \
        f"types.{const} = {getattr(T, const, None)}; offsetof(amd_queue_t, {AMD_QUEUE_OFFSETS[const]}) = {c_offset}"


def test_amd_queue_starts_with_hsa_queue(c_says):
    """An amd_queue_t's address is its hsa_queue_t's: ROCr hands out the one as the other."""
    assert c_says[("Q", "hsa_queue")] == (0,)


def test_barrier_dependency_count():
    """BARRIER_MAX_DEPS is the length of dep_signal[] (the C layout of that array is checked above)."""
    dep = field_type(P.hsa_barrier_and_packet_t, "dep_signal")
    assert dep._length_ == P.BARRIER_MAX_DEPS == 5


@pytest.mark.parametrize("name", ["hsa_kernel_dispatch_packet_t", "hsa_barrier_and_packet_t",
                                  "hsa_barrier_or_packet_t", "hsa_amd_barrier_value_packet_t"])
def test_packets_are_one_slot(name):
    assert ctypes.sizeof(STRUCTS[name]) == P.PACKET_SIZE == 64
