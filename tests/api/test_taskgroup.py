"""aiogpu.TaskGroup: GPU work submitted inside the group is part of it. A failure of that work
fails the group (cancelling the siblings) even when nobody awaits the future; a failure that a
task awaited and handled is that task's business."""
from __future__ import annotations

import anyio
import pytest

import aiogpu
from gpu_kernels import Gate, fail_if


def gpu_errors(exc: BaseException) -> list[BaseException]:
    """The GPUErrors inside a (possibly nested) exception group."""
    if isinstance(exc, BaseExceptionGroup):
        return [e for sub in exc.exceptions for e in gpu_errors(sub)]
    return [exc] if isinstance(exc, aiogpu.GPUError) else []


async def unawaited_failure_cancels_the_sibling(rt):
    d0 = rt.devices[0]
    finished = []

    async def sibling():
        await anyio.sleep(3)
        finished.append("sibling")

    with pytest.raises(BaseExceptionGroup) as info:
        async with aiogpu.TaskGroup() as tg:
            tg.start_soon(sibling)
            bad = d0.launch(fail_if, grid=(1,), block=(1,), args=(d0.alloc(4), 1))   # never awaited
    assert gpu_errors(info.value) and gpu_errors(info.value)[0] is bad.exception()
    assert finished == [], "the sibling ran to its end: the failure did not cancel it"


async def failure_of_a_task_s_unawaited_work_fails_the_group(rt):
    d0 = rt.devices[0]

    async def submit_and_return():
        d0.launch(fail_if, grid=(1,), block=(1,), args=(d0.alloc(4), 1))

    with pytest.raises(BaseExceptionGroup) as info:
        async with aiogpu.TaskGroup() as tg:
            tg.start_soon(submit_and_return)
            tg.start_soon(anyio.sleep, 3)
    assert len(gpu_errors(info.value)) == 1


async def failure_after_the_body_fails_the_group_at_exit(rt):
    d0, d1 = rt.devices
    gate = Gate()
    with pytest.raises(BaseExceptionGroup) as info:
        async with aiogpu.TaskGroup() as tg:
            held = gate.launch(d1)
            late = d0.launch(fail_if, grid=(1,), block=(1,), args=(d0.alloc(4), 1), after=[held])
            with anyio.CancelScope(shield=True):
                await anyio.sleep(0.05)
            gate.open()                  # the body ends while ``late`` is still pending
    assert gpu_errors(info.value) == [late.exception()]
    assert all(f.done() for f in tg.submitted)


async def handled_failure_is_not_the_group_s(rt):
    d0 = rt.devices[0]
    handled = []

    async def awaits_and_handles():
        try:
            await d0.launch(fail_if, grid=(1,), block=(1,), args=(d0.alloc(4), 1))
        except aiogpu.GPUError as exc:
            handled.append(exc)

    async def succeeds_unawaited():
        d0.launch(fail_if, grid=(1,), block=(1,), args=(d0.alloc(4), 0))

    async with aiogpu.TaskGroup() as tg:
        tg.start_soon(awaits_and_handles)
        tg.start_soon(succeeds_unawaited)
    assert len(handled) == 1 and all(f.done() for f in tg.submitted)


SCENARIOS = [unawaited_failure_cancels_the_sibling, failure_of_a_task_s_unawaited_work_fails_the_group,
             failure_after_the_body_fails_the_group_at_exit, handled_failure_is_not_the_group_s]


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.__name__)
def test_task_group(rt, scenario, backend):
    anyio.run(scenario, rt, backend=backend)
