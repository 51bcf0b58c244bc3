"""The watchdog fails work whose completion was lost, and only that: work held up behind it (on
the device, waiting for it) gets its full time once the lost one has been dealt with."""
from __future__ import annotations

import numpy as np

import aiogpu
from gpu_kernels import peek, slow_write


def test_only_the_lost_completion_times_out(make_runtime):
    rt = make_runtime(watchdog_s=0.5)
    d0, d1 = rt.devices
    x = d1.alloc(8)
    mirror = d0.alloc(8)
    assert aiogpu.copy(mirror, np.zeros(1, np.int64)).wait(10)
    rt.api.emulator.faults.lose_completion_at(1, agent=0)
    lost = d0.launch(peek, grid=(1,), block=(1,), args=(mirror,))
    # Ordered after ``lost`` on the device (it overwrites memory ``lost`` reads) without
    # depending on its result; it waits on another GPU until the lost one is dealt with.
    behind = aiogpu.copy(mirror, np.full(1, 3, np.int64))
    after = d1.launch(slow_write, grid=(1,), block=(1,), args=(x, 400), after=[behind])
    assert lost.wait(10) and isinstance(lost.exception(), aiogpu.WatchdogTimeout)
    assert behind.wait(10) and behind.exception() is None, behind.exception()
    assert after.wait(10) and after.exception() is None, after.exception()
    out = np.zeros(1, np.int64)
    assert aiogpu.copy(out, x).wait(10) and out[0] == 7
