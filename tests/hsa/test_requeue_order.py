"""Ordering across a queue that was aborted and recreated (found by the 1M-operation stress).

A queue error destroys an HSA queue and puts a new one in its place under the same name. Work
that failed with the old queue retires only after what it was ordered after; later work on the
new queue that must come after it cannot rely on the new queue's barrier bit, which orders only
packets of the new queue.
"""
from __future__ import annotations

import numpy as np

import aiogpu
from gpu_kernels import Gate, add_const_n

N = 16


def test_overwrite_on_a_recreated_queue_waits_for_the_failed_writers_predecessor(make_runtime):
    rt = make_runtime(gpus=2, queues_per_device=2)
    d0, d1 = rt.devices
    buf, src = d0.alloc(N * 8), d0.alloc(N * 8)
    assert aiogpu.gather(aiogpu.copy(buf, np.zeros(N, np.int64)),
                         aiogpu.copy(src, np.full(N, 7, np.int64))).wait(20)
    gate = Gate()
    held = gate.launch(d1)
    late = aiogpu.copy(buf, np.full(N, 5, np.int64), after=[held])   # a write that waits on gpu1
    assert d0.engines.runs(late.queue)                              # on a copy engine
    rt.api.emulator.faults.queue_error_at(1, agent=0)                # the next packet on gpu0 fails
    failed = d0.launch(add_const_n, grid=(N,), block=(N,), args=(buf, 1, N))
    assert failed.wait(20) and isinstance(failed.exception(), aiogpu.GPUError)
    # A failed future retires only after its predecessors: `late` cannot run before the gate opens.
    assert not failed.retired and not rt.hub.is_complete(failed.signal)
    last = aiogpu.copy(buf, src)              # a shader copy on the recreated queue of `failed`
    assert last.lane is failed.lane
    assert not last.done()
    gate.open()
    assert late.wait(20) and last.wait(20)
    assert failed.retired
    assert last.exception() is None
    out = buf.to_numpy(np.int64)
    assert out.wait(20)
    assert (out.result() == 7).all(), "the last write in program order must win"
