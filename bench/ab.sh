#!/usr/bin/env bash
# One device call comparing this tree with an older one (A/B in one call: the machines differ
# between calls): the service benchmark in alternating rounds (old, new, old, new, ...), host
# cost per operation on the real driver for both, the service's peers once, and h200.sh's steps
# for this tree: FIRST_STEPS before (it builds this tree), LAST_STEPS after the comparison.
#
#   git archive OLD_COMMIT aiogpu bench setup.py pyproject.toml tests/fakes | gzip > ab_old.tgz
#   (on the device, from the repository root, with the wheels in .whl/ as for h200.sh)
#   OLD_TGZ=ab_old.tgz ROUNDS=3 FIRST_STEPS=tests LAST_STEPS=bench bash bench/ab.sh
#
# Results go to $OUT (default ./out): ab.log (one line per run), each run's serve JSON and
# h200.sh's files. WORKS (default trivial,1ms) are the service's kinds of work; the peers run
# PyTorch in the handler for trivial work and in the executor for 1 ms (the issue's two targets),
# once, or with PEERS_EACH_ROUND=1 the trivial work's peers in every round.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
NEW=$PWD
OLD=${OLD_DIR:-/tmp/ab_old}
if [[ -n ${OLD_TGZ:-} ]]; then
  rm -rf "$OLD"; mkdir -p "$OLD" && tar xzf "$OLD_TGZ" -C "$OLD"
fi
# This tree first (h200.sh installs the wheels, builds the C parts and runs its steps), so that
# the old tree builds with the same Cython.
STEPS=${FIRST_STEPS-tests} OUT=$OUT bash bench/h200.sh > "$OUT/h200_first.log" 2>&1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
(cd "$OLD" && python3 -m aiogpu.cuda.build_hotc > /dev/null 2>&1
 python3 setup.py -q build_ext --inplace -j "$(nproc)" > "$OUT/old_build.log" 2>&1) || tail -3 "$OUT/old_build.log"
for tree in "$OLD" "$NEW"; do
  (cd "$tree" && PYTHONPATH=$tree:$PYTHONPATH python3 -c 'import aiogpu._core as C; print(C.summary())' 2>&1 | tail -1)
done
: > "$OUT/ab.log"
WORKS=${WORKS:-trivial,1ms}
for r in $(seq "${ROUNDS:-3}"); do
  for tree in "$OLD" "$NEW"; do
    tag=$([[ $tree == "$NEW" ]] && echo new || echo old)
    (cd "$tree" && PYTHONPATH=$tree:$PYTHONPATH timeout 120 python3 bench/serve.py --backend cuda --modes aiogpu \
      --work "$WORKS" --duration "${SERVE_S:-4}" --warmup 1 --json "$OUT/serve_${tag}_$r.json" > /dev/null 2>&1)
    python3 - "$OUT/serve_${tag}_$r.json" "$tag" "$r" >> "$OUT/ab.log" <<'PY'
import json, sys
for key, got in json.load(open(sys.argv[1])).items():
    if key == "meta":
        continue
    print(f"serve {sys.argv[2]} round {sys.argv[3]} {key}: {got['req_per_s']:.0f} req/s, loop lag p99 "
          f"{got['lag_p99_ms']:.2f} ms, loop cpu {got['loop_cpu']:.2f}, wrong {got['wrong']}, errors {got['errors']}")
PY
  done
  # PEERS_EACH_ROUND=1: the trivial work's peers in every round, between the trees' runs (their
  # rates spread as much as aiogpu's between runs: a median of each needs each in every round).
  if [[ ${PEERS_EACH_ROUND:-0} == 1 && -n ${REF_MODES-host_only,torch_blocking} ]]; then
    PYTHONPATH=$NEW:$PYTHONPATH timeout 120 python3 bench/serve.py --backend cuda --modes "${REF_MODES-host_only,torch_blocking}" \
      --work trivial --duration "${SERVE_S:-4}" --warmup 1 --json "$OUT/serve_peers_$r.json" 2>&1 | sed "s/^/peers round $r /" >> "$OUT/ab.log"
  fi
done
# The peers in the same call, on this tree's benchmark (each once, unless PEERS_EACH_ROUND ran
# them): aiohttp alone and PyTorch in the handler for trivial work, PyTorch in the executor for 1 ms.
if [[ ${PEERS_EACH_ROUND:-0} != 1 && -n ${REF_MODES-host_only,torch_blocking} ]]; then
  PYTHONPATH=$NEW:$PYTHONPATH timeout 120 python3 bench/serve.py --backend cuda --modes "${REF_MODES-host_only,torch_blocking}" \
    --work trivial --duration "${SERVE_S:-4}" --warmup 1 --json "$OUT/serve_peers.json" 2>&1 | sed "s/^/peers /" >> "$OUT/ab.log"
fi
if [[ $WORKS == *1ms* && -n ${REF_MODES_1MS-torch_executor} ]]; then
  PYTHONPATH=$NEW:$PYTHONPATH timeout 120 python3 bench/serve.py --backend cuda --modes "${REF_MODES_1MS-torch_executor}" \
    --work 1ms --duration "${SERVE_S:-4}" --warmup 1 --json "$OUT/serve_peers_1ms.json" 2>&1 | sed "s/^/peers /" >> "$OUT/ab.log"
fi
for tree in "$OLD" "$NEW"; do
  tag=$([[ $tree == "$NEW" ]] && echo new || echo old)
  (cd "$tree" && PYTHONPATH=$tree:$PYTHONPATH timeout 120 python3 bench/hostcost.py --backend cuda \
    --shapes submit,await1,buffers,service 2>&1 | sed "s/^/hostcost $tag /") >> "$OUT/ab.log"
done
cat "$OUT/ab.log"
if [[ -n ${LAST_STEPS-bench} ]]; then
  STEPS=${LAST_STEPS-bench} BUILD_HOTC=0 BUILD_CORE=0 OUT=$OUT bash bench/h200.sh > "$OUT/h200_last.log" 2>&1
fi
