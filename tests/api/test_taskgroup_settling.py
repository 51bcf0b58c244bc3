"""aiogpu.TaskGroup counts a submitted future as settled only once the group has heard of it on
its loop: ``done()`` turns True on the waiter thread before the group's callback reaches the
loop, and a group that exited in between lost the failure (it exited without raising)."""
from __future__ import annotations

import threading

import anyio
import pytest

import aiogpu
from gpu_kernels import Gate, fail_if


def test_a_failure_whose_delivery_lags_its_settling_still_fails_the_group(rt):
    d0, d1 = rt.devices
    hub = rt.hub
    release = threading.Event()
    held_back = []
    original = hub._post

    def lagging_post(posts, *args, **kwargs):
        # The failed future's delivery to the loop is held back (as a preempted waiter
        # thread would hold it) until the group has had every chance to exit.
        if any(getattr(a, "arg", None) is late and getattr(a, "arg", None).done()
               for items in posts.values() for a in items):
            held_back.append(True)
            release.wait(10)
        return original(posts, *args, **kwargs)

    gate = Gate()
    late = None

    async def main():
        nonlocal late
        with pytest.raises(BaseExceptionGroup) as info:
            async with aiogpu.TaskGroup():
                held = gate.launch(d1)
                late = d0.launch(fail_if, grid=(1,), block=(1,), args=(d0.alloc(4), 1), after=[held])
                hub._post = lagging_post
                gate.open()
                while not late.done():        # settled on the waiter thread, not yet delivered
                    await anyio.sleep(0.001)
                threading.Timer(0.5, release.set).start()   # (a fallback: the group must wait)
        return info.value

    try:
        group = anyio.run(main)
    finally:
        hub._post = original
        release.set()
    assert held_back
    assert [e for e in group.exceptions if isinstance(e, aiogpu.GPUError)] == [late.exception()]
