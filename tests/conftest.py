"""Fixtures shared by the runtime tests: a fresh runtime per test, checked for leaks.

``rt``/``make_runtime`` are emulated runtimes (tests that look at emulator internals);
``any_rt`` runs a public-API test once per backend: the emulator, and CUDA where
``aiogpu.runtime.cuda_available()`` finds an NVIDIA GPU (skipped cleanly elsewhere).
"""
from __future__ import annotations

import time

import numpy as np
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


@pytest.fixture
def make_runtime():
    """Factory for emulated runtimes; each is closed and checked for leaks after the test."""
    made = []

    def make(**options):
        options.setdefault("gpus", 2)
        rt = aiogpu.Runtime("emulator", **options)
        made.append(rt)
        return rt

    yield make
    for rt in made:
        if not rt.closed:
            stats = wait_for_baseline(rt)
            rt.close()
            assert stats["pending"] == 0, stats
            assert stats["signals_in_use"] == 0, stats
            assert stats["kernarg_in_use"] == 0, stats
            assert stats["host_locks"] == 0, stats


def _close_checked(rt) -> None:
    if rt.closed:
        return
    stats = wait_for_baseline(rt)
    rt.close()
    assert stats["pending"] == 0, stats
    assert stats["signals_in_use"] == 0, stats
    assert stats["kernarg_in_use"] == 0, stats
    assert stats["host_locks"] == 0, stats


def backend_runtime(backend: str, *, shader_copies: bool = False):
    """A runtime of ``backend`` for the parametrised tests (two emulated GPUs; every CUDA GPU)."""
    if backend == "emulator":
        return aiogpu.Runtime("emulator", gpus=2, **({"sdma_engines": 0} if shader_copies else {}))
    return aiogpu.Runtime(backend, **({"copy_engines": False} if shader_copies else {}))


@pytest.fixture(params=BACKENDS)
def any_backend(request):
    return request.param


@pytest.fixture
def make_any(any_backend):
    """Factory of runtimes of the test's backend; each is closed and checked for leaks."""
    made = []

    def make(**options):
        rt = backend_runtime(any_backend, **options)
        made.append(rt)
        return rt

    yield make
    for rt in made:
        _close_checked(rt)


@pytest.fixture
def any_rt(make_any):
    """A fresh runtime of each backend (emulator; CUDA where available), checked for leaks."""
    return make_any()


@pytest.fixture(params=BACKENDS_2GPU)
def any_rt2(request):
    """Like ``any_rt``, for tests that need two GPUs (CUDA where two answer)."""
    rt = backend_runtime(request.param)
    yield rt
    _close_checked(rt)


@pytest.fixture
def rt(make_runtime):
    return make_runtime()


@pytest.fixture
def host():
    rng = np.random.default_rng(1234)
    return lambda n, dtype=np.float32: rng.standard_normal(n).astype(dtype)
