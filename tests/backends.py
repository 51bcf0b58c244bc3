"""Backends the public-API tests run on, and what this machine has (shared by conftest.py and
the tests: the emulator always; CUDA where an NVIDIA GPU answers; two-GPU variants and torch
interop only where those are present)."""
from __future__ import annotations

import pytest

import aiogpu
from aiogpu.runtime import cuda_available

CUDA_OK, CUDA_WHY = cuda_available()
BACKENDS = [
    pytest.param("emulator", id="emulator"),
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


def wait_for_baseline(rt: aiogpu.Runtime, timeout: float = 5.0) -> dict:
    """The runtime's stats once nothing is pending (or ``timeout`` passed)."""
    rt.leaks(timeout, buffers=False)
    return rt.stats()


def backend_runtime(backend: str, *, shader_copies: bool = False, **options):
    """A runtime of ``backend`` for the parametrised tests (two emulated GPUs; every CUDA GPU)."""
    if backend == "emulator":
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


