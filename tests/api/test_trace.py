"""Timeline traces: the file is valid Chrome/Perfetto trace JSON with a track per queue/engine."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import aiogpu
from gpu_kernels import scale, sleep_ms


@pytest.mark.asyncio
async def test_trace_records_every_operation(rt, tmp_path):
    path = tmp_path / "trace.json"
    d0, d1 = rt.devices
    with aiogpu.trace(str(path)):
        a, b = d0.alloc(4096), d1.alloc(4096)
        up = aiogpu.copy(a, np.ones(1024, np.float32))
        k = d0.launch(scale, grid=(1024,), block=(256,), args=(a, 2.0, 1024))
        peer = aiogpu.copy(b, a)
        s = d1.launch(sleep_ms, grid=(1,), block=(1,), args=(5,))
        await aiogpu.gather(up, k, peer, s)
    doc = json.loads(path.read_text())
    events = doc["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    names = {e["name"] for e in spans}
    assert {"scale", "sleep_ms"} <= names
    copies = [e for e in spans if e["cat"] == "copy"]
    assert len(copies) == 2 and all(e["args"]["bytes"] == 4096 for e in copies)
    for e in spans:
        assert e["dur"] >= 0 and isinstance(e["ts"], float)
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
    tracks = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert any(t.startswith("gpu0.q") for t in tracks) and any(".sdma" in t or ".rocr-" in t for t in tracks)
    procs = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert procs == {"gpu0", "gpu1"}
    kernel = next(e for e in spans if e["name"] == "sleep_ms")
    assert kernel["args"]["device_timestamps"] and kernel["dur"] >= 4000  # >= 4 ms in us


def test_demo_writes_a_trace(tmp_path):
    path = tmp_path / "demo.json"
    out = subprocess.run([sys.executable, "-m", "aiogpu", "demo", "--backend", "emulator", "--batches", "4",
                          "--trace", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "all match NumPy" in out.stdout
    events = json.loads(path.read_text())["traceEvents"]
    assert sum(e["ph"] == "X" for e in events) >= 4 * 6
