"""Graph executables on HSA, in detail: patched dimensions reach the packet, a freed buffer is
refused, a join runs where its inputs do, a graph of one device replays
there, and what an executable owns is given back (and a failure to is logged readably)."""
from __future__ import annotations

import gc
import logging

import numpy as np
import pytest

import aiogpu
import aiogpu.hsa.graph as HG
from gpu_kernels import add_const_n

N = 8


@aiogpu.kernel("i64*")
def record_dims(launch, out):
    """Writes the dispatch's dimension count and its grid's last size."""
    out[0] = launch.dims
    out[1] = launch.grid[-1]


def test_a_patched_grid_of_more_dimensions_reaches_the_dispatch(make_runtime):
    rt = make_runtime(gpus=1)
    d0 = rt.devices[0]
    out = d0.alloc(16)
    with aiogpu.Graph() as g:
        node = d0.launch(record_dims, grid=(4,), block=(4,), args=(out,))
    with g.instantiate() as exe:
        assert exe.launch().wait(20)
        got = out.to_numpy(np.int64)
        assert got.wait(20) and list(got.result()) == [1, 4]
        assert exe.launch(grid={node: (4, 3)}, block={node: (4, 1)}).wait(20)
        got = out.to_numpy(np.int64)
        assert got.wait(20) and list(got.result()) == [2, 3]


def test_a_replay_after_the_destination_of_its_copy_was_freed_is_refused(make_runtime):
    rt = make_runtime(gpus=1)
    d0 = rt.devices[0]
    src, dst = d0.alloc(64), d0.alloc(64)
    with aiogpu.Graph() as g:
        aiogpu.copy(dst, src)
    with g.instantiate() as exe:
        assert exe.launch().wait(20)
        dst.free()
        with pytest.raises(ValueError):
            exe.launch()


def test_a_join_runs_on_the_device_of_its_inputs_and_a_one_device_graph_replays_there(make_runtime):
    rt = make_runtime(gpus=2)
    d1 = rt.devices[1]
    buf = d1.alloc(N * 8)
    assert aiogpu.copy(buf, np.zeros(N, np.int64)).wait(20)
    with aiogpu.Graph() as g:
        a = d1.launch(add_const_n, grid=(N,), block=(N,), args=(buf, 1, N))
        join = aiogpu.gather(a)
    assert repr(a).startswith("<GraphNode 0 launch") and repr(join).startswith("<GraphNode 1 gather")
    with g.instantiate() as exe:
        assert exe.lane_of[join].device is d1
        assert exe.home_device() is d1
        replay = exe.launch()
        assert replay.device is d1
        assert replay.wait(20) and replay.exception() is None
    got = buf.to_numpy(np.int64)
    assert got.wait(20) and (got.result() == 1).all()


def test_a_collected_executable_leaves_no_reference_behind(make_runtime):
    rt = make_runtime(gpus=1)
    d0 = rt.devices[0]
    buf = d0.alloc(N * 8)
    with aiogpu.Graph() as g:
        d0.launch(add_const_n, grid=(N,), block=(N,), args=(buf, 1, N))
    before = set(HG._OWNED)
    exe = g.instantiate()
    mine = set(HG._OWNED) - before
    assert len(mine) == 1
    assert exe.launch().wait(20)
    del exe
    for _ in range(3):
        gc.collect()
    assert not mine & HG._OWNED


def test_a_failed_release_is_logged_with_what_failed(make_runtime, monkeypatch, caplog):
    rt = make_runtime(gpus=1)
    d0 = rt.devices[0]
    src = np.arange(N, dtype=np.int64)
    buf = d0.alloc(N * 8)
    with aiogpu.Graph() as g:
        aiogpu.copy(buf, src)
    exe = g.instantiate()
    real = rt.host.unlock

    def refusing(*args):
        real(*args)
        raise RuntimeError("injected: unlock refused")

    monkeypatch.setattr(rt.host, "unlock", refusing)
    with caplog.at_level(logging.ERROR, logger="aiogpu"):
        exe.close()
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(messages) == 1 and "graph executable failed" in messages[0], messages


def test_a_replay_failed_by_its_lanes_queue_names_the_lane(make_runtime):
    rt = make_runtime(gpus=1, queues_per_device=1)
    d0 = rt.devices[0]
    buf = d0.alloc(N * 8)
    assert aiogpu.copy(buf, np.zeros(N, np.int64)).wait(20)
    with aiogpu.Graph() as g:
        d0.launch(add_const_n, grid=(N,), block=(N,), args=(buf, 1, N))
    with g.instantiate() as exe:
        with rt.lock:
            rt.api.emulator.faults.queue_error_at(1, agent=0)
            replay = exe.launch()
        assert replay.wait(20)
        assert f"graph lane {d0.queues[0].name} (replay 0)" in str(replay.exception())


def test_a_replay_after_the_source_of_its_copy_was_freed_is_refused(make_runtime):
    rt = make_runtime(gpus=1)
    d0 = rt.devices[0]
    src, dst = d0.alloc(64), d0.alloc(64)
    with aiogpu.Graph() as g:
        aiogpu.copy(dst, src)
    with g.instantiate() as exe:
        assert exe.launch().wait(20)
        src.free()
        with pytest.raises(ValueError):
            exe.launch()


def test_a_shader_copy_node_from_a_host_array_replays(make_runtime, monkeypatch):
    rt = make_runtime(gpus=1)
    d0 = rt.devices[0]
    monkeypatch.setattr(d0.engines, "pick", lambda dst_agent, src_agent: None)   # no engine: a shader copy
    host = np.arange(N, dtype=np.int64)
    buf = d0.alloc(N * 8)
    with aiogpu.Graph() as g:
        node = aiogpu.copy(buf, host)
    with g.instantiate() as exe:
        assert node.kind == "shader-copy" and exe.lane_of[node].device is d0
        assert exe.launch().wait(20)
    got = buf.to_numpy(np.int64)
    assert got.wait(20) and (got.result() == host).all()


def test_a_node_runs_in_the_lane_of_its_dependency_on_the_same_device(make_runtime):
    rt = make_runtime(gpus=1, queues_per_device=2)
    d0 = rt.devices[0]
    buf = d0.alloc(N * 8)
    with aiogpu.Graph() as g:
        a = d0.launch(add_const_n, grid=(N,), block=(N,), args=(buf, 1, N))
        b = d0.launch(add_const_n, grid=(N,), block=(N,), args=(buf, 1, N))
    with g.instantiate() as exe:
        assert exe.lane_of[b].queue is exe.lane_of[a].queue
        assert len(exe.lanes) == 1
