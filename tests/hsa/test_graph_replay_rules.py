"""Graph capture and replay rules on HSA that results alone seldom show: replays of one
executable run in launch order, a replay is ordered after pending work on what it touches (SDMA
copy parts included), patched buffers are tracked, a copy whose engine is gone at replay time
falls back to a shader copy, and captured copies of distinct host arrays are independent.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

import aiogpu
from aiogpu.ordering import Hazards
from aiogpu.hsa.queues import KernargRing
from aiogpu.futures import GPUFuture
from gpu_kernels import GATES, Gate, add_const_n, wait_gate


@aiogpu.kernel("i64*, u32")
def gated_increment(launch, x, key):
    """Adds 1 to every element once the test opens gate ``key``."""
    GATES[int(key)].wait(30)
    x[:] += 1

N = 16


def test_replays_of_one_executable_run_in_launch_order(make_runtime):
    """Even with no buffer in common (a kernel of scalars only), the second replay of an
    executable is ordered after the first: it completes only after it."""
    rt = make_runtime(gpus=1)
    d0 = rt.devices[0]
    first_gate, second_gate = Gate(), Gate()
    with aiogpu.Graph() as g:
        node = d0.launch(wait_gate, grid=(1,), block=(1,), args=(first_gate.key,))
    exe = g.instantiate()
    first = exe.launch()
    second_gate.open()
    second = exe.launch(args={node: (second_gate.key,)})
    seen, called = [], threading.Event()
    second.add_done_callback(lambda f: (seen.append(first.done() or rt.hub.is_complete(first.signal)), called.set()))
    assert first in second.preds, "the second replay is not ordered after the first"
    first_gate.open()
    assert first.wait(20) and second.wait(20) and called.wait(20)
    assert second.exception() is None
    assert seen == [True], "the second replay completed before the first"


def test_replay_with_sdma_copy_waits_for_pending_work_on_its_buffers(make_runtime):
    """A replay whose copy runs on an SDMA engine while earlier work on its source is pending:
    the copy reads what that work wrote."""
    rt = make_runtime(gpus=2)
    d0, d1 = rt.devices
    src, dst = d0.alloc(N * 8), d1.alloc(N * 8)
    assert aiogpu.copy(src, np.zeros(N, np.int64)).wait(20)
    with aiogpu.Graph() as g:
        aiogpu.copy(dst, src)
    exe = g.instantiate()
    assert exe.engine_of, "the copy should be planned on an engine"
    gate = Gate()
    held = gate.launch(d0)
    pending = d0.launch(add_const_n, grid=(N,), block=(N,), args=(src, 9, N), after=[held])
    replay = exe.launch()
    assert pending in replay.preds
    gate.open()
    assert replay.wait(20) and replay.exception() is None
    out = dst.to_numpy(np.int64)
    assert out.wait(20) and (out.result() == 9).all()


def test_replay_tracks_the_buffers_of_patched_arguments(make_runtime):
    """A replay with patched arguments becomes the last writer of the patched buffer, so a
    later read of it waits for the replay."""
    rt = make_runtime(gpus=1)
    d0 = rt.devices[0]
    a, b = d0.alloc(N * 8), d0.alloc(N * 8)
    assert aiogpu.gather(aiogpu.copy(a, np.zeros(N, np.int64)), aiogpu.copy(b, np.zeros(N, np.int64))).wait(20)
    with aiogpu.Graph() as g:
        node = d0.launch(add_const_n, grid=(N,), block=(N,), args=(a, 1, N))
    exe = g.instantiate()
    gate = Gate()                    # the replay cannot finish (and retire) before the checks:
    d0.launch(add_const_n, grid=(N,), block=(N,), args=(b, 0, N), after=[gate.launch(d0)])
    replay = exe.launch(args={node: (b, 5, N)})      # it writes b after that gated write
    assert b.last_write is replay and a.last_write is not replay
    out = b.to_numpy(np.int64)
    assert not out.done()
    gate.open()
    assert out.wait(20) and (out.result() == 5).all()


def test_replay_copy_falls_back_to_a_shader_copy_when_its_engine_is_gone(make_runtime):
    """The engine planned at instantiation is lost (as after a memory fault): the replay's copy
    runs as a shader copy on a compute queue, still after the node it follows (here gated, on
    another queue than the fallback's), and the data arrives."""
    rt = make_runtime(gpus=2, queues_per_device=2)
    d0, d1 = rt.devices
    other, src, dst = d0.alloc(N * 8), d0.alloc(N * 8), d1.alloc(N * 8)
    assert aiogpu.gather(aiogpu.copy(src, np.arange(N, dtype=np.int64)),
                         aiogpu.copy(other, np.zeros(N, np.int64))).wait(20)
    gate = Gate()
    with aiogpu.Graph() as g:
        d0.launch(add_const_n, grid=(N,), block=(N,), args=(other, 1, N))     # takes the first queue
        a = d0.launch(gated_increment, grid=(N,), block=(N,), args=(src, gate.key))
        aiogpu.copy(dst, src, after=[a])
    exe = g.instantiate()
    assert exe.engine_of and exe.lane_of[a].queue is not d0.queues[0]
    with rt.lock:
        d0.engines.lose()
    parts = []
    real = exe._fallback_copy

    def fallback(node, fut, dev, waits):
        parts.append(fut)
        return real(node, fut, dev, waits)

    exe._fallback_copy = fallback
    replay = exe.launch()
    assert len(parts) == 1 and parts[0].queue in {q.name for q in d0.queues}
    gate.open()
    assert replay.wait(20) and replay.exception() is None
    out = dst.to_numpy(np.int64)
    assert out.wait(20) and (out.result() == np.arange(N) + 1).all()


def test_captured_copies_of_distinct_host_arrays_are_independent(make_runtime):
    rt = make_runtime(gpus=1)
    d0 = rt.devices[0]
    b1, b2 = d0.alloc(N * 8), d0.alloc(N * 8)
    h1, h2 = np.ones(N, np.int64), np.full(N, 2, np.int64)
    with aiogpu.Graph() as g:
        first = aiogpu.copy(h1, b1)          # writes h1
        second = aiogpu.copy(b2, h2)         # reads h2: no conflict with writing h1
        third = aiogpu.copy(b1, h1)          # reads h1: after the copy that wrote it
    assert first not in second.deps
    assert first in third.deps
    exe = g.instantiate()
    assert exe.launch().wait(20)
    out = b2.to_numpy(np.int64)
    assert out.wait(20) and (out.result() == 2).all()


def test_written_by_is_exact_over_the_range():
    """Hazards.written_by: whether one future is the last writer of every byte of a range."""
    hazards = Hazards()
    a, b = GPUFuture(None, "a"), GPUFuture(None, "b")
    hazards._record(0, 100, a, True)
    hazards._record(40, 60, b, True)
    assert hazards.host(0, 40).written_by(a)
    assert hazards.host(60, 40).written_by(a)
    assert not hazards.host(0, 100).written_by(a)
    assert hazards.host(40, 20).written_by(b)
    assert not hazards.host(30, 20).written_by(b)
    assert not hazards.host(100, 10).written_by(a)      # bytes nobody wrote
    assert not hazards.host(90, 20).written_by(a)       # runs past the written bytes


def test_a_shader_copy_node_runs_on_its_copy_device(make_runtime):
    """A copy within gpu1 is a shader copy on one of gpu1's queues, not on another device."""
    rt = make_runtime(gpus=2)
    d1 = rt.devices[1]
    a, b = d1.alloc(N * 8), d1.alloc(N * 8)
    assert aiogpu.copy(b, np.full(N, 3, np.int64)).wait(20)
    with aiogpu.Graph() as g:
        node = aiogpu.copy(a, b)
    exe = g.instantiate()
    assert node.kind == "shader-copy" and exe.lane_of[node].device is d1
    assert exe.launch().wait(20)
    out = a.to_numpy(np.int64)
    assert out.wait(20) and (out.result() == 3).all()


def test_replayed_nodes_leave_their_queues_once_retired(make_runtime):
    """Graph node futures are tracked in their queue while in flight and forgotten after."""
    rt = make_runtime(gpus=2)
    d0, d1 = rt.devices
    x, y = d0.alloc(N * 8), d1.alloc(N * 8)
    assert aiogpu.copy(x, np.zeros(N, np.int64)).wait(20)
    with aiogpu.Graph() as g:
        a = d0.launch(add_const_n, grid=(N,), block=(N,), args=(x, 1, N))
        b = aiogpu.copy(y, x, after=[a])
        d1.launch(add_const_n, grid=(N,), block=(N,), args=(y, 1, N), after=[b])
    exe = g.instantiate()
    assert aiogpu.gather(*[exe.launch() for _ in range(3)]).wait(20)
    out = y.to_numpy(np.int64)
    assert out.wait(20) and (out.result() == 4).all()
    with rt.lock:
        assert all(not q.inflight for d in rt.devices for q in d.queues)


def test_graph_misuse_raises_with_a_message_that_says_what_is_wrong(make_runtime):
    rt = make_runtime(gpus=1)
    d0 = rt.devices[0]
    x = d0.alloc(N * 8)
    with pytest.raises(ValueError, match="^an empty graph cannot be instantiated$"):
        aiogpu.Graph().instantiate()
    with aiogpu.Graph() as g:
        node = d0.launch(add_const_n, grid=(N,), block=(N,), args=(x, 1, N))
    with pytest.raises(TypeError, match=r"^a graph node is not work: nothing runs until a replay; await "
                                         r"exe.launch\(\) \(exe = graph.instantiate\(\)\) instead of waiting"):
        node.wait()
    exe = g.instantiate()
    for name in ("args", "grid", "block"):
        with pytest.raises(TypeError, match=f"{name}= takes a dict of graph node"):
            exe.launch(**{name: [node]})
    with pytest.raises(ValueError, match="block entries must be between 1 and"):
        exe.launch(block={node: (2048,)})
    with pytest.raises(ValueError, match=r"patched grid \(16,\) / block \(4, 4\) .* inconsistent"):
        exe.launch(block={node: (4, 4)})


def test_newest_writer_of_a_host_range_is_the_latest_write_over_any_of_its_bytes():
    hazards = Hazards()
    a, b, c = (GPUFuture(None, n) for n in "abc")
    for f in (a, b, c):
        f.retired = False                      # in flight: pruning keeps them
    hazards._record(50, 100, b, True)
    hazards._record(0, 50, a, True)
    assert hazards.host(0, 100).last_write is a
    assert hazards.host(60, 10).last_write is b
    hazards._record(70, 80, c, True)
    assert hazards.host(0, 100).last_write is c
    assert sorted(f.label for f in hazards.host(0, 100).writers()) == ["a", "b", "c"]


def test_a_lane_exceeding_the_ring_replays_in_parts(make_runtime):
    """100 chained launches on a ring of 64 packets: the lane goes in parts that each fit, in
    order; two replays give exactly twice the increments."""
    rt = make_runtime(gpus=1, queues_per_device=1, ring_size=64)
    d0 = rt.devices[0]
    assert d0.queues[0].size == 64
    x = d0.alloc(N * 8)
    assert aiogpu.copy(x, np.zeros(N, np.int64)).wait(20)
    with aiogpu.Graph() as g:
        for _ in range(100):
            d0.launch(add_const_n, grid=(N,), block=(N,), args=(x, 1, N))
    exe = g.instantiate()
    assert aiogpu.gather(exe.launch(), exe.launch()).wait(60)
    out = x.to_numpy(np.int64)
    assert out.wait(20) and (out.result() == 200).all()


def test_kernarg_ring_never_straddles_its_end():
    """An allocation that does not fit before the end of the ring starts at its beginning."""
    ring = KernargRing(0x10000, 256)
    first, e1 = ring.alloc(64)
    second, e2 = ring.alloc(128)
    assert (first, second) == (0x10000, 0x10040)
    ring.free(e1)
    ring.free(e2)
    third, _ = ring.alloc(128)              # 64 bytes are left before the end: wrap
    assert third == 0x10000
    assert ring.alloc(128) is None          # the rest is in use until the third is freed
