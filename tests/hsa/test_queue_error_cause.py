"""The operation blamed for a queue error carries the emulator's explanation as its cause."""
from __future__ import annotations

import numpy as np

import aiogpu
from aiogpu.hsa_bindings.emulator import InjectedFault
from gpu_kernels import add_const_n

N = 8


def test_the_blamed_operation_is_caused_by_the_injected_fault(make_runtime):
    rt = make_runtime(gpus=1, queues_per_device=1)
    d0 = rt.devices[0]
    buf = d0.alloc(N * 8)
    assert aiogpu.copy(buf, np.zeros(N, np.int64)).wait(20)
    with rt.lock:
        rt.api.emulator.faults.queue_error_at(1, agent=0)
        fut = d0.launch(add_const_n, grid=(N,), block=(N,), args=(buf, 1, N))
    assert fut.wait(20)
    err = fut.exception()
    assert isinstance(err, aiogpu.GPUError) and err.queue == d0.queues[0].name
    assert isinstance(err.__cause__, InjectedFault), repr(err.__cause__)
