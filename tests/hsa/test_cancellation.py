"""Cancellation and interruption: nothing wedges, nothing is freed under the device's feet."""
from __future__ import annotations

import asyncio
import ctypes
import random

import numpy as np
import pytest

import aiogpu
from aiogpu.hsa import queues as Q
from aiogpu.hsa_bindings import atomics
from aiogpu.hsa_bindings import types as T
from gpu_kernels import freed_while_in_use, sleep_ms, slow_increment


@pytest.mark.asyncio
async def test_tasks_cancelled_at_random_points_leave_no_wedged_queue(rt):
    rng = random.Random(3)
    d0, d1 = rt.devices
    counter = d0.alloc(8)
    await aiogpu.copy(counter, np.zeros(1, np.int64))
    submitted = []

    async def worker(i):
        for _ in range(5):
            f = d0.launch(slow_increment, grid=(1,), block=(1,), args=(counter,))
            submitted.append(f)
            await asyncio.sleep(rng.random() * 0.004)
            await f

    tasks = [asyncio.ensure_future(worker(i)) for i in range(20)]
    for _ in range(10):
        await asyncio.sleep(rng.random() * 0.02)
        rng.choice(tasks).cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await aiogpu.gather(*submitted)             # every submitted launch still completes...
    value = (await counter.to_numpy(np.int64))[0]
    assert value == len(submitted)              # ...exactly once, in order
    await d1.launch(sleep_ms, grid=(1,), block=(1,), args=(0,))   # and the device is usable


def test_an_error_between_reservation_and_publication_publishes_noops(rt, monkeypatch):
    """Rule 4: a reserved slot is always published, even when writing the packet fails."""
    d0 = rt.devices[0]
    real = Q.AqlQueue._write_bodies
    calls = {"n": 0}

    def failing(self, first, blob, n):
        calls["n"] += 1
        if calls["n"] == 1:
            raise KeyboardInterrupt("interrupted between reservation and publication")
        return real(self, first, blob, n)

    monkeypatch.setattr(Q.AqlQueue, "_write_bodies", failing)
    queue = d0.queues[0]
    before = rt.api.hsa_queue_load_write_index_relaxed(queue._q)
    with pytest.raises(KeyboardInterrupt):
        queue.submit(Q.PacketGroup(*_noop_group(rt)))
    after = rt.api.hsa_queue_load_write_index_relaxed(queue._q)
    assert after == before + 1, "the slot was reserved"
    # The queue did not wedge on an unpublished slot: later packets complete.
    futs = [d0.launch(sleep_ms, grid=(1,), block=(1,), args=(0,)) for _ in range(8)]
    assert all(f.wait(10) for f in futs)
    assert rt.api.emulator.queue_errors == []


def _noop_group(rt):
    fut = rt.hub.new_future("interrupted")
    rt.hub.discard(fut)
    pkt, header = Q.barrier_and_packets([])[0]
    return [pkt], [header], fut


def test_header_before_body_writer_is_caught_by_the_eager_processor(make_runtime, monkeypatch):
    """The test above has teeth: a writer that publishes headers before bodies (the defect in
    the KFD review) is reported by the eager packet processor as INVALID_PACKET_FORMAT."""
    import time

    rt = make_runtime(gpus=1, eager=True)
    rt.api.emulator.faults.eager_recheck_s = 0.15   # re-read well after the slow writer's body
    d0 = rt.devices[0]

    def header_first(self, first, group_headers_and_blob):
        blob, headers, n = group_headers_and_blob
        for i in range(n):
            atomics.store_u32_release(self._slot(first + i), headers[i])   # header first...
        time.sleep(0.03)
        src = (ctypes.c_char * len(blob)).from_buffer(blob)
        for i in range(n):                                                  # ...body later
            ctypes.memmove(self._slot(first + i) + 4, ctypes.addressof(src) + i * 64 + 4, 60)

    real_try = Q.AqlQueue._try_publish

    def broken_try(self, group):
        n = len(group)
        if not self.has_room(n):
            return False
        if group.kernargs and not self._place_kernargs(group):
            return False
        first = self.api.hsa_queue_add_write_index_scacq_screl(self._q, n)
        header_first(self, first, (group.blob, group.headers, n))
        self.api.hsa_signal_store_screlease(self.doorbell, first + n - 1)
        self.inflight[group.future] = (first, first + n - 1)
        group.future.packet = first + n - 1
        return True

    monkeypatch.setattr(Q.AqlQueue, "_try_publish", broken_try)
    f = d0.launch(sleep_ms, grid=(1,), block=(1,), args=(0,))
    with pytest.raises(aiogpu.GPUError) as info:
        f.wait(10) and f.result()
    assert info.value.status == T.HSA_STATUS_ERROR_INVALID_PACKET_FORMAT
    monkeypatch.setattr(Q.AqlQueue, "_try_publish", real_try)


@pytest.mark.asyncio
async def test_freed_buffer_stays_mapped_until_the_device_is_done(rt):
    d0 = rt.devices[0]
    gate, inc, address = await freed_while_in_use(d0)
    import gc
    gc.collect()
    assert d0.memory.small.used >= 1, "memory returned while a pending kernel uses it"
    gate.open()
    await inc
    assert inc.exception() is None
    assert rt.api.emulator.memory_faults == [], "the device touched freed memory"
    assert address not in d0.memory.small._used
