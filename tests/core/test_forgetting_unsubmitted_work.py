"""``FutureHub.discard``: a future whose work was never submitted is forgotten whole: it stops
being watched, and every completion key it held (its own and those its work would have named)
is released for reuse."""
from __future__ import annotations

from fakes.fake_hub import ManualHub


class KeyHub(ManualHub):
    """Records the completion keys retained and released."""

    def __init__(self) -> None:
        super().__init__()
        self.retained: list = []
        self.released: list = []

    def retain_key(self, key: int) -> None:
        self.retained.append(key)

    def release_key(self, key: int) -> None:
        self.released.append(key)


def test_discard_releases_the_keys_the_work_would_have_named_and_its_own():
    hub = KeyHub()
    earlier, later = hub.new(7), hub.new(8)
    fut = hub.new(9)
    with hub.lock:
        hub.depend(fut, earlier)
        hub.depend(fut, later, semantic=False)
    assert hub.retained == [7, 8]
    with hub.lock:
        hub.discard(fut)
    assert sorted(hub.released) == [7, 8, 9]
    assert fut.signal == 0 and fut.retired


def test_discard_of_a_watched_future_stops_watching_it():
    hub = KeyHub()
    kept, fut = hub.new(3), hub.new(4)
    assert hub.pending_count == 2
    with hub.lock:
        hub.discard(fut)
    assert hub.pending_futures() == [kept]
    assert hub.released == [4]
    # A completion read for the forgotten key settles nothing.
    hub._settle([(4, fut)])
    assert not fut.done()
