"""How a replay's lanes wait: for the other lanes' nodes they depend on (one barrier packet
names several), and a copy that falls back to a shader copy waits for nothing else."""
from __future__ import annotations

import numpy as np

import aiogpu
from gpu_kernels import Gate, add_const_n

N = 16


def test_a_join_waits_for_nodes_of_several_other_lanes_in_one_barrier_packet(make_runtime):
    rt = make_runtime(gpus=2, queues_per_device=2)
    d0, d1 = rt.devices
    x, y, z = d0.alloc(N * 8), d1.alloc(N * 8), d1.alloc(N * 8)
    assert aiogpu.gather(*(aiogpu.copy(b, np.zeros(N, np.int64)) for b in (x, y, z))).wait(20)
    with aiogpu.Graph() as g:
        a = d0.launch(add_const_n, grid=(N,), block=(N,), args=(x, 1, N))
        b = d1.launch(add_const_n, grid=(N,), block=(N,), args=(y, 2, N))
        c = d1.launch(add_const_n, grid=(N,), block=(N,), args=(z, 3, N))
        aiogpu.gather(a, b, c)
    exe = g.instantiate()
    lanes = {exe.lane_of[n].queue.name for n in (a, b, c)}
    assert len(lanes) == 3, f"the three launches should run in three lanes, not {lanes}"
    for _ in range(2):
        replay = exe.launch()
        assert replay.wait(20) and replay.exception() is None, replay.exception()
    for buf, step in ((x, 1), (y, 2), (z, 3)):
        out = buf.to_numpy(np.int64)
        assert out.wait(20) and (out.result() == 2 * step).all()


def test_a_replays_fallback_shader_copy_does_not_wait_for_unrelated_work_on_its_queue(make_runtime):
    """Its engine lost, a replay's copy runs as a shader copy on the device's first queue; it
    waits for what it depends on, not for a kernel that happens to be running there."""
    rt = make_runtime(gpus=2, queues_per_device=1)
    d0, d1 = rt.devices
    src, dst = d0.alloc(N * 8), d1.alloc(N * 8)
    assert aiogpu.copy(src, np.arange(N, dtype=np.int64)).wait(20)
    with aiogpu.Graph() as g:
        aiogpu.copy(dst, src)
    exe = g.instantiate()
    assert exe.engine_of, "the copy should be planned on an engine"
    with rt.lock:
        d0.engines.lose()
    gate = Gate()
    held = gate.launch(d0)                   # unrelated, on the queue the fallback uses
    try:
        replay = exe.launch()
        assert replay.wait(20) and replay.exception() is None, "the copy waited for the held kernel"
        assert not held.done()
    finally:
        gate.open()
    assert held.wait(20)
    out = dst.to_numpy(np.int64)
    assert out.wait(20) and (out.result() == np.arange(N)).all()
