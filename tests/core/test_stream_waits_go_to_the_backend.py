"""``GPUFuture.wait_on(stream)`` hands the wait to the runtime that owns the future's hub (the
CUDA backend makes the stream wait on the device); a future of no runtime has nothing to wait
for, and raises its failure if it failed."""
from __future__ import annotations

import pytest

from aiogpu._core.futures import completed_future
from aiogpu.errors import GPUError
from fakes.fake_hub import ManualHub


class Owner:
    def __init__(self) -> None:
        self.calls: list = []

    def wait_on(self, fut, stream, *, device=None) -> None:
        self.calls.append((fut, stream, device))


def test_wait_on_is_handed_to_the_owner_with_the_stream_and_the_device():
    hub = ManualHub()
    hub.owner = owner = Owner()
    fut = hub.new(1)
    fut.wait_on("stream", device="gpu0")
    fut.wait_on("other")
    assert owner.calls == [(fut, "stream", "gpu0"), (fut, "other", None)]


def test_wait_on_a_future_of_no_runtime_returns_or_raises_its_failure():
    assert completed_future(None, "done").wait_on("stream") is None
    err = GPUError("it failed")
    with pytest.raises(GPUError) as info:
        completed_future(None, "failed", exc=err).wait_on("stream")
    assert info.value is err


def test_wait_on_a_future_of_a_hub_without_a_runtime_returns_or_raises_its_failure():
    hub = ManualHub()                       # (no runtime owns it)
    done, failed = hub.new(1), hub.new(2)
    hub.complete(done)
    err = GPUError("it failed")
    with hub.lock:
        hub.fail(failed, err)
    assert done.wait_on("stream") is None
    with pytest.raises(GPUError) as info:
        failed.wait_on("stream")
    assert info.value is err
