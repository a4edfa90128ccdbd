#!/usr/bin/env bash
# Where the server's model thread spends its wall time under load, against the in-process replay:
# py-spy (carried as a wheel in .whl) samples every thread, idle ones included, of
#   1. the seed replay in process (cached, CUDA graphs), and
#   2. `hstu serve` at the seed preset under `hstu loadgen --order sent` (the replay's requests),
# plus, when the system allows attaching, a GIL-holder-only recording of the server meanwhile.
# Raw (collapsed) stacks with thread ids go to OUT_DIR; fold them with any flame-graph tool.
#   bash scripts/gpu_profile_server.sh OUT_DIR
set -uo pipefail
out=$1
port=${PORT:-8124}
url=http://127.0.0.1:$port
spy="python3 -m py_spy"
command -v py-spy >/dev/null && spy=py-spy
mkdir -p "$out"
$spy record --idle --threads --format raw --rate 250 -o "$out/in_process.txt" -- \
  python3 -m hstu.cli replay --preset seed --device cuda --cuda-graphs --no-uncached --no-progress --out "$out/replay" \
  > "$out/replay.log" 2>&1
python3 -c "import json; from hstu.scripts.bench import BenchShape; print(json.dumps(BenchShape().model_config().to_dict()))" \
  > "$out/seed_model.json"
$spy record --idle --threads --format raw --rate 250 -o "$out/server.txt" -- \
  python3 -m hstu.cli serve --device cuda --cuda-graphs --config "$out/seed_model.json" --port "$port" \
  --page-size 32 --chunk-tokens 128 --num-pages 8192 --host-cache-mb 4096 --max-batch-size 8 ${SERVE_ARGS:-} \
  > "$out/serve.log" 2>&1 &
for _ in $(seq 240); do
  python3 -c "import httpx,sys; sys.exit(httpx.get('$url/v2/health/ready').status_code != 200)" 2>/dev/null && break
  sleep 0.5
done
server=$(pgrep -f "hstu.cli serve .*--port $port" | head -1)
$spy record --pid "$server" --gil --threads --format raw --rate 250 --duration 6 -o "$out/server_gil.txt" \
  > "$out/gil.log" 2>&1 &
gil=$!
for run in 1 2 3; do
  python3 -m hstu.cli loadgen --server "$url" --workload replay --order sent --rate 3000 --requests 200 --users 64 \
    --connections 128 --processes 4 --seed "$run" --out "$out/loadgen_$run" 2>&1 | grep offered
done
wait $gil
kill -INT "$server"
wait
ls -la "$out"
