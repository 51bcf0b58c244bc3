"""CUDA C source -> cubin with NVRTC, for one device architecture, cached per process.

A kernel's ``cuda=`` source is compiled once per (source, architecture) with
``--gpu-architecture=sm_XY``; when this NVRTC does not know the architecture it falls back to
PTX for the newest virtual architecture it knows, which the driver then JIT-compiles.
Compilation errors are ``ValueError`` (bad input, raised before anything is submitted) carrying
NVRTC's log.
"""
from __future__ import annotations

import hashlib
import threading

_cache: dict[tuple[str, str], tuple[bytes, str]] = {}
_lock = threading.Lock()

OPTIONS = [b"--std=c++17", b"-default-device"]


def compile_source(source: str, name: str, major: int, minor: int) -> tuple[bytes, str]:
    """(image bytes, "cubin" or "ptx") for ``source`` on compute capability ``major.minor``."""
    arch = f"{major}{minor}"
    key = (hashlib.sha256(source.encode()).hexdigest(), arch)
    with _lock:
        hit = _cache.get(key)
        if hit is not None:
            return hit
        image = _compile(source, name, arch)
        _cache[key] = image
        return image


def _compile(source: str, name: str, arch: str) -> tuple[bytes, str]:
    from cuda.bindings import nvrtc

    def ok(result, what):
        err = result[0]
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"{what}: {nvrtc.nvrtcGetErrorString(err)[1]!r}")
        return result[1] if len(result) > 1 else None

    prog = ok(nvrtc.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], []),
              "nvrtcCreateProgram")
    try:
        for target, kind in ((f"sm_{arch}", "cubin"), (f"compute_{arch}", "ptx"), (None, "ptx")):
            opts = list(OPTIONS) + ([f"--gpu-architecture={target}".encode()] if target else [])
            (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
            if err == nvrtc.nvrtcResult.NVRTC_SUCCESS:
                if kind == "cubin":
                    size = ok(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
                    buf = b" " * size
                    ok(nvrtc.nvrtcGetCUBIN(prog, buf), "nvrtcGetCUBIN")
                else:
                    size = ok(nvrtc.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
                    buf = b" " * size
                    ok(nvrtc.nvrtcGetPTX(prog, buf), "nvrtcGetPTX")
                return bytes(buf), kind
            log = _log(nvrtc, prog)
            if err == nvrtc.nvrtcResult.NVRTC_ERROR_COMPILATION:
                raise ValueError(f"NVRTC could not compile the CUDA source of kernel {name!r}:\n{log}")
        raise ValueError(f"NVRTC knows no architecture for sm_{arch} (kernel {name!r})")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _log(nvrtc, prog) -> str:
    err, size = nvrtc.nvrtcGetProgramLogSize(prog)
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS or size <= 1:
        return ""
    buf = b" " * size
    nvrtc.nvrtcGetProgramLog(prog, buf)
    return buf.rstrip(b"\0 ").decode(errors="replace")
