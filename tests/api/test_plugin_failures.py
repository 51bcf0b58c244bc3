"""The pytest plugin's leak check reports real leaks only: a failing test is not given a second,
spurious error for the buffers its own traceback keeps alive."""
from __future__ import annotations

from test_plugin import run_suite


def test_a_failing_test_that_holds_a_buffer_gets_no_teardown_error(tmp_path):
    out = run_suite(tmp_path, """
        import numpy as np, aiogpu

        def test_fails_holding_a_buffer(gpu):
            buf = gpu.alloc(64)
            assert aiogpu.copy(buf, np.zeros(64, np.uint8)).wait(10)
            assert False, "the test's own failure"

        KEEP = []

        def test_leaks_a_buffer(gpu):
            KEEP.append(gpu.alloc(64))
    """)
    assert "1 failed, 1 passed, 1 error" in out.stdout, out.stdout
    assert "the test's own failure" in out.stdout
    assert "ERROR at teardown of test_leaks_a_buffer" in out.stdout, out.stdout
    assert "ERROR at teardown of test_fails_holding_a_buffer" not in out.stdout, out.stdout
