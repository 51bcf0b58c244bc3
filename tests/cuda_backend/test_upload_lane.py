"""Which CUDA stream a small upload goes on (``cuda/copies.copy_lane``): a request's upload,
the launch that reads it and the download after it run on one compute stream when one is idle,
so the request needs no cross-stream wait (``cuStreamWaitValue64``); with every compute stream
busy the upload goes on the upload stream, and never queues behind a running kernel.

On the fake driver, on both hot paths; a compute stream is busy while it is held
(``fakecuda_controls.hold``: its completion-word writes wait, as on a GPU still running the work).
"""
from __future__ import annotations

import json

import pytest

from backends import build_libcuda, needs_fake_libcuda, on_fake_cuda, run_on_fake_cuda

pytestmark = on_fake_cuda

SCRIPT = r"""
import json
import numpy as np
import fakecuda_controls as fc
import aiogpu
import aiogpu.cuda.driver as D

k2 = aiogpu.kernel("f32*, const f32*, u32", cuda='extern "C" __global__ void k2(float* a, const float* b, unsigned n) {}',
                   name="k2")(lambda launch, a, b, n: None)
noop = aiogpu.kernel("u32", cuda='extern "C" __global__ void noop(unsigned n) {}', name="noop")(lambda launch, n: None)
rt = aiogpu.Runtime("cuda")
dev = rt.devices[0]
x, y = dev.alloc(1024), dev.alloc(1024)
host = np.arange(256, dtype=np.float32)
assert dev.launch(k2, (256,), (256,), (y, x, 256)).wait(10)         # (compiled and loaded)
assert dev.launch(noop, (1,), (1,), (0,)).wait(10)
assert y.to_numpy().wait(10)                                         # (the pinned pool warm)
out = {"hot": D.HOT.name}

def waits():
    # The cross-stream waits queued since the log was cleared (both hot paths log them).
    return sum(c[0] == "cuStreamWaitValue64" for c in fc.log)

def request():
    # A request as bench/serve.py's handler makes it: upload, launch, download.
    # Every stream held from here on, as on a GPU still running each copy and kernel when the
    # next is submitted: the launch would wait for an upload on another stream.
    fc.log.clear()
    for lane in dev.lanes:
        fc.hold(lane.stream)
    up = aiogpu.copy(x, host)
    run = dev.launch(k2, (256,), (256,), (y, x, 256))
    down = y.to_numpy(np.float32)
    for lane in dev.lanes:
        fc.release(lane.stream)
    assert down.wait(10) and up.exception() is None and run.exception() is None
    return {"lanes": [up.lane.name, run.lane.name, down.lane.name],
            "kinds": [up.lane.kind, run.lane.kind, down.lane.kind], "waits": waits()}

out["idle"] = request()
# Every compute stream busy: a launch held on each (touching no memory, launches go to the
# streams in turn).
for lane in dev.compute:
    fc.hold(lane.stream)
busy = [dev.launch(noop, (1,), (1,), (0,)) for _ in dev.compute]
out["busy_streams"] = len({f.lane.name for f in busy}) == len(dev.compute)
other = dev.alloc(1024)
up = aiogpu.copy(other, host)
out["busy_lane"] = up.lane.kind
out["busy_up_done"] = up.wait(10) and up.exception() is None    # (it did not wait for the held kernels)
for lane in dev.compute:
    fc.release(lane.stream)
out["busy_done"] = all(f.wait(10) and f.exception() is None for f in busy)
# A big upload goes on the upload stream however idle the compute streams are.
big = dev.alloc(1 << 20)
out["big_lane"] = aiogpu.copy(big, np.zeros(1 << 18, np.float32)).lane.kind
for b in (x, y, other, big):
    b.free()
out["leaks"] = rt.leaks(5)
rt.close()
print(json.dumps(out))
"""


def _check(out: dict) -> None:
    idle = out["idle"]
    # Old: the upload went on the upload stream, and the launch waited for it there (one wait).
    assert idle["kinds"] == ["compute"] * 3 and len(set(idle["lanes"])) == 1, out
    assert idle["waits"] == 0, out
    assert out["busy_streams"] and out["busy_lane"] == "h2d" and out["busy_up_done"] and out["busy_done"], out
    assert out["big_lane"] == "h2d", out
    assert out["leaks"] == {}, out


def _run(**env: str) -> dict:
    proc = run_on_fake_cuda(SCRIPT, **env)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_request_runs_on_one_idle_compute_stream_bindings():
    out = _run(AIOGPU_CUDA_HOT="bindings")
    assert out["hot"] == "cuda-bindings", out
    _check(out)


@needs_fake_libcuda
def test_a_request_runs_on_one_idle_compute_stream_c():
    out = _run(LD_LIBRARY_PATH=build_libcuda.build())
    if out["hot"] != "c":
        pytest.fail(f"the C hot path did not load: {out}")
    _check(out)
