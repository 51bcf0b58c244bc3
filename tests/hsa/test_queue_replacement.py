"""A failed AQL queue is replaced: work submitted while it is being aborted runs on the new one."""
from __future__ import annotations

import threading

import numpy as np

import aiogpu
from gpu_kernels import add_const_n

N = 16


def test_a_launch_from_a_done_callback_of_work_its_queue_failed_runs_on_the_new_queue(make_runtime):
    """A done-callback registered outside any event loop runs on the waiter thread, inside the
    abort that fails its future; a launch it makes on the same queue (a retry) comes while the
    old queue is destroyed and the new one not yet created, and must still run, not wait in
    the back-log for a retirement that never comes."""
    rt = make_runtime(gpus=1, queues_per_device=1)
    d0 = rt.devices[0]
    a, b = d0.alloc(N * 8), d0.alloc(N * 8)
    assert aiogpu.gather(aiogpu.copy(a, np.zeros(N, np.int64)), aiogpu.copy(b, np.zeros(N, np.int64))).wait(20)
    retries, inside_abort, called = [], threading.Event(), threading.Event()

    def retry(_fut):
        if d0.queues[0].broken:
            inside_abort.set()
        retries.append(d0.launch(add_const_n, grid=(N,), block=(N,), args=(b, 1, N)))
        called.set()

    with rt.lock:             # the queue's error is handled once the callback is registered
        rt.api.emulator.faults.queue_error_at(1, agent=0)
        failed = d0.launch(add_const_n, grid=(N,), block=(N,), args=(a, 1, N))
        failed.add_done_callback(retry)
    assert failed.wait(20) and isinstance(failed.exception(), aiogpu.GPUError)
    assert called.wait(20) and inside_abort.is_set() and len(retries) == 1, "the callback should run inside the abort"
    assert retries[0].wait(20), "the retry was left in the back-log"
    assert retries[0].exception() is None, retries[0].exception()
    out = b.to_numpy(np.int64)
    assert out.wait(20) and (out.result() == 1).all()
