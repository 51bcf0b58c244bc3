"""A packet group that cannot be written to its ring: every slot it reserved is published as a
no-op (AQL rule 4: the packet processor never stalls on a reserved, unpublished slot), and its
future fails and retires at once; the call that submitted it does not raise, and the queue goes on."""
from __future__ import annotations

import numpy as np

import aiogpu
from aiogpu.hsa_bindings import packets as P
from gpu_kernels import Gate, add_const_n

try:                                    # the AQL queue writer, wherever it lives
    import aiogpu.hsa.queues as Q
except ImportError:
    import aiogpu.queues as Q

N = 8


def test_a_group_whose_headers_fail_publishes_no_ops_in_every_reserved_slot(make_runtime, monkeypatch):
    rt = make_runtime(gpus=2, queues_per_device=1)
    d0, d1 = rt.devices
    queue = d0.queues[0]
    buf = d0.alloc(N * 8)
    assert aiogpu.copy(buf, np.zeros(N, np.int64)).wait(20)
    gate = Gate()
    elsewhere = gate.launch(d1)          # a wait on another device: a barrier-AND packet first
    real_headers, stores, failing = Q.AqlQueue._publish_headers, [], []
    real_store = Q.atomics.store_u32_release

    def first_header_then_fail(self, first, headers):
        failing.append((first, len(headers)))
        real_headers(self, first, headers[:1])
        raise RuntimeError("injected: publishing the headers failed")

    def recording_store(address, word):
        stores.append((address, word))
        return real_store(address, word)

    monkeypatch.setattr(Q.AqlQueue, "_publish_headers", first_header_then_fail)
    monkeypatch.setattr(Q.atomics, "store_u32_release", recording_store)
    try:
        victim = d0.launch(add_const_n, grid=(N,), block=(N,), args=(buf, 1, N), after=[elsewhere])
    finally:
        monkeypatch.setattr(Q.AqlQueue, "_publish_headers", real_headers)
    assert victim.done() and "injected" in str(victim.exception())
    first, n = failing[0]
    assert n >= 2
    noop = Q.noop_header()
    assert P.header_type(noop) == P.HSA_PACKET_TYPE_BARRIER_AND
    assert (noop >> P.HSA_PACKET_HEADER_SCACQUIRE_FENCE_SCOPE) & 3 == P.HSA_FENCE_SCOPE_NONE
    assert (noop >> P.HSA_PACKET_HEADER_SCRELEASE_FENCE_SCOPE) & 3 == P.HSA_FENCE_SCOPE_NONE
    noops = [address for address, word in stores if word == noop]
    assert noops == [queue._slot(first + i) for i in range(n)]
    gate.open()
    other = d0.alloc(N * 8)             # (buf reads as failed: its last writer did)
    assert aiogpu.copy(other, np.zeros(N, np.int64)).wait(20)
    later = d0.launch(add_const_n, grid=(N,), block=(N,), args=(other, 2, N))
    assert later.wait(20), "the queue stalled on a reserved slot"
    assert later.exception() is None
    got = other.to_numpy(np.int64)
    assert got.wait(20) and (got.result() == 2).all()


def test_a_group_that_cannot_be_written_fails_and_retires_without_raising(make_runtime, monkeypatch):
    rt = make_runtime(gpus=1, queues_per_device=1)
    d0 = rt.devices[0]
    buf = d0.alloc(N * 8)
    assert aiogpu.copy(buf, np.zeros(N, np.int64)).wait(20)
    real, calls = Q.AqlQueue._write_bodies, []

    def broken_once(self, first, blob, n):
        calls.append(first)
        if len(calls) == 1:
            raise RuntimeError("injected: writing the ring failed")
        return real(self, first, blob, n)

    monkeypatch.setattr(Q.AqlQueue, "_write_bodies", broken_once)
    victim = d0.launch(add_const_n, grid=(N,), block=(N,), args=(buf, 1, N))
    assert victim.done() and victim.retired
    err = victim.exception()
    assert isinstance(err, aiogpu.GPUError) and "could not be queued" in str(err) and err.queue == d0.queues[0].name
    other = d0.alloc(N * 8)
    later = other.fill(0)
    assert later.wait(20) and later.exception() is None
    assert len(calls) == 2, "the failed group was written again"
