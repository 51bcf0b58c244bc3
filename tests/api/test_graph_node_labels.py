"""A captured node is named by its operation (its repr, its replays' node futures and their
errors carry that name)."""
from __future__ import annotations

import aiogpu
from gpu_kernels import add_const_n

N = 16


def test_a_graph_node_is_named_by_its_operation(make_runtime):
    rt = make_runtime(gpus=1)
    d0 = rt.devices[0]
    x, y = d0.alloc(N * 8), d0.alloc(N * 8)
    with aiogpu.Graph():
        launch = d0.launch(add_const_n, grid=(N,), block=(N,), args=(x, 1, N))
        copy = aiogpu.copy(y, x)
        join = aiogpu.gather(launch, copy)
    assert [n.label for n in (launch, copy, join)] == [f"add_const_n@{d0.name}", "copy", "gather"]
