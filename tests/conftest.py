"""Fixtures shared by the runtime tests: a fresh emulated runtime per test, checked for leaks."""
from __future__ import annotations

import time

import numpy as np
import pytest

import aiogpu


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


@pytest.fixture
def rt(make_runtime):
    return make_runtime()


@pytest.fixture
def host():
    rng = np.random.default_rng(1234)
    return lambda n, dtype=np.float32: rng.standard_normal(n).astype(dtype)
