"""Typed views and slices of Buffers: validation, data through every operation, hazards on byte
ranges, lifetime, leak accounting, NumPy refusal and the interop exports' refusal off CUDA."""
from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

import aiogpu
from gpu_kernels import add_const_n, fail_if, scale, slow_increment

GATES: dict[int, threading.Event] = {}


@aiogpu.kernel("i64*, i64, u32")
def gated_add(launch, x, key, n):
    """Waits for the test to open gate ``key`` (deterministic 'slow' work), then adds ``key``."""
    GATES[int(key)].wait(30)
    x[:n] += key


def gate(key: int) -> threading.Event:
    GATES[key] = threading.Event()
    return GATES[key]


# -- what a view is ----------------------------------------------------------------------------
def test_len_shape_and_slices_of_raw_and_typed(any_rt):
    buf = any_rt.devices[0].alloc(256)
    assert len(buf) == 256 and buf.shape == (256,) and buf.dtype == np.uint8 and buf.base is None
    raw = buf[16:48]
    assert (raw.nbytes, raw.offset, len(raw), raw.base) == (32, 16, 32, buf)
    v = buf.view(np.float32)
    assert (len(v), v.shape, v.nbytes) == (64, (64,), 256)
    part = v[8:16]
    assert (part.offset, part.nbytes, part.dtype) == (32, 32, np.float32)
    m = buf.view(np.int16, (8, 4), offset=64)
    assert (m.shape, len(m), m.nbytes, m.offset) == ((8, 4), 8, 64, 64)
    row = m[-1]
    assert (row.shape, row.offset) == ((4,), 64 + 7 * 8)
    assert m[2:4].shape == (2, 4) and m[2:4].offset == 64 + 16
    sub = part.view(np.int64, offset=8)     # offsets compose: relative to the view
    assert (sub.offset, sub.shape) == (40, (3,))


@pytest.mark.asyncio
async def test_offset_copies_fill_and_to_numpy_through_views(any_rt):
    d = any_rt.devices[0]
    buf = d.alloc(64 * 4)
    v = buf.view(np.float32)
    await aiogpu.copy(v, np.zeros(64, np.float32))
    await aiogpu.copy(v[10:20], np.arange(10, dtype=np.float32) + 1)       # host -> view
    await v[40:44].fill(int(np.float32(7).view(np.uint32)))
    other = d.alloc(16)
    await aiogpu.copy(other, v[10:14])                                      # view -> buffer
    await aiogpu.copy(v[50:54], other)                                      # buffer -> view
    whole = await v.to_numpy()
    assert whole.dtype == np.float32 and whole.shape == (64,)
    expect = np.zeros(64, np.float32)
    expect[10:20] = np.arange(10) + 1
    expect[40:44] = 7
    expect[50:54] = [1, 2, 3, 4]
    np.testing.assert_array_equal(whole, expect)
    m = await buf.view(np.float32, (8, 8)).to_numpy()
    assert m.shape == (8, 8)
    np.testing.assert_array_equal(m, expect.reshape(8, 8))
    np.testing.assert_array_equal(await v[10:12].to_numpy(np.uint8), expect[10:12].view(np.uint8))
    assert (await buf[40:44].to_numpy()).dtype == np.uint8


@pytest.mark.asyncio
async def test_launch_on_views_touches_only_their_bytes(any_rt):
    d = any_rt.devices[0]
    buf = d.alloc(32 * 4)
    v = buf.view(np.float32)
    await aiogpu.copy(v, np.ones(32, np.float32))
    await d.launch(scale, grid=(8,), block=(8,), args=(v[8:16], 3.0, 8))
    await d.launch(scale, grid=(8,), block=(8,), args=(buf[64:96], 5.0, 8))   # a raw byte slice
    got = await v.to_numpy()
    expect = np.ones(32, np.float32)
    expect[8:16], expect[16:24] = 3, 5
    np.testing.assert_array_equal(got, expect)


@pytest.mark.asyncio
async def test_peer_copy_between_views_of_two_devices(any_rt2):
    d0, d1 = any_rt2.devices[:2]
    a, b = d0.alloc(1024), d1.alloc(1024)
    await aiogpu.copy(a.view(np.int32), np.arange(256, dtype=np.int32))
    await aiogpu.copy(b.view(np.int32), np.zeros(256, np.int32))
    await aiogpu.copy(b.view(np.int32)[100:200], a.view(np.int32)[0:100])
    got = await b.view(np.int32).to_numpy()
    expect = np.zeros(256, np.int32)
    expect[100:200] = np.arange(100)
    np.testing.assert_array_equal(got, expect)


# -- hostile input -----------------------------------------------------------------------------
BAD_DTYPES = [object, "V8", "S4", "U2", "M8[s]", "m8[s]", [("a", "f4"), ("b", "i4")],
              [("a", "O"), ("b", "i8")], ">f4" if np.little_endian else "<f4", "not-a-dtype", ("f4", 2)]


@pytest.mark.parametrize("dtype", BAD_DTYPES, ids=str)
def test_non_numeric_dtypes_are_refused(rt, dtype):
    buf = rt.devices[0].alloc(64)
    with pytest.raises(TypeError):
        buf.view(dtype)
    with pytest.raises(TypeError):
        buf.to_numpy(dtype)


@pytest.mark.parametrize("dtype", [np.bool_, np.int8, np.uint16, np.int32, np.uint64, np.float16,
                                   np.float32, np.float64, np.complex64, np.complex128])
def test_numeric_dtypes_are_accepted(rt, dtype):
    v = rt.devices[0].alloc(64).view(dtype)
    assert v.dtype == np.dtype(dtype) and v.nbytes == 64


@pytest.mark.parametrize("offset, shape, error", [
    (-4, None, ValueError), (64, None, ValueError), (1000, None, ValueError), (2, None, ValueError),
    (True, None, TypeError), (4.0, None, TypeError), ("4", None, TypeError),
    (0, 17, ValueError), (0, (4, 5), ValueError), (0, 0, ValueError), (0, (-1,), ValueError),
    (0, (), TypeError), (0, (2.0,), TypeError), (0, "4", TypeError), (60, 2, ValueError),
])
def test_out_of_bounds_and_misaligned_views_are_refused(rt, offset, shape, error):
    buf = rt.devices[0].alloc(64)
    with pytest.raises(error):
        buf.view(np.float32, shape, offset)


def test_alignment_counts_from_the_allocation(rt):
    buf = rt.devices[0].alloc(64)
    with pytest.raises(ValueError, match="multiple"):
        buf[2:34].view(np.float32)               # byte 2 of the allocation
    assert buf[4:36].view(np.float32).offset == 4
    with pytest.raises(ValueError):
        buf.view(np.float32, shape=None, offset=0)[0:3].view(np.float64, offset=4)


def test_a_remainder_needs_a_shape(rt):
    buf = rt.devices[0].alloc(10)
    with pytest.raises(ValueError, match="shape"):
        buf.view(np.float32)
    assert buf.view(np.float32, 2).nbytes == 8


@pytest.mark.parametrize("key, error", [
    (slice(0, 100), IndexError), (slice(-100, 4), IndexError), (slice(4, 4), ValueError),
    (slice(8, 2), ValueError), (slice(0, 8, 2), ValueError), (3, TypeError), ("a", TypeError),
    ((slice(0, 2), slice(0, 2)), TypeError), (slice(0.0, 2), TypeError), (None, TypeError),
])
def test_bad_slices_are_refused_not_clipped(rt, key, error):
    v = rt.devices[0].alloc(64).view(np.float32)
    with pytest.raises(error):
        v[key]


def test_negative_slice_bounds_count_from_the_end(rt):
    v = rt.devices[0].alloc(64).view(np.float32)
    assert v[-4:].offset == 48 and v[-4:].shape == (4,)
    m = v.view(np.float32, (4, 4))
    with pytest.raises(IndexError):
        m[4]
    with pytest.raises(IndexError):
        m[-5]


@pytest.mark.asyncio
async def test_views_of_a_freed_buffer_are_unusable(rt):
    d = rt.devices[0]
    buf = d.alloc(64)
    v = buf.view(np.float32)
    part = v[0:4]
    buf.free()
    for call in (lambda: v[0:2], lambda: buf.view(np.int8), lambda: part.to_numpy(),
                 lambda: aiogpu.copy(part, np.zeros(4, np.float32)),
                 lambda: aiogpu.copy(np.zeros(4, np.float32), part),
                 lambda: d.launch(scale, grid=(4,), block=(4,), args=(part, 2.0, 4)),
                 lambda: part.fill(0)):
        with pytest.raises(ValueError, match="freed"):
            call()
    with pytest.raises(TypeError, match="view"):
        part.free()
    assert rt.stats()["small_allocations"] == 0      # the view did not keep the memory


@pytest.mark.asyncio
async def test_a_view_keeps_its_buffer_alive(rt):
    d = rt.devices[0]
    v = d.alloc(64).view(np.int32)[4:8]          # the Buffer itself is not referenced
    import gc
    gc.collect()
    assert rt.stats()["small_allocations"] == 1
    await aiogpu.copy(v, np.arange(4, dtype=np.int32))
    np.testing.assert_array_equal(await v.to_numpy(), np.arange(4))
    del v
    gc.collect()
    assert rt.stats()["small_allocations"] == 0


def test_views_of_another_runtime_or_device_are_refused(make_runtime):
    a, b = make_runtime(), make_runtime()
    foreign = b.devices[0].alloc(64).view(np.float32)
    with pytest.raises(ValueError, match="another runtime"):
        a.devices[0].launch(scale, grid=(4,), block=(4,), args=(foreign[0:4], 2.0, 4))
    with pytest.raises(ValueError, match="another runtime"):
        aiogpu.copy(a.devices[0].alloc(16), foreign[0:4])
    with pytest.raises(ValueError, match="gpu1"):
        a.devices[0].launch(scale, grid=(4,), block=(4,), args=(a.devices[1].alloc(16).view(np.float32), 2.0, 4))


def test_launch_checks_a_views_dtype_and_alignment(rt):
    d = rt.devices[0]
    buf = d.alloc(64)
    with pytest.raises(TypeError, match="float64"):
        d.launch(scale, grid=(4,), block=(4,), args=(buf.view(np.float64), 2.0, 4))
    with pytest.raises(ValueError, match="aligned"):
        d.launch(scale, grid=(4,), block=(4,), args=(buf[2:18], 2.0, 4))
    with pytest.raises(ValueError, match="4-byte"):
        buf[2:10].fill(0)
    with pytest.raises(ValueError):
        aiogpu.copy(buf[0:8], np.zeros(4, np.float32))          # sizes differ: 8 vs 16 bytes
    assert rt.stats()["pending"] == 0                            # nothing was submitted


# -- NumPy must not read device memory ----------------------------------------------------------
@pytest.mark.parametrize("make", [lambda b: b, lambda b: b.view(np.float32), lambda b: b[0:8]])
def test_numpy_refuses_buffers_with_a_pointer_to_to_numpy(rt, make):
    obj = make(rt.devices[0].alloc(64))
    for convert in (np.asarray, np.array, lambda o: np.asarray(o, dtype=np.float32)):
        with pytest.raises(TypeError, match="to_numpy"):
            convert(obj)
    with pytest.raises(TypeError):
        list(obj)
    with pytest.raises(TypeError):
        np.stack([obj, obj])


def test_interop_exports_are_cuda_only_with_a_clear_error(rt):
    v = rt.devices[0].alloc(64).view(np.float32)
    assert not hasattr(v, "__cuda_array_interface__")
    with pytest.raises(aiogpu.NotOnCudaError, match="emulator"):
        v.__dlpack__()
    with pytest.raises(TypeError):
        v.__dlpack_device__()


class FakeCudaArray:
    """Looks like another library's CUDA array."""

    @property
    def __cuda_array_interface__(self):
        return {"shape": (4,), "typestr": "<f4", "data": (0x1000, False), "version": 3, "stream": None}


def test_hsa_refuses_foreign_arrays_clearly(rt):
    d = rt.devices[0]
    with pytest.raises(TypeError, match="another library's array"):
        d.launch(scale, grid=(4,), block=(4,), args=(FakeCudaArray(), 2.0, 4))
    with pytest.raises(TypeError, match="another library's array"):
        aiogpu.copy(d.alloc(16), FakeCudaArray())
    with pytest.raises(TypeError, match="must be a Buffer"):
        d.launch(scale, grid=(4,), block=(4,), args=(np.zeros(4, np.float32), 2.0, 4))


# -- hazards on byte ranges ----------------------------------------------------------------------
@pytest.mark.asyncio
async def test_disjoint_views_run_concurrently_and_overlapping_ones_are_ordered(rt):
    d = rt.devices[0]
    buf = d.alloc(16 * 8)
    v = buf.view(np.int64)
    await aiogpu.copy(v, np.zeros(16, np.int64))
    g = gate(101)
    held = d.launch(gated_add, grid=(1,), block=(1,), args=(v[0:8], 101, 8))
    disjoint = d.launch(add_const_n, grid=(1,), block=(1,), args=(v[8:16], 5, 8))
    overlapping = d.launch(add_const_n, grid=(1,), block=(1,), args=(v[4:12], 1000, 8))
    assert held not in disjoint.preds                      # no false ordering ...
    await asyncio.wait_for(disjoint.asyncio(), 20)         # ... it finishes while the gate is shut
    assert not held.done()
    assert held in overlapping.preds and not overlapping.done()
    g.set()
    await aiogpu.gather(held, overlapping)
    got = await v.to_numpy()
    expect = np.zeros(16, np.int64)
    expect[0:8] += 101
    expect[8:16] += 5
    expect[4:12] += 1000
    np.testing.assert_array_equal(got, expect)
    assert buf.ranges is None        # nothing pending: the buffer is back on the fast path


@pytest.mark.asyncio
async def test_a_whole_buffer_write_waits_for_every_view_and_the_views_for_it(rt):
    d = rt.devices[0]
    buf = d.alloc(8 * 8)
    v = buf.view(np.int64)
    await aiogpu.copy(v, np.zeros(8, np.int64))
    g = gate(102)
    held = d.launch(gated_add, grid=(1,), block=(1,), args=(v[6:7], 102, 1))
    whole = d.launch(add_const_n, grid=(1,), block=(1,), args=(buf, 1, 8))      # raw, whole
    after = d.launch(add_const_n, grid=(1,), block=(1,), args=(v[0:1], 10, 1))
    assert held in whole.preds and whole in after.preds
    g.set()
    await aiogpu.gather(held, whole, after)
    np.testing.assert_array_equal(await v.to_numpy(), [11, 1, 1, 1, 1, 1, 103, 1])


@pytest.mark.asyncio
async def test_overlapping_views_lose_no_updates(any_rt):
    d = any_rt.devices[0]
    buf = d.alloc(64)
    await aiogpu.copy(buf.view(np.int64), np.zeros(8, np.int64))
    # Every launch reads element 0, pauses, writes it back + 1, through different views.
    views = [buf.view(np.int64), buf.view(np.int64)[0:1], buf[0:16], buf.view(np.int64, 2)]
    futs = [d.launch(slow_increment, grid=(1,), block=(1,), args=(views[i % 4],)) for i in range(12)]
    await aiogpu.gather(*futs)
    assert (await buf.view(np.int64)[0:1].to_numpy())[0] == 12


@pytest.mark.asyncio
async def test_a_failed_write_into_a_view_fails_only_overlapping_readers(rt):
    d = rt.devices[0]
    buf = d.alloc(16)
    v = buf.view(np.int32)
    await aiogpu.copy(v, np.zeros(4, np.int32))
    bad = d.launch(fail_if, grid=(1,), block=(1,), args=(v[1:2], 1))
    with pytest.raises(aiogpu.GPUError):
        await bad
    np.testing.assert_array_equal(await v[2:4].to_numpy(), [0, 0])      # disjoint: fine
    with pytest.raises(aiogpu.GPUError):
        await v[0:2].to_numpy()                                          # overlaps the failure
    with pytest.raises(aiogpu.GPUError):
        await buf.to_numpy()
    await v[1:2].fill(9)                                                 # defines it again
    np.testing.assert_array_equal(await v.to_numpy(), [0, 9, 0, 0])


@pytest.mark.asyncio
async def test_graph_capture_orders_views_by_their_bytes(rt):
    d = rt.devices[0]
    buf = d.alloc(8 * 8)
    v = buf.view(np.int64)
    await aiogpu.copy(v, np.zeros(8, np.int64))
    with aiogpu.Graph() as g:
        a = d.launch(add_const_n, grid=(1,), block=(1,), args=(v[0:4], 1, 4))
        b = d.launch(add_const_n, grid=(1,), block=(1,), args=(v[4:8], 2, 4))
        c = d.launch(add_const_n, grid=(1,), block=(1,), args=(v[2:6], 10, 4))
    assert a not in b.deps and a in c.deps and b in c.deps
    exe = g.instantiate()
    await exe.launch()
    await exe.launch()
    np.testing.assert_array_equal(await v.to_numpy(), [2, 2, 22, 22, 24, 24, 4, 4])


# -- accounting ----------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_views_are_not_counted_as_buffers(rt):
    d = rt.devices[0]
    buf = d.alloc(4096)
    views = [buf.view(np.float32)[i * 4:(i + 1) * 4] for i in range(100)]
    await aiogpu.gather(*[aiogpu.copy(w, np.full(4, i, np.float32)) for i, w in enumerate(views)])
    stats = rt.stats()
    assert stats["small_allocations"] + stats["large_allocations"] == 1
    assert await rt.leaks_async(5, buffers=False) == {}
    del views, buf
    assert await rt.leaks_async(5) == {}
