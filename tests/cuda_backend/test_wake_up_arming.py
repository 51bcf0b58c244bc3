"""The wake-ups parked awaits queue on CUDA (``LaneHub._wake_for``): a burst of awaits, each
parking on work newer than the last wake-up queued, queues one host function per lane while
that wake-up has not run, not one each (a ``cuLaunchHostFunc`` costs the loop about what a
launch costs); the waiter that wake-up wakes arms the lane again for the rest
(``LaneHub.rearm``), and every awaiter is woken, by the waiter alone, when the work completes.

On the fake driver, on both hot paths, with the lanes held (``fakecuda_controls.hold``): their
completion words and host functions wait, in stream order, as on a GPU still running the work.
"""
from __future__ import annotations

import json
import textwrap

import pytest

from backends import build_libcuda, needs_fake_libcuda, on_fake_cuda, run_on_fake_cuda

pytestmark = on_fake_cuda

BURST = 32

SCRIPT = r"""
import asyncio, json
import fakecuda_controls as fc
import aiogpu
import aiogpu.cuda.driver as D

@aiogpu.kernel("u32", cuda='extern "C" __global__ void noop(unsigned n) {}')
def noop(launch, n):
    pass

rt = aiogpu.Runtime("cuda", spin_s=0)          # (no spin: every await parks)
dev = rt.devices[0]
dev.launch(noop, (1,), (1,), (0,)).wait(10)     # (compiled and loaded: the fast path)
lanes = [lane for lane in dev.lanes if lane.kind == "compute"]
BURST = %d

async def awaiting(fut):
    return await fut

async def main():
    for lane in lanes:
        fc.hold(lane.stream)
    arms = rt.hub.arms
    tasks = []
    for i in range(BURST):                      # launch, park; launch, park; ...
        tasks.append(asyncio.ensure_future(awaiting(dev.launch(noop, (1,), (1,), (i,)))))
        await asyncio.sleep(0)
    parked = sum(not t.done() for t in tasks)
    burst_arms = rt.hub.arms - arms
    # The first wake-up of each lane runs, with the work before it: the waiter wakes, arms the
    # lane again for the awaits parked since, and settles what completed.
    for lane in lanes:
        fc.step(lane.stream, 2)
    while not tasks[0].done():
        await asyncio.sleep(0.001)
    # The rest completes: the waiter alone wakes its awaiters (this loop submits nothing).
    for lane in lanes:
        fc.release(lane.stream)
    results = await asyncio.wait_for(asyncio.gather(*tasks), 10)
    return {"hot": D.HOT.name, "lanes": len(lanes), "parked": parked, "burst_arms": burst_arms,
            "arms": rt.hub.arms - arms, "woken": len(results)}

out = asyncio.run(main())
out["leaks"] = rt.leaks(5)
rt.close()
print(json.dumps(out))
"""


def _check(out: dict) -> None:
    assert out["parked"] == BURST, out
    # Old: one host function per park (each parked on work newer than the last wake-up).
    assert out["burst_arms"] <= 2 * out["lanes"], out
    assert out["arms"] <= 4 * out["lanes"], out
    assert out["woken"] == BURST and out["leaks"] == {}, out


def _run(**env: str) -> dict:
    proc = run_on_fake_cuda(textwrap.dedent(SCRIPT % BURST), **env)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_burst_of_parked_awaits_queues_one_wake_up_per_lane_bindings():
    out = _run(AIOGPU_CUDA_HOT="bindings")
    assert out["hot"] == "cuda-bindings", out
    _check(out)


@needs_fake_libcuda
def test_a_burst_of_parked_awaits_queues_one_wake_up_per_lane_c():
    out = _run(LD_LIBRARY_PATH=build_libcuda.build())
    if out["hot"] != "c":
        pytest.fail(f"the C hot path did not load: {out}")
    _check(out)
