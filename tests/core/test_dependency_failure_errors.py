"""The error a future fails with when work it depends on fails (``Hub.fail`` spreading to the
dependents): it names the dependent and its cause, carries the cause's ``status`` (None when the
cause has none), the dependent's own ``queue`` and ``packet``, and has the cause as
``__cause__``."""
from __future__ import annotations

from aiogpu.errors import GPUError
from fakes.fake_hub import ManualHub


def failed_dependent(cause: BaseException) -> BaseException:
    hub = ManualHub()
    root, dep = hub.new(1), hub.new(2)
    dep.queue, dep.packet = "gpu0.q1", 5
    with hub.lock:
        hub.depend(dep, root)
        hub.fail(root, cause)
    assert dep.done()
    return dep.exception()


def test_a_dependents_error_carries_the_status_and_its_own_queue_and_packet():
    cause = GPUError("the kernel faulted", status=0x1016, queue="gpu0.q0", packet=3)
    err = failed_dependent(cause)
    assert type(err) is GPUError
    assert str(err) == "op2: a dependency failed (op1: the kernel faulted)"
    assert (err.status, err.queue, err.packet) == (0x1016, "gpu0.q1", 5)
    assert err.__cause__ is cause


def test_a_cause_without_a_status_gives_none():
    err = failed_dependent(RuntimeError("a host step failed"))
    assert err.status is None and (err.queue, err.packet) == ("gpu0.q1", 5)
