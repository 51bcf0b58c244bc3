"""Every example runs on the emulator and does what it says."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
ENV = {**os.environ, "AIOGPU_BACKEND": "emulator"}


def run(*args: str, timeout: int = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=ENV,
                          cwd=EXAMPLES.parent)


def test_async_server_example():
    out = run(str(EXAMPLES / "async_server.py"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 wrong answers" in out.stdout


def test_loader_example():
    out = run(str(EXAMPLES / "loader_two_gpus.py"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "32 batches over 2 GPU(s)" in out.stdout and "0 bad" in out.stdout


def test_pytest_plugin_example_suite():
    out = run("-m", "pytest", "-q", "-p", "no:cacheprovider", str(EXAMPLES / "test_with_aiogpu_plugin.py"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "6 passed" in out.stdout


def test_torch_service_example_runs_or_says_why_not():
    """Needs PyTorch with CUDA and aiogpu's CUDA backend; elsewhere it says so and exits 0."""
    out = run(str(EXAMPLES / "torch_service.py"), "--duration", "2", "--warmup", "1")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "torch_service: skipped:" in out.stdout or " 0 wrong, 0 errors" in out.stdout, out.stdout
