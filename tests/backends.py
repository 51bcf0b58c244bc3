"""Backends the public-API tests run on, and what this machine has (shared by conftest.py and
the tests: the emulator always; the real ROCr over the virtual KFD (hsa-virtual) where the
package built it and ROCr 5.2.3 is installed; CUDA where an NVIDIA GPU answers; two-GPU variants
and torch interop only where those are present)."""
from __future__ import annotations

import asyncio
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import aiogpu
from aiogpu.runtime import cuda_available

ROOT = Path(__file__).resolve().parent.parent
# The fake driver in tests/fakes (an instant fake cuda.bindings) runs the CUDA backend's host paths on a
# machine without a GPU, in a child process; where the real cuda-bindings are installed it cannot
# shadow them, and the CUDA tests run those paths on the real driver instead.
on_fake_cuda = pytest.mark.skipif(
    importlib.util.find_spec("cuda") is not None,
    reason="the real cuda-bindings are installed: the fake of tests/fakes cannot shadow them "
           "(the CUDA tests run these paths on the real driver)")


# A child script's opening on the fake driver: a CUDA runtime, its device d0, a buffer x of 16
# int64 zeros, and a graph g of one launch adding 1 to them.
FAKE_CUDA_GRAPH = """
import numpy as np, aiogpu
from gpu_kernels import add_const_n
rt = aiogpu.Runtime("cuda")
d0 = rt.devices[0]
x = d0.alloc(128)
assert aiogpu.copy(x, np.zeros(16, np.int64)).wait(20)
with aiogpu.Graph() as g:
    d0.launch(add_const_n, grid=(16,), block=(16,), args=(x, 1, 16))
"""


def run_on_fake_cuda(script: str, *, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    """``python -c script`` on the fake driver of tests/fakes (CUDA backend by default; ``env`` adds
    variables), from the repository's root, its output captured as text."""
    path = os.pathsep.join([str(ROOT / "tests" / "fakes"), str(ROOT), str(ROOT / "tests")])
    full = {**os.environ, "PYTHONPATH": path, "AIOGPU_BACKEND": "cuda", **env}
    return subprocess.run([sys.executable, "-c", script], env=full, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)

CUDA_OK, CUDA_WHY = cuda_available()

# The builder of the fake libcuda.so.1 (tests/fakes/libcuda), loaded from its path: it is a script,
# not a package module. ``needs_fake_libcuda`` marks the tests that build it.
_spec = importlib.util.spec_from_file_location("build_libcuda", ROOT / "tests" / "fakes" / "libcuda" / "build_libcuda.py")
build_libcuda = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build_libcuda)
needs_fake_libcuda = pytest.mark.skipif(
    build_libcuda.compiler() is None,
    reason="no C compiler (tried $CC, cc, gcc, clang): the fake libcuda.so.1 cannot be built")


def _hsa_virtual_available() -> tuple[bool, str]:
    """The virtual KFD with ROCr, and comgr with the OpenCL headers: the test kernels have only
    NumPy bodies, and ROCr needs a code object, compiled from their signatures."""
    from aiogpu import vkfd
    from aiogpu.hsa_bindings import comgr

    ok, why = vkfd.available()
    if not ok:
        return ok, why
    has_comgr, why_not = comgr.available()
    if not has_comgr or comgr.opencl_header_dir() is None:
        return False, f"comgr cannot compile the kernels' stub code objects ({why_not}; needs libamd-comgr2, " \
                      f"rocm-device-libs and libclang-common-14-dev)"
    return True, why


VIRTUAL_OK, VIRTUAL_WHY = _hsa_virtual_available()
on_hsa_virtual = pytest.mark.skipif(not VIRTUAL_OK, reason=f"hsa-virtual is unavailable here: {VIRTUAL_WHY}")
HSA_VIRTUAL = pytest.param("hsa-virtual", id="hsa-virtual", marks=[pytest.mark.hsa_virtual, on_hsa_virtual])
BACKENDS = [
    pytest.param("emulator", id="emulator"),
    HSA_VIRTUAL,
    pytest.param("cuda", id="cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
        not CUDA_OK, reason=f"the CUDA backend is unavailable here: {CUDA_WHY}")]),
]


def _cuda_gpu_count() -> int:
    if not CUDA_OK:
        return 0
    from cuda.bindings import driver as cu

    err, count = cu.cuDeviceGetCount()
    return count if err == 0 else 0


CUDA_GPUS = _cuda_gpu_count()
BACKENDS_2GPU = [   # the emulated runtimes have two GPUs
    pytest.param("emulator", id="emulator"),
    HSA_VIRTUAL,
    pytest.param("cuda", id="cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
        CUDA_GPUS < 2, reason=f"needs two NVIDIA GPUs; {CUDA_GPUS} here ({CUDA_WHY})")]),
]


def _torch_with_cuda() -> bool:
    if not CUDA_OK:
        return False
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


TORCH_CUDA = _torch_with_cuda()


def _cupy_with_cuda() -> bool:
    if not CUDA_OK:
        return False
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - not installed, or without a usable driver
        return False


CUPY_CUDA = _cupy_with_cuda()
needs_torch = pytest.mark.skipif(not TORCH_CUDA, reason=f"needs the CUDA backend and a CUDA build of torch ({CUDA_WHY})")
needs_cupy = pytest.mark.skipif(not CUPY_CUDA, reason=f"needs the CUDA backend and CuPy with a GPU ({CUDA_WHY})")


def wait_until(predicate, timeout: float = 10.0) -> bool:
    """Whether ``predicate()`` holds within ``timeout`` s (polled): for what the waiter thread
    does shortly after a future settles (retirement, releases)."""
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.002)
    return predicate()


def wait_for_baseline(rt: aiogpu.Runtime, timeout: float = 5.0) -> dict:
    """The runtime's stats once nothing is pending (or ``timeout`` passed)."""
    rt.leaks(timeout, buffers=False)
    return rt.stats()


def backend_runtime(backend: str, *, shader_copies: bool = False, **options):
    """A runtime of ``backend`` for the parametrised tests (two emulated GPUs; every CUDA GPU)."""
    if backend in ("emulator", "hsa-virtual"):
        options.setdefault("gpus", 2)
    if shader_copies:
        options["copy_engines"] = False
    return aiogpu.Runtime(backend, **options)


def _close_checked(rt) -> None:
    """Close ``rt`` after checking (the one leak check, ``Runtime.leaks``) that nothing leaked."""
    if rt.closed:
        return
    leaks = rt.leaks(5.0, buffers=False)
    emulator = getattr(getattr(rt, "api", None), "emulator", None)
    rt.close()
    assert leaks == {}, leaks
    assert not (emulator and emulator.kernarg_mismatches), emulator.kernarg_mismatches


def runtime_factory(backend: str):
    """The body of a factory fixture: yields ``make(**options)``, which opens a runtime of
    ``backend`` as ``backend_runtime`` does; once the test is done, closes every runtime it
    opened after checking that nothing leaked (``_close_checked``)."""
    made = []

    def make(**options):
        rt = backend_runtime(backend, **options)
        made.append(rt)
        return rt

    yield make
    for rt in made:
        _close_checked(rt)


def _loop_runners() -> list:
    out = [pytest.param(asyncio.run, id="asyncio")]
    try:
        import uvloop
        out.append(pytest.param(uvloop.run, id="uvloop"))
    except ImportError:       # pragma: no cover - uvloop is a dependency off Windows
        pass
    return out


# How a test runs its coroutine: asyncio.run, and uvloop.run where uvloop is installed.
LOOP_RUNNERS = _loop_runners()


class Ticks:
    """Counts the running loop's iterations: a callback that queues itself again each one
    (as timers and I/O get their turn in each)."""

    def __init__(self) -> None:
        self.n, self._stopped, self._loop = 0, False, asyncio.get_running_loop()

    def start(self) -> None:
        self._loop.call_soon(self._tick)

    def stop(self) -> None:
        self._stopped = True

    def _tick(self) -> None:
        self.n += 1
        if not self._stopped:
            self._loop.call_soon(self._tick)


class Batches:
    """Counts a trio run's scheduler batches, trio's analogue of a loop iteration: an
    instrument whose ``after_io_wait`` hook runs once before each batch is taken from the run
    queue (trio's ``unrolled_run``), so every task of one batch reads the same ``n``."""

    def __init__(self) -> None:
        self.n = 0

    def start(self) -> None:
        import trio

        trio.lowlevel.add_instrument(self)

    def after_io_wait(self, _timeout: float) -> None:
        self.n += 1


def count_calls(monkeypatch: Any, obj: Any, name: str) -> list:
    """Replace ``obj.name`` (for the test) by a wrapper that records each call's positional
    arguments in the returned list and then calls the original."""
    calls: list = []
    real = getattr(obj, name)

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, spy)
    return calls
