"""Host cost of the common launch on the fake CUDA driver, counted in Python-level calls (not
time): a launch of a shape launched before, with plain arguments, runs as compiled code (the
core's ``submit.launch_plain`` and the backend's ``cuda/encode.py``) but for a few calls. The
count leaves out the modules that are compiled (those with a ``.pxd``), so it is the same
whether they run compiled or, where they are not built, interpreted."""
from __future__ import annotations

import json

from backends import run_on_fake_cuda

SCRIPT = r"""
import json, os, sys
import aiogpu
import aiogpu._core as core

PKG = os.path.dirname(aiogpu.__file__) + os.sep
TYPED = {core.source_base(n) + ".py" for n in core.module_names() if os.path.exists(core.source_base(n) + ".pxd")}
rt = aiogpu.Runtime("cuda")
d0 = rt.devices[0]
k = aiogpu.kernel("u32", cuda='extern "C" __global__ void noop(unsigned n) {}', name="noop")(lambda launch, n: None)
kb = aiogpu.kernel("f32*, const f32*, u32", cuda='extern "C" __global__ void k2(float* a, const float* b, unsigned n) {}',
                   name="k2")(lambda launch, a, b, n: None)
x, y = d0.alloc(4096), d0.alloc(4096)
out = {}
for name, launch in (("scalars", lambda: d0.launch(k, (1,), (1,), (0,))),
                     ("buffers", lambda: d0.launch(kb, (1,), (1,), (x, y, 0)))):
    launch().wait(30)                     # compiled, loaded, the shape validated
    for _ in range(20):
        launch()
    calls = []

    def prof(frame, event, arg):
        if event == "call":
            f = frame.f_code.co_filename
            if f.startswith(PKG) and f not in TYPED:
                calls.append(f[len(PKG):] + ":" + frame.f_code.co_name)

    n = 50
    sys.setprofile(prof)
    futs = [launch() for _ in range(n)]
    sys.setprofile(None)
    futs[-1].wait(30)
    out[name] = (len(calls) / n, sorted(set(calls)))
print(json.dumps(out))
rt.close()
"""


def test_a_plain_launch_makes_few_python_calls_outside_the_compiled_modules():
    proc = run_on_fake_cuda(SCRIPT)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for shape, (per_launch, names) in got.items():
        # Device.launch, and the hub's future key and watch (cuda/waiter.py); the general path
        # (check_args, _launch_shape, guarded, the CUDA encode's helpers) took 20 and more.
        assert per_launch <= 6, (shape, per_launch, names)
        assert not any(n.endswith((":check_args", ":_launch_shape", ":_current_capture", ":_encode_kernel",
                                   ":_completed_on_lane", ":_wait_on_device")) for n in names), (shape, names)
