#!/usr/bin/env bash
# The REST path on the GPU: `hstu serve` at the seed preset with CUDA graphs in the background,
# then the seed replay over HTTP with --verify and the open-loop load generator against it.
#   bash scripts/gpu_rest.sh OUT_DIR      (called by gpu_pipeline.sh's "rest" stage)
set -uo pipefail
out=$1
port=${PORT:-8123}
url=http://127.0.0.1:$port
mkdir -p "$out"
python3 -c "import json; from hstu.scripts.bench import BenchShape; print(json.dumps(BenchShape().model_config().to_dict()))" \
  > "$out/seed_model.json"
python3 -m hstu.cli serve --device cuda --cuda-graphs --config "$out/seed_model.json" --port "$port" \
  --page-size 32 --chunk-tokens 128 --num-pages 8192 --host-cache-mb 4096 --max-batch-size 8 \
  > "$out/serve.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null' EXIT
for _ in $(seq 240); do
  python3 -c "import httpx,sys; sys.exit(httpx.get('$url/v2/health/ready').status_code != 200)" 2>/dev/null && break
  kill -0 $server 2>/dev/null || { echo "server exited"; tail -20 "$out/serve.log"; exit 1; }
  sleep 0.5
done
rc=0
python3 -m hstu.cli replay --server "$url" --preset seed --verify --no-progress --concurrency 16 --out "$out/replay_server" || rc=1
python3 -m hstu.cli loadgen --server "$url" --rate 3000 --requests 400 --users 64 --connections 32 --processes 4 \
  --out "$out/loadgen" || rc=1
tail -5 "$out/serve.log"
exit $rc
