#!/usr/bin/env bash
# The CUDA bench under each hot path / GIL setting, the key figures side by side (device machine).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 -m aiogpu.cuda.build_hotc 2>&1 | tail -1
KEYS="floor_sync_us aiogpu_await_us_uvloop submit_us_aiogpu_launch_bindings submit_us_aiogpu_launch_c call_us_launch_raw_bindings aiogpu_ops_per_s_8 aiogpu_ops_per_s_64 stream_await_us torch_sync_floor_us"
for cfg in ${CONFIGS:-c_hold c_release bindings}; do
  case $cfg in
    c_hold) cfgenv="AIOGPU_CUDA_HOT=c";;
    c_release) cfgenv="AIOGPU_CUDA_HOT=c AIOGPU_HOTC_RELEASE_GIL=1";;
    bindings) cfgenv="AIOGPU_CUDA_HOT=bindings";;
  esac
  env $cfgenv timeout 200 python3 -m aiogpu bench --backend cuda ${BENCH_ARGS:-} --json "$OUT/bench_$cfg.json" > "$OUT/bench_$cfg.log" 2>&1
  python3 - "$OUT/bench_$cfg.json" "$cfg" $KEYS <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(sys.argv[2], " ".join(f"{k}={d.get(k, float('nan')):.2f}" for k in sys.argv[3:]))
PY
done
