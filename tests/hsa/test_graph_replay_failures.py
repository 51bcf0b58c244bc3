"""How a graph replay fails: through its inputs, as an ordinary launch does (a ``T*`` argument is
read and written, an ``out T*`` one only written), and through its queue (a replay longer than
the ring, published in parts, fails whole when a queue error hits; nothing waits forever)."""
from __future__ import annotations

import numpy as np
import pytest

import aiogpu
from aiogpu.errors import GPUError
from gpu_kernels import Gate, add_const_n, fail_if

N = 16


@aiogpu.kernel("out i64*, i64, u32")
def set_n(launch, x, v, n):
    x[:n] = v


def _failed_write(d0, x):
    """Make a failed launch the last writer of ``x`` (its contents are now undefined)."""
    bad = d0.launch(fail_if, grid=(1,), block=(1,), args=(x, 1))
    assert bad.wait(20) and bad.exception() is not None
    return bad


def test_a_replay_reading_a_buffer_whose_writer_failed_fails(make_runtime):
    """``add_const_n`` reads and writes its ``i64*``: after a failed write, an ordinary launch of
    it fails, and so must a replay of it, unpatched or patched onto that buffer."""
    rt = make_runtime(gpus=1)
    d0 = rt.devices[0]
    x, y = d0.alloc(N * 8), d0.alloc(N * 8)
    assert aiogpu.gather(aiogpu.copy(x, np.zeros(N, np.int64)), aiogpu.copy(y, np.zeros(N, np.int64))).wait(20)
    with aiogpu.Graph() as g:
        node = d0.launch(add_const_n, grid=(N,), block=(N,), args=(x, 1, N))
    exe = g.instantiate()
    _failed_write(d0, x)
    plain = d0.launch(add_const_n, grid=(N,), block=(N,), args=(x, 1, N))
    assert plain.wait(20) and isinstance(plain.exception(), GPUError)      # the rule
    replay = exe.launch()
    assert replay.wait(20)
    assert isinstance(replay.exception(), GPUError) and "dependency failed" in str(replay.exception())
    _failed_write(d0, y)
    patched = exe.launch(args={node: (y, 1, N)})
    assert patched.wait(20) and isinstance(patched.exception(), GPUError)


def test_a_replay_that_only_writes_a_failed_buffer_runs_and_resets_it(make_runtime):
    """An ``out T*`` argument is only written: the replay runs and its result is defined."""
    rt = make_runtime(gpus=1)
    d0 = rt.devices[0]
    x = d0.alloc(N * 8)
    with aiogpu.Graph() as g:
        d0.launch(set_n, grid=(N,), block=(N,), args=(x, 4, N))
    exe = g.instantiate()
    _failed_write(d0, x)
    replay = exe.launch()
    assert replay.wait(20) and replay.exception() is None
    out = x.to_numpy(np.int64)
    assert out.wait(20) and (out.result() == 4).all()


def test_a_replay_waits_for_a_pending_writer_of_a_read_write_argument(make_runtime):
    """The replay is ordered after (and fails with) a pending earlier writer of its ``T*``."""
    rt = make_runtime(gpus=1)
    d0 = rt.devices[0]
    x = d0.alloc(N * 8)
    assert aiogpu.copy(x, np.zeros(N, np.int64)).wait(20)
    with aiogpu.Graph() as g:
        d0.launch(add_const_n, grid=(N,), block=(N,), args=(x, 1, N))
    exe = g.instantiate()
    gate = Gate()
    writer = d0.launch(add_const_n, grid=(N,), block=(N,), args=(x, 10, N), after=[gate.launch(d0)])
    replay = exe.launch()
    assert writer in replay.preds and not replay.done()
    gate.open()
    assert replay.wait(20) and replay.exception() is None
    out = x.to_numpy(np.int64)
    assert out.wait(20) and (out.result() == 11).all()


def test_a_queue_error_fails_a_replay_whose_parts_wait_in_the_back_log(make_runtime):
    """A lane of 100 launches on a ring of 64 goes in parts; the queue fails at its first packet
    while the later parts wait in the back-log. Their nodes' completions (which another
    device's lane and an SDMA copy wait for) must fail too: the replay fails, the work waiting on
    them on gpu1 fails rather than blocks its queue, and later work on both GPUs runs."""
    rt = make_runtime(gpus=2, queues_per_device=1, ring_size=64)
    d0, d1 = rt.devices
    x, y, z = d0.alloc(N * 8), d1.alloc(N * 8), d1.alloc(N * 8)
    zeros = np.zeros(N, np.int64)
    assert aiogpu.gather(aiogpu.copy(x, zeros), aiogpu.copy(y, zeros), aiogpu.copy(z, zeros)).wait(20)
    with aiogpu.Graph() as g:
        last = None
        for _ in range(100):
            last = d0.launch(add_const_n, grid=(N,), block=(N,), args=(x, 1, N))
        d1.launch(add_const_n, grid=(N,), block=(N,), args=(y, 1, N), after=[last])
        aiogpu.copy(z, x, after=[last])
    exe = g.instantiate()
    rt.api.emulator.faults.queue_error_at(1, agent=0)
    replay = exe.launch()
    assert replay.wait(20), "the replay never settled"
    assert isinstance(replay.exception(), GPUError)
    # What only writes the replay's buffers is ordered after all of its work (on gpu1's queue
    # behind the lane that waited for a back-logged node, on gpu0 behind the SDMA copy that did).
    later = [d0.launch(set_n, grid=(N,), block=(N,), args=(x, 3, N)),
             d1.launch(set_n, grid=(N,), block=(N,), args=(y, 0, N)),
             d1.launch(set_n, grid=(N,), block=(N,), args=(z, 0, N))]
    assert all(f.wait(20) for f in later), "later work waits forever behind the failed replay"
    assert [f.exception() for f in later] == [None, None, None]
    again = exe.launch()
    assert again.wait(20) and again.exception() is None
    outs = [b.to_numpy(np.int64) for b in (x, y, z)]
    assert all(o.wait(20) for o in outs)
    assert [int(o.result()[0]) for o in outs] == [103, 1, 103]
