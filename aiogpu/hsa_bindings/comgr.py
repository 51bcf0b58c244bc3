"""OpenCL C to an AMD code object, through ROCm's code object manager (libamd_comgr), by ctypes.

``compile_opencl(source, isa)`` runs comgr's pipeline, the one ROCm's own runtimes use: compile
the source to LLVM bitcode with the device libraries linked in, generate a relocatable object for
the agent's ISA, link it into an executable code object (the bytes ``hsa_code_object_reader_*``
loads). Where libamd_comgr is absent, ``available()`` says why and nothing else changes.

Code objects are kept in the on-disk cache (``aiogpu.compile_cache``), keyed by the source, the
ISA, the options and comgr's version, so a second process loads them without compiling. comgr
is called through ctypes, which releases the GIL: a compile on a worker thread (``Device.load``,
or a first launch) leaves the event loop running.
"""
from __future__ import annotations

import ctypes
import glob
from ctypes import POINTER, c_bool, c_char_p, c_int32, c_size_t, c_uint64
from functools import lru_cache

from .. import compile_cache

LIBRARY = "libamd_comgr.so.2"

STATUS_SUCCESS = 0
LANGUAGE_OPENCL_1_2 = 1
DATA_KIND_SOURCE, DATA_KIND_LOG, DATA_KIND_BC, DATA_KIND_RELOCATABLE, DATA_KIND_EXECUTABLE = 1, 5, 6, 7, 8
ACTION_CODEGEN_BC_TO_RELOCATABLE = 0x6
ACTION_LINK_RELOCATABLE_TO_EXECUTABLE = 0x9
ACTION_COMPILE_SOURCE_WITH_DEVICE_LIBS_TO_BC = 0xF


class _Handle(ctypes.Structure):
    _fields_ = [("handle", c_uint64)]


Data, DataSet, ActionInfo = (type(n, (_Handle,), {}) for n in ("Data", "DataSet", "ActionInfo"))

S = c_int32
PROTOTYPES = {
    "amd_comgr_status_string": (S, [S, POINTER(c_char_p)]),
    "amd_comgr_create_data": (S, [c_int32, POINTER(Data)]),
    "amd_comgr_set_data": (S, [Data, c_size_t, c_char_p]),
    "amd_comgr_set_data_name": (S, [Data, c_char_p]),
    "amd_comgr_get_data": (S, [Data, POINTER(c_size_t), c_char_p]),
    "amd_comgr_release_data": (S, [Data]),
    "amd_comgr_create_data_set": (S, [POINTER(DataSet)]),
    "amd_comgr_destroy_data_set": (S, [DataSet]),
    "amd_comgr_data_set_add": (S, [DataSet, Data]),
    "amd_comgr_action_data_count": (S, [DataSet, c_int32, POINTER(c_size_t)]),
    "amd_comgr_action_data_get_data": (S, [DataSet, c_int32, c_size_t, POINTER(Data)]),
    "amd_comgr_create_action_info": (S, [POINTER(ActionInfo)]),
    "amd_comgr_destroy_action_info": (S, [ActionInfo]),
    "amd_comgr_action_info_set_isa_name": (S, [ActionInfo, c_char_p]),
    "amd_comgr_action_info_set_language": (S, [ActionInfo, c_int32]),
    "amd_comgr_action_info_set_option_list": (S, [ActionInfo, POINTER(c_char_p), c_size_t]),
    "amd_comgr_action_info_set_logging": (S, [ActionInfo, c_bool]),
    "amd_comgr_do_action": (S, [c_int32, ActionInfo, DataSet, DataSet]),
}


class ComgrError(RuntimeError):
    """comgr failed; the message carries the compiler's log where there is one."""


@lru_cache(maxsize=1)
def _library() -> tuple[ctypes.CDLL | None, str]:
    try:
        lib = ctypes.CDLL(LIBRARY)
    except OSError as exc:
        return None, f"{LIBRARY} not loadable ({exc})"
    for name, (restype, argtypes) in PROTOTYPES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib, f"{LIBRARY} loaded"


def version() -> str:
    """comgr's version ("2.4"), part of the disk cache's key ("?" where it cannot tell)."""
    lib, _ = _library()
    if lib is None or not hasattr(lib, "amd_comgr_get_version"):
        return "?"
    major, minor = c_size_t(0), c_size_t(0)
    fn = lib.amd_comgr_get_version
    fn.restype, fn.argtypes = None, [POINTER(c_size_t), POINTER(c_size_t)]
    fn(ctypes.byref(major), ctypes.byref(minor))
    return f"{major.value}.{minor.value}"


def available() -> tuple[bool, str]:
    lib, why = _library()
    return lib is not None, why


def _check(lib: ctypes.CDLL, status: int, what: str, log: str = "") -> None:
    if status != STATUS_SUCCESS:
        text = c_char_p()
        lib.amd_comgr_status_string(status, ctypes.byref(text))
        detail = f"\n{log}" if log else ""
        raise ComgrError(f"{what}: {(text.value or b'?').decode()}{detail}")


@lru_cache(maxsize=1)
def opencl_header_dir() -> str | None:
    """Where clang's ``opencl-c.h`` lives (Debian: libclang-common-*-dev); comgr compiles OpenCL
    C against it. Newest clang first."""
    found = sorted(glob.glob("/usr/lib/llvm-*/lib/clang/*/include/opencl-c.h"), reverse=True)
    found += glob.glob("/opt/rocm*/llvm/lib/clang/*/include/opencl-c.h")
    return found[0].rsplit("/", 1)[0] if found else None


def default_options() -> tuple[str, ...]:
    inc = opencl_header_dir()
    header = ("-I" + inc, "-Xclang", "-finclude-default-header") if inc else ()
    return ("-O3", *header)


def isa_name(_agent_name: str) -> str:
    """comgr's ISA name for an HSA agent name such as ``gfx90a``."""
    return _agent_name if _agent_name.startswith("amdgcn-") else f"amdgcn-amd-amdhsa--{_agent_name}"


def compile_opencl(source: str, isa: str, *, options: tuple[str, ...] | None = None) -> bytes:
    """An executable AMD code object for ``isa`` (``gfx90a`` or a full comgr ISA name), from
    the disk cache when it holds one. ComgrError (with the compiler's log) when it fails."""
    lib, why = _library()
    if lib is None:
        raise ComgrError(f"cannot compile OpenCL C: {why}")
    if options is None:
        options = default_options()
    name = compile_cache.key("comgr", version(), isa_name(isa), "\0".join(options), source)
    return compile_cache.cached(name, lambda: _compile(lib, source, isa, options))


def _compile(lib: ctypes.CDLL, source: str, isa: str, options: tuple[str, ...]) -> bytes:
    owned: list[tuple[str, object]] = []

    def new(kind: str, cls: type, create: str) -> object:
        obj = cls()
        _check(lib, getattr(lib, create)(ctypes.byref(obj)), create)
        owned.append((kind, obj))
        return obj

    def new_set() -> object:
        return new("set", DataSet, "amd_comgr_create_data_set")

    try:
        src = Data()
        _check(lib, lib.amd_comgr_create_data(DATA_KIND_SOURCE, ctypes.byref(src)), "create source")
        owned.append(("data", src))
        body = source.encode()
        _check(lib, lib.amd_comgr_set_data(src, len(body), body), "set source")
        _check(lib, lib.amd_comgr_set_data_name(src, b"aiogpu_kernel.cl"), "name source")
        inputs = new_set()
        _check(lib, lib.amd_comgr_data_set_add(inputs, src), "add source")
        info = new("info", ActionInfo, "amd_comgr_create_action_info")
        _check(lib, lib.amd_comgr_action_info_set_isa_name(info, isa_name(isa).encode()), f"ISA {isa}")
        _check(lib, lib.amd_comgr_action_info_set_language(info, LANGUAGE_OPENCL_1_2), "language")
        _check(lib, lib.amd_comgr_action_info_set_logging(info, True), "logging")
        opts = (c_char_p * len(options))(*[o.encode() for o in options])
        _check(lib, lib.amd_comgr_action_info_set_option_list(info, opts, len(options)), "options")
        current = inputs
        for action, what in ((ACTION_COMPILE_SOURCE_WITH_DEVICE_LIBS_TO_BC, "compile OpenCL C to bitcode"),
                             (ACTION_CODEGEN_BC_TO_RELOCATABLE, "generate code"),
                             (ACTION_LINK_RELOCATABLE_TO_EXECUTABLE, "link the code object")):
            result = new_set()
            status = lib.amd_comgr_do_action(action, info, current, result)
            _check(lib, status, what, _log(lib, result, owned))
            current = result
        return _bytes(lib, current, DATA_KIND_EXECUTABLE, owned)
    finally:
        for kind, obj in reversed(owned):
            {"data": lib.amd_comgr_release_data, "set": lib.amd_comgr_destroy_data_set,
             "info": lib.amd_comgr_destroy_action_info}[kind](obj)


def _bytes(lib: ctypes.CDLL, data_set: object, kind: int, owned: list) -> bytes:
    data = Data()
    _check(lib, lib.amd_comgr_action_data_get_data(data_set, kind, 0, ctypes.byref(data)), "get result")
    owned.append(("data", data))
    size = c_size_t(0)
    _check(lib, lib.amd_comgr_get_data(data, ctypes.byref(size), None), "result size")
    buf = ctypes.create_string_buffer(size.value)
    _check(lib, lib.amd_comgr_get_data(data, ctypes.byref(size), buf), "result bytes")
    return buf.raw[:size.value]


def _log(lib: ctypes.CDLL, data_set: object, owned: list) -> str:
    count = c_size_t(0)
    if lib.amd_comgr_action_data_count(data_set, DATA_KIND_LOG, ctypes.byref(count)) or not count.value:
        return ""
    try:
        return _bytes(lib, data_set, DATA_KIND_LOG, owned).decode(errors="replace")
    except ComgrError:
        return ""
