"""What an instantiated graph holds and when it gives it back: its kernarg blocks (HSA) and
host-memory locks go when the executable is closed (``exe.close()``, ``with``) or collected,
and its last replay has retired; never while a replay may still read them."""
from __future__ import annotations

import gc

import numpy as np
import pytest

import aiogpu
from backends import FAKE_CUDA_GRAPH, on_fake_cuda, run_on_fake_cuda, wait_for_baseline
from gpu_kernels import Gate, add_const_n, wait_gate

N = 16


def _graph(rt, x, gate=None):
    """A launch on each GPU (each needs kernarg memory); gated first when ``gate`` is given."""
    d0, d1 = rt.devices
    with aiogpu.Graph() as g:
        after = [d0.launch(wait_gate, grid=(1,), block=(1,), args=(gate.key,))] if gate else []
        a = d0.launch(add_const_n, grid=(N,), block=(N,), args=(x, 1, N), after=after)
        d1.launch(add_const_n, grid=(N,), block=(N,), args=(rt.devices[1].alloc(N * 8), 1, N), after=[a])
    return g


def _blocks(rt) -> int:
    return wait_for_baseline(rt, 20)["kernarg_blocks"]


def _value(x) -> int:
    out = x.to_numpy(np.int64)
    assert out.wait(20)
    return int(out.result()[0])


def test_dropped_executables_give_their_kernarg_blocks_back(make_runtime):
    rt = make_runtime(gpus=2)
    x = rt.devices[0].alloc(N * 8)
    assert aiogpu.copy(x, np.zeros(N, np.int64)).wait(20)
    baseline = _blocks(rt)
    exe = _graph(rt, x).instantiate()
    assert exe.launch().wait(20)
    assert _blocks(rt) == baseline + 1          # (kernargs of every device: one block here)
    del exe
    for _ in range(50):
        exe = _graph(rt, x).instantiate()
        assert exe.launch().wait(20) and exe.launch().wait(20)
        del exe
    gc.collect()
    assert _blocks(rt) == baseline
    assert _value(x) == 101


def test_close_keeps_the_blocks_until_the_last_replay_retired(make_runtime):
    """Closed while a replay waits for a gate: the blocks stay (the replay has yet to read its
    kernargs), the replay computes what it should, then the blocks go. Later launches raise."""
    rt = make_runtime(gpus=2)
    x = rt.devices[0].alloc(N * 8)
    assert aiogpu.copy(x, np.zeros(N, np.int64)).wait(20)
    baseline = _blocks(rt)
    gate = Gate()
    exe = _graph(rt, x, gate).instantiate()
    first = exe.launch()
    second = exe.launch()
    exe.close()
    exe.close()                                 # idempotent
    with pytest.raises(ValueError, match="closed"):
        exe.launch()
    assert not second.done()
    assert rt.stats()["kernarg_blocks"] == baseline + 1
    gate.open()
    assert first.wait(20) and second.wait(20)
    assert first.exception() is None and second.exception() is None
    assert _value(x) == 2
    assert _blocks(rt) == baseline


def test_an_executable_dropped_while_its_replay_runs_keeps_its_blocks_until_it_retired(make_runtime):
    rt = make_runtime(gpus=2)
    x = rt.devices[0].alloc(N * 8)
    assert aiogpu.copy(x, np.zeros(N, np.int64)).wait(20)
    baseline = _blocks(rt)
    gate = Gate()
    replay = _graph(rt, x, gate).instantiate().launch()
    gc.collect()
    assert rt.stats()["kernarg_blocks"] == baseline + 1
    gate.open()
    assert replay.wait(20) and replay.exception() is None
    assert _value(x) == 1
    gc.collect()
    assert _blocks(rt) == baseline


def test_with_closes_and_host_locks_go_too(make_runtime):
    """``with g.instantiate() as exe``: closed at the end of the block; the host arrays its
    copies lock are unlocked then as well (not at the runtime's close)."""
    rt = make_runtime(gpus=2)
    d0 = rt.devices[0]
    x = d0.alloc(N * 8)
    src, dst = np.arange(N, dtype=np.int64), np.zeros(N, np.int64)
    base = wait_for_baseline(rt, 20)
    with aiogpu.Graph() as g:
        up = aiogpu.copy(x, src)
        k = d0.launch(add_const_n, grid=(N,), block=(N,), args=(x, 1, N), after=[up])
        aiogpu.copy(dst, x, after=[k])
    with g.instantiate() as exe:
        assert rt.stats()["host_locks"] > base["host_locks"]
        assert exe.launch().wait(20)
    assert (dst == src + 1).all()
    with pytest.raises(ValueError, match="closed"):
        exe.launch()
    after = wait_for_baseline(rt, 20)
    assert (after["kernarg_blocks"], after["host_locks"]) == (base["kernarg_blocks"], base["host_locks"])
    assert exe is not None                      # still referenced: released by close, not by gc


def test_a_failed_instantiation_gives_its_blocks_back(make_runtime, monkeypatch):
    rt = make_runtime(gpus=2)
    x = rt.devices[0].alloc(N * 8)
    baseline = _blocks(rt)
    g = _graph(rt, x)
    from aiogpu.hsa.graph import HsaGraphExec
    real = HsaGraphExec._dispatch_packet
    calls = []

    def fail_second(self, *a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("instantiation failed on purpose")
        return real(self, *a, **k)
    monkeypatch.setattr(HsaGraphExec, "_dispatch_packet", fail_second)
    with pytest.raises(RuntimeError, match="on purpose"):
        g.instantiate()
    assert _blocks(rt) == baseline


@on_fake_cuda
def test_cuda_executables_close_too():
    """On CUDA, ``close`` (and ``with``) destroys the executable once its replays retired."""
    got = run_on_fake_cuda(FAKE_CUDA_GRAPH + """
from backends import wait_for_baseline
with g.instantiate() as exe:
    assert exe.launch().wait(20)
try:
    exe.launch()
except ValueError as e:
    print("refused:", "closed" in str(e))
wait_for_baseline(rt, 20)
assert aiogpu.copy(x, np.zeros(16, np.int64)).wait(20)
wait_for_baseline(rt, 20)
import time
deadline = time.monotonic() + 20      # the waiter destroys it: soon after its work retired
while exe.exec is not None and time.monotonic() < deadline:
    time.sleep(0.01)
print("destroyed:", exe.exec is None and exe.lane is None)
rt.close()
""")
    assert got.returncode == 0, got.stdout + got.stderr
    assert "refused: True" in got.stdout and "destroyed: True" in got.stdout, got.stdout + got.stderr


def test_a_replay_still_deferred_at_close_runs_before_the_blocks_go(make_runtime, monkeypatch):
    """A replay deferred behind a launch whose kernel compiles (held here) is launched work:
    closing the executable first keeps its kernargs until that replay has run and retired."""
    import threading

    from aiogpu.deferred import Deferred
    from aiogpu.hsa.device import HsaDevice

    hold = threading.Event()
    compiled = set()

    def needs(self, kernel):
        return kernel.name == "held_add" and (kernel, self.index) not in compiled

    def compile_(self, kernel):
        assert hold.wait(30)
        compiled.add((kernel, self.index))
    monkeypatch.setattr(HsaDevice, "_needs_compile", needs)
    monkeypatch.setattr(HsaDevice, "_compile", compile_)

    @aiogpu.kernel("i64*, i64, u32", name="held_add")
    def held_add(launch, x, c, n):
        x[:n] += c

    rt = make_runtime(gpus=2)
    x = rt.devices[0].alloc(N * 8)
    assert aiogpu.copy(x, np.zeros(N, np.int64)).wait(20)
    baseline = _blocks(rt)
    exe = _graph(rt, x).instantiate()
    writer = rt.devices[0].launch(held_add, grid=(N,), block=(N,), args=(x, 10, N))
    replay = exe.launch()
    assert isinstance(replay, Deferred) and not replay.submitted
    exe.close()
    del exe
    gc.collect()
    assert rt.stats()["kernarg_blocks"] == baseline + 1
    hold.set()
    assert writer.wait(20) and replay.wait(20) and replay.exception() is None
    assert _value(x) == 11
    assert _blocks(rt) == baseline


def test_a_fallback_shader_copy_takes_no_room_of_the_executables_blocks(make_runtime):
    """With its engine gone, a replay's copy runs as a shader copy: its arguments go in the
    queue's kernarg ring (freed when it retires), not in the executable's blocks, which would
    otherwise grow by a block every few thousand replays for as long as it lives."""
    rt = make_runtime(gpus=2)
    d0, d1 = rt.devices
    src, dst = d0.alloc(N * 8), d1.alloc(N * 8)
    assert aiogpu.copy(src, np.arange(N, dtype=np.int64)).wait(20)
    with aiogpu.Graph() as g:
        k = d0.launch(add_const_n, grid=(N,), block=(N,), args=(src, 1, N))
        aiogpu.copy(dst, src, after=[k])
    exe = g.instantiate()
    assert exe.engine_of, "the copy should be planned on an engine"
    with rt.lock:
        d0.engines.lose()
    used = exe._kernarg_room
    for _ in range(3):
        assert exe.launch().wait(20)
    assert exe._kernarg_room == used
    out = dst.to_numpy(np.int64)
    assert out.wait(20) and (out.result() == np.arange(N) + 3).all()


def test_an_executable_outliving_its_runtime_closes_and_dies_quietly(make_runtime, caplog):
    """The runtime's close frees every block itself: closing or dropping the executable later
    does nothing (no double free), and a launch says the runtime is closed."""
    rt = make_runtime(gpus=2)
    x = rt.devices[0].alloc(N * 8)
    exe = _graph(rt, x).instantiate()
    other = _graph(rt, x).instantiate()
    assert exe.launch().wait(20)
    rt.close()
    with pytest.raises(aiogpu.RuntimeClosedError):
        exe.launch()
    exe.close()
    del exe, other
    gc.collect()
    assert [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")] == []
