"""CUDA C source -> cubin with NVRTC, for one device architecture, cached per process and on disk.

A kernel's ``cuda=`` source is compiled once per (source, architecture) with
``--gpu-architecture=sm_XY``; when this NVRTC does not know the architecture it falls back to
PTX for the newest virtual architecture it knows, which the driver then JIT-compiles.
Compilation errors are ``ValueError`` (bad input) carrying NVRTC's log.

Thread-safe, and meant to run off the event loop (``Device.load``; a first launch compiles on a
worker thread): the lock guards only the in-process cache, never a compile (cuda-bindings
releases the GIL inside NVRTC), so two kernels compile at once and a cache hit never waits for
another kernel's compile. Results are also kept in the on-disk cache (``aiogpu.compile_cache``),
keyed by the source, the architecture, the options and NVRTC's version.
"""
from __future__ import annotations

import threading

from .. import compile_cache

# (source, architecture) -> image: keyed by the source itself (a str caches its hash, so the
# question ``cached`` answers before every copy costs a dictionary lookup, not a digest of the
# source; the kernels keep their sources alive anyway).
_cache: dict[tuple[str, str], tuple[bytes, str]] = {}
_lock = threading.Lock()

OPTIONS = [b"--std=c++17", b"-default-device"]
_version: list[str] = []


def cached(source: str, major: int, minor: int) -> bool:
    """Whether ``source`` is compiled for ``major.minor`` in this process already (no compile)."""
    key = (source, f"{major}{minor}")
    with _lock:
        return key in _cache


def version() -> str:
    """NVRTC's version ("12.4"), part of the disk cache's key."""
    if not _version:
        from cuda.bindings import nvrtc
        got = nvrtc.nvrtcVersion()
        _version.append(f"{got[1]}.{got[2]}" if got[0] == nvrtc.nvrtcResult.NVRTC_SUCCESS else "?")
    return _version[0]


def compile_source(source: str, name: str, major: int, minor: int) -> tuple[bytes, str]:
    """(image bytes, "cubin" or "ptx") for ``source`` on compute capability ``major.minor``."""
    arch = f"{major}{minor}"
    key = (source, arch)
    with _lock:
        hit = _cache.get(key)
    if hit is not None:
        return hit
    disk = compile_cache.key("nvrtc", version(), arch, b" ".join(OPTIONS), source)
    stored = compile_cache.get(disk)
    image: tuple[bytes, str] | None = None
    if stored is not None:
        kind, _, code = stored.partition(b"\0")
        if kind in (b"cubin", b"ptx") and code:
            image = (code, kind.decode())
    if image is None:
        image = _compile(source, name, arch)
        compile_cache.put(disk, image[1].encode() + b"\0" + image[0])
    with _lock:
        return _cache.setdefault(key, image)


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
