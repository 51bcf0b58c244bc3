"""The waiter's timeout: the periodic scan's (POLL_S) while work nobody waits for is pending,
else only the lost-wakeup guard's (LOST_WAKEUP_GUARD_S)."""
from __future__ import annotations

import threading

from aiogpu.hsa import signals
from gpu_kernels import Gate

DEADLINE_S = 10.0


def test_the_wait_times_out_for_the_scan_only_while_work_nobody_waits_for_is_pending(make_runtime, monkeypatch):
    rt = make_runtime(gpus=1)
    calls: list[tuple[set, int]] = []          # (signal handles, timeout) of each wait
    cond = threading.Condition()
    real = rt.api.hsa_amd_signal_wait_any

    def spy(n, sigs, conds, vals, timeout, hint, out):
        with cond:
            calls.append(({sigs[i].handle for i in range(n)}, int(timeout)))
            cond.notify_all()
        return real(n, sigs, conds, vals, timeout, hint, out)

    monkeypatch.setattr(rt.api, "hsa_amd_signal_wait_any", spy)
    poll, guard = int(signals.POLL_S * rt.hub._freq), int(signals.LOST_WAKEUP_GUARD_S * rt.hub._freq)
    gate = Gate()
    held = gate.launch(rt.devices[0])
    try:
        with cond:       # the second wait begun after the launch was built after it
            start = len(calls)
            assert cond.wait_for(lambda: len(calls) >= start + 2, DEADLINE_S)
            assert calls[-1][1] == poll, "work nobody waits for is left to a scan that comes too late"
        held.add_done_callback(lambda _: None)     # now waited for: in the wait itself
        with cond:
            assert cond.wait_for(lambda: held.signal in calls[-1][0], DEADLINE_S)
            assert calls[-1][1] == guard, "the waiter polls although everything pending is in its wait"
    finally:
        gate.open()
    assert held.wait(DEADLINE_S)
