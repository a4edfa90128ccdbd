#!/usr/bin/env bash
# One device call of gpu_pipeline.sh whose results come back as one file: the device tool returns
# only a few files from $OUT, and a call of several stages writes dozens.
#   bash scripts/gpu_call.sh SECONDS "STAGES..." [KEY=VALUE ...]
# runs `STAGES=... KEY=VALUE... bash scripts/gpu_pipeline.sh` under a `timeout` of SECONDS (keep it
# under the call's limit so the tarball is still written), packs $OUT into $OUT/all.tgz (plots
# left out) and prints the pipeline log's tail and exit status.
set -uo pipefail
[ $# -ge 2 ] || { echo "usage: bash scripts/gpu_call.sh SECONDS \"STAGES...\" [KEY=VALUE ...]" >&2; exit 2; }
limit=$1 stages=$2
shift 2
cd "$(dirname "$0")/.."
export OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
timeout "$limit" env "$@" STAGES="$stages" bash scripts/gpu_pipeline.sh > /dev/null 2>&1
rc=$?
cd "$OUT" || exit 1
find . -name '*.png' -delete
tar czf /tmp/gpu_call_all.tgz . && rm -rf ./* && mv /tmp/gpu_call_all.tgz "$OUT/all.tgz"
tar xzf "$OUT/all.tgz" ./gpu_pipeline.log -O 2>/dev/null | grep -vE "^\s*$" | tail -c 11000
echo "pipeline rc=$rc"
exit "$rc"
