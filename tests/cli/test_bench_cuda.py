"""``aiogpu bench`` on CUDA runs end to end on the fake driver of tests/fakes (a smoke test: no
timing is asserted): every figure is there, each throughput figure is the median of its runs, and
the runtimes it makes are all closed when it ends."""
from __future__ import annotations

import importlib.util
import statistics
import json

from backends import build_libcuda, needs_fake_libcuda, on_fake_cuda, run_on_fake_cuda

pytestmark = [on_fake_cuda, needs_fake_libcuda]


def test_the_cuda_bench_runs_on_the_fake_driver_and_leaves_no_runtime_open(tmp_path):
    lib_dir = build_libcuda.build()          # (the bench times the C hot path against raw calls)
    if importlib.util.find_spec("aiogpu.cuda._hotc") is None:
        from aiogpu.cuda import build_hotc
        build_hotc.build(verbose=False)
    out = tmp_path / "bench.json"
    got = run_on_fake_cuda(f"""
import threading
from aiogpu.cli import bench_cuda
args = bench_cuda.argparse.Namespace(quick=True, json={str(out)!r})
assert bench_cuda.run(args) == 0
print("threads", sorted(t.name for t in threading.enumerate()))
""", timeout=240, LD_LIBRARY_PATH=lib_dir)
    assert got.returncode == 0, got.stdout + got.stderr[-3000:]
    assert "threads ['MainThread']" in got.stdout, got.stdout    # (a runtime left open has its waiter)
    res = json.loads(out.read_text())
    for k in (8, 64):
        for who in ("aiogpu", "executor"):
            runs = res[f"{who}_ops_per_s_{k}_runs"]
            assert len(runs) == 3 and all(r > 0 for r in runs)
            assert res[f"{who}_ops_per_s_{k}"] == statistics.median(runs)
    for key in ("floor_sync_us", "aiogpu_await_us_uvloop", "submit_us_aiogpu_launch_c", "graph_replay_us_per_node",
                "h2d_GBs_aiogpu", "ops_ratio_64", "await_over_floor_uvloop"):
        assert res[key] > 0, key
