"""The AQL protocol end to end: small rings, many producers, the eager processor, invalid packets."""
from __future__ import annotations

import ctypes
import threading
import time

import pytest

from aiogpu.hsa_bindings import atomics, packets
from aiogpu.hsa_bindings import types as T

from emu_helpers import barrier_packet, ok, saxpy_body


def test_ring_of_four_slots_takes_1000_packets(make_hsa):
    hsa = make_hsa(emulator_min_queue_size=4)
    q, done = hsa.queue(0, size=4), hsa.signal(1000)
    assert q.size == 4
    for _ in range(1000):
        q.submit(barrier_packet([], done))
    assert hsa.wait_zero(done, timeout=20)
    assert q.overruns == 0
    assert q.read_index() == q.write_index() == 1000
    assert not hsa.errors


def test_many_producers_one_queue(make_hsa):
    """Multi-producer: slots are published out of order; the processor still takes them in order."""
    hsa = make_hsa(emulator_min_queue_size=16)
    q, done = hsa.queue(0, size=16), hsa.signal(800)

    def produce():
        for _ in range(200):
            q.submit(barrier_packet([], done))

    threads = [threading.Thread(target=produce) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert hsa.wait_zero(done, timeout=20)
    assert q.overruns == 0 and q.read_index() == 800 and not hsa.errors


def test_nothing_runs_before_the_doorbell(hsa):
    q, done = hsa.queue(0), hsa.signal(1)
    index = q.reserve()
    q.publish(index, barrier_packet([], done))
    time.sleep(0.03)
    assert hsa.value(done) == 1 and q.read_index() == 0  # published but not rung
    q.ring(index)
    assert hsa.wait_zero(done)


def test_invalid_header_stops_the_processor_until_published(hsa):
    q, first, second = hsa.queue(0), hsa.signal(1), hsa.signal(1)
    i0, i1 = q.reserve(), q.reserve()
    q.publish(i1, barrier_packet([], second))
    q.ring(i1)  # rung past an unpublished slot
    time.sleep(0.03)
    assert hsa.value(second) == 1 and q.read_index() == 0
    q.publish(i0, barrier_packet([], first))
    q.ring(i0)
    assert hsa.wait_zero(second) and hsa.value(first) == 0


def header_first_writer(q, packet, gap: float) -> int:
    """The defect of kfd-review.txt: the packet is copied into the ring header first."""
    word, body = packet
    index = q.reserve()
    address = q.slot(index)
    atomics.store_u32_release(address, word)  # header (and setup) land first ...
    time.sleep(gap)  # ... the copy is pre-empted / still running ...
    ctypes.memmove(address + 4, body[4:], packets.PACKET_SIZE - 4)  # ... then the body
    q.ring(index)
    return index


def test_eager_processor_catches_header_before_body(make_hsa):
    hsa = make_hsa(eager=True)
    hsa.emu.faults.eager_recheck_s = 0.15  # longer than the writer's gap: the re-read sees the body land
    k = hsa.load_kernel(0, "saxpy", "f32*, const f32*, f32, u32", saxpy_body)
    n = 64
    x, y = hsa.device_alloc(0, n * 4), hsa.device_alloc(0, n * 4)
    q, done = hsa.queue(0), hsa.signal(1)
    index = header_first_writer(q, k.packet((n,), (64,), k.kernargs([y, x, 1.0, n], [n * 4] * 2), done), 0.03)
    assert hsa.wait_errors() == [(T.HSA_STATUS_ERROR_INVALID_PACKET_FORMAT, q.id)]
    assert q.read_index() == index and hsa.value(done) == 1
    torn = [f for f in hsa.emu.faults.fired if f.kind == "torn_packet"]
    assert len(torn) == 1 and torn[0].packet == index


def test_eager_processor_catches_a_whole_packet_copy_patched_later(make_hsa):
    """A template packet copied with its header, then patched in the ring (a graph-replay writer):
    the change lands after the re-read, while the packet waits; completion notices it."""
    hsa = make_hsa(eager=True)
    q, gate, done = hsa.queue(0), hsa.signal(1), hsa.signal(1)
    word, body = barrier_packet([gate])
    index = q.reserve()
    address = q.slot(index)
    ctypes.memmove(address, word.to_bytes(4, "little") + body[4:], packets.PACKET_SIZE)  # header included
    q.ring(index)
    time.sleep(0.05)
    ctypes.c_uint64.from_address(address + 56).value = done.handle  # patch the completion signal
    hsa.api.hsa_signal_store_screlease(gate, 0)
    assert hsa.wait_errors() == [(T.HSA_STATUS_ERROR_INVALID_PACKET_FORMAT, q.id)]
    assert hsa.value(done) == 1 and q.read_index() == index
    assert [f.kind for f in hsa.emu.faults.fired] == ["torn_packet"]


def test_header_before_body_goes_unnoticed_without_eager(hsa):
    """The same writer passes a doorbell-driven processor: only eager mode exposes the defect."""
    q, done = hsa.queue(0), hsa.signal(1)
    header_first_writer(q, barrier_packet([], done), 0.003)
    assert hsa.wait_zero(done) and not hsa.errors


def test_eager_processor_passes_10000_header_last_packets(make_hsa):
    hsa = make_hsa(eager=True)
    q, done = hsa.queue(0, size=256), hsa.signal(10_000)
    for _ in range(10_000):
        q.submit(barrier_packet([], done))
    assert hsa.wait_zero(done, timeout=60)
    assert not hsa.errors and not hsa.emu.faults.fired
    assert q.read_index() == 10_000


def test_eager_processor_reads_before_the_doorbell(make_hsa):
    hsa = make_hsa()
    hsa.emu.faults.eager = True  # switched on at run time, while the processor waits
    q, done = hsa.queue(0), hsa.signal(1)
    index = q.reserve()
    q.publish(index, barrier_packet([], done))  # never rung
    assert hsa.wait_zero(done)


def dispatch_fields(k, args, **fields):
    word, body = k.packet((64,), (64,), args)
    p = packets.hsa_kernel_dispatch_packet_t.from_buffer_copy(body)
    dims = fields.pop("dims", 1)
    for name, value in fields.items():
        setattr(p, name, value)
    return packets.make_header(packets.HSA_PACKET_TYPE_KERNEL_DISPATCH) | dims << 16, p


BAD_DISPATCHES = [
    ({"dims": 0}, T.HSA_STATUS_ERROR_INCOMPATIBLE_ARGUMENTS),
    ({"dims": 1, "workgroup_size_x": 0}, T.HSA_STATUS_ERROR_INCOMPATIBLE_ARGUMENTS),
    ({"dims": 1, "grid_size_x": 0}, T.HSA_STATUS_ERROR_INCOMPATIBLE_ARGUMENTS),
    ({"dims": 1, "grid_size_y": 2}, T.HSA_STATUS_ERROR_INCOMPATIBLE_ARGUMENTS),
    ({"dims": 2, "workgroup_size_x": 64, "workgroup_size_y": 32}, T.HSA_STATUS_ERROR_INCOMPATIBLE_ARGUMENTS),
    ({"dims": 1, "reserved2": 1}, T.HSA_STATUS_ERROR_INVALID_PACKET_FORMAT),
    ({"dims": 1 | 1 << 4}, T.HSA_STATUS_ERROR_INVALID_PACKET_FORMAT),
    ({"dims": 1, "group_segment_size": 1 << 20}, T.HSA_STATUS_ERROR_INVALID_ARGUMENT),
    ({"dims": 1, "kernel_object": 0}, T.HSA_STATUS_ERROR_INVALID_CODE_OBJECT),
]


@pytest.mark.parametrize("fields,status", BAD_DISPATCHES)
def test_invalid_dispatch_fails_and_suspends_the_queue(hsa, fields, status):
    k = hsa.load_kernel(0, "saxpy", "f32*, const f32*, f32, u32", saxpy_body)
    buf = hsa.device_alloc(0, 256)
    args = k.kernargs([buf, buf, 1.0, 64], [256, 256])
    q, before, bad, after = hsa.queue(0), hsa.signal(1), hsa.signal(1), hsa.signal(1)
    q.submit(barrier_packet([], before))
    word, pkt = dispatch_fields(k, args, **fields)
    pkt.completion_signal = bad
    failing = q.submit((word, bytes(pkt)))
    q.submit(barrier_packet([], after))
    assert hsa.wait_errors() == [(status, q.id)]
    time.sleep(0.02)
    assert hsa.value(before) == 0 and hsa.value(bad) == 1 and hsa.value(after) == 1
    assert q.read_index() == failing
    assert ctypes.c_uint32.from_address(q.slot(failing)).value == word  # the failing packet is still there
    assert hsa.api.hsa_amd_queue_set_priority(q.ptr, T.HSA_AMD_QUEUE_PRIORITY_NORMAL) == T.HSA_STATUS_ERROR_INVALID_QUEUE
    q.destroy()  # a suspended queue can be destroyed
    assert hsa.api.hsa_queue_load_read_index_scacquire(q.ptr) == 0
    hsa.emu.api_errors.clear()  # that call on a destroyed queue was recorded


def test_kernel_object_of_another_agent_is_invalid_code(hsa):
    k1 = hsa.load_kernel(1, "saxpy", "f32*, const f32*, f32, u32", saxpy_body)
    buf = hsa.device_alloc(0, 256)
    q = hsa.queue(0)
    q.submit(k1.packet((64,), (64,), k1.kernargs([buf, buf, 1.0, 64], [256, 256])))
    assert hsa.wait_errors() == [(T.HSA_STATUS_ERROR_INVALID_CODE_OBJECT, q.id)]


@pytest.mark.parametrize("kind,word", [
    ("agent dispatch", packets.make_header(packets.HSA_PACKET_TYPE_AGENT_DISPATCH)),
    ("vendor format", packets.make_header(packets.HSA_PACKET_TYPE_VENDOR_SPECIFIC) | 7 << 16),
    ("barrier reserved", None),
])
def test_invalid_packet_types(hsa, kind, word):
    q = hsa.queue(0)
    body = bytearray(64)
    if word is None:
        word, body = barrier_packet([])
        body = bytearray(body)
        body[56:64] = b"\x00" * 8
        body[48] = 1  # reserved2
    q.submit((word, bytes(body)))
    assert hsa.wait_errors() == [(T.HSA_STATUS_ERROR_INVALID_PACKET_FORMAT, q.id)]


def test_body_exception_fails_the_queue(hsa):
    def body(launch, buf):
        raise ValueError("boom")

    k = hsa.load_kernel(0, "boom", "u8*", body)
    buf = hsa.device_alloc(0, 64)
    q, done = hsa.queue(0), hsa.signal(1)
    q.submit(k.packet((1,), (1,), k.kernargs([buf], [64]), done))
    assert hsa.wait_errors() == [(T.HSA_STATUS_ERROR_EXCEPTION, q.id)]
    assert "boom" in hsa.emu.queue_errors[0].detail and hsa.value(done) == 1


def test_queue_error_waits_for_earlier_packets_to_complete(make_hsa):
    """When the callback runs, every earlier packet has completed and decremented its signal
    (the CP writes the signal as the packet completes); the read index, which advances as
    dispatches launch, is already past the failing dispatch."""
    hsa = make_hsa(compute_units=2)
    seen = []

    def slow(launch, buf):
        time.sleep(0.05)

    def boom(launch, buf):
        raise RuntimeError("fails")

    ks, kb = hsa.load_kernel(0, "slow", "u8*", slow), hsa.load_kernel(0, "boom", "u8*", boom)
    buf = hsa.device_alloc(0, 64)
    done = hsa.signal(1)

    @T.queue_error_callback_t
    def on_error(status, queue, _data):
        seen.append((status, hsa.api.hsa_queue_load_read_index_scacquire(queue), hsa.value(done)))

    qp = ctypes.POINTER(T.hsa_queue_t)()
    ok(hsa.api.hsa_queue_create(hsa.gpus[0], 64, 0, on_error, None, 0, 0, ctypes.byref(qp)))
    from emu_helpers import AqlWriter
    q = AqlWriter(hsa.api, qp)
    q.submit(ks.packet((1,), (1,), ks.kernargs([buf], [64]), done))
    failing = q.submit(kb.packet((1,), (1,), kb.kernargs([buf], [64])))
    deadline = time.monotonic() + 5
    while not seen and time.monotonic() < deadline:
        time.sleep(0.005)
    assert seen == [(T.HSA_STATUS_ERROR_EXCEPTION, failing + 1, 0)]
    q.destroy()


def test_read_index_advances_when_a_dispatch_launches(make_hsa):
    """ROCr/CP: the read index moves past a dispatch when it is launched, not when it completes;
    a ring's slots are reused while earlier dispatches still run."""
    hsa = make_hsa()
    gate = threading.Event()
    k = hsa.load_kernel(0, "held", "u8*", lambda launch, buf: gate.wait(10))
    buf = hsa.device_alloc(0, 64)
    q, held, done = hsa.queue(0, size=64), hsa.signal(1), hsa.signal(64)
    q.submit(k.packet((1,), (1,), k.kernargs([buf], [64]), held))
    deadline = time.monotonic() + 5
    while q.read_index() < 1 and time.monotonic() < deadline:
        time.sleep(0.002)
    assert q.read_index() == 1 and hsa.value(held) == 1  # launched, still running
    for _ in range(64):  # wraps onto slot 0 while the dispatch in it runs on
        q.submit(barrier_packet([], done))
    assert hsa.wait_zero(done) and hsa.value(held) == 1 and q.read_index() == 65
    gate.set()
    assert hsa.wait_zero(held) and q.overruns == 0 and not hsa.errors
