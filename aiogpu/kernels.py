"""Kernel declarations: one signature, per-backend implementations, and the built-in kernels.

``@aiogpu.kernel("f32*, const f32*, f32, u32", hsaco=..., cuda=...)`` declares a kernel. Its
Python body is the NumPy reference implementation: the emulator runs it once per dispatch, with
pointer arguments as typed views of whole buffers, and tests use it as the oracle. ``hsaco`` is an
AMD code object (kernel symbol = the function's name); ``opencl`` is OpenCL C source, compiled for
the agent's ISA at first use through ROCm's comgr (where libamd_comgr is present); ``cuda`` is
CUDA C source or cubin bytes.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Callable

from .hsa_bindings import codeobject, emulated_code
from .hsa_bindings import types as T
from .hsa_bindings.signature import Arg, KernargLayout, parse_signature


@dataclass(frozen=True)
class LoadedKernel:
    """A kernel resolved on one agent: what a dispatch packet needs."""

    kernel_object: int
    kernarg_size: int
    group_segment_size: int
    private_segment_size: int
    layout: KernargLayout
    executable: int
    args: tuple = ()
    hidden: tuple = ()          # codeobject.HiddenArg: dispatch geometry the runtime fills (v5)
    kernarg_align: int = 16     # the kernarg segment's alignment


class Kernel:
    """A GPU kernel with a typed signature; launch it with ``Device.launch``."""

    def __init__(self, body: Callable, signature: str, *, hsaco: bytes | None = None,
                 cuda: str | bytes | None = None, opencl: str | None = None, name: str | None = None):
        if not callable(body):
            raise TypeError("a kernel body must be a function")
        self.body = body
        self.name = name or body.__name__
        self.signature = signature
        self.args: tuple[Arg, ...] = parse_signature(signature)
        self.hsaco = hsaco
        self.cuda = cuda
        self.opencl = opencl
        self._token: int | None = None
        self._compiled: dict[str, bytes] = {}    # ISA -> code object built from ``opencl``
        self.__doc__ = body.__doc__

    @property
    def writes(self) -> list[int]:
        """Indices of the pointer arguments the kernel may write (not ``const``)."""
        return [i for i, a in enumerate(self.args) if a.pointer and not a.const]

    @property
    def reads(self) -> list[int]:
        return [i for i, a in enumerate(self.args) if a.pointer]

    def code_object(self, backend: str, isa: str) -> bytes:
        """The code object to load for ``backend`` on an agent of ``isa``."""
        if backend == "emulator":
            if self._token is None:
                self._token = emulated_code.register(self.body)
            return emulated_code.code_object([(self.name, self.signature, self._token)])
        if self.hsaco is not None:
            return self.hsaco
        if self.opencl is not None:
            if isa not in self._compiled:
                from .hsa_bindings import comgr
                self._compiled[isa] = comgr.compile_opencl(self.opencl, isa)
            return self._compiled[isa]
        raise ValueError(f"kernel {self.name!r} has no AMD code object (hsaco=) or OpenCL C source "
                         f"(opencl=) for {isa}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the reference body directly (on NumPy arrays), e.g. as a test oracle."""
        return self.body(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<Kernel {self.name}({self.signature})>"


def kernel(signature: str, *, hsaco: bytes | None = None, cuda: str | bytes | None = None,
           opencl: str | None = None, name: str | None = None) -> Callable[[Callable], Kernel]:
    """Declare a kernel from its NumPy reference body: ``@aiogpu.kernel("f32*, u32")``."""
    parse_signature(signature)  # bad signatures fail at declaration

    def wrap(body: Callable) -> Kernel:
        return Kernel(body, signature, hsaco=hsaco, cuda=cuda, opencl=opencl, name=name)

    return wrap


def load_kernel(api: Any, agent: Any, kernel: Kernel, isa: str) -> LoadedKernel:
    """Load ``kernel``'s code object for ``agent`` through the executable calls."""
    code = kernel.code_object(api.backend, isa)
    buf = ctypes.create_string_buffer(code, len(code))
    reader = T.hsa_code_object_reader_t()
    api.check(api.hsa_code_object_reader_create_from_memory(buf, len(code), ctypes.byref(reader)),
              f"loading the code object of {kernel.name}")
    exe = T.hsa_executable_t()
    try:
        api.check(api.hsa_executable_create_alt(T.HSA_PROFILE_FULL, T.HSA_DEFAULT_FLOAT_ROUNDING_MODE_DEFAULT,
                                                None, ctypes.byref(exe)), "hsa_executable_create_alt")
        api.check(api.hsa_executable_load_agent_code_object(exe, agent, reader, None, None),
                  f"hsa_executable_load_agent_code_object({kernel.name})")
        api.check(api.hsa_executable_freeze(exe, None), "hsa_executable_freeze")
    finally:
        api.hsa_code_object_reader_destroy(reader)
    sym = T.hsa_executable_symbol_t()
    api.check(api.hsa_executable_get_symbol_by_name(exe, (kernel.name + ".kd").encode(), ctypes.byref(agent),
                                                    ctypes.byref(sym)), f"kernel symbol {kernel.name}.kd")

    def info(attr: int, ctype: Any) -> int:
        value = ctype()
        api.check(api.hsa_executable_symbol_get_info(sym, attr, ctypes.byref(value)), "symbol info")
        return value.value

    lengths = api.backend == "emulator"
    try:   # hidden arguments from the code object's metadata (v5: the dispatch geometry)
        hidden = codeobject.kernel_metadata(code, kernel.name).hidden
    except ValueError:
        hidden = ()
    return LoadedKernel(
        kernel_object=info(T.HSA_EXECUTABLE_SYMBOL_INFO_KERNEL_OBJECT, ctypes.c_uint64),
        kernarg_size=info(T.HSA_EXECUTABLE_SYMBOL_INFO_KERNEL_KERNARG_SEGMENT_SIZE, ctypes.c_uint32),
        group_segment_size=info(T.HSA_EXECUTABLE_SYMBOL_INFO_KERNEL_GROUP_SEGMENT_SIZE, ctypes.c_uint32),
        private_segment_size=info(T.HSA_EXECUTABLE_SYMBOL_INFO_KERNEL_PRIVATE_SEGMENT_SIZE, ctypes.c_uint32),
        layout=KernargLayout.of(kernel.args, hidden_lengths=lengths),
        executable=exe.handle,
        args=kernel.args,
        hidden=hidden,
        kernarg_align=max(16, info(T.HSA_EXECUTABLE_SYMBOL_INFO_KERNEL_KERNARG_SEGMENT_ALIGNMENT, ctypes.c_uint32)),
    )


# -- built-in kernels ---------------------------------------------------------------------------
# CUDA launches ceil(grid / block) blocks; these loops stride over the whole range, so they are
# right for any grid (the CUDA backend launches its own shader copies with a capped grid).
COPY_CU = r"""
extern "C" __global__ void aiogpu_copy(unsigned char* dst, const unsigned char* src, unsigned long long n) {
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    if ((((unsigned long long)dst | (unsigned long long)src) & 15) == 0) {
        unsigned long long n16 = n / 16;
        const uint4* s = (const uint4*)src;
        uint4* d = (uint4*)dst;
        for (unsigned long long k = i; k < n16; k += stride) d[k] = s[k];
        for (unsigned long long k = n16 * 16 + i; k < n; k += stride) dst[k] = src[k];
    } else {
        for (unsigned long long k = i; k < n; k += stride) dst[k] = src[k];
    }
}
"""

FILL_CU = r"""
extern "C" __global__ void aiogpu_fill(unsigned int* dst, unsigned int value, unsigned long long n) {
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long k = i; k < n; k += stride) dst[k] = value;
}
"""


COPY_CL = """
__kernel void aiogpu_copy(__global uchar* dst, __global const uchar* src, ulong n) {
    ulong i = get_global_id(0);
    if (i < n) dst[i] = src[i];
}
"""

FILL_CL = """
__kernel void aiogpu_fill(__global uint* dst, uint value, ulong n) {
    ulong i = get_global_id(0);
    if (i < n) dst[i] = value;
}
"""


@kernel("u8*, const u8*, u64", name="aiogpu_copy", cuda=COPY_CU, opencl=COPY_CL)
def copy_kernel(launch, dst, src, n):
    """Shader copy: the fallback when no SDMA engine (CUDA: copy stream) is available."""
    dst[:n] = src[:n]


@kernel("u32*, u32, u64", name="aiogpu_fill", cuda=FILL_CU, opencl=FILL_CL)
def fill_kernel(launch, dst, value, n):
    """Fill ``n`` 32-bit words with ``value``."""
    dst[:n] = value


BUILTINS = (copy_kernel, fill_kernel)
