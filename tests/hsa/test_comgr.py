"""OpenCL C kernels become AMD code objects through ROCm's comgr (for the real HSA backend)."""
from __future__ import annotations

import struct

import pytest

import aiogpu
from aiogpu.hsa_bindings import comgr
from aiogpu.hsa.kernels import code_object
from aiogpu.kernels import copy_kernel, fill_kernel

ok, why = comgr.available()
needs_comgr = pytest.mark.skipif(not ok or comgr.opencl_header_dir() is None,
                                 reason=f"needs libamd-comgr2, rocm-device-libs and clang's OpenCL headers ({why})")
EM_AMDGPU = 0xE0

SAXPY_CL = """
__kernel void saxpy(__global float* y, __global const float* x, float a, uint n) {
    size_t i = get_global_id(0);
    if (i < n) y[i] += a * x[i];
}
"""


def elf_machine(blob: bytes) -> int:
    assert blob[:4] == b"\x7fELF" and blob[4] == 2, "not a 64-bit ELF"
    return struct.unpack_from("<H", blob, 18)[0]


@needs_comgr
@pytest.mark.parametrize("isa", ["gfx90a", "gfx908", "gfx1030"])
def test_opencl_kernel_compiles_to_a_code_object(isa):
    @aiogpu.kernel("f32*, const f32*, f32, u32", opencl=SAXPY_CL)
    def saxpy(launch, y, x, a, n):
        y[:n] += a * x[:n]

    blob = code_object(saxpy, "hsa", isa)
    assert elf_machine(blob) == EM_AMDGPU
    assert b"saxpy.kd" in blob, "the kernel descriptor symbol the loader looks up"
    assert code_object(saxpy, "hsa", isa) is blob, "compiled once per ISA"


@needs_comgr
def test_built_in_kernels_have_amd_code_objects():
    for k in (copy_kernel, fill_kernel):
        blob = code_object(k, "hsa", "gfx90a")
        assert elf_machine(blob) == EM_AMDGPU and f"{k.name}.kd".encode() in blob


@needs_comgr
def test_compile_errors_carry_the_compiler_log():
    with pytest.raises(comgr.ComgrError, match="undeclared identifier"):
        comgr.compile_opencl("__kernel void broken(__global int* x) { x[0] = nope; }", "gfx90a")


def test_a_kernel_without_amd_code_says_so():
    @aiogpu.kernel("u32")
    def only_python(launch, n):
        pass

    with pytest.raises(ValueError, match="no AMD code object"):
        code_object(only_python, "hsa", "gfx90a")


@needs_comgr
@pytest.mark.parametrize("version", [4, 5])
def test_hidden_geometry_arguments_of_comgr_code_objects(version):
    """Issue 14.8: code object v5 kernels (newer comgr's default) read the work-group size and
    counts from hidden kernel arguments; the runtime fills them from the kernel's metadata, so
    the built-in copy and fill compute the right global ids whichever version comgr produces."""
    from aiogpu.hsa_bindings import codeobject
    from aiogpu.kernels import COPY_CL
    opts = comgr.default_options() + (f"-mcode-object-version={version}",)
    blob = comgr.compile_opencl(COPY_CL, "gfx90a", options=opts)
    meta = codeobject.kernel_metadata(blob, "aiogpu_copy")
    assert meta.version == version and meta.kernarg_size >= 24
    kinds = {h.kind: h for h in meta.hidden}
    data = codeobject.fill_hidden(meta.hidden, bytes(meta.kernarg_size), (1000,), (256,))

    def read(kind):
        h = kinds[kind]
        return int.from_bytes(data[h.offset:h.offset + h.size], "little")

    assert read("hidden_global_offset_x") == 0
    if version >= 5:
        assert (read("hidden_block_count_x"), read("hidden_group_size_x"), read("hidden_remainder_x")) == (3, 256, 232)
        assert (read("hidden_group_size_y"), read("hidden_block_count_y"), read("hidden_grid_dims")) == (1, 1, 1)
    default = codeobject.kernel_metadata(code_object(copy_kernel, "hsa", "gfx90a"), "aiogpu_copy")
    assert default.version in (4, 5, 6)


def test_code_object_metadata_reader_handles_message_pack():
    from aiogpu.hsa_bindings import codeobject
    doc = bytes([0x82, 0xA1, 0x61, 0x92, 0x01, 0xCD, 0x01, 0x00, 0xA1, 0x62, 0xC3])  # {"a": [1, 256], "b": True}
    assert codeobject.unpackb(doc) == {"a": [1, 256], "b": True}
    with pytest.raises(ValueError):
        codeobject.kernel_metadata(b"\x7fELF" + bytes(60), "k")
