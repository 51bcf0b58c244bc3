"""Property tests: the AQL writer against the eager packet processor, the buddy sub-allocator,
and dependency ordering against a sequential NumPy oracle."""
from __future__ import annotations

import threading

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aiogpu
from aiogpu.cli.stress import add_buf, add_const
from aiogpu.memory import BLOCK, MIN_PIECE, BuddyAllocator
from gpu_kernels import sleep_ms

FAST = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FAST
@given(ring=st.sampled_from([4, 8, 16, 64]), producers=st.integers(1, 4),
       mix=st.lists(st.sampled_from(["dispatch", "dep", "gather"]), min_size=5, max_size=60))
def test_aql_writer_never_trips_the_eager_packet_processor(ring, producers, mix):
    """Random packet mixes from several threads into small rings, with the eager packet
    processor reading each slot the moment its header turns valid: nothing is torn or lost."""
    rt = aiogpu.Runtime("emulator", gpus=2, ring_size=ring, eager=True, emulator_min_queue_size=4)
    try:
        d0, d1 = rt.devices
        futures, errors = [], []

        def produce(seed):
            try:
                prev = None
                for i, kind in enumerate(mix):
                    dev = (d0, d1)[(seed + i) % 2]
                    if kind == "dispatch":
                        prev = dev.launch(sleep_ms, (1,), (1,), (0,))
                    elif kind == "dep" and prev is not None:
                        prev = dev.launch(sleep_ms, (1,), (1,), (0,), after=[prev])
                    elif prev is not None:
                        prev = aiogpu.gather(prev, dev.launch(sleep_ms, (1,), (1,), (0,)))
                    if prev is not None:
                        futures.append(prev)
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=produce, args=(p,)) for p in range(producers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        for f in futures:
            assert f.wait(30), f"{f} never completed"
            assert f.exception() is None, f.exception()
        assert rt.api.emulator.queue_errors == []
    finally:
        rt.close()


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(1, 1 << 20), st.integers(0, 1 << 16)),
                    min_size=1, max_size=80))
def test_buddy_allocator_no_overlap_alignment_full_reuse(ops):
    next_block = [BLOCK * 16]
    returned = []

    def get_block():
        next_block[0] += BLOCK
        return next_block[0]

    alloc = BuddyAllocator(get_block, returned.append)
    live: dict[int, int] = {}
    for is_alloc, size, pick in ops:
        size = min(size, BLOCK // 2)
        if is_alloc or not live:
            addr = alloc.alloc(size)
            piece = 1 << alloc.order_for(size)
            assert piece >= max(size, MIN_PIECE)
            assert addr % piece == 0, "a piece is aligned to its size"
            for other, osize in live.items():
                assert addr + piece <= other or other + osize <= addr, "pieces overlap"
            live[addr] = piece
        else:
            addr = sorted(live)[pick % len(live)]
            alloc.free(addr)
            del live[addr]
    for addr in list(live):
        alloc.free(addr)
    assert alloc.used == 0, "freeing everything frees every piece"
    alloc.flush()                   # the size classes' caches keep freed pieces until flushed
    assert alloc.blocks == 0, "freeing everything (and flushing the cache) returns every block"
    assert all(b % BLOCK == 0 for b in returned)


@FAST
@given(program=st.lists(st.tuples(st.sampled_from(["add", "addbuf", "copy", "upload"]),
                                  st.integers(0, 3), st.integers(0, 3), st.integers(1, 50)),
                        min_size=1, max_size=40))
def test_dependency_ordering_matches_a_sequential_oracle(make_runtime, program):
    """Operations issued back to back without after= on shared buffers across two devices give
    exactly what running them one by one on the host gives."""
    rt = make_runtime(gpus=2)
    devs = rt.devices
    bufs = [devs[i % 2].alloc(8 * 8) for i in range(4)]
    oracle = [np.zeros(8, np.int64) for _ in bufs]
    for b in bufs:
        aiogpu.copy(b, np.zeros(8, np.int64))
    for kind, i, j, c in program:
        if kind == "add":
            bufs[i].device.launch(add_const, (8,), (8,), (bufs[i], c))
            oracle[i] += c
        elif kind == "addbuf" and i != j and bufs[i].device is bufs[j].device:
            bufs[i].device.launch(add_buf, (8,), (8,), (bufs[i], bufs[j]))
            oracle[i] += oracle[j]
        elif kind == "copy" and i != j:
            aiogpu.copy(bufs[i], bufs[j])
            oracle[i] = oracle[j].copy()
        elif kind == "upload":
            data = np.full(8, c, np.int64)
            aiogpu.copy(bufs[i], data)
            oracle[i] = data.copy()
    for b, expect in zip(bufs, oracle):
        out = b.to_numpy(np.int64)
        assert out.wait(30)
        np.testing.assert_array_equal(out.result(), expect)
