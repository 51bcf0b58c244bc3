"""``python -m aiogpu stress`` says what it is doing once every operation is submitted: it is
draining (the tasks' last checks, the work still pending on the device, the leak check), not
sitting at "N/N ops"."""
from __future__ import annotations

from aiogpu.cli.stress import run_stress


def test_the_progress_says_when_it_is_draining():
    said: list[str] = []
    stats, leaks = run_stress(ops=300, gpus=2, seed=5, tasks=8, faults=False, progress=said.append)
    assert stats.ops == 300 and leaks == {}
    draining = [i for i, m in enumerate(said) if m.startswith("draining")]
    assert draining, said
    first = draining[0]
    assert all("ops" in m and not m.startswith("draining") for m in said[:first]), said
    assert all(m.startswith(("draining", "checking")) for m in said[first:]), said
    assert "pending on the device" in said[draining[-1]]
    assert said[-1].startswith("checking for leaks"), said
