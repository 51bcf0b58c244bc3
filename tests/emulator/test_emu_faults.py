"""Fault injection does what it says; GPU memory faults reach the system event handlers."""
from __future__ import annotations

import ctypes
import time

import pytest

from aiogpu.hsa_bindings import types as T

from emu_helpers import barrier_packet, ok


def submit_barriers(hsa, q, count):
    signals = [hsa.signal(1) for _ in range(count)]
    ids = [q.submit(barrier_packet([], s)) for s in signals]
    return ids, signals


def test_queue_error_at_kth_packet(hsa):
    hsa.emu.faults.queue_error_at(3, status=T.HSA_STATUS_ERROR_ILLEGAL_INSTRUCTION)
    q = hsa.queue(0)
    ids, signals = submit_barriers(hsa, q, 5)
    assert hsa.wait_errors() == [(T.HSA_STATUS_ERROR_ILLEGAL_INSTRUCTION, q.id)]
    time.sleep(0.02)
    assert [hsa.value(s) for s in signals] == [0, 0, 1, 1, 1]
    assert q.read_index() == ids[2]
    fired = hsa.emu.faults.fired
    assert [(f.kind, f.packet, f.queue) for f in fired] == [("queue_error", ids[2], q.id)]


def test_queue_error_counts_only_the_chosen_agent(hsa):
    hsa.emu.faults.queue_error_at(2, agent=1)
    q0, q1 = hsa.queue(0), hsa.queue(1)
    _, s0 = submit_barriers(hsa, q0, 3)
    assert all(hsa.wait_zero(s) for s in s0)
    _, s1 = submit_barriers(hsa, q1, 3)
    assert hsa.wait_errors() == [(T.HSA_STATUS_ERROR_EXCEPTION, q1.id)]
    assert hsa.value(s1[0]) == 0 and hsa.value(s1[1]) == 1


def register_events(hsa, result=0):
    """A system event handler recording (type, agent handle, address, reason mask)."""
    events = []

    @T.system_event_callback_t
    def handler(event, _data):
        e = event.contents
        events.append((e.event_type, e.memory_fault.agent.handle, e.memory_fault.virtual_address,
                       e.memory_fault.fault_reason_mask))
        return result

    hsa._keep.append(handler)
    ok(hsa.api.hsa_amd_register_system_event_handler(handler, None))
    return events


def wait_events(events, count=1, timeout=5.0):
    deadline = time.monotonic() + timeout
    while len(events) < count and time.monotonic() < deadline:
        time.sleep(0.002)
    return events


def test_memory_fault_evicts_the_device_and_is_only_a_system_event(hsa):
    """KFD evicts every queue of the process on the faulting device and ROCr reports the fault
    through the system event handler (Runtime::VMFaultHandler), not the queue callback."""
    events = register_events(hsa)
    q1, other, q0 = hsa.queue(1), hsa.queue(1), hsa.queue(0)
    gate, blocked = hsa.signal(1), hsa.signal(1)
    other.submit(barrier_packet([gate], blocked))            # waits on the gate, on the same GPU
    k = hsa.load_kernel(1, "touch", "u8*", lambda launch, buf: buf.fill(1))
    buf = hsa.device_alloc(1, 64)
    args = k.kernargs([buf], [64])
    hsa.free(buf)
    signals = [hsa.signal(1), hsa.signal(1)]
    q1.submit(barrier_packet([], signals[0]))
    q1.submit(k.packet((1,), (1,), args, signals[1]))        # faults: use after free
    assert [e[:2] for e in wait_events(events)] == [(T.HSA_AMD_GPU_MEMORY_FAULT_EVENT, hsa.gpus[1].handle)]
    hsa.api.hsa_signal_store_screlease(gate, 0)
    _, fine = submit_barriers(hsa, q0, 1)                   # GPU 0 is not affected
    assert hsa.wait_zero(fine[0])
    time.sleep(0.03)
    assert hsa.value(signals[0]) == 0 and hsa.value(signals[1]) == 1
    assert hsa.value(blocked) == 1, "a queue of the faulted device went on running"
    assert not hsa.errors and not hsa.emu.queue_errors       # no queue error callback
    assert hsa.emu.memory_faults[0].handled


def test_a_faulted_device_stays_evicted_for_the_life_of_the_process(hsa):
    """KFD keeps the process evicted on the faulted device (``qpd->evicted``): queues created
    there later are created evicted and never run; other devices go on."""
    events = register_events(hsa)
    hsa.emu.faults.memory_fault_at(1, agent=1)
    q1 = hsa.queue(1)
    submit_barriers(hsa, q1, 1)
    assert wait_events(events)
    _, later = submit_barriers(hsa, hsa.queue(1), 1)
    _, fine = submit_barriers(hsa, hsa.queue(0), 1)
    assert hsa.wait_zero(fine[0])
    assert not hsa.wait_zero(later[0], timeout=0.2), "a queue created on the faulted device ran"
    assert hsa.emu.evicted == {1}


def test_unhandled_memory_fault_is_what_rocr_aborts_on(hsa):
    register_events(hsa, result=T.HSA_STATUS_ERROR)
    hsa.emu.faults.memory_fault_at(1)
    submit_barriers(hsa, hsa.queue(0), 1)
    deadline = time.monotonic() + 5
    while not hsa.emu.memory_faults and time.monotonic() < deadline:
        time.sleep(0.002)
    assert [f.handled for f in hsa.emu.memory_faults] == [False]


def test_lose_completion_at(hsa):
    hsa.emu.faults.lose_completion_at(2)
    q = hsa.queue(0)
    ids, signals = submit_barriers(hsa, q, 3)
    assert hsa.wait_zero(signals[2])
    assert [hsa.value(s) for s in signals] == [0, 1, 0]
    assert q.read_index() == 3 and not hsa.errors  # the packet retired; only its signal was lost
    assert hsa.emu.faults.fired[0].kind == "lost_completion"


def test_delay_completions(hsa):
    faults = hsa.emu.faults
    faults.delay_completions(0.05, count=2)
    q = hsa.queue(0)
    t0 = time.monotonic()
    _, signals = submit_barriers(hsa, q, 3)
    assert all(hsa.wait_zero(s) for s in signals)
    assert time.monotonic() - t0 >= 0.1
    assert [f.kind for f in faults.fired] == ["delayed_completion"] * 2
    # copies are delayed too
    faults.delay_completions(0.05, count=1)
    a, b, s = hsa.alloc(hsa.system_pool, 64), hsa.device_alloc(0, 64), hsa.signal(1)
    t0 = time.monotonic()
    ok(hsa.api.hsa_amd_memory_async_copy(b, hsa.gpus[0], a, hsa.cpu, 64, 0, None, s))
    assert hsa.wait_zero(s) and time.monotonic() - t0 >= 0.05


def test_reset_turns_everything_off(make_hsa):
    hsa = make_hsa(eager=True, rocr_version="5.7")       # (engine status tells the SDMA state)
    faults = hsa.emu.faults
    faults.queue_error_at(1)
    faults.lose_completion_at(1)
    faults.delay_completions(10)
    faults.exhaust_sdma()
    faults.reset()
    assert not faults.eager
    q = hsa.queue(0)
    _, signals = submit_barriers(hsa, q, 2)
    assert all(hsa.wait_zero(s, timeout=2) for s in signals)
    mask = ctypes.c_uint32()
    ok(hsa.api.hsa_amd_memory_copy_engine_status(hsa.gpus[0], hsa.cpu, ctypes.byref(mask)))
    assert mask.value == 0b11 and not hsa.errors and not faults.fired


def test_bad_fault_arguments():
    from aiogpu.hsa_bindings.emulator import FaultInjector
    with pytest.raises(ValueError):
        FaultInjector().queue_error_at(0)
    with pytest.raises(ValueError):
        FaultInjector().delay_completions(-1)


def test_kernel_touching_freed_memory_is_a_memory_fault_event(hsa):
    events = register_events(hsa)
    k = hsa.load_kernel(0, "touch", "u8*", lambda launch, buf: buf.fill(1))
    buf = hsa.device_alloc(0, 4096)
    args = k.kernargs([buf], [4096])
    hsa.free(buf)
    q, done = hsa.queue(0), hsa.signal(1)
    q.submit(k.packet((1,), (1,), args, done))
    assert wait_events(events) == [(T.HSA_AMD_GPU_MEMORY_FAULT_EVENT, hsa.gpus[0].handle, buf,
                                    T.HSA_AMD_MEMORY_FAULT_PAGE_NOT_PRESENT)]
    assert "use after free" in hsa.emu.memory_faults[0].reason
    assert hsa.value(done) == 1 and not hsa.errors


def test_peer_gpu_needs_allow_access(make_hsa):
    hsa = make_hsa()
    events = register_events(hsa)
    k = hsa.load_kernel(1, "read", "const u8*", lambda launch, buf: int(buf.sum()))
    mine = hsa.device_alloc(0, 4096)
    q, done = hsa.queue(1), hsa.signal(1)
    q.submit(k.packet((1,), (1,), k.kernargs([mine], [4096]), done))
    assert [e[1:3] for e in wait_events(events)] == [(hsa.gpus[1].handle, mine)]
    assert "allow_access" in hsa.emu.memory_faults[0].reason
    hsa = make_hsa()            # a new process: the faulted device stays evicted in that one
    k = hsa.load_kernel(1, "read", "const u8*", lambda launch, buf: int(buf.sum()))
    mine = hsa.device_alloc(0, 4096)
    hsa.allow(mine, 1)
    q2, done2 = hsa.queue(1), hsa.signal(1)
    q2.submit(k.packet((1,), (1,), k.kernargs([mine], [4096]), done2))
    assert hsa.wait_zero(done2)


def test_kernarg_segment_out_of_reach_is_a_memory_fault(hsa):
    events = register_events(hsa)
    k = hsa.load_kernel(0, "noop", "u32", lambda launch, n: None)
    q = hsa.queue(0)
    q.submit(k.packet((1,), (1,), 0x1000))
    assert [e[1:3] for e in wait_events(events)] == [(hsa.gpus[0].handle, 0x1000)]
    assert not hsa.errors
