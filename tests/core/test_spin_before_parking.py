"""The hub's default spin (``Hub.spin``, ``Hub.spin_await``; the HSA backend uses it): while
one future is awaited, poll its completion on the loop for up to ``spin_s`` seconds, yielding
between polls; settle it there once it reads complete; stop at the deadline or as soon as a
second future is awaited. Driven by hand here, with a clock the test sets."""
from __future__ import annotations

import asyncio
import types

import pytest

from aiogpu._core import hub as hub_module
from fakes.fake_hub import ManualHub


class PollHub(ManualHub):
    """Its completion reads complete from the ``after``-th poll on (never with ``after`` 0)."""

    def __init__(self, after: int, spin_s: float = 10.0) -> None:
        super().__init__(spin_s=spin_s)
        self.after, self.polls = after, 0

    def is_complete(self, key: int) -> bool:
        assert key in (1, 2)
        self.polls += 1
        return self.after != 0 and self.polls >= self.after


def steps(gen, limit: int = 20) -> tuple[int, object]:
    """Run a spin generator to its end (at most ``limit`` yields): (yields, its return value)."""
    n = 0
    while n < limit:
        try:
            next(gen)
        except StopIteration as stop:
            return n, stop.value
        n += 1
    return n, "did not end"


def test_the_spin_settles_the_future_on_the_loop_once_it_reads_complete():
    hub = PollHub(after=3)
    fut = hub.new(1)
    hub.awaiting = 1
    assert steps(hub.spin(fut)) == (2, None)
    assert hub.polls == 3 and fut.done() and fut.result() is None


def test_spin_await_spins_and_leaves_the_result_to_the_awaiter():
    hub = PollHub(after=2)
    fut = hub.new(1)
    hub.awaiting = 1
    # False: it did not leave a success for the awaiter to take without result().
    assert steps(hub.spin_await(fut)) == (1, False)
    assert fut.done()


def test_the_spin_stops_at_its_deadline(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(hub_module, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    hub = PollHub(after=0, spin_s=1.0)
    fut = hub.new(1)
    hub.awaiting = 1
    gen = hub.spin(fut)
    next(gen)                           # the deadline is 101.0; polled once
    now[0] = 100.5
    next(gen)                           # polled again, before the deadline
    now[0] = 101.0                      # the deadline itself: no more polls
    assert steps(gen) == (0, None)
    assert hub.polls == 2 and hub.pending_count == 1     # (not settled)


def test_the_spin_stops_once_a_second_future_is_awaited():
    hub = PollHub(after=0)
    fut = hub.new(1)
    hub.awaiting = 1
    gen = hub.spin(fut)
    next(gen)
    hub.awaiting = 2
    assert steps(gen) == (0, None)
    assert hub.polls == 1 and hub.pending_count == 1     # (not settled)


@pytest.mark.parametrize("awaiting", [0, 2])
def test_no_spin_unless_exactly_one_future_is_awaited(awaiting):
    hub = PollHub(after=1)
    fut = hub.new(1)
    hub.awaiting = awaiting
    assert steps(hub.spin(fut)) == (0, None)
    assert hub.polls == 0 and hub.pending_count == 1


# -- the await around it (GPUFuture.__await__ on asyncio) ------------------------------------------
def count_calls(monkeypatch, cls, name: str) -> list:
    calls: list = []
    original = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        calls.append(kwargs or args)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, wrapper)
    return calls


async def _await(fut):
    return await fut


def run_bounded(coro):
    """Run ``coro`` on asyncio; a hang (an await parked on a hub that has no waiter) fails."""
    async def main():
        return await asyncio.wait_for(coro, 10)
    return asyncio.run(main())


def test_an_await_settled_by_the_spin_parks_not_and_takes_its_turn_slot(monkeypatch):
    from aiogpu import _loops
    # (The port is an extension type where the loop bridge is compiled: its methods cannot be
    # wrapped there; the interpreted run, which mutation testing uses, checks the turn slot.)
    try:
        admit = count_calls(monkeypatch, _loops.AsyncioPort, "admit")
    except TypeError:
        admit = None
    hub = PollHub(after=2)
    fut = hub.new(1)
    assert run_bounded(_await(fut)) is None
    assert hub.polls == 2 and fut._ports is None       # spun, never registered
    assert admit is None or admit == [(False,)]        # took a slot of this turn, not as woken


def test_an_await_does_not_spin_while_another_is_awaited():
    hub = PollHub(after=1)
    fut = hub.new(1)
    hub.awaiting = 1                     # (another future is being awaited)

    async def main():
        task = asyncio.create_task(_await(fut))
        for _ in range(5):
            await asyncio.sleep(0)
        parked = sum(map(len, (fut._ports or {}).values()))
        hub.complete(fut)
        await task
        return parked

    assert run_bounded(main()) == 1 and hub.polls == 0


class SeenHub(PollHub):
    """Its spin sees the work complete on the device and leaves settling it to the waiter (as
    the CUDA backend's does): the awaiter then takes the value without parking."""

    def spin_await(self, fut):
        yield
        fut.value = "the value"
        return True


def test_an_await_whose_spin_saw_the_work_done_returns_the_value_without_parking():
    hub = SeenHub(after=0)
    fut = hub.new(1)
    assert run_bounded(_await(fut)) == "the value"
    assert fut._ports is None


def test_awaits_one_after_another_each_spin():
    hub = PollHub(after=2)
    first, second = hub.new(1), hub.new(2)

    async def main():
        await first
        hub.polls = 0                    # (the second completes at its own second poll)
        await second

    run_bounded(main())
    assert first._ports is None and second._ports is None and hub.awaiting == 0
