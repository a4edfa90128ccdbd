#!/usr/bin/env bash
# Issue 17 on a two-GPU machine, in one call: the seed workload's sent load (every answer verified)
# against the Ray Serve app with 1, then 2 ranking replicas (one GPU each), the same requests,
# users and seed, each on a fresh server; then the scaling report (scripts/scale_report.py:
# requests/s, p50/p99, mean batch, per-replica cache hit rates, the router's affinity share, the
# ratio of the two runs' requests/s).
#   bash scripts/gpu_scale.sh OUT_DIR     (needs the serve and ray extras: carry .whl and .rayk)
# REPLICAS (default "1 2"), INGRESS (listening ingress replicas, default 8: the HTTP side must not be
# the limit of two ranking replicas; four served ~1,200 requests/s with one, RESULTS.md run CD),
# SENT_RATE (default 6000: more than two replicas serve), REQUESTS (default 4000), LOADGEN_PROCESSES
# (default 8) change the run.
set -uo pipefail
out=$1
mkdir -p "$out"
rc=0
runs=()
for n in ${REPLICAS:-1 2}; do
  REFERENCE=0 SERVER_REPLAY=0 LOADS=sent SENT_REPEATS=0 REQUESTS="${REQUESTS:-4000}" SENT_RATE="${SENT_RATE:-6000}" \
    LOADGEN_PROCESSES="${LOADGEN_PROCESSES:-8}" PORT=$((8200 + n)) \
    SERVE_ARGS="--replicas $n --front-ends ${INGRESS:-8} --direct-ingress" \
    bash scripts/gpu_rest.sh "$out/replicas_$n" > "$out/replicas_$n.log" 2>&1 || rc=1
  grep -hE "^(offered|verified)" "$out/replicas_$n.log" | sed "s/^/replicas $n: /"
  runs+=("$out/replicas_$n")
done
python3 -m hstu.scripts.scale_report "${runs[@]}" --out "$out/scale.json" || rc=1
exit $rc
