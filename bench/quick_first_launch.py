"""Issue 15's first-launch loop stall alone (the same code as ``aiogpu bench``), ``n`` times."""
import json
import sys

import aiogpu
from aiogpu.cli import bench_cuda

rt = aiogpu.Runtime(backend="cuda")
for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 3):
    print(json.dumps(bench_cuda.first_launch_stall(rt.devices[0])))
rt.close()
