"""Kernel dispatches on the virtual KFD: the kernel's NumPy reference body stands in for its
machine code.

The real ROCr loads a real code object (``hsaco=``, ``opencl=`` compiled by comgr, or, for a
kernel with only a body, a stub compiled from its signature: ``stub_source``); a dispatch's
``kernel_object`` is the address of the kernel descriptor ROCr's loader placed. aiogpu's HSA
kernel loader registers each kernel object it loads (``register``), so the dispatch callback
finds the kernel without reading ROCr's link map. The body is called as on the emulator,
``body(launch, *args)``, with the explicit arguments decoded from the kernarg segment: pointer
arguments become NumPy views (``DeviceArray``: an access out of bounds is a GPU memory fault)
of the length of the Buffer behind them, which aiogpu knows at launch (``remember_lengths``;
the real ABI passes bare pointers), else up to the end of the allocation holding the pointer
(aiogpu sub-allocates: that may cover other buffers, so only launches aiogpu did not make see it).

How a dispatch ends, as KFD and ROCr report it: a body's out-of-bounds access is a GPU memory
fault (memory-exception event, the device's queues evicted); any other exception (BaseException
included) a trap, which ROCr reports as HSA_STATUS_ERROR_EXCEPTION through the queue's error
callback; a kernel object nobody registered an invalid code object.
"""
from __future__ import annotations

import atexit
import collections
import ctypes
import threading
import traceback
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..hsa_bindings import signature
from ..hsa_bindings.emulator.dispatch import DeviceArray, KernelError, Launch
from ..hsa_bindings.emulator.memory import MemoryFault

CP_ERROR_INVALID_CODE = 8          # AqlQueue::DynamicScratchHandler: "Invalid (or NULL) code"
CP_ERROR_TRAP = 0x80000000         # "Debug trap": HSA_STATUS_ERROR_EXCEPTION
OPENCL_TYPES = {"f32": "float", "f64": "double", "i8": "char", "i16": "short", "i32": "int", "i64": "long",
                "u8": "uchar", "u16": "ushort", "u32": "uint", "u64": "ulong"}
_LENGTHS_KEPT = 1 << 16


@dataclass(frozen=True)
class Registered:
    name: str
    body: Any
    args: tuple
    layout: signature.KernargLayout
    explicit_size: int


_lock = threading.Lock()
_kernels: dict[int, Registered] = {}
_lengths: "collections.OrderedDict[tuple[int, bytes], tuple[int, ...]]" = collections.OrderedDict()
_by_address: dict[int, int] = {}       # pointer -> the byte length of its latest launch
_code: list = []                       # code-object buffers ROCr's link map points at
errors: "collections.deque[BaseException]" = collections.deque(maxlen=64)   # the bodies' recent failures
_vk: Any = None


def stub_source(name: str, args: tuple) -> str:
    """OpenCL C of an empty kernel with ``args``' parameters: a code object ROCr can load for a
    kernel that has only a NumPy body (the body does the work on the virtual KFD)."""
    params = []
    for i, a in enumerate(args):
        t = OPENCL_TYPES[a.type_name]
        params.append(f"__global {'const ' if a.const else ''}{t}* a{i}" if a.pointer else f"{t} a{i}")
    pragma = "#pragma OPENCL EXTENSION cl_khr_fp64 : enable\n" if any(a.type_name == "f64" for a in args) else ""
    return f"{pragma}__kernel void {name}({', '.join(params)}) {{ }}\n"


def install(vk: Any) -> None:
    """Route the virtual KFD's user dispatches here (once per process)."""
    global _vk
    with _lock:
        if _vk is None:
            _vk = vk
            vk.set_dispatch_callback(_dispatch)
            # no engine thread may call into an interpreter that is finalising
            atexit.register(vk.set_dispatch_callback, None)


def register(kernel_object: int, name: str, body: Any, args: tuple, code: Any = None) -> None:
    """Kernel object ``kernel_object`` (a loaded kernel descriptor) runs ``body``. ``code``: the
    code object's buffer, kept alive (ROCr's link map names it)."""
    layout = signature.KernargLayout.of(args, hidden_lengths=False)
    explicit = max((off + a.size for a, off in zip(args, layout.offsets)), default=0)
    with _lock:
        _kernels[kernel_object] = Registered(name, body, args, layout, explicit)
        if code is not None:
            _code.append(code)
        if _vk is not None:
            _vk.note_user_kernel(kernel_object)


def remember_lengths(kernel_object: int, kernarg: bytes, lengths: list) -> None:
    """The byte lengths of a launch's pointer arguments (its Buffers'), for the dispatch whose
    explicit kernel arguments are ``kernarg``'s; also per pointer, for dispatches whose exact
    arguments were forgotten (a graph's, replayed long after it was built)."""
    entry = _kernels.get(kernel_object)
    if entry is None or not lengths:
        return
    key = (kernel_object, bytes(kernarg[:entry.explicit_size]))
    sizes = tuple(int(n) for n in lengths)
    pointers = [int.from_bytes(kernarg[off:off + 8], "little")
                for a, off in zip(entry.args, entry.layout.offsets) if a.pointer]
    with _lock:
        _lengths[key] = sizes
        _lengths.move_to_end(key)
        while len(_lengths) > _LENGTHS_KEPT:
            _lengths.popitem(last=False)
        _by_address.update(zip(pointers, sizes))


def _dispatch(gpu, kobj, karg, grid, wg, dims, _group, _private) -> int:
    vk = _vk
    entry = _kernels.get(kobj)
    if entry is None or vk is None:
        return CP_ERROR_INVALID_CODE
    launch = Launch(tuple(grid[i] for i in range(dims)), tuple(wg[i] for i in range(dims)), dims, gpu)
    try:
        size = max(entry.explicit_size, 1)
        host = vk.host_address(karg, size)
        if not host:
            raise MemoryFault(karg, f"kernarg segment of {entry.name}")
        data = ctypes.string_at(host, size) + bytes(entry.layout.size - size if entry.layout.size > size else 0)
        values, _ = signature.unpack(entry.args, entry.layout, data)
        with _lock:
            lengths = _lengths.get((kobj, data[:entry.explicit_size]))
            pointer_lengths = iter(lengths or [_by_address.get(int(v)) for a, v in zip(entry.args, values) if a.pointer])
        args = []
        for i, (a, v) in enumerate(zip(entry.args, values)):
            if a.pointer:
                args.append(_view(vk, gpu, entry.name, i, a, int(v), next(pointer_lengths, None)))
            else:
                args.append(v)
        entry.body(launch, *args)
        return 0
    except MemoryFault as fault:
        _remember(fault)
        vk.report_fault(fault.address)
        return -1
    except BaseException as exc:    # SystemExit/KeyboardInterrupt end the dispatch, not the engine
        err = KernelError(entry.name, launch, exc)
        err.__cause__ = exc
        _remember(err)
        return CP_ERROR_TRAP


def _remember(exc: BaseException) -> None:
    for e in (exc, exc.__cause__):
        if e is not None:
            traceback.clear_frames(e.__traceback__)
    errors.append(exc)


def _view(vk: Any, gpu: int, kernel: str, index: int, arg: Any, address: int, nbytes: int | None) -> np.ndarray:
    if nbytes is None:      # a launch aiogpu did not describe: up to the end of the allocation
        found = vk.allocation(address)
        nbytes = found[0] + found[1] - address if found else 0
    where = f"kernel {kernel} argument {index} ({arg})"
    if nbytes and not vk.can_access(gpu, address, nbytes):
        raise MemoryFault(address, f"{where}: memory not mapped for GPU {gpu}")
    host = vk.host_address(address, max(nbytes, 1)) if nbytes else 0
    if nbytes and not host:
        raise MemoryFault(address, f"{where}: no allocation holds it")
    usable = nbytes - nbytes % arg.dtype.itemsize
    raw = np.frombuffer((ctypes.c_char * usable).from_address(host), dtype=np.uint8) if usable else np.zeros(0, np.uint8)
    view = raw.view(arg.dtype).view(DeviceArray)
    view._where = where
    if arg.const:
        view.flags.writeable = False
    return view
