"""What a queue failure tells each operation on the queue: the queue, the packet and the cause
chain (the stress relies on the chain leading to the injected fault), for the operation that
failed, its queue-mates, and work failed when the queue is aborted."""
from __future__ import annotations

import numpy as np
import pytest

import aiogpu
from aiogpu.futures import cause_chain
from aiogpu.hsa_bindings.emulator import InjectedFault
from gpu_kernels import Gate, add_const_n, add_into

N = 16


def _pending_behind_a_gate(rt, error_at=None):
    """(gate, first, second, buffer first writes): two launches on gpu0's only queue, the first
    after a gated kernel of gpu1 (so gpu0 processes only its barrier before the gate opens).
    ``error_at``: arm a queue error at that packet of gpu0 from then on (1: that barrier)."""
    d0, d1 = rt.devices
    a, b = d0.alloc(N * 8), d0.alloc(N * 8)
    assert aiogpu.gather(aiogpu.copy(a, np.zeros(N, np.int64)), aiogpu.copy(b, np.zeros(N, np.int64))).wait(20)
    if error_at is not None:      # armed once the uploads (which may be shader copies) are done
        rt.api.emulator.faults.queue_error_at(error_at, agent=0)
    gate = Gate()
    held = gate.launch(d1)
    first = d0.launch(add_const_n, grid=(N,), block=(N,), args=(a, 1, N), after=[held])
    second = d0.launch(add_const_n, grid=(N,), block=(N,), args=(b, 1, N))
    assert first.queue == second.queue == d0.queues[0].name
    return gate, first, second, a


def test_a_queue_error_names_queue_packet_and_cause_for_the_failed_and_its_queue_mates(make_runtime):
    rt = make_runtime(gpus=2, queues_per_device=1)
    gate, first, second, _ = _pending_behind_a_gate(rt, error_at=2)    # the first launch's dispatch
    gate.open()
    assert first.wait(20) and second.wait(20)
    queue = rt.devices[0].queues[0]
    failed, mate = first.exception(), second.exception()
    assert isinstance(failed, aiogpu.GPUError) and isinstance(mate, aiogpu.GPUError)
    assert (failed.queue, failed.packet) == (queue.name, first.packet)
    assert (mate.queue, mate.packet) == (queue.name, second.packet)
    assert f"queue {queue.name} failed" in str(mate.__cause__), "a queue-mate's cause is the queue's error"
    for exc in (failed, mate):
        assert any(isinstance(e, InjectedFault) for e in cause_chain(exc))
    assert queue.errors and f"queue {queue.name} failed" in queue.errors[-1]


def test_abort_fails_pending_work_naming_queue_and_packet(make_runtime):
    """Work pending on an aborted queue, none of it the one to blame (as after a memory fault,
    which names no packet): each fails with the abort's error, its queue and its packet."""
    rt = make_runtime(gpus=2, queues_per_device=1)
    gate, first, second, _ = _pending_behind_a_gate(rt)
    queue = rt.devices[0].queues[0]
    with rt.lock:
        rt.hub.settle_failed(queue.abort(aiogpu.GPUError("evicted for the test", status=41), -1))
    gate.open()
    for fut in (first, second):
        assert fut.wait(20)
        exc = fut.exception()
        assert isinstance(exc, aiogpu.GPUError) and "evicted for the test" in str(exc)
        assert (exc.queue, exc.packet, exc.status) == (queue.name, fut.packet, 41)
    later = rt.devices[0].launch(add_const_n, grid=(N,), block=(N,), args=(rt.devices[0].alloc(N * 8), 1, N))
    assert later.wait(20) and later.exception() is None, "the queue was not recreated"


def test_capture_rejects_foreign_dependencies_and_runtimes(make_runtime):
    rt, other = make_runtime(gpus=1), make_runtime(gpus=1)
    d0 = rt.devices[0]
    x = d0.alloc(N * 8)
    with aiogpu.Graph() as first:
        node = d0.launch(add_const_n, grid=(N,), block=(N,), args=(x, 1, N))
    with aiogpu.Graph():
        with pytest.raises(ValueError, match="after= takes nodes of the same graph"):
            d0.launch(add_const_n, grid=(N,), block=(N,), args=(x, 1, N), after=[node])
    with aiogpu.Graph():
        d0.launch(add_const_n, grid=(N,), block=(N,), args=(x, 1, N))
        with pytest.raises(ValueError, match="^a graph captures the operations of one runtime$"):
            other.devices[0].launch(add_const_n, grid=(N,), block=(N,), args=(other.devices[0].alloc(N * 8), 1, N))
    assert first.nodes == [node]


def test_dependents_of_failed_work_carry_its_status(make_runtime):
    """Reading what failed work wrote fails before anything runs, with the failure's status."""
    rt = make_runtime(gpus=2, queues_per_device=1)
    gate, first, _, buf = _pending_behind_a_gate(rt, error_at=2)
    gate.open()
    assert first.wait(20)
    d0 = rt.devices[0]
    reader = d0.launch(add_into, grid=(N,), block=(N,), args=(d0.alloc(N * 8), buf, N))
    assert reader.wait(20)
    exc = reader.exception()
    assert isinstance(exc, aiogpu.GPUError) and "a dependency failed" in str(exc)
    assert exc.status == first.exception().status is not None


def test_overwriting_what_a_failed_reader_read_does_not_fail(make_runtime):
    """Write after read only orders: a reader that failed (its queue died while it waited for
    an earlier writer) does not fail the next writer of what it read, which still comes after
    that earlier writer."""
    rt = make_runtime(gpus=2, queues_per_device=2)
    d0, d1 = rt.devices
    buf, out = d0.alloc(N * 8), d0.alloc(N * 8)
    assert aiogpu.gather(aiogpu.copy(buf, np.zeros(N, np.int64)), aiogpu.copy(out, np.zeros(N, np.int64))).wait(20)
    gate = Gate()
    held = gate.launch(d1)
    late = aiogpu.copy(buf, np.full(N, 5, np.int64), after=[held])
    rt.api.emulator.faults.queue_error_at(1, agent=0)
    reader = d0.launch(add_into, grid=(N,), block=(N,), args=(out, buf, N))
    assert reader.wait(20) and isinstance(reader.exception(), aiogpu.GPUError)
    assert not reader.retired
    overwrite = aiogpu.copy(buf, np.full(N, 7, np.int64))
    gate.open()
    assert late.wait(20) and overwrite.wait(20)
    assert overwrite.exception() is None
    got = buf.to_numpy(np.int64)
    assert got.wait(20) and (got.result() == 7).all()


def test_replay_reading_host_memory_still_waits_for_writers_of_its_other_inputs(make_runtime):
    """A replay's inputs are all ordered, whatever comes first among them (here a host array)."""
    rt = make_runtime(gpus=2)
    d0, d1 = rt.devices
    b1, b2, c = (d0.alloc(N * 8) for _ in range(3))
    assert aiogpu.gather(*(aiogpu.copy(b, np.zeros(N, np.int64)) for b in (b1, b2, c))).wait(20)
    host = np.full(N, 2, np.int64)
    with aiogpu.Graph() as g:
        aiogpu.copy(b1, host)
        d0.launch(add_into, grid=(N,), block=(N,), args=(b2, c, N))
    exe = g.instantiate()
    gate = Gate()
    held = gate.launch(d1)
    pending = aiogpu.copy(c, np.full(N, 6, np.int64), after=[held])    # on an engine, not a queue
    assert d0.engines.runs(pending.queue)
    replay = exe.launch()
    gate.open()
    assert pending.wait(20) and replay.wait(20) and replay.exception() is None
    got = b2.to_numpy(np.int64)
    assert got.wait(20) and (got.result() == 6).all()
