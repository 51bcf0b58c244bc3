"""A buffer's ordering state by byte range, read directly (``ordering``): what its views' state
says once it moved from the buffer's two fields to ranges, what ``touching`` reports, and what
work whose input failed leaves in the view it would have written."""
from __future__ import annotations

import numpy as np

import aiogpu
from aiogpu import ordering
from gpu_kernels import Gate, add_const_n, add_into, fail_if

N = 16


def test_touching_names_the_unfinished_writer_and_readers_of_a_buffer_and_of_a_view(make_runtime):
    """``touching`` is what a consumer outside aiogpu must wait for (the CUDA exports' rule)."""
    rt = make_runtime(gpus=1)
    d0 = rt.devices[0]
    buf, out = d0.alloc(N * 8), d0.alloc(N * 8)
    gate = Gate()
    writer = d0.launch(add_const_n, grid=(N,), block=(N,), args=(buf, 1, N), after=[gate.launch(d0)])
    reader = d0.launch(add_into, grid=(N,), block=(N,), args=(out, buf, N))
    try:
        with rt.lock:
            assert ordering.touching(buf) == ([writer], [reader])
            assert ordering.touching(buf[0:8 * 4]) == ([writer], [reader])    # now by byte range
    finally:
        gate.open()
    assert writer.wait(20) and reader.wait(20)


def test_a_views_state_keeps_what_the_whole_buffer_had_and_orders_later_writes_after_it(make_runtime):
    """When a view is first used, the whole buffer's state becomes the range of all its bytes:
    its writer still wrote every byte, and is older than any write after it."""
    rt = make_runtime(gpus=1)
    d0 = rt.devices[0]
    buf = d0.alloc(N * 8)
    gate = Gate()
    whole = d0.launch(add_const_n, grid=(N,), block=(N,), args=(buf, 1, N), after=[gate.launch(d0)])
    try:
        with rt.lock:
            head = ordering.state_of(buf[0:64])
            assert head.written_by(whole) and head.last_write is whole
        part = d0.launch(add_const_n, grid=(8,), block=(8,), args=(buf.view(np.int64, (8,)), 1, 8))
        with rt.lock:
            assert ordering.state_of(buf[0:N * 8]).last_write is part    # the newer of the two
            assert not ordering.state_of(buf[0:N * 8]).written_by(part)
    finally:
        gate.open()
    assert whole.wait(20) and part.wait(20)


def test_splitting_a_middle_range_keeps_every_range_findable(make_runtime):
    """Views writing bytes inside an earlier range split it; every range keeps its writer."""
    rt = make_runtime(gpus=1)
    d0 = rt.devices[0]
    buf = d0.alloc(256)
    gate = Gate()
    held = gate.launch(d0)
    v = buf.view(np.int64)                      # 32 elements
    writers = {}
    try:
        for lo, hi in [(0, 32), (8, 16), (2, 4)]:      # the last two each split a range before the last
            writers[lo, hi] = d0.launch(add_const_n, grid=(hi - lo,), block=(hi - lo,),
                                        args=(v[lo:hi], 1, hi - lo), after=[held])
        with rt.lock:
            for (lo, hi), want in [((2, 4), writers[2, 4]), ((8, 16), writers[8, 16]), ((16, 32), writers[0, 32]),
                                   ((0, 2), writers[0, 32]), ((4, 8), writers[0, 32])]:
                assert ordering.touching(v[lo:hi])[0] == [want], (lo, hi)
    finally:
        gate.open()
    assert all(f.wait(20) for f in writers.values())


def test_work_whose_input_failed_leaves_the_view_it_would_write_failed(make_runtime):
    """A copy from bytes a failed kernel wrote fails without running, and what it would have
    written into a view of another buffer reads as failed until something overwrites it."""
    rt = make_runtime(gpus=1)
    d0 = rt.devices[0]
    src, dst = d0.alloc(16), d0.alloc(16)
    assert aiogpu.gather(aiogpu.copy(src, np.zeros(16, np.uint8)), aiogpu.copy(dst, np.zeros(16, np.uint8))).wait(20)
    bad = d0.launch(fail_if, grid=(1,), block=(1,), args=(src.view(np.int32), 1))
    assert bad.wait(20) and isinstance(bad.exception(), aiogpu.GPUError)
    copied = aiogpu.copy(dst[0:8], src[0:8])
    assert copied.wait(20) and "a dependency failed" in str(copied.exception())
    assert copied.exception().__cause__ is bad.exception()
    fine = dst[8:16].to_numpy()                            # the other bytes are fine
    assert fine.wait(20) and fine.exception() is None
    later = dst[0:4].to_numpy()
    assert later.wait(20) and isinstance(later.exception(), aiogpu.GPUError)
