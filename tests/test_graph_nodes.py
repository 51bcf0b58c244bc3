"""What a captured operation (a graph node) is outside a replay: named by its operation (its
replays' futures and errors carry that name), and never done."""
from __future__ import annotations

import aiogpu
from gpu_kernels import add_const_n

N = 16


def test_a_graph_node_is_named_by_its_operation_and_is_never_done(make_runtime):
    rt = make_runtime(gpus=1)
    d0 = rt.devices[0]
    x, y = d0.alloc(N * 8), d0.alloc(N * 8)
    with aiogpu.Graph():
        launch = d0.launch(add_const_n, grid=(N,), block=(N,), args=(x, 1, N))
        copy = aiogpu.copy(y, x)
        join = aiogpu.gather(launch, copy)
    nodes = [launch, copy, join]
    assert [n.label for n in nodes] == [f"add_const_n@{d0.name}", "copy", "gather"]
    assert not any(n.done() for n in nodes)
