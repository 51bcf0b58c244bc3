"""The emulator against the real ROCr: the same raw HSA sequences on the emulator (behind its
Python HSA API) and on hsa-virtual (ROCr 5.2.3 over the virtual KFD), comparing what a program
can observe: statuses, signal values, read indices, copy results, and which GPU's engine ran a
copy. Differences found are fixed in the emulator or written in docs/rocr-model.md."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from aiogpu.hsa_bindings import loader
from aiogpu.hsa_bindings import packets as P
from aiogpu.hsa_bindings import types as T
from aiogpu.hsa_bindings.atomics import store_u32_release
from backends import on_hsa_virtual

TIMEOUT_NS = 20 * 10**9
BOTH = [pytest.param("emulator", id="emulator"), pytest.param("hsa-virtual", id="hsa-virtual", marks=on_hsa_virtual)]


class Raw:
    """Raw HSA calls on one library: agents, pools, signals, queues, packets, copies."""

    def __init__(self, backend: str, **options):
        self.backend = backend
        self.api = loader.load(backend, "conformance", gpus=2, **options)
        self.signals, self.queues, self.blocks, self.locked = [], [], [], []
        self.cpu, self.gpus = None, []
        api = self.api

        @T.agent_iterate_callback_t
        def visit(agent, _data):
            kind = ctypes.c_uint32()
            api.hsa_agent_get_info(agent, T.HSA_AGENT_INFO_DEVICE, ctypes.byref(kind))
            a = T.hsa_agent_t(agent.handle)
            if kind.value == T.HSA_DEVICE_TYPE_CPU and self.cpu is None:
                self.cpu = a
            elif kind.value == T.HSA_DEVICE_TYPE_GPU:
                self.gpus.append(a)
            return T.HSA_STATUS_SUCCESS

        api.check(api.hsa_iterate_agents(visit, None), "iterate agents")
        self.vram = [self._pool(g, T.HSA_AMD_MEMORY_POOL_GLOBAL_FLAG_COARSE_GRAINED) for g in self.gpus]

    def _pool(self, agent, flag):
        found = []

        @T.pool_iterate_callback_t
        def visit(pool, _data):
            seg, flags = ctypes.c_uint32(), ctypes.c_uint32()
            self.api.hsa_amd_memory_pool_get_info(pool, T.HSA_AMD_MEMORY_POOL_INFO_SEGMENT, ctypes.byref(seg))
            self.api.hsa_amd_memory_pool_get_info(pool, T.HSA_AMD_MEMORY_POOL_INFO_GLOBAL_FLAGS, ctypes.byref(flags))
            if seg.value == T.HSA_AMD_SEGMENT_GLOBAL and flags.value & flag and not found:
                found.append(T.hsa_amd_memory_pool_t(pool.handle))
            return T.HSA_STATUS_SUCCESS

        self.api.hsa_amd_agent_iterate_memory_pools(agent, visit, None)
        return found[0]

    def close(self):
        api = self.api
        for q in self.queues:
            api.hsa_queue_destroy(q)
        for s in self.signals:
            api.hsa_signal_destroy(s)
        for b in self.blocks:
            api.hsa_amd_memory_pool_free(b)
        for p in self.locked:
            api.hsa_amd_memory_unlock(p)
        api.hsa_shut_down()

    # -- pieces ------------------------------------------------------------------------------------
    def signal(self, value: int):
        s = T.hsa_signal_t()
        self.api.check(self.api.hsa_signal_create(value, 0, None, ctypes.byref(s)), "signal")
        self.signals.append(s)
        return s

    def value(self, s) -> int:
        return self.api.hsa_signal_load_scacquire(s)

    def wait_below(self, s, value: int = 1) -> int:
        return self.api.hsa_signal_wait_scacquire(s, T.HSA_SIGNAL_CONDITION_LT, value, TIMEOUT_NS,
                                                  T.HSA_WAIT_STATE_BLOCKED)

    def queue(self, gpu: int):
        q = ctypes.POINTER(T.hsa_queue_t)()
        self.api.check(self.api.hsa_queue_create(self.gpus[gpu], 64, T.HSA_QUEUE_TYPE_MULTI,
                                                 T.queue_error_callback_t(), None, 0xFFFFFFFF, 0xFFFFFFFF,
                                                 ctypes.byref(q)), "queue")
        self.queues.append(q)
        return q

    def submit_barrier(self, q, kind: int, deps: list, completion) -> int:
        """Body first, header last (release), then the doorbell with the packet's index."""
        pkt = P.hsa_barrier_and_packet_t() if kind == P.HSA_PACKET_TYPE_BARRIER_AND else P.hsa_barrier_or_packet_t()
        for i, d in enumerate(deps):
            pkt.dep_signal[i] = d
        pkt.completion_signal = completion
        index = self.api.hsa_queue_add_write_index_scacq_screl(q, 1)
        slot = q.contents.base_address + (index % q.contents.size) * P.PACKET_SIZE
        ctypes.memmove(slot + 4, ctypes.addressof(pkt) + 4, P.PACKET_SIZE - 4)
        store_u32_release(slot, P.make_header(kind))
        self.api.hsa_signal_store_screlease(T.hsa_signal_t(q.contents.doorbell_signal.handle), index)
        return index

    def device(self, gpu: int, nbytes: int) -> int:
        out = ctypes.c_void_p()
        self.api.check(self.api.hsa_amd_memory_pool_allocate(self.vram[gpu], nbytes, 0, ctypes.byref(out)), "alloc")
        self.blocks.append(out.value)
        agents = (T.hsa_agent_t * len(self.gpus))(*self.gpus)
        self.api.check(self.api.hsa_amd_agents_allow_access(len(self.gpus), agents, None, out.value), "access")
        return out.value

    def lock(self, arr: np.ndarray) -> int:
        agents = (T.hsa_agent_t * len(self.gpus))(*self.gpus)
        out = ctypes.c_void_p()
        self.api.check(self.api.hsa_amd_memory_lock(arr.ctypes.data, arr.nbytes, agents, len(self.gpus),
                                                    ctypes.byref(out)), "lock")
        self.locked.append(arr.ctypes.data)
        return out.value

    def copy(self, dst: int, dst_agent, src: int, src_agent, nbytes: int) -> int:
        done = self.signal(1)
        status = self.api.hsa_amd_memory_async_copy(dst, dst_agent, src, src_agent, nbytes, 0, None, done)
        if status == T.HSA_STATUS_SUCCESS:
            self.wait_below(done)
        return status, self.value(done)

    def engine_copies(self) -> list[int]:
        """Per GPU, how many copies its engines (SDMA queues or blit kernels) ran."""
        if self.api.vkfd is not None:
            return [self.api.vkfd.counters(g)["sdma_copy_linear"] + self.api.vkfd.counters(g)["blit_copy"]
                    for g in range(len(self.gpus))]
        em = self.api.emulator
        return [sum(len(h) for h in em.engine_history(g)) for g in range(len(self.gpus))]


@pytest.fixture(params=BOTH)
def raw(request):
    r = Raw(request.param)
    yield r
    r.close()


def _barrier_and_trace(raw: Raw) -> list:
    q = raw.queue(0)
    dep, done = raw.signal(1), raw.signal(1)
    index = raw.submit_barrier(q, P.HSA_PACKET_TYPE_BARRIER_AND, [dep], done)
    waited = raw.api.hsa_signal_wait_scacquire(done, T.HSA_SIGNAL_CONDITION_LT, 1, 20 * 10**6,
                                               T.HSA_WAIT_STATE_BLOCKED)   # not done: its dependency is 1
    before = (waited, raw.api.hsa_queue_load_read_index_scacquire(q))
    raw.api.hsa_signal_store_screlease(dep, 0)
    after = (raw.wait_below(done), raw.api.hsa_queue_load_read_index_scacquire(q))
    return [index, before, after]


def test_a_barrier_and_waits_for_its_dependency_then_completes_and_moves_the_read_index(raw):
    assert _barrier_and_trace(raw) == [0, (1, 0), (0, 1)]


def test_a_barrier_or_completes_when_one_dependency_does(raw):
    q = raw.queue(1)
    a, b, done = raw.signal(1), raw.signal(1), raw.signal(1)
    raw.submit_barrier(q, P.HSA_PACKET_TYPE_BARRIER_OR, [a, b], done)
    raw.api.hsa_signal_store_screlease(b, 0)
    assert (raw.wait_below(done), raw.value(a), raw.api.hsa_queue_load_read_index_scacquire(q)) == (0, 1, 1)


def test_copies_run_on_the_engine_of_the_gpu_rocr_5_2_3_picks(raw):
    """Runtime::CopyMemory: the source GPU's engine for device-to-host and peer copies, the
    destination's for host-to-device."""
    n = 1 << 20
    host = np.arange(n // 4, dtype=np.uint32)
    back = np.zeros_like(host)
    h, hb = raw.lock(host), raw.lock(back)
    d0, d1 = raw.device(0, n), raw.device(1, n)
    seen = []
    for dst, dst_agent, src, src_agent in ((d1, raw.gpus[1], h, raw.cpu),          # host-to-device on gpu1
                                           (d0, raw.gpus[0], d1, raw.gpus[1]),     # peer 1 -> 0 on gpu1
                                           (hb, raw.cpu, d0, raw.gpus[0])):        # device-to-host on gpu0
        before = raw.engine_copies()
        assert raw.copy(dst, dst_agent, src, src_agent, n) == (T.HSA_STATUS_SUCCESS, 0)
        seen.append([b - a > 0 for a, b in zip(before, raw.engine_copies())])
    np.testing.assert_array_equal(back, host)
    assert seen == [[False, True], [False, True], [True, False]]


@on_hsa_virtual
def test_without_sdma_queues_rocr_copies_with_its_blit_kernels_and_they_are_right():
    raw = Raw("hsa-virtual", sdma_queues=0)
    try:
        n = (1 << 20) + 13                # a tail the aligned kernel copies byte-wise
        host = np.random.default_rng(3).integers(0, 255, n, dtype=np.uint8)
        back = np.zeros_like(host)
        h, hb = raw.lock(host), raw.lock(back)
        d0, d1 = raw.device(0, n + 64), raw.device(1, n + 64)
        steps = [(d0, raw.gpus[0], h, raw.cpu, n), (d1 + 3, raw.gpus[1], d0, raw.gpus[0], n),   # misaligned
                 (hb, raw.cpu, d1 + 3, raw.gpus[1], n)]
        for dst, da, src, sa, size in steps:
            assert raw.copy(dst, da, src, sa, size) == (T.HSA_STATUS_SUCCESS, 0)
        np.testing.assert_array_equal(back, host)
        c0, c1 = raw.api.vkfd.counters(0), raw.api.vkfd.counters(1)
        assert c0["sdma_copy_linear"] == c1["sdma_copy_linear"] == 0
        assert c0["sdma_queues_refused"] > 0 and c0["blit_copy"] >= 2 and c1["blit_copy"] >= 1
    finally:
        raw.close()


@on_hsa_virtual
def test_the_sdma_packets_rocr_writes_for_a_copy():
    raw = Raw("hsa-virtual")
    try:
        n = 4096
        host = np.ones(n, np.uint8)
        h, d = raw.lock(host), raw.device(0, n)
        before = raw.api.vkfd.counters(0)
        assert raw.copy(d, raw.gpus[0], h, raw.cpu, n) == (T.HSA_STATUS_SUCCESS, 0)
        after = raw.api.vkfd.counters(0)
        grew = {k for k in after if after[k] > before[k]}
        # BlitSdma::SubmitLinearCopyCommand on gfx9: HDP flush (POLL_REGMEM), COPY_LINEAR, then the
        # signal's decrement (ATOMIC), the event's mailbox (FENCE) and the interrupt (TRAP)
        assert {"sdma_copy_linear", "sdma_poll", "sdma_atomic", "sdma_fence", "sdma_trap"} <= grew
        assert after["sdma_bytes"] - before["sdma_bytes"] == n
    finally:
        raw.close()
