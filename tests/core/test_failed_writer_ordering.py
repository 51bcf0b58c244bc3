"""Memory whose last writer failed without running: what later work orders after.

Work not submitted because an input failed still becomes the last writer of what it would have
written, and it is ordered after what it would have waited for. A later writer of that memory
waits (ordering only) for that still-running work, through any chain of such failures, and does
not fail if that work then fails (write after write never propagates a failure)."""
from __future__ import annotations

import numpy as np
import pytest

import aiogpu
from gpu_kernels import Gate, add_into, fail_if, slow_increment

N = 4


def _failed_input(d0):
    """A buffer whose last writer failed (its queue is replaced; the buffer reads as failed)."""
    bad = d0.alloc(N * 8)
    failed = d0.launch(fail_if, grid=(1,), block=(1,), args=(bad, 1))
    assert failed.wait(20) and isinstance(failed.exception(), aiogpu.GPUError)
    return bad


def _chain_of_failures(d0, bad, b, length):
    """``length`` launches writing ``b`` that fail without running (they read ``bad``)."""
    chain = [d0.launch(add_into, grid=(N,), block=(N,), args=(b, bad, N)) for _ in range(length)]
    for fut in chain:
        assert fut.done() and isinstance(fut.exception(), aiogpu.GPUError)
    return chain


@pytest.mark.parametrize("length", [1, 2])
def test_a_writer_after_failed_writers_waits_for_the_work_they_were_ordered_after(make_runtime, length):
    rt = make_runtime(gpus=1)
    d0 = rt.devices[0]
    bad = _failed_input(d0)
    b = d0.alloc(N * 8)
    assert aiogpu.copy(b, np.zeros(N, np.int64)).wait(20)
    gate = Gate()
    held = d0.launch(slow_increment, grid=(1,), block=(1,), args=(b,), after=[gate.launch(d0)])
    chain = _chain_of_failures(d0, bad, b, length)
    assert "add_into" in chain[0].label, chain[0].label
    later = aiogpu.copy(b, np.arange(N, dtype=np.int64))       # writes b, reads nothing of it
    early = later.wait(0.3)
    gate.open()
    assert held.wait(20) and held.exception() is None
    assert later.wait(20) and later.exception() is None, later.exception()
    got = b.to_numpy(np.int64)
    assert got.wait(20)
    assert not early and list(got.result()) == [0, 1, 2, 3], "the later writer ran before the work the failed writers were ordered after"

def test_a_writer_after_a_failed_writer_does_not_fail_with_the_work_it_was_ordered_after(make_runtime):
    rt = make_runtime(gpus=1)
    d0 = rt.devices[0]
    bad = _failed_input(d0)
    b = d0.alloc(N * 8)
    gate = Gate()
    doomed = d0.launch(fail_if, grid=(1,), block=(1,), args=(b, 1), after=[gate.launch(d0)])
    _chain_of_failures(d0, bad, b, 1)
    later = aiogpu.copy(b, np.arange(N, dtype=np.int64))     # on a copy engine: not on the failing queue
    gate.open()
    assert doomed.wait(20) and isinstance(doomed.exception(), aiogpu.GPUError)
    assert later.wait(20)
    assert later.exception() is None, "an ordering-only edge propagated a failure"
    got = b.to_numpy(np.int64)
    assert got.wait(20) and list(got.result()) == [0, 1, 2, 3]
