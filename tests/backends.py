"""Backends the public-API tests run on, and what this machine has (shared by conftest.py and
the tests: the emulator always; CUDA where an NVIDIA GPU answers; two-GPU variants and torch
interop only where those are present)."""
from __future__ import annotations

import time

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
    deadline = time.monotonic() + timeout
    while True:
        stats = rt.stats()
        if (stats["pending"] == 0 and stats["signals_in_use"] == 0 and stats["kernarg_in_use"] == 0
                and stats["backlog"] == 0 and stats["host_locks"] == 0) or time.monotonic() > deadline:
            return stats


def backend_runtime(backend: str, *, shader_copies: bool = False):
    """A runtime of ``backend`` for the parametrised tests (two emulated GPUs; every CUDA GPU)."""
    if backend == "emulator":
        return aiogpu.Runtime("emulator", gpus=2, **({"sdma_engines": 0} if shader_copies else {}))
    return aiogpu.Runtime(backend, **({"copy_engines": False} if shader_copies else {}))


def _close_checked(rt) -> None:
    if rt.closed:
        return
    stats = wait_for_baseline(rt)
    emulator = getattr(getattr(rt, "api", None), "emulator", None)
    rt.close()
    assert not (emulator and emulator.kernarg_mismatches), emulator.kernarg_mismatches
    assert stats["pending"] == 0, stats
    assert stats["signals_in_use"] == 0, stats
    assert stats["kernarg_in_use"] == 0, stats
    assert stats["host_locks"] == 0, stats


