"""A failed AQL queue is replaced: work submitted when its failures are settled runs on the new one."""
from __future__ import annotations

import threading

import numpy as np

import aiogpu
from gpu_kernels import add_const_n

N = 16


def test_a_launch_from_a_done_callback_of_work_its_queue_failed_runs_on_the_new_queue(make_runtime):
    """A done-callback registered outside any event loop runs on the waiter thread, when the
    core settles the abort's failure report: the new queue exists by then, so a launch it
    makes on the same queue (a retry) runs there, rather than wait in the back-log of a
    broken queue for a retirement that never comes."""
    rt = make_runtime(gpus=1, queues_per_device=1)
    d0 = rt.devices[0]
    a, b = d0.alloc(N * 8), d0.alloc(N * 8)
    assert aiogpu.gather(aiogpu.copy(a, np.zeros(N, np.int64)), aiogpu.copy(b, np.zeros(N, np.int64))).wait(20)
    retries, on_a_live_queue, called = [], threading.Event(), threading.Event()

    def retry(_fut):
        if not d0.queues[0].broken and d0.queues[0].generation == 1:
            on_a_live_queue.set()
        retries.append(d0.launch(add_const_n, grid=(N,), block=(N,), args=(b, 1, N)))
        called.set()

    with rt.lock:             # the queue's error is handled once the callback is registered
        rt.api.emulator.faults.queue_error_at(1, agent=0)
        failed = d0.launch(add_const_n, grid=(N,), block=(N,), args=(a, 1, N))
        failed.add_done_callback(retry)
    assert failed.wait(20) and isinstance(failed.exception(), aiogpu.GPUError)
    assert called.wait(20) and len(retries) == 1
    assert on_a_live_queue.is_set(), "the failure was settled before the queue was replaced"
    assert retries[0].wait(20), "the retry was left in the back-log"
    assert retries[0].exception() is None, retries[0].exception()
    out = b.to_numpy(np.int64)
    assert out.wait(20) and (out.result() == 1).all()
