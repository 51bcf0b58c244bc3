"""Issue 15's stream-await figures alone (the same code as ``aiogpu bench``): one JSON line."""
import json
import sys

import aiogpu
from aiogpu.cli import bench_cuda

rt = aiogpu.Runtime(backend="cuda")
res = bench_cuda.torch_stream_costs(rt, int(sys.argv[1]) if len(sys.argv) > 1 else 2000)
res["stream_await_over_torch_floor"] = res["stream_await_us"] / res["torch_sync_floor_us"]
res["torch_executor_over_stream_await"] = res["torch_executor_await_us"] / res["stream_await_us"]
print(json.dumps(res))
rt.close()
