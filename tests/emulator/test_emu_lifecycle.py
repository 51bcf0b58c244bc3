"""Shut-down joins every emulator thread; executables; queue destruction."""
from __future__ import annotations

import ctypes
import threading
import time


from aiogpu.hsa_bindings import packets
from aiogpu.hsa_bindings import types as T

from emu_helpers import Hsa, barrier_packet, ok, saxpy_body


def emulator_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("aiogpu-emu")]


def exercise(hsa: Hsa) -> None:
    """Start every kind of thread: packet processors, compute units, SDMA engines, waiters."""
    k = hsa.load_kernel(0, "saxpy", "f32*, const f32*, f32, u32", saxpy_body)
    x, y = hsa.device_alloc(0, 4096), hsa.device_alloc(0, 4096)
    q0, q1, done = hsa.queue(0), hsa.queue(1), hsa.signal(2)
    q0.submit(k.packet((1024,), (256,), k.kernargs([y, x, 1.0, 1024], [4096, 4096]), done))
    a = hsa.alloc(hsa.system_pool, 4096)
    ok(hsa.api.hsa_amd_memory_async_copy(y, hsa.gpus[0], a, hsa.cpu, 4096, 0, None, done))
    assert hsa.wait_zero(done)
    q1.submit(barrier_packet([hsa.signal(1)]))  # left blocked at shut-down


def test_shutdown_leaks_no_threads():
    before = set(emulator_threads())
    for _ in range(10):
        hsa = Hsa(gpus=2)
        exercise(hsa)
        assert len(emulator_threads()) > len(before)
        hsa.close()
        assert not hsa.emu.api_errors
    deadline = time.monotonic() + 2
    while set(emulator_threads()) - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert set(emulator_threads()) - before == set()


def test_shutdown_wakes_a_blocked_api_waiter():
    hsa = Hsa(gpus=1)
    s = hsa.signal(1)
    result = []
    waiter = threading.Thread(target=lambda: result.append(hsa.api.hsa_signal_wait_scacquire(
        s, T.HSA_SIGNAL_CONDITION_EQ, 0, (1 << 64) - 1, T.HSA_WAIT_STATE_BLOCKED)))
    waiter.start()
    time.sleep(0.02)
    hsa.close()
    waiter.join(2)
    assert not waiter.is_alive() and result == [1]


def test_destroy_queue_joins_its_processor(hsa):
    q = hsa.queue(0)
    name_count = len(emulator_threads())
    q.destroy()
    assert len(emulator_threads()) == name_count - 1
    assert hsa.api.hsa_queue_destroy(q.ptr) == T.HSA_STATUS_ERROR_INVALID_QUEUE


def test_destroy_queue_from_its_error_callback(hsa):
    """A runtime may tear a failed queue down inside the callback (on the processor's thread)."""
    destroyed = []

    @T.queue_error_callback_t
    def on_error(status, queue, _data):
        destroyed.append(hsa.api.hsa_queue_destroy(queue))

    qp = ctypes.POINTER(T.hsa_queue_t)()
    ok(hsa.api.hsa_queue_create(hsa.gpus[0], 64, 0, on_error, None, 0, 0, ctypes.byref(qp)))
    from emu_helpers import AqlWriter
    empty_dispatch = packets.make_header(packets.HSA_PACKET_TYPE_KERNEL_DISPATCH) | 1 << 16, bytes(64)
    AqlWriter(hsa.api, qp).submit(empty_dispatch)  # grid 0: fails
    deadline = time.monotonic() + 5
    while not destroyed and time.monotonic() < deadline:
        time.sleep(0.005)
    assert destroyed == [T.HSA_STATUS_SUCCESS]


def test_executable_symbols_and_destroy(hsa):
    k = hsa.load_kernel(0, "saxpy", "f32*, const f32*, f32, u32", saxpy_body)
    api, sym = hsa.api, T.hsa_executable_symbol_t()
    for name in (b"saxpy", b"saxpy.kd"):
        ok(api.hsa_executable_get_symbol_by_name(k.executable, name, ctypes.byref(hsa.gpus[0]), ctypes.byref(sym)))
    assert api.hsa_executable_get_symbol_by_name(k.executable, b"nope", ctypes.byref(hsa.gpus[0]),
                                                 ctypes.byref(sym)) == T.HSA_STATUS_ERROR_INVALID_SYMBOL_NAME
    assert api.hsa_executable_get_symbol_by_name(k.executable, b"saxpy", ctypes.byref(hsa.gpus[1]),
                                                 ctypes.byref(sym)) == T.HSA_STATUS_ERROR_INVALID_SYMBOL_NAME
    values = {}
    for attr, ctype in [(T.HSA_EXECUTABLE_SYMBOL_INFO_KERNEL_KERNARG_SEGMENT_ALIGNMENT, ctypes.c_uint32),
                        (T.HSA_EXECUTABLE_SYMBOL_INFO_KERNEL_GROUP_SEGMENT_SIZE, ctypes.c_uint32),
                        (T.HSA_EXECUTABLE_SYMBOL_INFO_KERNEL_PRIVATE_SEGMENT_SIZE, ctypes.c_uint32)]:
        v = ctype()
        ok(api.hsa_executable_symbol_get_info(sym, attr, ctypes.byref(v)))
        values[attr] = v.value
    assert list(values.values()) == [16, 0, 0]
    reader = T.hsa_code_object_reader_t()
    junk = ctypes.create_string_buffer(b"\x7fELF not ours")
    assert api.hsa_code_object_reader_create_from_memory(ctypes.addressof(junk), 13, ctypes.byref(reader)) \
        == T.HSA_STATUS_ERROR_INVALID_CODE_OBJECT
    other = T.hsa_code_object_reader_t()
    assert api.hsa_executable_load_agent_code_object(k.executable, hsa.gpus[1], other, None, None) \
        == T.HSA_STATUS_ERROR_FROZEN_EXECUTABLE
    ok(api.hsa_executable_destroy(k.executable))
    buf = hsa.device_alloc(0, 64)
    q = hsa.queue(0)
    q.submit(k.packet((1,), (1,), k.kernargs([buf, buf, 1.0, 1], [64, 64])))  # a dangling kernel object
    assert hsa.wait_errors() == [(T.HSA_STATUS_ERROR_INVALID_CODE_OBJECT, q.id)]


def test_timeline_and_engine_history_are_bounded(make_hsa):
    """Issue 13.20: a long-running emulator keeps the newest records only, and totals."""
    hsa = make_hsa(timeline_records=100, engine_history_records=8)
    q, done = hsa.queue(0), hsa.signal(300)
    for _ in range(300):
        q.submit(barrier_packet([], done))
    assert hsa.wait_zero(done, timeout=20)
    a, b = hsa.alloc(hsa.system_pool, 64), hsa.device_alloc(0, 64)
    copies = hsa.signal(40)
    for _ in range(40):
        ok(hsa.api.hsa_amd_memory_async_copy(b, hsa.gpus[0], a, hsa.cpu, 64, 0, None, copies))
    assert hsa.wait_zero(copies)
    timeline = hsa.emu.timeline
    deadline = time.monotonic() + 5
    while timeline.total < 340 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert len(timeline) == 100 and timeline.total == 340 and timeline.dropped == 240
    assert timeline.counts == {"barrier": 300, "copy": 40}
    assert max(r.end_ns for r in timeline) == max(r.end_ns for r in timeline.records())  # newest kept
    history = hsa.emu.engine_history(0)
    assert all(len(h) <= 8 for h in history) and sum(len(h) for h in history) <= 16
    assert sum(hsa.emu.engine_outcomes(0).values()) == 40
