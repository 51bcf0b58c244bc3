"""Device timestamps of a future: none before its work has ended, its dispatch's after."""
from __future__ import annotations

from gpu_kernels import Gate


def test_a_pending_future_has_no_device_times_and_a_completed_one_has_them(make_runtime):
    rt = make_runtime(gpus=1)
    d0 = rt.devices[0]
    gate = Gate()
    fut = gate.launch(d0)            # the runtime's first signal: no earlier use's timestamps
    try:
        assert rt.hub.device_times(fut) is None
    finally:
        gate.open()
    assert fut.wait(20) and fut.exception() is None
    start, end = rt.hub.device_times(fut)
    assert 0 < start <= end
