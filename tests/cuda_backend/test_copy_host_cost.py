"""What a copy costs on the host beyond its driver calls: nothing that grows with the kernels'
sources. (Every copy asks whether the built-in copy kernel still needs compiling, for the
shader-copy fallback; that question hashed the kernel's whole CUDA source each time, about a
tenth of a service request's instructions.)"""
from __future__ import annotations

from backends import on_fake_cuda, run_on_fake_cuda

SCRIPT = r"""
import hashlib
import numpy as np
calls = [0]
real = hashlib.sha256
def counting(*args, **kwargs):
    calls[0] += 1
    return real(*args, **kwargs)
hashlib.sha256 = counting
import aiogpu
rt = aiogpu.Runtime()
dev = rt.devices[0]
host = np.arange(256, dtype=np.float32)
x = dev.alloc(host.nbytes)
aiogpu.copy(x, host).wait(10)            # (warm: pools, lanes)
assert (x.to_numpy(np.float32).wait(10), True)
before = calls[0]
for _ in range(20):
    aiogpu.copy(x, host).wait(10)
    out = x.to_numpy(np.float32)
    out.wait(10)
    assert (out.result() == host).all()
print("hashes", calls[0] - before)
rt.close()
"""


@on_fake_cuda
def test_copies_hash_no_kernel_source():
    proc = run_on_fake_cuda(SCRIPT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[-2:] == ["hashes", "0"], proc.stdout
