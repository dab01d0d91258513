#!/usr/bin/env bash
# The same recipe on 1 GPU, on 2 GPUs with DDP and on 2 GPUs with FSDP, at the same global batch: loss curves,
# tokens/s and a comparison table (recipes/compare_runs.py) under RESULTS/multi.
#
#   bash recipes/gpu_multi.sh RESULTS [DATA_ROOT]
#
# Environment: CONFIG (default recipes/configs/tinystories_rbf.yaml), STEPS (default 300), WORK (default
# /tmp/hf_rbf_gpu_multi), and the accelerate configs recipes/accelerate/{ddp,fsdp}.yaml.  The recipe's
# global_batch_size (64) is kept: each of the 2 processes gets 32 blocks per step, the single GPU 64.
set -uo pipefail

RESULTS=${1:?usage: bash recipes/gpu_multi.sh RESULTS [DATA_ROOT]}
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
mkdir -p "$RESULTS/multi"
RESULTS=$(cd "$RESULTS" && pwd)
WORK=${WORK:-/tmp/hf_rbf_gpu_multi}
CONFIG=${CONFIG:-recipes/configs/tinystories_rbf.yaml}
STEPS=${STEPS:-300}
mkdir -p "$WORK"
export HF_HOME=${HF_HOME:-$WORK/hf_home}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
LOG="$RESULTS/multi/gpu_multi.log"

if [ -d "$REPO/wheels" ] && ! python -c "import datasets, evaluate" 2>/dev/null; then
    python -m pip install --no-deps --no-index "$REPO"/wheels/*.whl >> "$LOG" 2>&1
fi
DATA_ROOT=${2:-${HF_RBF_DATA_ROOT:-}}
if [ -z "$DATA_ROOT" ]; then
    for c in "$REPO/../shared/data" "$REPO/shared/data"; do [ -d "$c" ] && DATA_ROOT=$(cd "$c" && pwd) && break; done
fi
[ -d "$DATA_ROOT/tinystories" ] || { echo "no data: pass DATA_ROOT"; exit 2; }

# Short runs: loss curves and speed, no story / bits per byte / remote-code check (the single-GPU recipes do those).
COMMON=(--set "data.root=$DATA_ROOT" "data.cache_dir=$WORK/data_cache" "training.max_steps=$STEPS"
        training.eval_steps=100 training.save_steps=100000 training.logging_steps=10
        evaluation.generation.enabled=false evaluation.bpb.enabled=false evaluation.remote_code_check=false
        model.expected_num_parameters=null)

run() {  # run NAME COMMAND...
    local name=$1; shift
    echo "=== $name: $*" | tee -a "$LOG"
    local t0=$(date +%s)
    "$@" >> "$LOG" 2>&1 && echo "$name $(( $(date +%s) - t0 ))s ok" | tee -a "$RESULTS/multi/timings.txt" \
        || echo "$name FAILED (see gpu_multi.log)" | tee -a "$RESULTS/multi/timings.txt"
}

CUDA_VISIBLE_DEVICES=0 run prepare python recipes/pretrain.py --config "$CONFIG" --prepare-only \
    --output-dir "$WORK/prepare" "${COMMON[@]}"
COMMON+=("tokenizer.path=$WORK/prepare/tokenizer")
rm -rf "$WORK/1gpu" "$WORK/ddp" "$WORK/fsdp"
CUDA_VISIBLE_DEVICES=0 run 1gpu python recipes/pretrain.py --config "$CONFIG" --output-dir "$WORK/1gpu" "${COMMON[@]}"
CUDA_VISIBLE_DEVICES=0,1 run ddp accelerate launch --config_file recipes/accelerate/ddp.yaml recipes/pretrain.py \
    --config "$CONFIG" --output-dir "$WORK/ddp" "${COMMON[@]}"
CUDA_VISIBLE_DEVICES=0,1 run fsdp accelerate launch --config_file recipes/accelerate/fsdp.yaml recipes/pretrain.py \
    --config "$CONFIG" --output-dir "$WORK/fsdp" "${COMMON[@]}"

runs=()
for name in 1gpu ddp fsdp; do
    if [ -f "$WORK/$name/metrics.json" ]; then
        mkdir -p "$RESULTS/multi/$name"
        for f in summary.json metrics.json metrics.csv loss_curve.png recipe.yaml; do
            [ -f "$WORK/$name/$f" ] && cp "$WORK/$name/$f" "$RESULTS/multi/$name/"
        done
        runs+=("$name=$RESULTS/multi/$name")
    fi
done
python recipes/compare_runs.py --runs "${runs[@]}" --output "$RESULTS/multi" \
    --title "$(basename "$CONFIG" .yaml): 1 GPU vs 2 GPUs (DDP, FSDP), same global batch" | tee -a "$LOG"
