"""Code object readers, executables and kernel symbols, as ROCr's loader exposes them.

A reader holds the kernels parsed from emulated code-object bytes (``emulated_code.parse``; any
other bytes are HSA_STATUS_ERROR_INVALID_CODE_OBJECT). Loading a reader into an executable for a
GPU agent gives each kernel a kernel object (the value a dispatch packet names, unique per
executable, agent and kernel). Freezing forbids further loads. Destroying an executable forgets
its kernel objects, so a later dispatch of one fails with INVALID_CODE_OBJECT, as a dangling
kernel descriptor would.
"""
from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass, field

from .. import emulated_code
from .. import types as T
from ._abi import StatusError, new_handle, require, store

GROUP_SEGMENT_SIZE = 0
PRIVATE_SEGMENT_SIZE = 0


@dataclass(frozen=True)
class KernelObject:
    handle: int
    gpu: int
    kernel: emulated_code.EmulatedKernel
    executable: int


@dataclass(eq=False)
class Executable:
    handle: int
    frozen: bool = False
    kernels: dict[tuple[int, str], KernelObject] = field(default_factory=dict)  # (gpu, name)
    symbols: dict[tuple[int, str], int] = field(default_factory=dict)  # -> symbol handle


class CodeObjects:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._readers: dict[int, dict[str, emulated_code.EmulatedKernel]] = {}
        self._executables: dict[int, Executable] = {}
        self._symbols: dict[int, KernelObject] = {}
        self._kernel_objects: dict[int, KernelObject] = {}

    # ---- readers ---------------------------------------------------------------------------
    def create_reader(self, address: int, size: int) -> int:
        require(address and size > 0, T.HSA_STATUS_ERROR_INVALID_ARGUMENT, "NULL or empty code object")
        try:
            kernels = emulated_code.parse(ctypes.string_at(address, size))
        except (ValueError, KeyError, TypeError) as exc:
            raise StatusError(T.HSA_STATUS_ERROR_INVALID_CODE_OBJECT, str(exc)) from exc
        handle = new_handle()
        with self._lock:
            self._readers[handle] = kernels
        return handle

    def destroy_reader(self, handle: int) -> None:
        with self._lock:
            require(self._readers.pop(handle, None) is not None,
                    T.HSA_STATUS_ERROR_INVALID_CODE_OBJECT_READER, "unknown reader")

    # ---- executables -----------------------------------------------------------------------
    def create_executable(self) -> int:
        exe = Executable(new_handle())
        with self._lock:
            self._executables[exe.handle] = exe
        return exe.handle

    def load(self, exe_handle: int, gpu: int, reader: int) -> int:
        """Load a reader's kernels for one GPU; returns a loaded-code-object handle."""
        with self._lock:
            exe = self._executable(exe_handle)
            require(not exe.frozen, T.HSA_STATUS_ERROR_FROZEN_EXECUTABLE, "executable is frozen")
            kernels = self._readers.get(reader)
            require(kernels is not None, T.HSA_STATUS_ERROR_INVALID_CODE_OBJECT_READER, "unknown reader")
            for name, kernel in kernels.items():
                ko = KernelObject(new_handle(), gpu, kernel, exe.handle)
                exe.kernels[(gpu, name)] = ko
                self._kernel_objects[ko.handle] = ko
        return new_handle()

    def freeze(self, exe_handle: int) -> None:
        with self._lock:
            self._executable(exe_handle).frozen = True

    def destroy_executable(self, exe_handle: int) -> None:
        with self._lock:
            exe = self._executable(exe_handle)
            del self._executables[exe_handle]
            for ko in exe.kernels.values():
                self._kernel_objects.pop(ko.handle, None)
            for symbol in exe.symbols.values():
                self._symbols.pop(symbol, None)

    def symbol(self, exe_handle: int, name: str, gpu: int | None) -> int:
        """Kernel symbol by name (``name`` or ``name.kd``) for a GPU agent."""
        kernel_name = name[:-3] if name.endswith(".kd") else name
        with self._lock:
            exe = self._executable(exe_handle)
            ko = exe.kernels.get((gpu, kernel_name)) if gpu is not None else None
            require(ko is not None, T.HSA_STATUS_ERROR_INVALID_SYMBOL_NAME,
                    f"no kernel {name!r} for this agent")
            key = (ko.gpu, kernel_name)
            if key not in exe.symbols:
                exe.symbols[key] = new_handle()
                self._symbols[exe.symbols[key]] = ko
            return exe.symbols[key]

    def symbol_info(self, symbol: int, attribute: int, address: int) -> None:
        ko = self._symbols.get(symbol)
        require(ko is not None, T.HSA_STATUS_ERROR_INVALID_EXECUTABLE_SYMBOL, "unknown symbol")
        values = {
            T.HSA_EXECUTABLE_SYMBOL_INFO_KERNEL_OBJECT: (ctypes.c_uint64, ko.handle),
            T.HSA_EXECUTABLE_SYMBOL_INFO_KERNEL_KERNARG_SEGMENT_SIZE: (ctypes.c_uint32, ko.kernel.layout.size),
            T.HSA_EXECUTABLE_SYMBOL_INFO_KERNEL_KERNARG_SEGMENT_ALIGNMENT: (ctypes.c_uint32, ko.kernel.kernarg_align),
            T.HSA_EXECUTABLE_SYMBOL_INFO_KERNEL_GROUP_SEGMENT_SIZE: (ctypes.c_uint32, GROUP_SEGMENT_SIZE),
            T.HSA_EXECUTABLE_SYMBOL_INFO_KERNEL_PRIVATE_SEGMENT_SIZE: (ctypes.c_uint32, PRIVATE_SEGMENT_SIZE),
        }
        require(attribute in values, T.HSA_STATUS_ERROR_INVALID_ARGUMENT, f"symbol attribute {attribute}")
        ctype, value = values[attribute]
        store(address, ctype, value)

    def kernel(self, kernel_object: int, gpu: int) -> emulated_code.EmulatedKernel | None:
        """The kernel a dispatch names, if that kernel object was loaded for this GPU."""
        ko = self._kernel_objects.get(kernel_object)
        return ko.kernel if ko is not None and ko.gpu == gpu else None

    def _executable(self, handle: int) -> Executable:
        exe = self._executables.get(handle)
        if exe is None:
            raise StatusError(T.HSA_STATUS_ERROR_INVALID_EXECUTABLE, f"unknown executable 0x{handle:x}")
        return exe
