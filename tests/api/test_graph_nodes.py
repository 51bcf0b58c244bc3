"""What a graph node is: a place in a captured graph, not a future of work.

Inside ``with aiogpu.Graph()``, ``launch``/``copy``/``fill``/``gather`` return nodes. Nothing runs
until a replay, so every future-like use of a node (await, result, callbacks, asyncio bridges,
asyncio's helpers) raises one TypeError that says to await a replay; a node is accepted only in
``after=`` inside its capture and as a patch key of ``exe.launch``.
"""
from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

import aiogpu
from aiogpu.futures import GPUFuture
from backends import on_fake_cuda, run_on_fake_cuda
from gpu_kernels import add_const_n

N = 16
NOT_WORK = "a graph node is not work"


def _nodes(rt):
    """A launch, a copy, a fill and a join node of one capture (nothing runs)."""
    d0 = rt.devices[0]
    x, y = d0.alloc(N * 8), d0.alloc(N * 8)
    host = np.zeros(N, np.int64)
    with aiogpu.Graph() as g:
        launch = d0.launch(add_const_n, grid=(N,), block=(N,), args=(x, 1, N))
        copy = aiogpu.copy(y, x, after=[launch])
        fill = y.fill(0, after=copy)               # a single node as after= too
        down = aiogpu.copy(host, y, after=[fill])
        join = aiogpu.gather(launch, down)
    return g, (x, y, host), [launch, copy, fill, down, join]


SYNC_METHODS = [
    ("done", ()), ("cancelled", ()), ("cancel", ()), ("result", ()), ("exception", ()),
    ("wait", (0.01,)), ("add_done_callback", (lambda f: None,)),
    ("remove_done_callback", (lambda f: None,)), ("_submitted_work", ()), ("wait_on", (0,)),
]


def test_every_future_method_of_a_node_raises_one_clear_error(make_runtime):
    rt = make_runtime(gpus=1)
    g, _, nodes = _nodes(rt)
    for node in nodes:
        assert not isinstance(node, GPUFuture)
        assert not asyncio.isfuture(node)
        for name, args in SYNC_METHODS:
            with pytest.raises(TypeError, match=NOT_WORK):
                getattr(node, name)(*args)
        with pytest.raises(TypeError, match=NOT_WORK):
            node.get_loop()
    assert rt.hub.pending_count == 0


def test_a_done_callback_on_a_node_never_runs(make_runtime):
    """Before, the callback ran at once, as if the node had completed."""
    rt = make_runtime(gpus=1)
    _, _, nodes = _nodes(rt)
    called = []
    for node in nodes:
        with pytest.raises(TypeError, match=NOT_WORK):
            node.add_done_callback(called.append)
    exe = nodes[0].graph.instantiate()
    assert exe.launch().wait(20)
    assert called == []


def test_awaiting_a_node_or_its_asyncio_bridge_raises(make_runtime):
    """``await node`` and ``await node.asyncio()`` (which resolved with None before any replay)
    raise; ``asyncio.gather(node)`` and ``asyncio.wait`` fail at once instead of hanging."""
    rt = make_runtime(gpus=1)
    _, _, nodes = _nodes(rt)

    async def main():
        for node in nodes:
            with pytest.raises(TypeError, match=NOT_WORK):
                await node
            with pytest.raises(TypeError, match=NOT_WORK):
                node.asyncio()
            with pytest.raises(TypeError, match=NOT_WORK):
                await asyncio.wait_for(asyncio.gather(node), 20)
            with pytest.raises(TypeError, match=NOT_WORK):
                await asyncio.wait([node], timeout=20)
            with pytest.raises(TypeError, match=NOT_WORK):
                await asyncio.wait_for(node, 20)
            with pytest.raises(TypeError, match=NOT_WORK):
                await asyncio.wait_for(asyncio.shield(node), 20)
            with pytest.raises(TypeError, match=NOT_WORK):
                await asyncio.wait_for(asyncio.ensure_future(node), 20)
            with pytest.raises(TypeError, match=NOT_WORK):
                for first in asyncio.as_completed([node], timeout=20):
                    await first
    asyncio.run(main())
    assert rt.hub.pending_count == 0


def test_a_capture_inside_a_task_group_adds_no_work_to_it(make_runtime):
    """A TaskGroup waits for the work submitted in it: nodes are none (it exits at once), a
    replay launched in it is."""
    rt = make_runtime(gpus=1)
    d0 = rt.devices[0]
    x = d0.alloc(N * 8)

    async def main():
        async with aiogpu.TaskGroup() as tg:
            assert aiogpu.copy(x, np.zeros(N, np.int64)) in tg.submitted
            with aiogpu.Graph() as g:
                d0.launch(add_const_n, grid=(N,), block=(N,), args=(x, 1, N))
            assert len(tg.submitted) == 1
            replay = g.instantiate().launch()
            assert replay in tg.submitted
        assert replay.done() and replay.exception() is None
    asyncio.run(main())


def test_to_numpy_inside_a_capture_is_refused(make_runtime):
    """A captured ``to_numpy`` would hand back an array that nothing fills until a replay (and
    that every replay overwrites): inside a capture, copy into an array of your own."""
    rt = make_runtime(gpus=1)
    d0 = rt.devices[0]
    x = d0.alloc(N * 8)
    assert aiogpu.copy(x, np.full(N, 7, np.int64)).wait(20)
    with aiogpu.Graph() as g:
        d0.launch(add_const_n, grid=(N,), block=(N,), args=(x, 1, N))
        with pytest.raises(TypeError, match="aiogpu.copy"):
            x.to_numpy(np.int64)
    assert len(g.nodes) == 1


def test_a_node_stays_usable_in_after_and_as_a_patch_key(make_runtime):
    """What a node is for: ``after=`` inside its capture, a key of ``exe.launch(args=...)``;
    replays compute what the graph says."""
    rt = make_runtime(gpus=1)
    g, (x, y, host), nodes = _nodes(rt)
    launch = nodes[0]
    assert aiogpu.copy(x, np.zeros(N, np.int64)).wait(20)
    exe = g.instantiate()
    assert exe.launch().wait(20)
    assert (host == 0).all()                     # the fill after the copy: zeros arrive
    assert exe.launch(args={launch: (x, 5, N)}).wait(20)
    out = x.to_numpy(np.int64)
    assert out.wait(20) and (out.result() == 6).all()
    with pytest.raises(ValueError, match="outside its capture"):
        rt.devices[0].launch(add_const_n, grid=(N,), block=(N,), args=(x, 1, N), after=[launch])
    with pytest.raises(ValueError, match="outside its capture"):
        aiogpu.gather(launch)


def test_a_node_in_after_of_another_graph_is_refused(make_runtime):
    rt = make_runtime(gpus=1)
    _, (x, _, _), nodes = _nodes(rt)
    with aiogpu.Graph():
        with pytest.raises(ValueError, match="same graph"):
            rt.devices[0].launch(add_const_n, grid=(N,), block=(N,), args=(x, 1, N), after=[nodes[0]])


def test_a_node_is_refused_from_a_thread_and_from_trio(make_runtime):
    """The refusal is the same whatever calls it: a plain thread (where ``wait`` blocked nothing
    before: it raised a RuntimeError of its own) and trio (through anyio)."""
    trio = pytest.importorskip("trio")
    rt = make_runtime(gpus=1)
    _, _, nodes = _nodes(rt)
    seen = []

    def in_thread():
        for node in nodes:
            try:
                node.wait(0.01)
            except TypeError as exc:
                seen.append(NOT_WORK in str(exc))
    t = threading.Thread(target=in_thread)
    t.start()
    t.join(20)
    assert seen == [True] * len(nodes)

    async def under_trio():
        for node in nodes:
            with pytest.raises(TypeError, match=NOT_WORK):
                await node
    trio.run(under_trio)


@on_fake_cuda
def test_cuda_capture_returns_the_same_nodes():
    """The CUDA backend records into the same capture: its nodes refuse the same way and replay."""
    got = run_on_fake_cuda("""
import asyncio, numpy as np, aiogpu
from gpu_kernels import add_const_n
rt = aiogpu.Runtime("cuda")
d0 = rt.devices[0]
x = d0.alloc(128)
with aiogpu.Graph() as g:
    node = d0.launch(add_const_n, grid=(16,), block=(16,), args=(x, 1, 16))
errors = []
for call in (lambda: node.done(), lambda: node.result(), lambda: node.add_done_callback(print),
             lambda: node.wait(0.01)):
    try:
        call()
    except TypeError as exc:
        errors.append("a graph node is not work" in str(exc))
async def main():
    try:
        await asyncio.wait_for(asyncio.gather(node), 20)
    except TypeError as exc:
        errors.append("a graph node is not work" in str(exc))
    await g.instantiate().launch(args={node: (x, 2, 16)})
asyncio.run(main())
print("ok", errors, asyncio.isfuture(node))
rt.close()
""")
    assert got.returncode == 0, got.stdout + got.stderr
    assert "ok [True, True, True, True, True] False" in got.stdout, got.stdout + got.stderr
