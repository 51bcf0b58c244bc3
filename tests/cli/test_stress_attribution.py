"""Stress counts a failure as expected only when an injected fault explains it: a GPU failure
that no fault explains (here: a kernel that fails by itself while faults are being injected) is
reported as unexpected and fails the run."""
from __future__ import annotations

import itertools

from aiogpu.cli.stress import run_stress
from aiogpu.hsa_bindings.emulator import packet_processor


def test_a_failure_no_injected_fault_explains_is_unexpected(monkeypatch):
    original, calls = packet_processor.execute, itertools.count(1)

    def sometimes_broken(ctx, job):
        # Often enough that such failures reach read-backs however few kernels the injected
        # faults leave to run (the last GPU is lost at its first memory fault; a lost completion
        # fails its whole queue): some runs execute under 300 kernels.
        if next(calls) % 25 == 0:
            raise RuntimeError("a kernel bug, not an injected fault")
        original(ctx, job)

    monkeypatch.setattr(packet_processor, "execute", sometimes_broken)
    stats, _leaks = run_stress(ops=3000, gpus=2, seed=21, tasks=32, faults=True, period=0.05)
    assert stats.faults >= 1
    assert stats.unexpected >= 1, stats
    assert any("a kernel bug" in note for note in stats.notes), stats.notes[:5]
