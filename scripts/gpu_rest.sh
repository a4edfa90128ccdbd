#!/usr/bin/env bash
# The REST path on the GPU against its in-process reference, in one call: the seed replay in
# process (cached, CUDA graphs), then `hstu serve` at the same preset in the background with the
# seed replay over HTTP (--verify; full histories, then incremental requests) and the open-loop
# load generator sending the same requests, a user's next request waiting for the previous answer,
# then only for the previous send (that run with --verify: the like-for-like comparison with the
# in-process replay, every answer checked).
#   bash scripts/gpu_rest.sh OUT_DIR      (called by gpu_pipeline.sh's "rest" stage)
# REFERENCE=0 skips the in-process replay and SERVER_REPLAY=0 the replay over HTTP (for a second
# server variant measured in the same call); SERVE_ARGS adds `hstu serve` flags (a variant);
# SENT_REPEATS=k repeats the sent run k times; LOADS picks the load runs (default "answered sent fit"; "inproc": the
# sent load in process first, through the same serve settings' runtime: loadgen --in-process); REQUESTS=n sets the seed workload's length for the in-process
# replay and the answered and sent runs alike (default 200: a sent run then lasts ~0.15 s on the H200, and
# sent runs in one call spread by 15-60%; 2000 measures over ~1.5 s); "paced" in LOADS adds a sent run at
# PACED_RATE requests/s (default 800, below what the server serves: its p50 is then a request's latency, not the
# queue's), in process too when LOADS has "inproc" (PACED_REPEATS=k: k more of each, users of their own);
# SENT_RATE (default 3000), LOADGEN_PROCESSES (default 4, 32 connections each) and USERS (default 64) set the answered and sent loads' offered rate, client processes and users
# (scripts/gpu_scale.sh raises them for two replicas); PYSPY=1 samples the server (its engine process and parse workers too) with py-spy, when installed,
# during one more, longer load run (collapsed stacks per thread, busy samples only, in OUT_DIR/pyspy.txt;
# PYSPY_IDLE=1: idle samples too, to see where threads wait; PYSPY_GIL=1: only samples holding the GIL;
# PYSPY_RATE: that load's offered requests/s, default 3000), with
# the GPU's utilisation every 100 ms beside it (OUT_DIR/gpu_util.csv). The server's /metrics at the end: metrics_end.txt.
set -uo pipefail
out=$(realpath -m "$1")
cd "$(dirname "$0")/.."
# run by itself (not as gpu_pipeline.sh's stage): the server wheels and the package first (run HC, on its own,
# stopped at the missing pydantic)
python3 -c "import fastapi, pydantic" 2>/dev/null || source scripts/gpu_wheels.sh
python3 -c "import hstu.cli" 2>/dev/null || python3 -m pip install -e . --no-deps --no-build-isolation -q
port=${PORT:-8123}
url=http://127.0.0.1:$port
mkdir -p "$out"
rc=0
requests=${REQUESTS:-200}
if [ "${REFERENCE:-1}" = 1 ]; then
  python3 -m hstu.cli replay --preset seed --device cuda --cuda-graphs --no-uncached --no-progress \
    --requests "$requests" --out "$out/in_process" || rc=1
fi
python3 -c "import json; from hstu.scripts.bench import BenchShape; print(json.dumps(BenchShape().model_config().to_dict()))" \
  > "$out/seed_model.json"
serve_flags="--device cuda --cuda-graphs --config $out/seed_model.json --page-size 32 --chunk-tokens 128 \
  --num-pages 8192 --host-cache-mb 4096 --max-batch-size 8 ${SERVE_ARGS:-}"
loads=" ${LOADS:-answered sent fit} "
if [[ $loads == *" inproc "* ]]; then  # the sent load through the same serve settings' runtime in process (no HTTP):
  # the like-for-like reference of the server's sent runs (requests/s, p50, mean batch under the same arrivals)
  python3 -m hstu.cli loadgen --in-process "$serve_flags" --workload replay --order sent --rate 3000 --requests "$requests" \
    --users 64 --first-user 900000 --out "$out/loadgen_inproc" || rc=1
  if [[ $loads == *" paced "* ]]; then
    for k in $(seq 0 "${PACED_REPEATS:-0}"); do
      python3 -m hstu.cli loadgen --in-process "$serve_flags" --workload replay --order sent --rate "${PACED_RATE:-800}" \
        --requests "$requests" --users 64 --first-user $((950000 + 10000 * k)) --out "$out/loadgen_inproc_paced${k#0}" || rc=1
    done
  fi
fi
python3 -m hstu.cli serve $serve_flags --port "$port" > "$out/serve.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null' EXIT
for _ in $(seq 240); do
  python3 -c "import httpx,sys; sys.exit(httpx.get('$url/v2/health/ready').status_code != 200)" 2>/dev/null && break
  kill -0 $server 2>/dev/null || { echo "server exited"; tail -20 "$out/serve.log"; exit 1; }
  sleep 0.5
done
# Each run has users of its own (--first-user): a run replaying users another run left in the cache
# would start with their histories shorter or diverged (an invalidation and a full recompute each),
# which the in-process replay, on a fresh cache, never pays.
if [ "${SERVER_REPLAY:-1}" = 1 ]; then
  first=0
  for mode in full incremental; do
    python3 -m hstu.cli replay --server "$url" --preset seed --verify --no-progress --concurrency 16 --first-user $first \
      $([ $mode = incremental ] && echo --incremental) --out "$out/replay_server_$mode" || rc=1
    first=$((first + 100000))
  done
fi
replay_load() {  # replay_load ORDER FIRST_USER NAME [RATE]: the seed workload's 200 requests, a user's next one
  # waiting for the previous answer (answered) or send (sent, every answer verified); 32 connections in
  # each of 4 processes: more than the users in flight
  local procs=${LOADGEN_PROCESSES:-4}
  python3 -m hstu.cli loadgen --server "$url" --workload replay --order "$1" --rate "${4:-${SENT_RATE:-3000}}" \
    --requests "$requests" --users "${USERS:-64}" --connections $((32 * procs)) --processes "$procs" --first-user "$2" \
    $([ "$1" = sent ] && echo --verify) --out "$out/$3" || rc=1
}
[[ $loads == *" answered "* ]] && replay_load answered 200000 loadgen_answered
[[ $loads == *" sent "* ]] && replay_load sent 300000 loadgen_sent
if [[ $loads == *" paced "* ]]; then
  for k in $(seq 0 "${PACED_REPEATS:-0}"); do
    replay_load sent $((350000 + 10000 * k)) "loadgen_paced${k#0}" "${PACED_RATE:-800}"
  done
fi
# SENT_REPEATS=k: k more sent runs against the same server, each with users of its own (sent runs in one
# call spread by 15-30%; compare medians)
for k in $(seq "${SENT_REPEATS:-0}"); do
  replay_load sent $((1000000 + 100000 * k)) "loadgen_sent_$k"
done
if [[ $loads == *" fit "* ]]; then
  python3 -m hstu.cli loadgen --server "$url" --rate 3000 --requests 400 --users 64 --connections 32 --processes 4 \
    --first-user 400000 --out "$out/loadgen_fit" || rc=1
fi
if [ -n "${PYSPY:-}" ] && command -v py-spy > /dev/null; then  # a longer load, sampled without pausing the server;
  # busy samples only (no --idle), so a thread's samples over the rate and the load's wall_s is its busy share
  py-spy record --pid $server --subprocesses --threads --nonblocking ${PYSPY_IDLE:+--idle} ${PYSPY_GIL:+--gil} --rate 200 \
    --duration 120 --format raw --output "$out/pyspy.txt" > "$out/pyspy.log" 2>&1 &
  spy=$!
  nvidia-smi --query-gpu=timestamp,utilization.gpu --format=csv,noheader -lms 100 > "$out/gpu_util.csv" 2>/dev/null &
  smi=$!
  python3 -m hstu.cli loadgen --server "$url" --workload replay --order sent --rate "${PYSPY_RATE:-3000}" --requests 2000 --users 64 \
    --connections 128 --processes 4 --first-user 500000 --out "$out/loadgen_profiled" | grep -E "^(offered|server phases)" || rc=1
  kill -INT "$spy"
  kill "$smi"
  wait "$spy"
fi
curl -s "$url/metrics" > "$out/metrics_end.txt"  # queue waits, batch sizes and latencies of every run above
tail -5 "$out/serve.log"
exit $rc
