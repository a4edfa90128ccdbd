#!/usr/bin/env bash
# Before/after of one command in one device call: the same command in an earlier tree (carried as
# a tarball) and in this one, so the ratio compares runs on one machine.
#   git archive -o .ab/before.tar.gz <commit>        (here; .ab/ is ignored, name it in carry)
#   BEFORE=.ab/before.tar.gz bash scripts/gpu_ab.sh 120 python3 -m hstu.cli bench --device cuda \
#       --cuda-graphs --sections e2e --out {out}
# {out} becomes $OUT/before and $OUT/after. ROUNDS=k alternates before, after, before, ... k times
# each ({out} then $OUT/before_1, $OUT/after_1, ...), so a drift of the machine shows rather than
# favouring one side. Each tree is installed (pip -e) and its extension built in a build directory
# of its own; the current tree is installed last, so later commands in the same call run it. Exit
# status: non-zero if any run failed.
set -uo pipefail
export PYTHONUNBUFFERED=1 MAX_JOBS="${MAX_JOBS:-$(nproc)}"
cd "$(dirname "$0")/.."
limit=$1
shift
OUT="${OUT:-$PWD/out}"
here=$PWD
before_dir=/tmp/hstu_before
rm -rf "$before_dir" && mkdir -p "$before_dir" && tar -xzf "${BEFORE:?BEFORE: the earlier tree as a .tar.gz}" -C "$before_dir" || exit 1
rounds=${ROUNDS:-1}
status=0
for round in $(seq "$rounds"); do
  for label in before after; do
    tree=$here
    [ "$label" = before ] && tree=$before_dir
    name=$label
    [ "$rounds" -gt 1 ] && name=${label}_$round
    echo "== $name ($(date +%T)): $tree"
    python3 -m pip install -e "$tree" --no-deps --no-build-isolation -q 2>&1 | tail -2
    export HSTU_BUILD_DIR=/tmp/hstu_build_$label
    (cd "$tree" && python3 -c "from hstu.ops._build import load_extension; load_extension()") || { status=1; continue; }
    args=()
    for a in "$@"; do args+=("${a//\{out\}/$OUT/$name}"); done
    (cd "$tree" && timeout "$limit" "${args[@]}") || status=1
  done
done
exit $status
