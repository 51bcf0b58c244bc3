"""What a queue failure tells each operation on the queue: the queue, the packet and the cause
chain (the stress relies on the chain leading to the injected fault), for the operation that
failed, its queue-mates, and work failed when the queue is aborted."""
from __future__ import annotations

import numpy as np
import pytest

import aiogpu
from aiogpu.futures import cause_chain
from aiogpu.hsa_bindings.emulator import InjectedFault
from gpu_kernels import Gate, add_const_n

N = 16


def _pending_behind_a_gate(rt):
    """(gate, first, second): two launches on gpu0's only queue, the first after a gated kernel
    of gpu1 (so nothing of gpu0 is processed before the gate opens)."""
    d0, d1 = rt.devices
    a, b = d0.alloc(N * 8), d0.alloc(N * 8)
    assert aiogpu.gather(aiogpu.copy(a, np.zeros(N, np.int64)), aiogpu.copy(b, np.zeros(N, np.int64))).wait(20)
    gate = Gate()
    held = gate.launch(d1)
    first = d0.launch(add_const_n, grid=(N,), block=(N,), args=(a, 1, N), after=[held])
    second = d0.launch(add_const_n, grid=(N,), block=(N,), args=(b, 1, N))
    assert first.queue == second.queue == d0.queues[0].name
    return gate, first, second


def test_a_queue_error_names_queue_packet_and_cause_for_the_failed_and_its_queue_mates(make_runtime):
    rt = make_runtime(gpus=2, queues_per_device=1)
    rt.api.emulator.faults.queue_error_at(2, agent=0)     # the first launch's dispatch packet
    gate, first, second = _pending_behind_a_gate(rt)
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
    gate, first, second = _pending_behind_a_gate(rt)
    queue = rt.devices[0].queues[0]
    with rt.lock:
        queue.abort(aiogpu.GPUError("evicted for the test", status=41), -1)
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
        with pytest.raises(ValueError, match="a graph captures the operations of one runtime"):
            other.devices[0].launch(add_const_n, grid=(N,), block=(N,), args=(other.devices[0].alloc(N * 8), 1, N))
    assert first.nodes == [node]
