"""Traces show every operation once, and work that overlaps on one queue as overlapping (on
separate rows of the queue's track), never nested as if one operation had called the other.
The demo's operation count and its trace agree; ``stress --ops N`` runs N operations."""
from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys

import numpy as np
import pytest

import aiogpu
from aiogpu.cli.stress import run_stress
from gpu_kernels import fail_if, sleep_ms


def spans_by_row(events):
    rows = {}
    for e in events:
        if e["ph"] == "X":
            rows.setdefault((e["pid"], e["tid"]), []).append(e)
    return rows


def assert_never_nested(events):
    """Chrome/Perfetto draw an event inside another of the same row as its child."""
    for row in spans_by_row(events).values():
        row.sort(key=lambda e: e["ts"])
        for a, b in zip(row, row[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-3, (a["name"], b["name"])


@pytest.mark.asyncio
async def test_kernels_overlapping_on_one_queue_are_drawn_side_by_side(make_runtime, tmp_path):
    rt = make_runtime(queues_per_device=1)
    d0 = rt.devices[0]
    path = tmp_path / "overlap.json"
    with aiogpu.trace(str(path)):
        slow = d0.launch(sleep_ms, grid=(1,), block=(1,), args=(200,))
        quick = d0.launch(sleep_ms, grid=(1,), block=(1,), args=(20,))      # no barrier: overlaps
        await aiogpu.gather(slow, quick)
    assert slow.queue == quick.queue
    events = json.loads(path.read_text())["traceEvents"]
    kernels = [e for e in events if e["ph"] == "X" and e["name"] == "sleep_ms"]
    assert len(kernels) == 2
    a, b = sorted(kernels, key=lambda e: e["ts"])
    assert b["ts"] < a["ts"] + a["dur"], "the two kernels did not overlap on the device"
    assert (a["pid"], a["tid"]) != (b["pid"], b["tid"])
    rows = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert all(rows[k["tid"]].startswith(slow.queue) for k in kernels)
    assert_never_nested(events)


@pytest.mark.asyncio
async def test_every_operation_appears_once(rt, tmp_path):
    d0, d1 = rt.devices
    path = tmp_path / "ops.json"
    with aiogpu.trace(str(path)):
        a, b = d0.alloc(4096), d1.alloc(4096)
        ops = [aiogpu.copy(a, np.ones(1024, np.float32))]
        ops.append(d0.launch(sleep_ms, grid=(1,), block=(1,), args=(5,)))
        ops.append(aiogpu.copy(b, a))
        ops.append(aiogpu.gather(*ops))
        done, _ = await asyncio.wait(ops, timeout=10)     # (wait() would block the loop)
        assert done == set(ops)
        out = d0.alloc(4)
        bad = d0.launch(fail_if, grid=(1,), block=(1,), args=(out, 1))
        assert (await asyncio.wait([bad], timeout=10))[0] == {bad}
        never_ran = aiogpu.copy(np.empty(1, np.int32), out)    # reads what ``bad`` failed to write
        ops += [bad, never_ran]
    assert never_ran.exception() is not None
    events = json.loads(path.read_text())["traceEvents"]
    recorded = [e for e in events if e["ph"] in ("X", "i")]
    assert sorted(e["name"] for e in recorded) == sorted(f.label for f in ops)
    failed = {e["name"] for e in recorded if e["args"]["failed"]}
    assert failed == {bad.label, never_ran.label}
    assert_never_nested(events)


def test_demo_reports_the_operations_its_trace_holds(tmp_path):
    path = tmp_path / "demo.json"
    out = subprocess.run([sys.executable, "-m", "aiogpu", "demo", "--backend", "emulator", "--batches", "8",
                          "--trace", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    reported = int(re.search(r"(\d+) GPU operations", out.stdout).group(1))
    events = json.loads(path.read_text())["traceEvents"]
    assert reported == sum(e["ph"] in ("X", "i") for e in events) == 8 * 6
    assert_never_nested(events)


@pytest.mark.parametrize("ops, tasks", [(300, 16), (1000, 64), (37, 64)])
def test_stress_runs_exactly_the_operations_asked_for(ops, tasks):
    stats, leaks = run_stress(ops=ops, gpus=2, seed=5, tasks=tasks, faults=False)
    assert stats.ops == ops
    assert leaks == {} and stats.mismatches == 0
