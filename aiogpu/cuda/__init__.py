"""The NVIDIA backend: the aiogpu API on CUDA GPUs through ``cuda-bindings`` (driver API + NVRTC).

``probe()`` says whether it can run here without raising; ``aiogpu.Runtime("cuda")`` (or
auto-selection finding an NVIDIA GPU and no HSA one) returns ``runtime.CudaRuntime``.

Modules, each named after its job:
  driver.py    the driver API: checked calls, error names, the hot-path calls, contexts
  nvrtc.py     CUDA C source -> cubin for a device's architecture (cached per process)
  encode.py    lanes (a stream + its in-order pending futures), loaded kernels, the launch
               encode and device-side waits: the per-operation part, compiled (encode.pxd)
  streams.py   completion words, the event pool
  hostmem.py   host arrays for DMA: registration (cached, counted) and pinned staging
  waiter.py    CudaHub: the adaptive spin, host-function wake-ups, the waiter
  device.py    CudaDevice: memory, kernels, launches
  runtime.py   CudaRuntime: devices, copies, joins, graphs, interop, shutdown
  graphs.py    graphs as CUDA graphs with per-replay kernel-node patches
  interop.py   __cuda_array_interface__ and DLPack for Buffers; foreign device arrays in copies
"""
from __future__ import annotations

_probed: tuple[bool, str] | None = None


def probe() -> tuple[bool, str]:
    """(True, what was found) when cuda-bindings loads, the driver initialises and a GPU answers;
    else (False, why not). Never raises; the answer is cached for the process."""
    global _probed
    if _probed is not None:
        return _probed
    try:
        from cuda.bindings import driver as cu
    except Exception as exc:  # noqa: BLE001 - any failure means "not here"
        _probed = (False, f"cuda-bindings is not installed ({type(exc).__name__}: {exc})")
        return _probed
    try:
        (err,) = cu.cuInit(0)
        if err != 0:
            _probed = (False, f"the CUDA driver did not initialise ({_name(cu, err)})")
            return _probed
        err, count = cu.cuDeviceGetCount()
        if err != 0 or count < 1:
            _probed = (False, "the CUDA driver reports no GPU")
            return _probed
        err, version = cu.cuDriverGetVersion()
        err, dev = cu.cuDeviceGet(0)
        err, name = cu.cuDeviceGetName(128, dev)
        label = name.split(b"\0", 1)[0].decode(errors="replace")
        _probed = (True, f"{count} NVIDIA GPU(s) ({label}), driver API {version // 1000}.{version % 1000 // 10}")
    except Exception as exc:  # noqa: BLE001 - no driver library, no device node, ...
        _probed = (False, f"no usable CUDA driver ({type(exc).__name__}: {exc})")
    return _probed


def _name(cu, err) -> str:
    try:
        e, s = cu.cuGetErrorName(err)
        return s.decode() if e == 0 else str(int(err))
    except Exception:  # noqa: BLE001
        return str(err)
