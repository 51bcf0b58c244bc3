"""Kernel dispatches run NumPy bodies over real memory; barrier bit, barrier packets, overlap."""
from __future__ import annotations

import ctypes
import time

import numpy as np

from aiogpu.hsa_bindings import packets, signature
from aiogpu.hsa_bindings import types as T

from emu_helpers import barrier_packet, ok, saxpy_body


def make_saxpy(hsa, gpu, n, a=2.0):
    k = hsa.load_kernel(gpu, "saxpy", "f32*, const f32*, f32, u32", saxpy_body)
    x, y = hsa.device_alloc(gpu, n * 4), hsa.device_alloc(gpu, n * 4)
    xs = np.linspace(-1, 1, n, dtype=np.float32)
    ys = np.arange(n, dtype=np.float32)
    hsa.host_view(x, n * 4, np.float32)[:] = xs
    hsa.host_view(y, n * 4, np.float32)[:] = ys
    return k, x, y, xs, ys, k.kernargs([y, x, a, n], [n * 4, n * 4])


def test_saxpy_matches_numpy_reference(hsa):
    n = 10_000
    k, x, y, xs, ys, args = make_saxpy(hsa, 0, n)
    assert k.kernarg_size == 80  # 8 + 8 + 4 + 4, two hidden u64 lengths, 26 bytes of geometry, to 16
    q, done = hsa.queue(0), hsa.signal(1)
    index = q.reserve()
    q.publish(index, k.packet((n,), (256,), args, done))
    q.ring(index)
    assert hsa.wait_zero(done)
    np.testing.assert_allclose(hsa.host_view(y, n * 4, np.float32), ys + np.float32(2.0) * xs, rtol=1e-6)
    assert q.read_index() == q.write_index() == 1
    assert ctypes.c_uint16.from_address(q.slot(index)).value == packets.INVALID_HEADER  # slot released
    (record,) = hsa.emu.timeline.records()
    assert (record.kind, record.name, record.nbytes, record.packet, record.queue) == ("dispatch", "saxpy", 2 * n * 4,
                                                                                       index, q.id)
    (event,) = hsa.emu.timeline.chrome_trace()
    assert event["ph"] == "X" and event["name"] == "saxpy" and event["dur"] >= 0


def test_body_sees_launch_geometry_and_typed_views(hsa):
    seen = {}

    def body(launch, out, inp, scale):
        seen.update(grid=launch.grid, block=launch.block, dims=launch.dims, agent=launch.agent,
                    out=(out.dtype, out.shape, out.flags.writeable), inp=(inp.dtype, inp.shape, inp.flags.writeable),
                    scale=type(scale))
        out[:] = inp * scale

    k = hsa.load_kernel(1, "scale", "f64*, const i32*, f64", body)
    out, inp = hsa.device_alloc(1, 8 * 6), hsa.device_alloc(1, 4 * 6)
    hsa.host_view(inp, 24, np.int32)[:] = np.arange(6)
    q, done = hsa.queue(1), hsa.signal(1)
    q.submit(k.packet((6, 4, 2), (2, 2, 2), k.kernargs([out, inp, 0.5], [48, 24]), done))
    assert hsa.wait_zero(done)
    assert seen["grid"] == (6, 4, 2) and seen["block"] == (2, 2, 2) and seen["dims"] == 3 and seen["agent"] == 1
    assert seen["out"] == (np.float64, (6,), True) and seen["inp"] == (np.int32, (6,), False)
    assert seen["scale"] is np.float64
    assert hsa.host_view(out, 48, np.float64).tolist() == [0, 0.5, 1, 1.5, 2, 2.5]


def test_writing_a_const_argument_is_a_queue_exception(hsa):
    def body(launch, out, inp):
        inp[0] = 1

    k = hsa.load_kernel(0, "bad", "u8*, const u8*", body)
    buf = hsa.device_alloc(0, 64)
    q, done = hsa.queue(0), hsa.signal(1)
    q.submit(k.packet((1,), (1,), k.kernargs([buf, buf], [64, 64]), done))
    assert hsa.wait_errors() == [(T.HSA_STATUS_ERROR_EXCEPTION, q.id)]
    assert hsa.value(done) == 1
    assert "read-only" in hsa.emu.queue_errors[0].detail


def sleeper(hsa, gpu, seconds):
    def body(launch, out):
        time.sleep(seconds)
        out[0] += 1

    k = hsa.load_kernel(gpu, "sleep", "i64*", body)
    counter = hsa.device_alloc(gpu, 8)
    return k, counter, k.kernargs([counter], [8])


def dispatch_records(hsa, queue):
    return [r for r in hsa.emu.timeline.records(kind="dispatch") if r.queue == queue.id]


def test_dispatches_without_barrier_bit_overlap(make_hsa):
    hsa = make_hsa(compute_units=4)
    k, counter, args = sleeper(hsa, 0, 0.1)
    q, done = hsa.queue(0), hsa.signal(4)
    for _ in range(4):
        q.submit(k.packet((1,), (1,), args, done))
    assert hsa.wait_zero(done)
    recs = dispatch_records(hsa, q)
    assert len(recs) == 4
    assert max(r.start_ns for r in recs) < min(r.end_ns for r in recs), "all four ran at once"


def test_barrier_bit_serialises_dispatches(make_hsa):
    hsa = make_hsa(compute_units=4)
    k, counter, args = sleeper(hsa, 0, 0.03)
    q, done = hsa.queue(0), hsa.signal(4)
    for _ in range(4):
        q.submit(k.packet((1,), (1,), args, done, barrier=True))
    assert hsa.wait_zero(done)
    recs = dispatch_records(hsa, q)
    assert all(b.start_ns >= a.end_ns for a, b in zip(recs, recs[1:]))
    assert hsa.host_view(counter, 8, np.int64)[0] == 4


def test_barrier_and_orders_work_across_queues_on_two_agents(hsa):
    """GPU 0 produces (slowly); GPU 1 waits for it with a barrier-AND, then reads GPU 0's memory."""
    def produce(launch, buf):
        time.sleep(0.05)
        buf[:] = np.arange(buf.size)

    def consume(launch, dst, src):
        dst[:] = src * 2

    kp = hsa.load_kernel(0, "produce", "i32*", produce)
    kc = hsa.load_kernel(1, "consume", "i32*, const i32*", consume)
    n = 256
    shared, result = hsa.device_alloc(0, n * 4), hsa.device_alloc(1, n * 4)
    hsa.allow(shared, 1)
    q0, q1 = hsa.queue(0), hsa.queue(1)
    produced, gate, consumed = hsa.signal(1), hsa.signal(1), hsa.signal(1)
    q1.submit(barrier_packet([produced], gate))  # queued first: must hold the consumer back
    q1.submit(kc.packet((n,), (64,), kc.kernargs([result, shared], [n * 4, n * 4]), consumed))
    time.sleep(0.02)
    assert hsa.value(consumed) == 1 and q1.read_index() == 0
    q0.submit(kp.packet((n,), (64,), kp.kernargs([shared], [n * 4]), produced))
    assert hsa.wait_zero(consumed)
    assert hsa.host_view(result, n * 4, np.int32).tolist() == list(range(0, 2 * n, 2))
    prod = hsa.emu.timeline.records(kind="dispatch", agent=0)[0]
    cons = hsa.emu.timeline.records(kind="dispatch", agent=1)[0]
    bar = hsa.emu.timeline.records(kind="barrier", agent=1)[0]
    assert cons.start_ns >= prod.end_ns and bar.end_ns >= prod.end_ns


def test_barrier_or_and_barrier_value(hsa):
    q = hsa.queue(0)
    a, b, done_or = hsa.signal(1), hsa.signal(1), hsa.signal(1)
    q.submit(barrier_packet([a, b], done_or, kind=packets.HSA_PACKET_TYPE_BARRIER_OR))
    time.sleep(0.02)
    assert hsa.value(done_or) == 1
    hsa.api.hsa_signal_store_screlease(b, 0)
    assert hsa.wait_zero(done_or)

    watched, done_val = hsa.signal(0), hsa.signal(1)
    p = packets.hsa_amd_barrier_value_packet_t()
    p.header.AmdFormat = packets.HSA_AMD_PACKET_TYPE_BARRIER_VALUE
    p.signal, p.value, p.mask, p.cond = watched, 0x40, 0xF0, T.HSA_SIGNAL_CONDITION_EQ
    p.completion_signal = done_val
    q.submit((packets.make_header(packets.HSA_PACKET_TYPE_VENDOR_SPECIFIC)
              | packets.HSA_AMD_PACKET_TYPE_BARRIER_VALUE << 16, bytes(p)))
    hsa.api.hsa_signal_store_screlease(watched, 0x3F)
    time.sleep(0.02)
    assert hsa.value(done_val) == 1
    hsa.api.hsa_signal_store_screlease(watched, 0x4A)  # (0x4A & 0xF0) == 0x40
    assert hsa.wait_zero(done_val)
    assert q.read_index() == 2 and not hsa.errors


def test_barrier_packet_blocks_later_packets_of_its_queue(hsa):
    q = hsa.queue(0)
    gate, first, second = hsa.signal(1), hsa.signal(1), hsa.signal(1)
    q.submit(barrier_packet([gate], first))
    q.submit(barrier_packet([], second))
    time.sleep(0.03)
    assert hsa.value(second) == 1 and q.read_index() == 0
    hsa.api.hsa_signal_store_relaxed(gate, 0)
    assert hsa.wait_zero(second) and hsa.value(first) == 0


def test_profiling_timestamps(hsa):
    k, counter, args = sleeper(hsa, 0, 0.02)
    q, done = hsa.queue(0), hsa.signal(1)
    ok(hsa.api.hsa_amd_profiling_set_profiler_enabled(q.ptr, 1))
    q.submit(k.packet((1,), (1,), args, done))
    assert hsa.wait_zero(done)
    t = T.hsa_amd_profiling_dispatch_time_t()
    ok(hsa.api.hsa_amd_profiling_get_dispatch_time(hsa.gpus[0], done, ctypes.byref(t)))
    assert t.end - t.start >= 20_000_000
    now = ctypes.c_uint64()
    ok(hsa.api.hsa_system_get_info(T.HSA_SYSTEM_INFO_TIMESTAMP, ctypes.byref(now)))
    assert t.start < t.end <= now.value
    record = hsa.emu.timeline.records(kind="dispatch")[0]
    assert (record.start_ns, record.end_ns, record.name) == (t.start, t.end, "sleep")


def test_body_sees_the_geometry_of_the_hidden_arguments(hsa):
    """Emulated kernels read their geometry from the hidden (code object v5) arguments, as device
    code does: left zero, the body sees no grid at all, and the mismatch is recorded."""
    seen = []
    k = hsa.load_kernel(0, "geo", "u8*", lambda launch, buf: seen.append((launch.grid, launch.block)))
    buf = hsa.device_alloc(0, 64)
    raw = hsa.alloc(hsa.kernarg_pool, k.kernarg_size)     # not from k.kernargs: hidden arguments stay 0
    ctypes.memmove(raw, signature.pack(k.args, k.layout, [buf], [64]), k.kernarg_size)
    q, done = hsa.queue(0), hsa.signal(2)
    q.submit(k.packet((100, 3), (32, 1), raw, done))
    q.submit(k.packet((100, 3), (32, 1), k.kernargs([buf], [64]), done))
    assert hsa.wait_zero(done)
    assert seen == [((), ()), ((100, 3), (32, 1))]
    assert len(hsa.emu.kernarg_mismatches) == 1
    hsa.emu.kernarg_mismatches.clear()


def test_misaligned_kernarg_segment_fails_the_dispatch(hsa):
    k = hsa.load_kernel(0, "noop", "u32", lambda launch, n: None)
    args = k.kernargs([1])
    data = ctypes.string_at(args, k.kernarg_size)
    moved = hsa.alloc(hsa.kernarg_pool, k.kernarg_size + 64) + 8   # 8-byte aligned only
    ctypes.memmove(moved, data, k.kernarg_size)
    q = hsa.queue(0)
    q.submit(k.packet((1,), (1,), moved))
    assert hsa.wait_errors() == [(T.HSA_STATUS_ERROR_INVALID_ARGUMENT, q.id)]
    assert "not aligned" in hsa.emu.queue_errors[0].detail
