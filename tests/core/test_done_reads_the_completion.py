"""``GPUFuture.done()`` of pending work reads the work's completion itself (the hub's
``observe``), so it is current without the waiter: it settles the future as soon as its
completion reads complete, but never inside this thread's own section of the runtime's lock
(a submission in progress must not see its work settle under it)."""
from __future__ import annotations

from fakes.fake_hub import ManualHub


class ReadHub(ManualHub):
    """The completions of the keys in ``complete`` read complete; every read is recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.complete_keys: set = set()
        self.reads: list = []

    def is_complete(self, key: int) -> bool:
        self.reads.append(key)
        return key in self.complete_keys


def test_done_settles_a_future_whose_completion_reads_complete():
    hub = ReadHub()
    fut, other = hub.new(1), hub.new(2)
    assert not fut.done() and hub.reads == [1]
    hub.complete_keys.add(1)
    assert fut.done() and fut.result() is None
    assert hub.reads == [1, 1]
    assert hub.pending_futures() == [other]         # settled and retired


def test_done_inside_the_lock_reads_nothing():
    hub = ReadHub()
    fut = hub.new(1)
    hub.complete_keys.add(1)
    with hub.lock:
        assert not fut.done()
    assert hub.reads == []
    assert fut.done()
