"""The common allocation (a small int size whose size class has a cached piece) is one compiled
call, ahead of ``Device.alloc``'s validation: it must keep every rule of the general path. A
closed runtime hands out nothing, tracked allocations record where they were made, and the
pinned blocks that small uploads are staged in, and that ``to_numpy`` arrays live in, go back
to the pool."""
from __future__ import annotations

import gc

import numpy as np
import pytest

import aiogpu
from backends import wait_until


def test_a_cached_piece_is_not_handed_out_after_close(make_any):
    rt = make_any()
    dev = rt.devices[0]
    dev.alloc(1024).free()                  # (its piece waits in the size class's cache)
    rt.close()
    with pytest.raises(aiogpu.RuntimeClosedError):
        dev.alloc(1024)


def test_an_allocation_from_the_cache_is_tracked_where_it_was_made(make_any):
    rt = make_any()
    dev = rt.devices[0]
    dev.alloc(1024).free()
    rt.track_allocations = 4
    buf = dev.alloc(1024)                   # (the cached piece)
    assert buf.allocated_at is not None
    assert any(frame.filename == __file__ for frame in buf.allocated_at)
    rt.track_allocations = 0
    untracked = dev.alloc(2048)
    assert untracked.allocated_at is None
    buf.free()
    untracked.free()


@pytest.mark.parametrize("size", [True, 1.5, 0, -4, np.int64(512)])
def test_what_the_cache_does_not_take_goes_through_the_checks(make_any, size):
    rt = make_any()
    dev = rt.devices[0]
    dev.alloc(512).free()
    if type(size) is np.int64:
        buf = dev.alloc(size)               # (a NumPy integer is a byte count: the general path)
        assert type(buf.nbytes) is int and buf.nbytes == 512
        buf.free()
    else:
        with pytest.raises((TypeError, ValueError)):
            dev.alloc(size)


@pytest.mark.asyncio
async def test_staged_uploads_and_downloads_give_their_pinned_blocks_back(make_any):
    rt = make_any()
    dev = rt.devices[0]
    buf = dev.alloc(1024)
    host = np.arange(256, dtype=np.float32)
    for _ in range(5):
        await aiogpu.copy(buf, host)        # (a small host source: staged in a pinned block)
        out = await buf.to_numpy(np.float32)
        assert (out == host).all()
    del out
    gc.collect()
    assert wait_until(lambda: rt.stats() is not None and rt.pinned.blocks_in_use == 0), rt.pinned.blocks_in_use
    buf.free()
