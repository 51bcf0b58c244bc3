"""The free-list cache in front of the buddy allocator: a freed small piece is reused by the
next request of its size class (a list pop, no lock), never handed out twice, never reused
while GPU work still uses it, and the leak checker sees it as free."""
from __future__ import annotations

import threading

import pytest

from aiogpu._core.interrupts import InterruptSafeLock
from aiogpu.memory import BLOCK, CACHE_BYTES, CACHE_MIN, SMALL_LIMIT, BuddyAllocator
from gpu_kernels import Gate, add_into, freed_while_in_use


def _buddy():
    blocks, returned = [BLOCK * 8], []

    def get_block():
        blocks[0] += BLOCK
        return blocks[0]
    return BuddyAllocator(get_block, returned.append), returned


def test_a_freed_piece_is_reused_by_its_size_class_only():
    alloc, _ = _buddy()
    a = alloc.alloc(1000)                 # order 10 (1 KiB)
    alloc.free(a)
    assert alloc.used == 0
    assert alloc.alloc(4096) != a         # another class does not take it
    assert alloc.alloc(513) == a          # its class does (1 KiB piece)
    assert alloc.take_cached(600) is None  # nothing cached any more


def test_the_cache_is_bounded_and_flush_returns_every_block():
    alloc, returned = _buddy()
    pieces = [alloc.alloc(SMALL_LIMIT) for _ in range(8)]   # 1 MiB pieces: cap is CACHE_MIN
    for p in pieces:
        alloc.free(p)
    assert len(alloc._cache[20]) == max(CACHE_MIN, CACHE_BYTES >> 20)
    assert alloc.used == 0 and alloc.blocks > 0
    alloc.flush()
    assert alloc.blocks == 0 and len(returned) == 4


def test_recycle_refuses_unknown_addresses_and_full_classes():
    alloc, _ = _buddy()
    assert alloc.recycle(12345) is False
    a = alloc.alloc(256)
    assert alloc.recycle(a) is True and alloc.used == 0
    assert alloc.recycle(a) is False      # not handed out any more: no double free


def test_steady_state_alloc_reuses_without_lock(rt, monkeypatch):
    d0 = rt.devices[0]
    first = d0.alloc(1024)
    addr = first.address
    first.free()
    entered = []
    real = rt.lock

    class Counting(InterruptSafeLock):   # (the runtime's lock field is of this type, compiled)
        def enter(self):
            entered.append(1)
            return real.enter()

        def exit(self):
            return real.exit()

        def __enter__(self):
            self.enter()
            return self

        def __exit__(self, *exc):
            self.exit()

    monkeypatch.setattr(rt, "lock", Counting())
    again = d0.alloc(1000)                # same class: the cached piece, no lock taken
    assert again.address == addr and entered == []
    again.free()
    assert entered == []
    monkeypatch.undo()
    assert rt.leaks() == {}


def test_free_twice_and_free_then_collect_release_once(rt):
    d0 = rt.devices[0]
    a = d0.alloc(512)
    a.free()
    a.free()                              # idempotent
    b, c = d0.alloc(512), d0.alloc(512)
    assert b.address != c.address         # the piece was handed out once
    del a                                 # __del__ after free gives nothing back again
    d = d0.alloc(512)
    assert len({b.address, c.address, d.address}) == 3
    for x in (b, c, d):
        x.free()
    assert rt.leaks() == {}


@pytest.mark.parametrize("size", [1, 255, 257, SMALL_LIMIT, SMALL_LIMIT + 1, 3 * BLOCK + 7])
def test_odd_and_huge_sizes_round_trip(rt, size):
    d0 = rt.devices[0]
    bufs = [d0.alloc(size) for _ in range(3)]
    assert len({b.address for b in bufs}) == 3
    for b in bufs:
        b.free()
    again = d0.alloc(size)
    again.free()
    assert rt.leaks() == {}


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "8", None])
def test_bad_sizes_raise_before_anything(rt, bad):
    with pytest.raises((TypeError, ValueError)):
        rt.devices[0].alloc(bad)
    assert rt.leaks() == {}


@pytest.mark.asyncio
async def test_a_piece_freed_while_a_kernel_uses_it_is_not_reused_before(rt):
    d0 = rt.devices[0]
    gate, inc, address = await freed_while_in_use(d0)
    others = [d0.alloc(8) for _ in range(4)]   # none may get the busy piece
    assert address not in {o.address for o in others}
    gate.open()
    await inc
    assert rt.api.emulator.memory_faults == []
    later = d0.alloc(8)                   # retired: now its class's cache has it
    assert later.address == address
    for b in (*others, later):
        b.free()
    assert await rt.leaks_async() == {}


def test_buffers_freed_while_a_launch_uses_them_go_back_when_it_retires(rt):
    """Fresh buffers (no earlier work) as a launch's written and read arguments, and one named
    twice: each counts the launch as one user, so freeing any of them while it waits keeps the
    memory until it has retired, and then gives it back."""
    d0 = rt.devices[0]
    gate = Gate()
    held = gate.launch(d0)
    dst, src, both = d0.alloc(64), d0.alloc(64), d0.alloc(64)
    first = d0.launch(add_into, grid=(1,), block=(1,), args=(dst, src, 8), after=[held])
    second = d0.launch(add_into, grid=(1,), block=(1,), args=(both, both, 8), after=[held])
    for b in (dst, src, both):
        b.free()
    assert [b.released for b in (dst, src, both)] == [False, False, False]
    gate.open()
    assert first.wait(10) and second.wait(10)
    assert first.exception() is None and second.exception() is None
    for _ in range(1000):       # (retirement may follow completion on the waiter thread)
        if first.retired and second.retired:
            break
        threading.Event().wait(0.01)
    with rt.lock:
        assert [b.released for b in (dst, src, both)] == [True, True, True]
    assert rt.leaks() == {}


def test_retired_work_is_not_kept_by_the_buffers_it_used(rt):
    """Once a launch has retired, the buffers it read and wrote no longer refer to it (nor to
    the results it holds): readers leave as they retire, a successful writer too."""
    d0 = rt.devices[0]
    gate = Gate()
    held = gate.launch(d0)
    dst, src = d0.alloc(64), d0.alloc(64)
    futs = [d0.launch(add_into, grid=(1,), block=(1,), args=(o, src, 8), after=[held])
            for o in (dst, d0.alloc(64), d0.alloc(64))]
    assert len(src.reads) == 3 and dst.last_write is futs[0]
    gate.open()
    for f in futs:
        assert f.wait(10)
    for _ in range(1000):       # (retirement may follow completion on the waiter thread)
        if all(f.retired for f in futs):
            break
        threading.Event().wait(0.01)
    with rt.lock:
        assert src.reads == [] and dst.last_write is None


def test_concurrent_alloc_and_free_hand_out_each_piece_once(rt):
    d0 = rt.devices[0]
    seen: list[int] = []
    errors = []

    def worker():
        try:
            for _ in range(300):
                bufs = [d0.alloc(256) for _ in range(4)]
                seen.append(len({b.address for b in bufs}))
                for b in bufs:
                    b.free()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and set(seen) == {4}
    assert rt.leaks() == {}
