"""A graph lane sent to a lost device's queue fails at once with DeviceLost naming that queue."""
from __future__ import annotations

import numpy as np
import pytest

import aiogpu
from aiogpu import DeviceLost
from gpu_kernels import add_const_n

N = 8


def test_a_replay_whose_lane_is_on_a_lost_device_fails_naming_the_lost_queue(make_runtime):
    rt = make_runtime(gpus=2, queues_per_device=1)
    d0, d1 = rt.devices
    a, b = d0.alloc(N * 8), d1.alloc(N * 8)
    assert aiogpu.gather(aiogpu.copy(a, np.zeros(N, np.int64)), aiogpu.copy(b, np.zeros(N, np.int64))).wait(20)
    with aiogpu.Graph() as g:
        d0.launch(add_const_n, grid=(N,), block=(N,), args=(a, 1, N))
        d1.launch(add_const_n, grid=(N,), block=(N,), args=(b, 1, N))
    with g.instantiate() as exe:
        rt.api.library.faults.memory_fault_at(1, agent=1)
        lost = d1.launch(add_const_n, grid=(N,), block=(N,), args=(d1.alloc(N * 8), 1, N))
        assert lost.wait(20) and isinstance(lost.exception(), DeviceLost)
        replay = exe.launch()
        assert replay.wait(20)
        err = replay.exception()
        assert isinstance(err, aiogpu.GPUError)
        causes = []
        while err is not None:
            causes.append(err)
            err = err.__cause__
        lane = [e for e in causes if isinstance(e, DeviceLost)]
        assert lane and lane[0].queue == d1.queues[0].name, causes
