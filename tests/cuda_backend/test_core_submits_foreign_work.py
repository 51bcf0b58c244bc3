"""Work that is not one of aiogpu's own operations, on the CUDA backend (fake driver of
tests/fakes, each test in a child process): graph replays, other libraries' streams and
events, and buffers exported through ``__cuda_array_interface__``. The core submits each of
them (``_core.submit.replay``/``foreign``/``writers_lane``); the backend only names the lane
and encodes, so each follows the rules of any operation."""
from __future__ import annotations

import textwrap

from backends import FAKE_CUDA_GRAPH, on_fake_cuda, run_on_fake_cuda

pytestmark = on_fake_cuda


def run(script: str, setup: str = "", timeout: float = 120) -> str:
    proc = run_on_fake_cuda("import fakecuda_controls as fc\n" + setup + textwrap.dedent(script), timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return proc.stdout


def test_a_closed_executable_whose_lane_still_runs_a_replay_is_destroyed_after_it():
    """The executable's destruction, asked for while a replay on its lane has not retired (the
    lane held here, as a GPU still running it), waits for that replay and then happens."""
    out = run(setup=FAKE_CUDA_GRAPH, script="""
    import time
    exe = g.instantiate()
    fc.hold(exe.lane.handle)
    fut = exe.launch()
    time.sleep(0.05)
    print("held", not fut.done())
    exe._destroy_when_idle()            # (what the waiter runs once the executable is let go)
    print("kept while running", exe.exec is not None)
    fc.release(exe.lane.handle)
    print("replay", fut.wait(20))
    deadline = time.monotonic() + 20
    while exe.exec is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    print("destroyed after", exe.exec is None and exe.lane is None)
    rt.close()
    """)
    for line in ("held True", "kept while running True", "replay True", "destroyed after True"):
        assert line in out, out


def test_replays_are_traced_as_graph_work_and_run_on_the_executables_lane():
    out = run(setup=FAKE_CUDA_GRAPH, script="""
    with g.instantiate() as exe:
        fut = exe.launch()
        print("lane", fut.lane is exe.lane, "kind", fut.kind, "device", fut.device is d0)
        print("done", fut.wait(20))
        exe.destroy()
        try:
            exe.launch()
        except ValueError as e:
            print("refused:", e)
    print("pending", rt.hub.pending_count)
    rt.close()
    """)
    assert "lane True kind graph device True" in out and "done True" in out, out
    assert "refused: this graph executable was destroyed" in out and "pending 0" in out, out


def test_stream_and_event_futures_go_through_the_core():
    """A stream's future is work on that stream's lane; an event never recorded is done at
    once with nothing submitted; a bad handle raises before anything is submitted."""
    out = run("""
    import aiogpu
    rt = aiogpu.Runtime("cuda")
    d0 = rt.devices[0]
    class TorchLikeStream:
        cuda_stream, device_index = 0x7000, 0
    f = rt.stream_future(TorchLikeStream())
    print("stream lane", f.lane is d0.foreign[0x7000], f.label)
    print("stream done", f.wait(20))
    class NeverRecorded:
        cuda_event = 0
    e = rt.stream_future(NeverRecorded())
    print("event", e.done(), e.label, getattr(e, "lane", None) is None)
    before = rt.hub.pending_count
    class OnDevice5:
        cuda_stream, device_index = 0x7001, 5
    for bad in (-1, OnDevice5()):
        try:
            rt.stream_future(bad)
        except (TypeError, ValueError) as exc:
            print("refused", type(exc).__name__)
    print("pending after", rt.hub.pending_count - before)
    rt.close()
    """)
    assert "stream lane True stream 0x7000" in out and "stream done True" in out, out
    assert "event True event (never recorded) True" in out, out
    assert out.count("refused") == 2 and "pending after 0" in out, out


def test_an_exported_buffer_names_the_lane_of_its_writers():
    """``__cuda_array_interface__``'s ``stream``: None with no pending writer; the writer's lane
    with one; with writers on two lanes, the lane of a join of both (one more operation)."""
    out = run("""
    import numpy as np, aiogpu
    from gpu_kernels import add_const_n
    rt = aiogpu.Runtime("cuda")
    d0 = rt.devices[0]
    x = d0.alloc(256)
    assert aiogpu.copy(x, np.zeros(32, np.int64)).wait(20)
    d0.load(add_const_n).wait(20)
    print("idle", x.__cuda_array_interface__["stream"])
    a, b = x.view(np.int64)[:16], x.view(np.int64)[16:]
    lanes = [l for l in d0.lanes if l.kind == "compute"][:2]
    for lane in lanes:
        fc.hold(lane.handle)
    fa = d0.launch(add_const_n, grid=(16,), block=(16,), args=(a, 1, 16))
    fb = d0.launch(add_const_n, grid=(16,), block=(16,), args=(b, 1, 16))
    one = a.__cuda_array_interface__["stream"]
    print("one writer", one == fa.lane.handle)
    print("two lanes", fa.lane is not fb.lane)
    joins = rt.hub.pending_count
    both = x.__cuda_array_interface__["stream"]
    print("join", both in (fa.lane.handle, fb.lane.handle), rt.hub.pending_count == joins + 1)
    for lane in lanes:
        fc.release(lane.handle)
    print("done", fa.wait(20), fb.wait(20))
    rt.close()
    """)
    assert "idle None" in out and "one writer True" in out and "two lanes True" in out, out
    assert "join True True" in out and "done True True" in out, out
