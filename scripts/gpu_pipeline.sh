#!/usr/bin/env bash
# The whole cached pipeline on the GPU in one call: install (server wheels carried in .whl when
# present), build, every `cuda` test (kernels, Triton attention, pipeline oracle, CUDA graphs,
# server), the end-to-end benchmark (eager, then CUDA graphs) and the seed replay with --verify.
#   bash scripts/gpu_pipeline.sh      (on the GPU machine, repository root; results under $OUT)
# STAGES picks the stages (default: the first six; also pytest_cuda_ops, pytest_cuda_rest, bounds, split, split_front, pressure_ab, pytest_hidden, split_hidden,
# split_b1, profile_b1, trace_b1, ahead_ab, stage_ab, split_orders, split_front_hidden, pressure_hidden, replay_sync, pytest_pipeline, profile_split, replay_ab,
# regimes, profile, profile_cold, bench_trace, rest, rest_invalidate, rest_switch, rest_worker, replay_worker, pytest_serving, rest_engine, rest_front2, rest_front3,
# attention, pytest_attention, silu_ab, profile_rerank, overlap_probe, schedule_tests, modes_kernels,
# modes_replay, modes_pressure, modes_bench, gluon_tests, sanitize_gluon, profile_pipelined, pipeline_gluon, stream_tests,
# pipeline_stream (STREAM_ENV), dl_tests, pipeline_dl, sanitize_dl, launch_cost,
# rest_loop2, engine_process, profile_host, rest_ray, rest_ray_direct, rest_ray_direct4, bench_export, bench_compiled,
# bench_autotune), e.g.
#   STAGES="build pytest_cuda replay_graphs bench_compiled" bash scripts/gpu_pipeline.sh
# Each stage has its own time limit so the call ends inside the device's 10 minutes; failed stages
# are listed last and make the exit status non-zero. scripts/gpu_check.sh covers the kernels alone
# (compute-sanitizer, kernel benchmarks).
set -uo pipefail
export PYTHONUNBUFFERED=1 HSTU_BUILD_DIR=/tmp/hstu_build MAX_JOBS="${MAX_JOBS:-$(nproc)}"
cd "$(dirname "$0")/.."
export OUT="${OUT:-$PWD/out}"
LOG="$OUT/gpu_pipeline.log"
mkdir -p "$OUT"
failed=()

STAGES="${STAGES:-build pytest_cuda bench replay bench_graphs replay_graphs}"

stage() {  # stage NAME SECONDS CMD...: run under a time limit, append to the one log (if in STAGES)
  local name=$1 limit=$2
  shift 2
  [[ " $STAGES " == *" $name "* ]] || return 0
  echo "== $name ($(date +%T), limit ${limit}s)" | tee -a "$LOG"
  timeout "$limit" "$@" 2>&1 | tee -a "$LOG"
  [ "${PIPESTATUS[0]}" -eq 0 ] || failed+=("$name")
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee -a "$LOG"
source scripts/gpu_wheels.sh  # the server wheels carried in .whl
python3 -m pip install -e . --no-deps --no-build-isolation -q 2>&1 | tail -2 | tee -a "$LOG"
stage build 240 python3 -c "from hstu.ops._build import cuda_build_enabled, load_extension; assert cuda_build_enabled(); load_extension(); print('extension built')"
stage pytest_cuda 300 python3 -m pytest -m cuda -q -rfE -p no:cacheprovider tests/
# the same suite in two steps, for a call with little else in it (the whole suite ran past 330 s on an H100, run GJ):
# the kernels' tests (tests/ops, 166 of 192), then the rest (pipeline, graphs, export, server)
stage pytest_cuda_ops 360 python3 -m pytest -m cuda -q -rfE -p no:cacheprovider tests/ops
stage pytest_cuda_rest 300 python3 -m pytest -m cuda -q -rfE -p no:cacheprovider tests/ --ignore=tests/ops
stage bench 120 python3 -m hstu.cli bench --device cuda --out "$OUT/bench"
stage replay 100 python3 -m hstu.cli replay --preset seed --device cuda --verify --no-progress --out "$OUT/replay"
stage bench_graphs 90 python3 -m hstu.cli bench --device cuda --cuda-graphs --sections e2e --out "$OUT/bench_graphs"
stage replay_graphs 120 python3 -m hstu.cli replay --preset seed --device cuda --cuda-graphs --verify --no-progress \
  --out "$OUT/replay_graphs"
# what the cost model calibrated by bench_graphs predicts for each open bar, beside what bench_graphs and
# replay_graphs measured in the same call (scripts/bar_bounds.py; needs bench_graphs earlier in the call)
stage bounds 30 python3 -m hstu.scripts.bar_bounds "$OUT/bench_graphs/bench.json" \
  --replay-json "$OUT/replay_graphs/replay.json" --out "$OUT/bounds.json"
# issue 11: every onload/recompute split of the host-tier batch against the planner's prediction
stage split 240 python3 -m hstu.cli bench --device cuda --cuda-graphs --sections e2e split --warmup 2 --repeats 8 \
  --out "$OUT/split"
# the split sweep at batch 1 alone (the planner's b1 choice against every fixed split)
stage split_b1 150 python3 -m hstu.cli bench --device cuda --cuda-graphs --sections split --batch-sizes 1 --warmup 2 \
  --repeats 8 --out "$OUT/split_b1"
# the same with the prefix's front recomputed beside its back's onload (host_split compute_front; compare with
# "split" in the same call), and the pressure replay both ways
stage split_front 240 python3 -m hstu.cli bench --device cuda --cuda-graphs --sections e2e split --warmup 2 --repeats 8 \
  --host-split compute_front --out "$OUT/split_front"
pressure() {  # pressure FLAG VALUE...: the pressure replay once per value of FLAG
  local flag=$1 v r="python3 -m hstu.cli replay --preset seed --device cuda --cuda-graphs --verify --no-progress"
  shift
  for v in "$@"; do
    $r --users 256 --requests 600 --num-pages 1024 --host-cache-mb 4096 "$flag" "$v" --out "$OUT/pressure_$v" \
      | grep -E "speedup|mismatch|onloaded|offloaded" | sed "s/^/$v: /" || return 1
  done
}
stage pressure_ab 240 bash -c "$(declare -f pressure); pressure --host-split load_front compute_front"
# issue 11: the host tier holding layer inputs (host_format hidden: half the bytes, K/V rebuilt on the GPU);
# compare with "split" / "split_front" / "pressure_ab" in the same call. pytest_hidden: its CUDA tests alone.
stage pytest_hidden 200 python3 -m pytest -m cuda -q -rfE -p no:cacheprovider tests/model/test_cuda_pipeline.py \
  tests/ops/test_cuda_kernels.py -k "hidden"
stage split_hidden 240 python3 -m hstu.cli bench --device cuda --cuda-graphs --sections e2e split --warmup 2 --repeats 8 \
  --host-format hidden --out "$OUT/split_hidden"
stage split_front_hidden 240 python3 -m hstu.cli bench --device cuda --cuda-graphs --sections e2e split --warmup 2 \
  --repeats 8 --host-split compute_front --host-format hidden --out "$OUT/split_front_hidden"
stage pressure_hidden 240 bash -c "$(declare -f pressure); pressure --host-format kv hidden"
# the replay ranking and synchronising one batch at a time (replay_graphs pipelines two)
stage replay_sync 120 python3 -m hstu.cli replay --preset seed --device cuda --cuda-graphs --verify --no-progress \
  --pipeline 1 --out "$OUT/replay_sync"
# the server's CUDA tests and the GPU pipeline's (oracle with eviction, pipelined batches, re-rank)
stage pytest_serving 240 python3 -m pytest -m cuda -q -rfE -p no:cacheprovider tests/serving tests/model/test_cuda_pipeline.py
# the GPU pipeline tests alone: oracle with eviction, pipelined batches, re-rank, graph padding
stage pytest_pipeline 200 python3 -m pytest -m cuda -q -rfE -p no:cacheprovider tests/model/test_cuda_pipeline.py \
  tests/engine/test_graphs.py -k "not compiled_layers"
# issue 11: where a split batch's time goes (batch 8, a quarter of the history recomputed): GPU-resident
# prefix eager and in a graph, then the prefix in the host tier (3/4 onloaded), then pure onload in graphs
profile_split() {
  local p="python3 -m hstu.cli profile --device cuda --batch 8 --forwards 5"
  $p --cached-tokens 3072 --out "$OUT/profile_gpu_prefix_eager" \
    && $p --cached-tokens 3072 --cuda-graphs --out "$OUT/profile_gpu_prefix_graphs" \
    && $p --onload-fraction 0.75 --out "$OUT/profile_split_eager" \
    && $p --onload-fraction 1.0 --cuda-graphs --out "$OUT/profile_onload_graphs"
}
stage profile_split 240 bash -c "$(declare -f profile_split); profile_split"
# issue 11: batch 1's split against its own compute shape: the prefix 55% onloaded (the planner's choice in
# run GA), then 2,176 tokens on the GPU (the split's compute alone), then almost nothing cached (recompute)
profile_b1() {
  local p="python3 -m hstu.cli profile --device cuda --cuda-graphs --batch 1 --forwards 10"
  $p --onload-fraction 0.55 --out "$OUT/profile_b1_split" && $p --cached-tokens 2176 --out "$OUT/profile_b1_gpu2176" \
    && $p --cached-tokens 128 --out "$OUT/profile_b1_gpu128"
}
stage profile_b1 200 bash -c "$(declare -f profile_b1); profile_b1"
# the split as Chrome traces (OUT/trace_*/trace_b1.json.gz; profile.json's timeline_us in short), its copies
# enqueued all at once and one layer ahead, and its compute alone: where its late start (run GB) goes
trace_b1() {
  local p="python3 -m hstu.cli profile --device cuda --cuda-graphs --batch 1 --forwards 5 --trace"
  HSTU_ONLOAD_AHEAD=all $p --onload-fraction 0.5 --out "$OUT/trace_split_all" \
    && $p --onload-fraction 0.5 --out "$OUT/trace_split_ahead1" && $p --cached-tokens 1920 --out "$OUT/trace_gpu1920"
}
stage trace_b1 200 bash -c "$(declare -f trace_b1); trace_b1"
# the onload's copies enqueued a layer ahead of the layer that reads them (default) against all at once, same
# call: batch 1 end-to-end and its split sweep, then batch 8 end-to-end
ahead_ab() {
  local m b="python3 -m hstu.cli bench --device cuda --cuda-graphs --warmup 2 --repeats 8"
  for m in all 1; do
    HSTU_ONLOAD_AHEAD=$m $b --sections e2e split --batch-sizes 1 --out "$OUT/ahead_${m}_b1" | sed "s/^/ahead $m: /" || return 1
  done
  for m in all 1; do
    HSTU_ONLOAD_AHEAD=$m $b --sections e2e --batch-sizes 8 --out "$OUT/ahead_${m}_b8" | sed "s/^/ahead $m: /" || return 1
  done
}
stage ahead_ab 240 bash -c "$(declare -f ahead_ab); ahead_ab"
# a graph batch's inputs staged by torch's copy_ (the onload after them) against read_pinned's kernel (the onload
# first), alternately: batch 1's split sweep and e2e, then batch 8's compute_front sweep (runs GF, GH)
stage_ab() {
  local m b="python3 -m hstu.cli bench --device cuda --cuda-graphs --warmup 2 --repeats 10"
  for m in engine kernel engine kernel; do
    HSTU_STAGE_COPY=$m $b --sections e2e split --batch-sizes 1 --out "$OUT/stage_${m}_b1" | sed "s/^/stage $m: /" || return 1
  done
  for m in engine kernel; do
    HSTU_STAGE_COPY=$m $b --sections e2e split --batch-sizes 8 --host-split compute_front --out "$OUT/stage_${m}_b8" \
      | sed "s/^/stage $m: /" || return 1
  done
}
stage stage_ab 300 bash -c "$(declare -f stage_ab); stage_ab"
# the host-tier planner under each host_split, one after another (auto is the default; run GH)
split_orders() {
  local h
  for h in auto load_front compute_front; do
    python3 -m hstu.cli bench --device cuda --cuda-graphs --warmup 2 --repeats 10 --sections e2e --batch-sizes 1 8 \
      --host-split $h --out "$OUT/orders_$h" | grep -E "host tier" | sed "s/^/$h: /" || return 1
  done
}
stage split_orders 200 bash -c "$(declare -f split_orders); split_orders"
# the seed replay synchronised per batch and pipelined, alternately, twice (one machine, one call)
replay_ab() {
  for k in 1 2 1 2; do
    python3 -m hstu.cli replay --preset seed --device cuda --cuda-graphs --no-progress --pipeline $k --out "/tmp/replay_ab" \
      | grep -E "requests/s|speedup req" | sed "s/^/pipeline $k: /" || return 1
  done
}
stage replay_ab 200 bash -c "$(declare -f replay_ab); replay_ab"
# issue 11's replay regimes beside the GPU-resident seed replay: pressure (1024 GPU pages = 32k tokens; 256
# users whose histories total 5.4x that; a 4 GiB host tier = 4x the GPU pages) and all-cold (every user new)
regimes() {
  local r="python3 -m hstu.cli replay --preset seed --device cuda --cuda-graphs --verify --no-progress"
  $r --users 256 --requests 600 --num-pages 1024 --host-cache-mb 4096 --out "$OUT/replay_pressure" \
    && $r --users 100000 --zipf-alpha 0 --requests 600 --out "$OUT/replay_cold"
}
stage regimes 240 bash -c "$(declare -f regimes); regimes"
stage profile 120 python3 -m hstu.cli profile --device cuda --cuda-graphs --batch 1 8 --forwards 10 --out "$OUT/profile"
# the same with the requests neither validated nor hashed before the timed forward, as bench times them
stage profile_cold 120 python3 -m hstu.cli profile --device cuda --cuda-graphs --batch 8 --forwards 10 --cold-requests \
  --out "$OUT/profile_cold"
# bench's e2e forwards with one more of each pass traced (host phases, runtime calls, per-stream activity, one clock):
# where a bench forward's time goes beside the profile's (run IA: b8 cached 2.97 ms timed, 2.62 ms in the profile)
stage bench_trace 150 python3 -m hstu.cli bench --device cuda --cuda-graphs --sections e2e --trace --out "$OUT/bench_trace"
stage rest 300 bash scripts/gpu_rest.sh "$OUT/rest"
# a shorter history always recomputed (the policy before "reuse"; compare with "rest" in the same call)
REFERENCE=0 SERVER_REPLAY=0 SERVE_ARGS="--on-shorter-history invalidate" stage rest_invalidate 200 \
  bash scripts/gpu_rest.sh "$OUT/rest_invalidate"
# a 0.5 ms GIL switch interval in the engine's process (compare with "rest" in the same call: the model
# thread took ~2x the in-process host time per batch in session 12)
REFERENCE=0 SERVER_REPLAY=0 SERVE_ARGS="--gil-switch-interval-ms 0.5" stage rest_switch 200 \
  bash scripts/gpu_rest.sh "$OUT/rest_switch"
# each batch's prepare job on the cache's worker thread (compare with "rest" in the same call: the worker
# made the e2e forward 0.28-0.32 ms slower in session 15); the in-process replay with the worker too
REFERENCE=0 SERVER_REPLAY=0 SERVE_ARGS="--prepare-worker" stage rest_worker 200 bash scripts/gpu_rest.sh "$OUT/rest_worker"
stage replay_worker 120 python3 -m hstu.cli replay --preset seed --device cuda --cuda-graphs --verify --no-progress \
  --prepare-worker --no-uncached --out "$OUT/replay_worker"
# the same server with its engine in a child process (compare with "rest" in the same call)
REFERENCE=0 SERVE_ARGS=--engine-process stage rest_engine 240 bash scripts/gpu_rest.sh "$OUT/rest_engine"
# two and three HTTP front ends before the one engine process (issue 18: the front end's loop was the limit)
REFERENCE=0 SERVER_REPLAY=0 SERVE_ARGS="--front-ends 2" stage rest_front2 200 bash scripts/gpu_rest.sh "$OUT/rest_front2"
REFERENCE=0 SERVER_REPLAY=0 SERVE_ARGS="--front-ends 3 --parse-processes 2" stage rest_front3 200 bash scripts/gpu_rest.sh "$OUT/rest_front3"
# two front ends and the engine process launching on a model thread of its own (before model_on_loop became its
# default; compare with rest_front2)
REFERENCE=0 SERVER_REPLAY=0 SERVE_ARGS="--front-ends 2 --no-model-on-loop" stage rest_thread2 200 bash scripts/gpu_rest.sh "$OUT/rest_thread2"
# issue 18 on this machine's host CPU: the engine process's own work per request (forward stubbed), thread vs loop
stage engine_process 120 python3 -m hstu.scripts.bench_engine_process --out "$OUT/engine_process.json"
# issue 12: the model thread's host phases without the forward (compare with "profile"'s, which include launches)
stage profile_host 120 python3 -m hstu.cli profile --host-only --forwards 30 --out "$OUT/profile_host"
# the same server behind Ray Serve, one replica on this GPU (issue 16: overhead vs "rest", same call)
REFERENCE=0 SERVE_ARGS="--replicas 1" stage rest_ray 240 bash scripts/gpu_rest.sh "$OUT/rest_ray"
# ... with the ingress replicas serving HTTP on the port themselves (no proxy actor)
REFERENCE=0 SERVE_ARGS="--replicas 1 --direct-ingress" stage rest_ray_direct 240 bash scripts/gpu_rest.sh "$OUT/rest_ray_direct"
# ... four of them on the one port (1.03x of `hstu serve --front-ends 2` in run BF; compare with rest_front2)
REFERENCE=0 SERVER_REPLAY=0 SERVE_ARGS="--replicas 1 --front-ends 4 --direct-ingress" stage rest_ray_direct4 240 \
  bash scripts/gpu_rest.sh "$OUT/rest_ray_direct4"
# issue 12 item 3: the attention kernel alone, every tile config and SiLU form at the cached, re-rank and
# uncached seed shapes (scripts/bench_kernels.py), then the bf16 accuracy tests of every SiLU form
stage attention 240 python3 -m hstu.scripts.bench_kernels --sections attention --copy-gib 0.25 --out "$OUT/attention.json"
stage pytest_attention 150 python3 -m pytest -m cuda -q -rfE -p no:cacheprovider tests/ops/test_cuda_kernels.py -k attention
# the end-to-end benchmark with each SiLU form (HSTU_ATTENTION_SILU), one after another in this call
silu_ab() {
  for mode in ${SILU_MODES:-exact fast tanh}; do
    HSTU_ATTENTION_SILU=$mode python3 -m hstu.cli bench --device cuda --cuda-graphs --sections e2e --no-planner \
      --out "$OUT/e2e_$mode" | sed "s/^/$mode: /" || return 1
  done
}
stage silu_ab 330 bash -c "$(declare -f silu_ab); silu_ab"
# the unchanged-history re-rank at batch 8 (issue 11 item 3): host phases, top functions, top kernels
stage profile_rerank 120 python3 -m hstu.cli profile --device cuda --cuda-graphs --rerank --batch 8 --forwards 10 \
  --out "$OUT/profile_rerank"
# the Gluon probe of FA3's overlap in the key loop (scripts/overlap_probe.py: serial / overlap, cp.async / TMA,
# against the production kernel on the same inputs; its table last), then its CUDA correctness test
stage overlap_probe 240 bash -c 'python3 -m hstu.scripts.overlap_probe --out "$OUT/overlap_probe.json" \
  && python3 -m pytest -m cuda -q -rfE -p no:cacheprovider tests/scripts/test_overlap_probe.py'
# A/B of attention variants by mode (mode_env): the schedule experiments of ops/triton_attention.py (off by
# default): OFF; SIMPLE = ALIGN_TAIL=1 + LONG_FIRST=1; CAUSAL = both + CAUSAL_SHARES=1; and the kernel: TRITON, GLUON
# (ops/gluon_attention.py, no stream kernel, host launch: the defaults before session 44), STREAM
# (ops/gluon_stream_attention.py: HSTU_GLUON_STREAM=1), STREAMA (the stream kernel where a launch's units reach a
# quarter of the SMs, host launch), STREAMP (its plain
# stream-K, no lanes: HSTU_GLUON_LANES=0), STREAMO (its own-key tiles gathered: HSTU_GLUON_OWN_TMA=0),
# GLUONG (its causal-boundary tiles gathered: HSTU_GLUON_MASKED_TMA=0); and the launch: DL (whole forwards
# launched from the device: HSTU_DEVICE_LAUNCH=1), DLSA (DL with STREAMA: the defaults since session 44), HL (the
# defaults with the host launch); DEFAULT: the defaults; FB: the default buckets with 18432 and 20480 added (a
# batch of 8's host-tier front of 2304 or 2560 tokens a user fits without padding to 24576; bar_bounds: b8 host tier
# 1.62x -> 1.65x). schedule_tests: the CUDA
# attention tests with the three schedule rules on; modes_kernels:
# the kernel at the bench shapes at its default tiles per mode (KERNEL_MODES); modes_replay: the seed replay
# alternating the modes (MODES), --verify; modes_pressure: the pressure replay per mode (PRESSURE_MODES); modes_bench:
# the end-to-end benchmark per mode (BENCH_MODES); gluon_tests:
# the Gluon kernel's CUDA tests (its CPU tests run in CI); pipeline_gluon: the GPU pipeline and graph tests with the Gluon kernel
mode_env() {
  case $1 in
    OFF) echo HSTU_ATTENTION_ALIGN_TAIL=0 ;;
    SIMPLE) echo HSTU_ATTENTION_ALIGN_TAIL=1 HSTU_ATTENTION_LONG_FIRST=1 ;;
    CAUSAL) echo HSTU_ATTENTION_ALIGN_TAIL=1 HSTU_ATTENTION_LONG_FIRST=1 HSTU_ATTENTION_CAUSAL_SHARES=1 ;;
    TRITON) echo HSTU_ATTENTION_KERNEL=triton ;;
    DEFAULT) echo MODE=default ;;
    GLUON) echo HSTU_ATTENTION_KERNEL=gluon HSTU_GLUON_STREAM_AUTO=0 HSTU_DEVICE_LAUNCH=0 ;;
    STREAM) echo HSTU_ATTENTION_KERNEL=gluon HSTU_GLUON_STREAM=1 ;;
    STREAMA) echo HSTU_ATTENTION_KERNEL=gluon HSTU_GLUON_STREAM_AUTO=1 HSTU_DEVICE_LAUNCH=0 ;;
    STREAMP) echo HSTU_ATTENTION_KERNEL=gluon HSTU_GLUON_STREAM=1 HSTU_GLUON_LANES=0 ;;
    STREAMO) echo HSTU_ATTENTION_KERNEL=gluon HSTU_GLUON_STREAM=1 HSTU_GLUON_OWN_TMA=0 ;;
    GLUONG) echo HSTU_ATTENTION_KERNEL=gluon HSTU_GLUON_MASKED_TMA=0 ;;
    HL) echo HSTU_DEVICE_LAUNCH=0 ;;
    FB) echo HSTU_GRAPH_BUCKETS=$(python3 -c "from hstu.engine.engine import default_graph_buckets as b
print(','.join(map(str, sorted({*b(host_split='auto'), 18432, 20480}))))") ;;
    PLANEACH) echo HSTU_ATTENTION_KERNEL=gluon HSTU_GLUON_PLAN_ONCE=0 ;;
    DL) echo HSTU_DEVICE_LAUNCH=1 ;;
    DLSA) echo HSTU_DEVICE_LAUNCH=1 HSTU_ATTENTION_KERNEL=gluon HSTU_GLUON_STREAM_AUTO=1 ;;
    *) echo "unknown mode $1" >&2; return 1 ;;
  esac
}
modes_kernels() {
  for m in ${KERNEL_MODES:-OFF SIMPLE CAUSAL}; do
    env $(mode_env $m) python3 -m hstu.scripts.bench_kernels --sections attention --copy-gib 0.25 \
      --tiles 128,64,8,2 --out "$OUT/attention_$m.json" | sed "s/^/$m: /" || return 1
  done
}
replay_modes() {  # replay_modes NAME "MODES" [replay flags]: the seed replay once per mode, in order, --verify
  local name=$1 modes=$2 m i=0
  shift 2
  for m in $modes; do
    i=$((i + 1))
    env $(mode_env $m) python3 -m hstu.cli replay --preset seed --device cuda --cuda-graphs --verify --no-progress \
      "$@" --out "$OUT/${name}_${i}_$m" | grep -E "requests/s|speedup|mismatch" | sed "s/^/$i $m: /" || return 1
  done
}
modes_bench() {  # the end-to-end benchmark (cached vs uncached, batch 1 and 8, CUDA graphs) per mode
  for m in $BENCH_MODES; do
    env $(mode_env $m) python3 -m hstu.cli bench --device cuda --cuda-graphs --sections e2e --out "$OUT/bench_$m" \
      | sed "s/^/$m: /" || return 1
  done
}
export BENCH_MODES="${BENCH_MODES:-TRITON GLUON}"
without() {  # without PREFIX "MODES": the modes not starting with PREFIX
  local m kept=()
  for m in $2; do [[ $m == "$1"* ]] || kept+=("$m"); done
  echo "${kept[*]}"
}
skip_after_failed() {  # skip_after_failed TESTS PREFIX PIPELINE: a kernel whose tests failed (or hung): no PREFIX* mode
  [[ " ${failed[*]} " == *" $1 "* ]] || return 0  # and no PIPELINE stage after them
  export KERNEL_MODES="$(without "$2" "${KERNEL_MODES:-}")" MODES="$(without "$2" "${MODES:-}")" \
    PRESSURE_MODES="$(without "$2" "${PRESSURE_MODES:-}")" BENCH_MODES="$(without "$2" "$BENCH_MODES")"
  STAGES=${STAGES//$3/}
  echo "$1 failed: $2 modes and $3 skipped" | tee -a "$LOG"
}
stage gluon_tests 240 python3 -m pytest -q -rfE -p no:cacheprovider tests/ops/test_cuda_kernels.py -k gluon
skip_after_failed gluon_tests GLUON pipeline_gluon
# the stream kernel's CUDA tests (HSTU_GLUON_STREAM=1, opt-in)
stage stream_tests 200 python3 -m pytest -q -rfE -p no:cacheprovider tests/ops/test_cuda_kernels.py -k "gluon and stream"
skip_after_failed stream_tests STREAM pipeline_stream
# the device launch (HSTU_DEVICE_LAUNCH=1, engine/device_launch.py): its tests, then the GPU pipeline and graph
# tests under it (pipeline_dl); sanitize_dl: its kernel under compute-sanitizer memcheck, with the caching
# allocator on (without it, a capture's allocations are plain cudaMallocs, which a capture refuses)
stage dl_tests 150 python3 -m pytest -q -rfE -p no:cacheprovider tests/engine/test_device_launch.py
skip_after_failed dl_tests DL pipeline_dl
stage pipeline_dl 240 env HSTU_DEVICE_LAUNCH=1 python3 -m pytest -m cuda -q -rfE -p no:cacheprovider \
  tests/model/test_cuda_pipeline.py tests/engine/test_graphs.py -k "not compiled_layers"
stage sanitize_dl 150 compute-sanitizer --tool memcheck --error-exitcode 9 \
  python3 -m pytest -q -m cuda -rfE -p no:cacheprovider tests/engine/test_device_launch.py
# compute-sanitizer memcheck on the Gluon kernel (issue 12: every new kernel): whole and cut units, a padded
# bucket, both tail forms
stage sanitize_gluon 200 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 9 \
  python3 -m pytest -q -m cuda -rfE -p no:cacheprovider tests/ops/test_cuda_kernels.py \
  -k "gluon and (padded or default-8-32 or gathered-2-8)"
# the model thread's launch of a graph batch piece by piece (device launch, host replay, clone, event), b1 and b8
stage launch_cost 120 python3 -m hstu.scripts.launch_cost --batch 1 8 --out "$OUT/launch_cost.json"
# issue 12's GPU busy share: batches launched back to back as the server does (rank_async), batch 1 and 8
stage profile_pipelined 150 python3 -m hstu.cli profile --device cuda --cuda-graphs --batch 1 8 --forwards 10 \
  --pipelined 16 --out "$OUT/profile_pipelined"
stage schedule_tests 200 bash -c "$(declare -f mode_env); env \$(mode_env CAUSAL) python3 -m pytest -m cuda -q \
  -rfE -p no:cacheprovider tests/ops/test_cuda_kernels.py -k attention"
stage modes_kernels 200 bash -c "$(declare -f mode_env modes_kernels); modes_kernels"
stage modes_replay 300 bash -c "$(declare -f mode_env replay_modes); replay_modes replay '${MODES:-OFF CAUSAL SIMPLE OFF CAUSAL}'"
stage modes_pressure 200 bash -c "$(declare -f mode_env replay_modes); replay_modes pressure \
  '${PRESSURE_MODES:-OFF CAUSAL}' --users 256 --requests 600 --num-pages 1024 --host-cache-mb 4096"
stage modes_bench 240 bash -c "$(declare -f mode_env modes_bench); modes_bench"
# the GPU pipeline and graph tests under the stream kernel (HSTU_GLUON_STREAM=1, opt-in; STREAM_ENV=
# HSTU_GLUON_STREAM_AUTO=1 for the per-launch choice)
stage pipeline_stream 240 env ${STREAM_ENV:-HSTU_GLUON_STREAM=1} python3 -m pytest -m cuda -q -rfE -p no:cacheprovider \
  tests/model/test_cuda_pipeline.py tests/engine/test_graphs.py -k "not compiled_layers"
HSTU_ATTENTION_KERNEL=gluon stage pipeline_gluon 240 python3 -m pytest -m cuda -q -rfE -p no:cacheprovider \
  tests/model/test_cuda_pipeline.py tests/engine/test_graphs.py tests/ops/kvcache/test_plan_feedback.py -k "not compiled_layers"
stage bench_export 300 python3 -m hstu.scripts.bench_export --device cuda --batch 8 --cuda-graphs --out "$OUT/bench_export.json"
stage bench_compiled 200 python3 -m hstu.cli bench --device cuda --compile --sections e2e --batch-sizes 8 --out "$OUT/bench_compiled"
# issue 12's memory passes beside the GEMMs: batch 8 with layers compiled under max-autotune (Inductor's GEMM templates,
# the SiLU and residual fused into their epilogues where faster) against the same buckets' eager-layer graphs, one
# bucket (3072 rows) so the autotuning stays within the stage (HSTU_COMPILE_MODE, engine/engine.py)
stage bench_autotune 420 bash -c 'env HSTU_GRAPH_BUCKETS=3072 python3 -m hstu.cli bench --device cuda --cuda-graphs \
  --sections e2e --batch-sizes 8 --out "$OUT/bench_b8_eager" && env HSTU_GRAPH_BUCKETS=3072 \
  HSTU_COMPILE_MODE=max-autotune-no-cudagraphs python3 -m hstu.cli bench --device cuda --compile --sections e2e \
  --batch-sizes 8 --out "$OUT/bench_b8_autotune"'
rm -f "$OUT/bench_graphs/bench.md" "$OUT/bench_compiled/bench.md" "$OUT/bench_trace/bench.md" \
  "$OUT/bench_b8_eager/bench.md" "$OUT/bench_b8_autotune/bench.md"

if ((${#failed[@]})); then
  echo "FAILED stages: ${failed[*]}" | tee -a "$LOG"
  exit 1
fi
echo "all stages passed" | tee -a "$LOG"
