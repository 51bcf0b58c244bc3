"""The pytest plugin catches tests that leave GPU work or buffers behind."""
from __future__ import annotations

import subprocess
import sys
import textwrap


def run_suite(tmp_path, body: str, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_suite.py").write_text(textwrap.dedent(body))
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path), *args],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)


def test_leaked_buffer_and_pending_work_fail_the_test(tmp_path):
    out = run_suite(tmp_path, """
        import numpy as np, aiogpu
        KEEP = []

        @aiogpu.kernel("u32")
        def nap(launch, ms):
            import time; time.sleep(ms / 1000)

        def test_clean(gpu):
            buf = gpu.alloc(64)
            assert aiogpu.copy(buf, np.zeros(64, np.uint8)).wait(10)

        def test_keeps_a_buffer(gpu):
            KEEP.append(gpu.alloc(64))
    """)
    assert "2 passed, 1 error" in out.stdout, out.stdout
    assert "buffers" in out.stdout


def test_shared_runtime_option(tmp_path):
    out = run_suite(tmp_path, """
        SEEN = []

        def test_a(gpu_runtime):
            SEEN.append(gpu_runtime)

        def test_b(gpu_runtime):
            assert SEEN and SEEN[0] is gpu_runtime
    """, "--aiogpu-shared-runtime")
    assert "2 passed" in out.stdout, out.stdout + out.stderr
