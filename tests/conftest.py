"""Fixtures shared by the runtime tests: a fresh runtime per test, checked for leaks.

``rt``/``make_runtime`` are emulated runtimes (tests that look at emulator internals);
``any_rt`` runs a public-API test once per backend: the emulator, and CUDA where
``aiogpu.runtime.cuda_available()`` finds an NVIDIA GPU (skipped cleanly elsewhere).
"""
from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest

from backends import BACKENDS, BACKENDS_2GPU, LOOP_RUNNERS, _close_checked, backend_runtime, runtime_factory

# Compiled kernels go to a cache of the test session's own, not the user's (child processes
# inherit it); tests of the cache itself point it elsewhere.
os.environ.setdefault("AIOGPU_CACHE_DIR", tempfile.mkdtemp(prefix="aiogpu-test-cache-"))

def pytest_configure(config):
    config.addinivalue_line("markers", "hsa_virtual: runs on the real ROCr over the virtual KFD (aiogpu.vkfd)")



@pytest.fixture
def make_runtime():
    """Factory for emulated runtimes; each is closed and checked for leaks after the test."""
    yield from runtime_factory("emulator")


@pytest.fixture(params=LOOP_RUNNERS)
def run(request):
    """How the test runs its coroutine: ``run(main())``, once per event loop (asyncio, uvloop)."""
    return request.param


@pytest.fixture(params=BACKENDS)
def any_backend(request):
    return request.param


@pytest.fixture
def make_any(any_backend):
    """Factory of runtimes of the test's backend; each is closed and checked for leaks."""
    yield from runtime_factory(any_backend)


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
