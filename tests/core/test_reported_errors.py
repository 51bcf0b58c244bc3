"""What the hub reports when host code it runs raises: a done-callback run without a loop is
named, with the future it was called for; an event left for the waiter is named as such. Both
go to the ``aiogpu`` logger with the exception, and stop nothing else."""
from __future__ import annotations

import logging

from fakes.fake_hub import ManualHub


def boom(*args) -> None:
    raise ValueError("boom")


def test_a_raising_done_callback_is_reported_with_its_future(caplog):
    hub = ManualHub()
    fut = hub.new(1)
    seen = []
    fut.add_done_callback(boom)
    fut.add_done_callback(seen.append)
    with caplog.at_level(logging.ERROR, logger="aiogpu"):
        hub.complete(fut)
    assert seen == [fut]
    (record,) = [r for r in caplog.records if r.name == "aiogpu"]
    assert record.getMessage() == f"GPUFuture done-callback {boom!r} of {fut!r} raised"
    assert record.exc_info[0] is ValueError


def test_a_raising_waiter_event_is_reported_as_one(caplog):
    hub = ManualHub()
    ran = []
    hub.post_event(boom)
    hub.post_event(lambda: ran.append(1))
    with caplog.at_level(logging.ERROR, logger="aiogpu"):
        hub.stop()                       # (runs what was left for the waiter)
    assert ran == [1]
    (record,) = [r for r in caplog.records if r.name == "aiogpu"]
    assert record.getMessage() == f"waiter event {boom!r} failed"
    assert record.exc_info[0] is ValueError
