#!/usr/bin/env bash
# py-spy of the service benchmark's server (all threads, GIL-holding samples and all samples).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
SPY=/tmp/site/bin/py-spy; [ -x $SPY ] || SPY=$(ls /tmp/site/*/py-spy 2>/dev/null | head -1)
echo "spy: $SPY"
python3 -m aiogpu.cuda.build_hotc 2>&1 | tail -1      # the C hot path and the compiled core, as bench/h200.sh builds them
python3 setup.py -q build_ext --inplace > "$OUT/build_core.log" 2>&1 || tail -3 "$OUT/build_core.log"
python3 -c 'import aiogpu._core as C; print(C.summary())'
MODE=${MODE:-aiogpu}; WORK=${WORK:-trivial}
for gil in "" "--gil"; do
  tag=${gil:+gil}; tag=${tag:-all}
  # SPY_ARGS=--native adds the C frames (the driver's share of a request); native unwinding at
  # 500 Hz slowed the H100 server about 25x (211 req/s against 5,524): compare shares, not rates,
  # or lower SPY_RATE
  timeout 120 $SPY record $gil ${SPY_ARGS:-} --threads --subprocesses --rate ${SPY_RATE:-500} --format raw -o "$OUT/spy_${MODE}_${WORK}_$tag.txt" -- \
    python3 bench/serve.py --backend cuda --modes $MODE --work $WORK --repeat 1 --duration ${SERVE_S:-5} 2>&1 | tail -5
done
