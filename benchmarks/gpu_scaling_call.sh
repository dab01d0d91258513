#!/usr/bin/env bash
# One device call of benchmarks/bench_scaling.py whose tokenizer and packed data survive into the next call on the
# same warm machine (gpu_session.sh's `scaling` job prepares them again in every call: about 48 s).  The results of
# this call (without the packed data) go to $OUT/NAME.tar.gz and the log to $OUT/NAME.log.
#
#   bash benchmarks/gpu_scaling_call.sh OUT NAME SECONDS [bench_scaling.py arguments ...]
#
# Wheels of ./.whl (datasets & co., which the GPU image lacks) go into /tmp/hf_rbf_site; data from ./gpu_data.
set -uo pipefail
OUT=${1:?usage: OUT NAME SECONDS [args]}; NAME=${2:?}; SECS=${3:?}; shift 3
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
SITE=/tmp/hf_rbf_site
ls .whl/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target "$SITE" .whl/*.whl 2>&1 | tail -3
export PYTHONUNBUFFERED=1 PYTHONPATH="$SITE:$REPO" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export HF_RBF_DATA_ROOT="$REPO/gpu_data" DATA_ROOT="$REPO/gpu_data"
ROOT=/tmp/hf_rbf_scaling  # prepared/ stays between calls; runs/ and the tables are this call's
mkdir -p "$ROOT" "$OUT" && rm -rf "$ROOT/runs" "$ROOT/scaling.json" "$ROOT/scaling.md"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | sort | uniq -c
t0=$(date +%s)
timeout --signal=INT --kill-after=20 "$SECS" python3 benchmarks/bench_scaling.py --output "$ROOT" "$@" 2>&1 \
    | tee "$OUT/$NAME.log"
echo "bench_scaling rc=${PIPESTATUS[0]} $(( $(date +%s) - t0 ))s" | tee -a "$OUT/$NAME.log"
tar -czf "$OUT/$NAME.tar.gz" --exclude=prepared --exclude='*.pt' --exclude='*.safetensors' -C "$ROOT" .
ls -la "$OUT"
