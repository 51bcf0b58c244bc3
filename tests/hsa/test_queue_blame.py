"""What each operation on a failed AQL queue is told: the packet it is blamed at and the queue's
HSA status, for the operations inside one submission of several packets (a graph lane), for
queue-mates and for back-logged work; and that an error reported for a queue already destroyed
changes nothing."""
from __future__ import annotations

import numpy as np

import aiogpu
from aiogpu.hsa import queues
from aiogpu.hsa_bindings import types as T
from backends import wait_until
from gpu_kernels import Gate, add_const_n

N = 16
STATUS = T.HSA_STATUS_ERROR_EXCEPTION


def _launch(dev, buf, c=1):
    return dev.launch(add_const_n, grid=(N,), block=(N,), args=(buf, c, N))


def test_nodes_inside_one_submission_fail_at_their_own_packets_with_the_queues_status(make_runtime, monkeypatch):
    """A graph lane is one submission (PacketGroup) of several packets; a node another lane waits
    for completes at a packet inside it. When the lane's queue fails, such a node fails naming
    its own packet, and the queue error's status (GPUError.status and .packet are public)."""
    rt = make_runtime(gpus=2, queues_per_device=2)
    d0, d1 = rt.devices
    x, z = d0.alloc(N * 8), d0.alloc(N * 8)
    assert aiogpu.gather(aiogpu.copy(x, np.zeros(N, np.int64)), aiogpu.copy(z, np.zeros(N, np.int64))).wait(20)
    with aiogpu.Graph() as g:
        _launch(d0, x)
        b = _launch(d0, x)              # after the first, in its lane: packet 1 of the lane
        c = _launch(d0, z)              # independent: the other queue's lane
        aiogpu.gather(b, c)             # joined in c's lane, so b's lane signals b's completion
    exe = g.instantiate()
    groups = []
    real_submit = queues.AqlQueue.submit
    monkeypatch.setattr(queues.AqlQueue, "submit", lambda self, group, **kw: groups.append(group) or real_submit(self, group, **kw))
    gate = Gate()            # on the other GPU: destroying the queue waits for nothing
    d0.launch(add_const_n, grid=(N,), block=(N,), args=(x, 0, N), after=[gate.launch(d1)])
    replay = exe.launch()            # after that launch (it writes x), so after the gate
    lane = next((gr for gr in groups if any(i > 0 for _, i in gr.marks)), None)
    assert lane is not None, "no node completes inside a lane: the test no longer tests that"
    queue = next(q for q in d0.queues if q.name == lane.future.queue)
    first = lane.future.packet - (len(lane) - 1)
    with rt.lock:      # what the queue's error callback does (nothing of the replay has run)
        rt.hub.settle_failed(queue.abort(aiogpu.GPUError(f"queue {queue.name} failed: for the test",
                                                         status=STATUS, queue=queue.name)))
    gate.open()
    assert replay.wait(20) and isinstance(replay.exception(), aiogpu.GPUError)
    for fut, i in lane.marks:
        assert fut.wait(20)
        exc = fut.exception()
        assert isinstance(exc, aiogpu.GPUError), exc
        assert (exc.queue, exc.packet, exc.status) == (queue.name, first + i, STATUS), (str(exc), first, i)


def test_a_queue_error_gives_its_status_to_the_failed_its_queue_mates_and_its_back_log(make_runtime):
    """A queue error fails everything on the queue with the error's HSA status: the operation
    that failed, those published behind it, and those still in the back-log, which are told
    that they were never submitted."""
    rt = make_runtime(gpus=2, queues_per_device=1, ring_size=4, emulator_min_queue_size=4)
    d0, d1 = rt.devices
    bufs = [d0.alloc(N * 8) for _ in range(6)]
    assert aiogpu.gather(*(aiogpu.copy(b, np.zeros(N, np.int64)) for b in bufs)).wait(20)
    queue = d0.queues[0]
    # The zero-fills were shader copies on this very ring, behind a room mark or two: start from
    # an empty ring (the packet processor may not have reached the last mark yet) and from what
    # they held given back (their kernel arguments are freed when the waiter retires them, after
    # their futures completed: before that, a launch short of kernarg space is back-logged, and
    # every later one behind it).
    assert wait_until(lambda: rt.api.hsa_queue_load_read_index_scacquire(queue._q)
                      == rt.api.hsa_queue_load_write_index_relaxed(queue._q), 20)
    assert rt.leaks(20, buffers=False) == {}
    gate = Gate()
    with rt.lock:       # the queue's error is handled once everything is submitted
        rt.api.emulator.faults.queue_error_at(1, agent=0)     # the first launch's barrier
        first = d0.launch(add_const_n, grid=(N,), block=(N,), args=(bufs[0], 1, N), after=[gate.launch(d1)])
        rest = [_launch(d0, b) for b in bufs[1:]]
        parked = [f for f in rest if any(g.future is f for g in queue.backlog)]
        published = [f for f in rest if f not in parked]
        assert parked and published, "the ring of 4 should hold some launches and park the rest"
    gate.open()
    for fut in [first, *rest]:
        assert fut.wait(20)
        exc = fut.exception()
        assert isinstance(exc, aiogpu.GPUError) and (exc.queue, exc.status) == (queue.name, STATUS), (fut, exc)
    assert first.exception().packet == first.packet
    for fut in published:
        assert fut.exception().packet == fut.packet and "before it completed" in str(fut.exception())
    for fut in parked:
        assert f"queue {queue.name} failed (HSA_STATUS_ERROR_EXCEPTION) before it was submitted" in str(fut.exception())


def test_an_error_handled_after_the_queue_was_destroyed_changes_nothing(make_runtime):
    """The driver's error callback only posts the error to the waiter; when that runs, the
    runtime may have closed and destroyed the queue already: the error is dropped, and no queue
    is created again."""
    rt = make_runtime(gpus=1, queues_per_device=1)
    queue = rt.devices[0].queues[0]
    generation = queue.generation
    rt.close()
    queue._on_error(STATUS, generation)          # what the posted error runs, late
    assert (queue._q, queue.generation, queue.errors) == (None, generation, [])
