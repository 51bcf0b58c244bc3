"""Kernels on HSA: the code object for an agent, loading it through the executable calls, and
the kernarg bytes of a dispatch.

The code object comes from the kernel's ``hsaco=`` bytes, else its ``opencl=`` source compiled
for the agent's ISA through ROCm's comgr (once per ISA), and on the emulator from the NumPy
reference body (registered once per process).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

from ..hsa_bindings import codeobject, emulated_code
from ..hsa_bindings import types as T
from ..hsa_bindings.signature import KernargLayout, pack
from ..kernels import Kernel


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
    # The code object's memory: ROCr's loader keeps pointing at it (its link map names it) for
    # as long as the executable exists, so it lives as long as this does (see ``unload_kernel``).
    code: Any = None


def code_object(kernel: Kernel, backend: str, isa: str) -> bytes:
    """The code object to load for ``backend`` (``hsa`` or ``emulator``) on an agent of ``isa``.
    ValueError when the kernel has no AMD implementation."""
    if backend == "emulator":
        token = kernel.artifacts.get("emulator")
        if token is None:
            token = kernel.artifacts["emulator"] = emulated_code.register(kernel.body)
        return emulated_code.code_object([(kernel.name, kernel.signature, token)])
    if kernel.hsaco is not None:
        return kernel.hsaco
    if kernel.opencl is not None:
        key = ("opencl", isa)
        if key not in kernel.artifacts:
            from ..hsa_bindings import comgr
            kernel.artifacts[key] = comgr.compile_opencl(kernel.opencl, isa)
        return kernel.artifacts[key]
    raise ValueError(f"kernel {kernel.name!r} has no AMD code object (hsaco=) or OpenCL C source "
                     f"(opencl=) for {isa}")


def needs_compile(kernel: Kernel, backend: str, isa: str) -> bool:
    """Whether ``code_object`` would compile (OpenCL C through comgr, not compiled yet)."""
    return (backend != "emulator" and kernel.hsaco is None and kernel.opencl is not None
            and ("opencl", isa) not in kernel.artifacts)


def load_kernel(api: Any, agent: Any, kernel: Kernel, isa: str) -> LoadedKernel:
    """Load ``kernel``'s code object for ``agent`` through the executable calls. The code
    object's memory is kept with the result until ``unload_kernel``."""
    code = code_object(kernel, api.backend, isa)
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
        code=buf,
    )


def unload_kernel(api: Any, loaded: LoadedKernel) -> None:
    """Destroy ``loaded``'s executable (no dispatch of it may be pending: its queues are gone);
    its code object's memory may be freed after this."""
    api.hsa_executable_destroy(T.hsa_executable_t(loaded.executable))


def pack_args(loaded: LoadedKernel, values: list, lengths: list, grid: tuple, block: tuple) -> bytes:
    """Kernarg bytes, padded to the segment size the code object asks for, with the hidden
    dispatch-geometry arguments (code object v5) filled for ``grid``/``block``."""
    data = pack(loaded.args, loaded.layout, values, lengths)
    data += bytes(max(0, loaded.kernarg_size - len(data)))
    return codeobject.fill_hidden(loaded.hidden, data, grid, block)
