#!/usr/bin/env bash
# Several benchmarks/gpu_session.sh runs at once on disjoint GPUs of one machine (a "lane" each), so that a machine of
# several GPUs does single-GPU jobs side by side; every lane's results come back in one tarball (the device tool returns
# at most 8 files).
#
#   bash benchmarks/gpu_lanes.sh OUT 'GPUS [VAR=VALUE ...] : JOB[:SECONDS] ...' ['GPUS ... : ...' ...]
#
# GPUS: the lane's CUDA_VISIBLE_DEVICES (e.g. 0 or 0,1); VAR=VALUE: environment of that lane's jobs (gpu_session.sh's
# variables, e.g. GPUTESTS="tests/test_kernels_rbf.py tests/test_kernels_gka.py" or BENCH_ARGS="--tokens 32768").
# Example:
#   bash benchmarks/gpu_lanes.sh $OUT '0 GPUTESTS="tests/test_kernels_rbf.py" : gputests:300' '1 : hostops profile:400'
# Timings from lanes that ran side by side share the host's CPUs: compare rows within one lane.
set -uo pipefail
OUT=${1:?usage: bash benchmarks/gpu_lanes.sh OUT 'GPUS [VAR=VALUE ...] : JOB ...' ...}
shift
REPO=$(cd "$(dirname "$0")/.." && pwd)
SESSION=${GPU_SESSION:-$REPO/benchmarks/gpu_session.sh}  # what runs a lane's jobs (a test substitutes a stub)
for spec in "$@"; do
    case "$spec" in
        *" : "*) ;;
        *) echo "gpu_lanes.sh: a lane is 'GPUS [VAR=VALUE ...] : JOB ...' (a ' : ' between them); got '$spec'" >&2
           exit 2 ;;
    esac
done
mkdir -p "$OUT/lanes"
# the carried wheels go into gpu_session.sh's site folder once, before the lanes start (not four installs at once)
bash "$SESSION" "$OUT/lanes/setup" > "$OUT/lanes/setup.log" 2>&1
pids=()
i=0
for spec in "$@"; do
    head=${spec%% : *}  # the first " : " (node ids in GPUTESTS hold "::")
    jobs=${spec#* : }
    read -r gpus assignments <<< "$head"
    (
        [ -n "${assignments// /}" ] && eval "export $assignments"
        export CUDA_VISIBLE_DEVICES=$gpus WORK=/tmp/hf_rbf_lane$i
        echo "lane $i: GPUs $gpus; $assignments; jobs $jobs"
        # shellcheck disable=SC2086
        bash "$SESSION" "$OUT/lanes/lane$i" $jobs
    ) > "$OUT/lanes/lane$i.log" 2>&1 &
    pids+=($!)
    i=$((i + 1))
done
for pid in "${pids[@]}"; do wait "$pid"; done
for f in "$OUT"/lanes/lane*.log; do echo "##### $f"; grep -v "^-" "$f" | tail -n 60; done
tar -czf "$OUT/lanes.tar.gz" -C "$OUT" lanes && rm -rf "$OUT/lanes"
ls -la "$OUT"
