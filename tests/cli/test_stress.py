"""A CI-sized run of ``python -m aiogpu stress``: random work under faults, checked against NumPy."""
from __future__ import annotations

import subprocess
import sys

from aiogpu.cli.stress import run_stress


def test_stress_without_faults_has_no_failures():
    stats, leaks = run_stress(ops=2000, gpus=4, seed=11, tasks=32, faults=False)
    assert stats.ops >= 2000 and stats.checks > 100
    assert (stats.failed, stats.unexpected, stats.mismatches, stats.hangs) == (0, 0, 0, 0), stats.notes
    assert leaks == {}


def test_stress_with_faults_loses_nothing_and_leaks_nothing():
    stats, leaks = run_stress(ops=5000, gpus=4, seed=12, tasks=64, faults=True, period=0.05)
    assert stats.faults >= 5, "the run injected too few faults to prove anything"
    assert stats.mismatches == 0, stats.notes
    assert stats.hangs == 0, stats.notes
    assert stats.unexpected == 0, stats.notes
    assert leaks == {}, leaks


def test_stress_command_prints_the_summary_line():
    out = subprocess.run([sys.executable, "-m", "aiogpu", "stress", "--ops", "1500", "--gpus", "2", "--seed", "3"],
                         capture_output=True, text=True, timeout=300)
    last = out.stdout.strip().splitlines()[-1]
    assert out.returncode == 0, out.stdout + out.stderr
    assert last.startswith("stress: ") and " 0 mismatches, 0 leaks, 0 hangs" in last
    assert "ops" in out.stderr  # progress while it runs
