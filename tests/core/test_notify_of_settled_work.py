"""``GPUFuture._notify(port, fn)``, the core's own completion hook (a TaskGroup hears of its
futures through it, deferred work of the work it was submitted as): ``fn(fut)`` runs once the
future has settled, and at once (inline without a port, else posted to it) when it has settled
already: settling may win the race with the registration, since it needs no lock."""
from __future__ import annotations

from fakes.fake_hub import ManualHub


class Port:
    def __init__(self) -> None:
        self.posted: list = []

    def post(self, batch) -> None:
        self.posted.extend(batch)


def test_notify_of_a_settled_future_runs_at_once_without_a_port():
    hub = ManualHub()
    fut = hub.new(1)
    hub.complete(fut)
    seen = []
    fut._notify(None, seen.append)
    assert seen == [fut]


def test_notify_of_a_settled_future_is_posted_to_its_port():
    hub = ManualHub()
    fut = hub.new(1)
    hub.complete(fut)
    seen, port = [], Port()
    fut._notify(port, seen.append)
    assert seen == [] and len(port.posted) == 1
    port.posted[0].run()
    assert seen == [fut]


def test_notify_of_a_pending_future_runs_once_it_settles():
    hub = ManualHub()
    fut = hub.new(1)
    seen = []
    fut._notify(None, seen.append)
    assert seen == []
    hub.complete(fut)
    assert seen == [fut]
