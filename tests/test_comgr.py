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
