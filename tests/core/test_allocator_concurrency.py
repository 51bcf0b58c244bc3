"""The buddy allocator's free-list cache is shared by ``alloc`` (under the runtime lock) and
``take_cached`` (any thread, no lock): a piece taken by one is never handed out by the other, and
neither raises when the other empties the list between its look and its take."""
from __future__ import annotations

import threading

from aiogpu.memory import BLOCK, BuddyAllocator


def _allocator() -> BuddyAllocator:
    blocks = iter(range(BLOCK, 1 << 40, BLOCK))
    return BuddyAllocator(lambda: next(blocks), lambda addr: None)


class _RacedList(list):
    """A cache list whose first use (a truth test, its length or a pop) lets another thread take
    from it first: ``take_cached`` running on a thread of its own just after the caller looked
    (or just before it pops)."""

    def __init__(self, items, race):
        super().__init__(items)
        self._race = race

    def _look(self):
        race, self._race = self._race, None
        if race is not None:
            thread = threading.Thread(target=race)
            thread.start()
            thread.join()

    # What the caller saw is the length before the other thread took its piece.
    def __bool__(self):
        seen = super().__len__() > 0
        self._look()
        return seen

    def __len__(self):
        seen = super().__len__()
        self._look()
        return seen

    def pop(self, *args):
        self._look()
        return super().pop(*args)


def test_alloc_survives_take_cached_emptying_the_cache_from_another_thread():
    alloc = _allocator()
    first = alloc.alloc(1024)
    alloc.free(first)                       # cached: the next request of its class takes it back
    order = alloc.order_for(1024)
    taken = []
    alloc._cache[order] = _RacedList(alloc._cache[order], lambda: taken.append(alloc.take_cached(1024)))
    got = alloc.alloc(1024)                 # the old code: IndexError (pop from empty list)
    assert taken == [first]                 # the other thread got the cached piece ...
    assert got != first                     # ... and alloc a fresh one, not the same piece twice
    assert alloc.used == 2


def test_flush_survives_take_cached_emptying_the_cache_from_another_thread():
    alloc = _allocator()
    pieces = [alloc.alloc(4096) for _ in range(2)]
    for p in pieces:
        alloc.free(p)
    order = alloc.order_for(4096)
    taken = []
    alloc._cache[order] = _RacedList(alloc._cache[order],
                                         lambda: taken.extend([alloc.take_cached(4096), alloc.take_cached(4096)]))
    alloc.flush()
    assert sorted(taken) == sorted(pieces) and alloc.used == 2
    for p in taken:                         # both still usable and freeable exactly once
        alloc.free(p)
    alloc.flush()
    assert alloc.used == 0 and alloc.blocks == 0


def test_threads_taking_and_allocating_never_share_a_piece():
    """Many rounds of two threads at a barrier, one in ``take_cached`` and one in ``alloc``,
    over a cache of one piece: each round hands every piece out once, and nothing raises."""
    alloc = _allocator()
    lock = threading.Lock()                 # the runtime lock, which alloc and free run under
    errors: list[BaseException] = []
    for _ in range(300):
        with lock:
            p = alloc.alloc(512)
            alloc.free(p)                   # cached
        got: list = [None, None]
        barrier = threading.Barrier(2)

        def taker():
            barrier.wait()
            got[0] = alloc.take_cached(512)

        def allocator():
            barrier.wait()
            try:
                with lock:
                    got[1] = alloc.alloc(512)
            except BaseException as exc:    # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=taker), threading.Thread(target=allocator)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        handed = [a for a in got if a is not None]
        assert len(set(handed)) == len(handed) == 2 - got.count(None)
        with lock:
            for a in handed:
                alloc.free(a)
    with lock:
        alloc.flush()
    assert alloc.used == 0
