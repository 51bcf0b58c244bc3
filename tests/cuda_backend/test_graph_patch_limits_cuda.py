"""A patched grid of a CUDA graph replay is checked against CUDA's limits, as a launch's is."""
from __future__ import annotations

from backends import on_fake_cuda, run_on_fake_cuda


@on_fake_cuda
def test_a_cuda_replays_patched_grid_is_checked_against_cudas_grid_limits():
    got = run_on_fake_cuda("""
import numpy as np, aiogpu
from gpu_kernels import add_const_n
rt = aiogpu.Runtime("cuda")
d0 = rt.devices[0]
x = d0.alloc(256)
assert aiogpu.copy(x, np.zeros(32, np.int64)).wait(20)
with aiogpu.Graph() as g:
    node = d0.launch(add_const_n, grid=(16,), block=(16,), args=(x, 1, 16))
with g.instantiate() as exe:
    print("patched:", exe.launch(grid={node: (32,)}, block={node: (16,)}).wait(20))
    try:
        exe.launch(grid={node: (1, 1 << 20)}, block={node: (1, 1)})
    except ValueError as e:
        print("refused:", "grid" in str(e), e)
rt.close()
""")
    assert got.returncode == 0, got.stdout + got.stderr
    assert "patched: True" in got.stdout and "refused: True" in got.stdout, got.stdout + got.stderr
