"""ordering.touching: the unretired work a consumer outside aiogpu must wait for."""
from __future__ import annotations

import numpy as np

import aiogpu
from aiogpu import ordering
from gpu_kernels import Gate, add_const_n

N = 8


def test_touching_a_buffer_nothing_used_names_no_work(make_runtime):
    rt = make_runtime(gpus=1)
    assert ordering.touching(rt.devices[0].alloc(64)) == ([], [])


def test_touching_names_the_pending_writer_then_nothing_once_it_retired(make_runtime):
    rt = make_runtime(gpus=1)
    d0 = rt.devices[0]
    buf = d0.alloc(N * 8)
    assert aiogpu.copy(buf, np.zeros(N, np.int64)).wait(20)
    gate = Gate()
    fut = d0.launch(add_const_n, grid=(N,), block=(N,), args=(buf, 1, N), after=[gate.launch(d0)])
    with rt.lock:
        assert ordering.touching(buf) == ([fut], [])
    gate.open()
    assert fut.wait(20)
