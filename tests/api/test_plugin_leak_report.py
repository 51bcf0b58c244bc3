"""The pytest plugin's leak check names each buffer a test left and the line that allocated
it, and costs no waiting when nothing is pending (a held buffer is no pending work)."""
from __future__ import annotations

from test_plugin import run_suite

SUITE = """
    import numpy as np, aiogpu
    from aiogpu.runtime import Runtime

    KEEP = []
    LOOKS = []
    _stats = Runtime.stats

    def _counted(self):
        LOOKS.append(1)
        return _stats(self)

    Runtime.stats = _counted

    def make_one(gpu, n):
        return gpu.alloc(n)

    def test_keeps_two_buffers(gpu):
        assert aiogpu.copy(gpu.alloc(64), np.zeros(64, np.uint8)).wait(10)
        KEEP.append(make_one(gpu, 4096))
        KEEP.append(make_one(gpu, 3 << 20))
        LOOKS.clear()

    def test_the_check_did_not_poll():
        assert 1 <= len(LOOKS) <= 4, len(LOOKS)    # waiting for the buffers: hundreds of looks
"""


def test_the_leak_error_names_each_buffer_and_where_it_was_allocated(tmp_path):
    out = run_suite(tmp_path, SUITE)
    assert "2 passed, 1 error" in out.stdout, out.stdout + out.stderr
    # the report itself: with CI set, pytest repeats whole messages in its short summary
    text = out.stdout.split("short test summary info")[0]
    assert "ERROR at teardown of test_keeps_two_buffers" in text
    assert "buffers: 2" in text
    assert "<Buffer 4096 B on gpu0" in text and f"<Buffer {3 << 20} B on gpu0" in text
    assert text.count("in make_one") == 2 and text.count("return gpu.alloc(n)") == 2
    assert "KEEP.append(make_one(gpu, 4096))" in text


def test_tracking_can_be_turned_off(tmp_path):
    out = run_suite(tmp_path, SUITE, "--aiogpu-track-allocs=0")
    assert "2 passed, 1 error" in out.stdout, out.stdout + out.stderr
    assert "<Buffer 4096 B on gpu0" in out.stdout and "in make_one" not in out.stdout
    assert "AIOGPU_TRACK_ALLOCS" in out.stdout
