"""The service benchmark runs end to end on the emulator (a smoke test: no timing is asserted)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def test_service_benchmark_smoke(tmp_path):
    pytest.importorskip("aiohttp")
    out = tmp_path / "serve.json"
    script = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "serve.py")
    got = subprocess.run([sys.executable, script, "--backend", "emulator", "--modes", "aiogpu",
                          "--work", "trivial,1ms", "--duration", "1", "--warmup", "0.5", "--clients", "4",
                          "--json", str(out)], capture_output=True, text=True, timeout=240)
    assert got.returncode == 0, got.stdout + got.stderr
    results = json.loads(out.read_text())
    for key in ("aiogpu/trivial", "aiogpu/1ms"):
        entry = results[key]
        assert set(entry) >= {"req_per_s", "p50_ms", "p99_ms", "lag_p99_ms", "wrong"}
        assert entry["wrong"] == 0 and entry["errors"] == 0
        assert entry["requests"] > 0 and entry["req_per_s"] > 0
