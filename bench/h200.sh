#!/usr/bin/env bash
# One device call on the H200: versions, the public-API and conformance tests on CUDA, the service
# benchmark, the CUDA microbenchmarks.
# Run from the repository root on the device machine with the carried wheels in .whl/ (see
# the device tool's README): results and logs go to $OUT (default ./out).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# the optional C hot path, built in place (no pip install here); without it aiogpu uses cuda-bindings
[[ ${BUILD_HOTC:-1} == 1 ]] && { python3 -m aiogpu.cuda.build_hotc 2>&1 | tail -3 | tee "$OUT/build_hotc.log"; }
# the compiled core (Cython, where the image has it), built in place; AIOGPU_PURE_CORE=1 runs it interpreted
[[ ${BUILD_CORE:-1} == 1 ]] && { python3 setup.py -q build_ext --inplace -j "$(nproc)" > "$OUT/build_core.log" 2>&1; tail -3 "$OUT/build_core.log"; }
# aiogpu's metadata in place, as an editable install writes it: the pytest plugin is registered by
# its entry point, and the plugin tests' child pytest finds it only there
python3 setup.py -q egg_info > "$OUT/egg_info.log" 2>&1 || tail -3 "$OUT/egg_info.log"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c 'import sys, cuda.bindings, numpy; print(sys.version); print("cuda-bindings", cuda.bindings.__version__, "numpy", numpy.__version__)'
  python3 -c 'import torch, cupy; print("torch", torch.__version__, "cupy", cupy.__version__)'
  python3 -c 'import trio, pytest_asyncio, uvloop; print("trio", trio.__version__, "pytest-asyncio", pytest_asyncio.__version__, "uvloop", uvloop.__version__)'
  python3 -c 'import aiogpu.cuda as c; print("probe", c.probe())'
  python3 -c 'import aiogpu.cuda.driver as D; print("hot path", D.HOT.name, "-", D.HOT_REASON)'
  python3 -c 'import aiogpu._core as C; print(C.summary())'
} 2>&1 | tee "$OUT/versions.txt"
STEPS=${STEPS:-"tests bench"}
if [[ $STEPS == *tests* ]]; then
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider --timeout 120 -rs \
    tests/api/test_backends.py tests/api/test_conformance.py tests/api/test_host_cost.py tests/api/test_issue13.py tests/api/test_dataloader.py tests/cuda_backend/test_stream_futures.py tests/api/test_compile_off_loop.py tests/cuda_backend/test_views_cuda.py tests/api/test_future_protocol.py ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/tests.log" | tail -40
fi
if [[ $STEPS == *serve* ]]; then
  timeout ${SERVE_TIMEOUT:-300} python3 bench/serve.py --backend cuda --duration ${SERVE_S:-5} \
    --repeat ${SERVE_REPEAT:-1} ${SERVE_ARGS:-} --json "$OUT/serve_h200.json" 2>&1 | tee "$OUT/serve.log"
fi
if [[ $STEPS == *fakedriver* ]]; then   # the service on the fake driver: aiogpu's host path in aiohttp, the GPU free
  # (The fake kernels compute nothing, so every answer reads as wrong: the rate is what counts.
  # Against this machine's serve run, it splits aiogpu's share of a request into the driver's
  # and its own; against host_only, its own and aiohttp's.)
  FAKE_LIB=$(python3 tests/fakes/libcuda/build_libcuda.py) && \
    LD_LIBRARY_PATH=$FAKE_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} PYTHONPATH=$PWD/tests/fakes:$PYTHONPATH \
    timeout ${SERVE_TIMEOUT:-300} python3 bench/serve.py --backend cuda --modes aiogpu --work trivial \
    --duration ${SERVE_S:-5} --repeat ${SERVE_REPEAT:-1} --json "$OUT/serve_fake_driver.json" 2>&1 | tee "$OUT/fakedriver.log"
fi
if [[ $STEPS == *torch_service* ]]; then   # issue 15's example: 64 clients, loop lag p99 < 5 ms
  timeout 180 python3 examples/torch_service.py --clients 64 --duration ${SERVE_S:-5} \
    --json "$OUT/torch_service_h200.json" 2>&1 | tee "$OUT/torch_service.log"
fi
if [[ $STEPS == *profile* ]]; then   # profiled separately: the profiler slows what it measures
  timeout 120 python3 bench/serve.py --backend cuda --modes aiogpu --duration 4 --profile "$OUT" 2>&1 | tee "$OUT/profile.log"
fi
if [[ $STEPS == *hot* ]]; then       # pyinstrument of submit, one awaiter, 64 awaiters
  timeout 180 python3 bench/profile_hot.py --backend cuda --out "$OUT" 2>&1 | tee "$OUT/hot.log"
fi
if [[ $STEPS == *bench* ]]; then
  timeout ${BENCH_TIMEOUT:-240} python3 -m aiogpu bench --backend cuda ${BENCH_ARGS:-} --json "$OUT/h200.json" 2>&1 | tee "$OUT/bench.log"
fi
if [[ $STEPS == *bindings* ]]; then   # the pure-Python fallback, for comparison with the default
  AIOGPU_CUDA_HOT=bindings timeout ${BENCH_TIMEOUT:-240} python3 -m aiogpu bench --backend cuda ${BENCH_ARGS:-} --json "$OUT/h200_bindings.json" 2>&1 | tee "$OUT/bench_bindings.log"
fi
