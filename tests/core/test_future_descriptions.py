"""What a future says about itself: its repr (label, where it runs, state) and the message of
the InvalidStateError that ``result()`` and ``exception()`` raise while it is pending."""
from __future__ import annotations

import pytest

import aiogpu
from aiogpu.errors import GPUError
from fakes.fake_hub import ManualHub


def test_the_repr_names_the_label_the_queue_and_the_state():
    hub = ManualHub()
    fut = hub.new(1)
    assert repr(fut) == "<GPUFuture op1 pending>"
    fut.queue = "gpu0.q1"
    assert repr(fut) == "<GPUFuture op1 on gpu0.q1 pending>"
    hub.complete(fut)
    assert repr(fut) == "<GPUFuture op1 on gpu0.q1 done>"
    failed = hub.new(2)
    with hub.lock:
        hub.fail(failed, GPUError("boom"))
    assert repr(failed) == "<GPUFuture op2 failed>"


def test_a_future_without_a_label_is_shown_as_a_question_mark():
    fut = ManualHub().new(1)
    fut.label = ""
    assert repr(fut) == "<GPUFuture ? pending>"


@pytest.mark.parametrize("ask", ["result", "exception"])
def test_asking_a_pending_future_for_its_outcome_names_it(ask):
    fut = ManualHub().new(1)
    with pytest.raises(aiogpu.InvalidStateError, match=r"^<GPUFuture op1 pending> is not done$"):
        getattr(fut, ask)()
