"""The AQL writer's store order, the replay join, and the queue priority, checked directly.

These pin rules that the emulator cannot show through results alone (see DESIGN.md, "AQL queue
protocol"): the eager packet processor cannot tell one whole-packet memmove from a correct
writer, so the writer's stores into the ring are recorded and their order checked.
"""
from __future__ import annotations

import ctypes
import struct
import threading
import time
import types

import numpy as np
import pytest

import aiogpu
from aiogpu.hsa import queues
from aiogpu.hsa.graph import DEP_OFFSET, HsaGraphExec
from aiogpu.hsa_bindings import atomics
from aiogpu.hsa_bindings import packets as P
from aiogpu.hsa_bindings import types as T
from gpu_kernels import Gate, add_const_n

N = 16


class StoreLog:
    """Records the writer's ring stores: body memmoves, release header stores, the doorbell."""

    def __init__(self, monkeypatch, api):
        self.events: list[tuple] = []
        self.on = True
        log = self

        def memmove(dst, src, size):
            if log.on:
                log.events.append(("body", int(dst), int(size)))
            return ctypes.memmove(dst, src, size)

        def store_u32_release(address, word):
            if log.on:
                log.events.append(("header", int(address), int(word)))
            return atomics.store_u32_release(address, word)

        real_doorbell = api.hsa_signal_store_screlease

        def doorbell(signal, value):
            if log.on:
                log.events.append(("doorbell", int(signal.handle), int(value)))
            return real_doorbell(signal, value)

        monkeypatch.setattr(queues, "ctypes", _Proxy(ctypes, memmove=memmove))
        monkeypatch.setattr(queues, "atomics", _Proxy(atomics, store_u32_release=store_u32_release))
        monkeypatch.setattr(api, "hsa_signal_store_screlease", doorbell)


class _Proxy(types.SimpleNamespace):
    """A module with some functions replaced."""

    def __init__(self, module, **replaced):
        super().__init__(**replaced)
        self._module = module

    def __getattr__(self, name):
        return getattr(self._module, name)


def test_header_words_are_stored_last_with_release_after_every_body(make_runtime, monkeypatch):
    """Rule 2: bodies (bytes 4..63) first, never touching a header; then each header word, in
    order, by one 32-bit release store; then the doorbell with the last packet's index."""
    rt = make_runtime(gpus=2, queues_per_device=1)
    d0, d1 = rt.devices
    buf = d0.alloc(N * 8)
    assert aiogpu.copy(buf, np.zeros(N, np.int64)).wait(20)
    gate = Gate()
    held = gate.launch(d1)                       # a dependency on another device: two packets
    log = StoreLog(monkeypatch, rt.api)
    fut = d0.launch(add_const_n, grid=(N,), block=(N,), args=(buf, 1, N), after=[held])
    log.on = False
    queue = d0.queues[0]
    first, last = queue.inflight[fut]
    assert last - first + 1 == 2
    slots = [queue.ring + (i % queue.size) * P.PACKET_SIZE for i in range(first, last + 1)]
    order = {e: i for i, e in enumerate(log.events)}
    body_end, headers = -1, []
    for slot in slots:
        bodies = [e for e in log.events if e[0] == "body" and e[1] < slot + P.PACKET_SIZE and e[1] + e[2] > slot]
        assert bodies, "the packet body was not written"
        for _, dst, size in bodies:
            assert dst >= slot + 4 and dst + size <= slot + P.PACKET_SIZE, "a body write touched the header"
        assert sum(size for _, _, size in bodies) == P.PACKET_SIZE - 4
        body_end = max(body_end, *(order[e] for e in bodies))
        stores = [e for e in log.events if e[0] == "header" and e[1] == slot]
        assert len(stores) == 1, "one release store of the header word per packet"
        headers.append(stores[0])
    assert all(order[h] > body_end for h in headers), "a header was published before every body"
    assert [order[h] for h in headers] == sorted(order[h] for h in headers)
    bells = [e for e in log.events if e[0] == "doorbell" and e[1] == queue.doorbell.handle]
    assert len(bells) == 1 and bells[0][2] == last and order[bells[0]] > order[headers[-1]]
    # What the ring holds is what was stored (the barrier waits on the gate, so it is unconsumed).
    assert atomics.load_u32_acquire(slots[0]) == headers[0][2]
    assert P.header_type(headers[0][2] & 0xFFFF) == P.HSA_PACKET_TYPE_BARRIER_AND
    assert struct.unpack_from("<Q", ctypes.string_at(slots[0] + DEP_OFFSET, 8))[0] == held.signal
    gate.open()
    assert fut.wait(20) and fut.exception() is None
    out = buf.to_numpy(np.int64)
    assert out.wait(20) and (out.result() == 1).all()


def test_replay_join_waits_for_its_sdma_copy_parts(make_runtime, monkeypatch):
    """A replay's future completes only after every part, SDMA copies included: its join
    barrier names each copy part's completion signal, and when it completes the copy has."""
    rt = make_runtime(gpus=2)
    d0, d1 = rt.devices
    src, dst = d0.alloc(N * 8), d1.alloc(N * 8)
    assert aiogpu.copy(src, np.zeros(N, np.int64)).wait(20)
    with aiogpu.Graph() as g:
        a = d0.launch(add_const_n, grid=(N,), block=(N,), args=(src, 4, N))
        aiogpu.copy(dst, src, after=[a])       # a peer copy: the source device's SDMA engine
    exe = g.instantiate()
    assert isinstance(exe, HsaGraphExec) and exe.engine_of, "the copy should be planned on an engine"
    copies, groups = [], []
    real_sdma, real_submit = HsaGraphExec._encode_sdma, queues.AqlQueue.submit
    monkeypatch.setattr(HsaGraphExec, "_encode_sdma",
                        lambda self, node, engine, fut, *a: copies.append(fut) or real_sdma(self, node, engine, fut, *a))
    monkeypatch.setattr(queues.AqlQueue, "submit",
                        lambda self, group, **kw: groups.append(group) or real_submit(self, group, **kw))
    seen, called = [], threading.Event()

    def on_done(_):      # the copy has completed (settled, or its signal reads so) by now
        seen.append(all(c.done() or rt.hub.is_complete(c.signal) for c in copies))
        called.set()

    replay = exe.launch()
    replay.add_done_callback(on_done)
    assert copies and all(c.device.engines.runs(c.queue) for c in copies)
    join = next(gr for gr in groups if gr.future is replay)
    waited = set()
    for k, header in enumerate(join.headers):
        assert P.header_type(header & 0xFFFF) == P.HSA_PACKET_TYPE_BARRIER_AND
        waited.update(struct.unpack_from("<5Q", join.blob, k * P.PACKET_SIZE + DEP_OFFSET))
    assert all(c.signal in waited for c in copies), "the join does not wait for the copy part"
    assert replay.wait(20) and replay.exception() is None
    assert all(c.wait(20) for c in copies)
    assert called.wait(20) and seen == [True]
    out = dst.to_numpy(np.int64)
    assert out.wait(20) and (out.result() == 4).all()


def test_queues_are_created_and_recreated_with_normal_priority(make_runtime):
    """DESIGN rule 7: normal queue priority, also for a queue recreated after an error."""
    rt = make_runtime(gpus=1, queues_per_device=2)
    emulator = rt.api.emulator
    d0 = rt.devices[0]
    emulator.faults.queue_error_at(1, agent=0)
    failed = d0.launch(add_const_n, grid=(N,), block=(N,), args=(d0.alloc(N * 8), 1, N))
    assert failed.wait(20) and isinstance(failed.exception(), aiogpu.GPUError)
    with rt.lock:                            # the abort that failed it recreates the queue
        assert any(q.generation for q in d0.queues), "a queue should have been recreated"
        for q in d0.queues:
            assert emulator._queue(q._q).priority == T.HSA_AMD_QUEUE_PRIORITY_NORMAL


def test_traced_work_carries_the_signals_dispatch_timestamps(make_runtime, tmp_path):
    """The waiter reads each completion signal's profiling timestamps (the emulator's clock is
    the host's monotonic one): a traced kernel's span is its run on the device, after its
    submission."""
    rt = make_runtime(gpus=1)
    d0 = rt.devices[0]
    gate = Gate()
    with aiogpu.trace(str(tmp_path / "t.json")) as tracer:
        fut = gate.launch(d0)
        opened = time.monotonic_ns()
        gate.open()
        assert fut.wait(20)
        done = time.monotonic_ns()
    (rec,) = [r for r in tracer.records if r["name"] == fut.label]
    assert rec["device_times"] and rec["submit_ns"] <= rec["start_ns"] <= rec["end_ns"] <= done
    assert rec["end_ns"] >= opened, "the kernel cannot end before its gate opened"


def test_more_than_five_dependencies_chain_over_barrier_packets():
    """Rule 5: five signals a barrier-AND packet; each signal waited on once; the completion
    signal on the last packet only."""
    signals = list(range(101, 113))                     # 12: three packets
    pkts = queues.barrier_and_packets(signals, completion=7, barrier=True)
    assert len(pkts) == 3
    waited = [p.dep_signal[j].handle for p, _ in pkts for j in range(P.BARRIER_MAX_DEPS) if p.dep_signal[j].handle]
    assert waited == signals
    assert [p.completion_signal.handle for p, _ in pkts] == [0, 0, 7]
    assert [P.header_barrier(h) for _, h in pkts] == [True, False, False]


def test_signal_pool_keeps_interrupt_signals_bounded_and_reuses_them(make_runtime):
    """At most ``max_interrupt`` signals with KFD events; beyond that busy-wait signals; each
    new one reads 1; a released interrupt signal is handed out again before any busy-wait one,
    reading 1."""
    from aiogpu.hsa.signals import SignalPool, has_interrupt_event
    rt = make_runtime(gpus=1)
    pool = SignalPool(rt.api, max_interrupt=2)
    try:
        handles = [pool.acquire() for _ in range(3)]
        assert pool.created == 3 and pool.in_use == 3
        assert [h in pool.interrupt for h in handles] == [True, True, False]
        assert [has_interrupt_event(h) for h in handles] == [True, True, False]
        assert [pool.views[h].value for h in handles] == [1, 1, 1], "a new signal of either kind reads 1"
        for h in handles:
            rt.api.hsa_signal_store_relaxed(T.hsa_signal_t(h), 0)     # "completed"
            pool.release(h)
        again = [pool.acquire() for _ in range(2)]
        assert set(again) == set(handles[:2]), "interrupt signals come back first"
        assert all(pool.views[h].value == 1 for h in again)
        assert pool.created == 3
    finally:
        pool.destroy()


def test_a_signal_without_a_kfd_event_is_never_waited_on_as_an_interrupt_signal(make_runtime):
    """Past KFD's event limit ROCr hands out signals without an event: the pool must count them
    as busy-wait signals (a wait_any on them would spin) and stop asking for events."""
    from aiogpu.hsa.signals import SignalPool, has_interrupt_event
    rt = make_runtime(gpus=1, emulator_event_limit=64)
    pool = SignalPool(rt.api, max_interrupt=1000)
    try:
        handles = [pool.acquire() for _ in range(80)]
        assert all(has_interrupt_event(h) for h in pool.interrupt)
        eventless = [h for h in handles if not has_interrupt_event(h)]
        assert eventless and not any(h in pool.interrupt for h in eventless)
        assert not pool._events_left
    finally:
        pool.destroy()


def test_failed_signal_creation_names_the_call(make_runtime, monkeypatch):
    """A failing signal constructor raises HsaError naming the HSA call that failed."""
    from aiogpu.errors import HsaError
    from aiogpu.hsa.signals import SignalPool
    rt = make_runtime(gpus=1)
    failing = lambda *args: T.HSA_STATUS_ERROR_OUT_OF_RESOURCES  # noqa: E731
    monkeypatch.setattr(rt.api, "hsa_amd_signal_create", failing)
    monkeypatch.setattr(rt.api, "hsa_signal_create", failing)
    with pytest.raises(HsaError, match=r"^hsa_amd_signal_create failed: HSA_STATUS_ERROR_OUT_OF_RESOURCES"):
        SignalPool(rt.api, max_interrupt=0).acquire()
    with pytest.raises(HsaError, match=r"^hsa_signal_create failed"):
        SignalPool(rt.api, max_interrupt=4).acquire()
    with pytest.raises(HsaError, match=r"^hsa_signal_create failed"):
        rt.hub._create_wake_signal()


def test_timestamp_frequency_comes_from_the_system_or_defaults_to_nanoseconds(make_runtime, monkeypatch):
    rt = make_runtime(gpus=1)
    freq = ctypes.c_uint64(0)
    rt.api.hsa_system_get_info(T.HSA_SYSTEM_INFO_TIMESTAMP_FREQUENCY, ctypes.byref(freq))
    assert freq.value > 1 and rt.hub._timestamp_frequency() == freq.value
    monkeypatch.setattr(rt.api, "hsa_system_get_info", lambda *args: T.HSA_STATUS_SUCCESS)   # says nothing
    assert rt.hub._timestamp_frequency() == 1_000_000_000


def test_the_waiter_sleeps_while_waited_for_work_is_pending_and_wakes_when_it_completes(make_runtime):
    """While a kernel someone waits for (here a done-callback) is held and nothing completes,
    the waiter thread blocks in wait_any (it wakes only for its lost-wakeup guard, every 0.1 s):
    it never spins. Its completion wakes it. (Work nobody waits for is scanned for every
    POLL_S instead: tests/hsa/test_waiter_wakeups.py.)"""
    rt = make_runtime(gpus=1)
    d0 = rt.devices[0]
    g = Gate()
    held = g.launch(d0)
    fired = threading.Event()
    held.add_done_callback(lambda f: fired.set())
    try:
        time.sleep(0.05)
        before = rt.hub.wakeups
        time.sleep(0.5)
        idle = rt.hub.wakeups - before
        assert idle < 50, f"the waiter woke {idle} times in 0.5 s with nothing completing"
    finally:
        g.open()
    assert fired.wait(10)
    assert rt.hub.wakeups > before
