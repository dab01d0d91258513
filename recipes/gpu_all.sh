#!/usr/bin/env bash
# Every family on the same data and budget on one GPU (H100 / H200: about 12 minutes), then CORE-20, throughput,
# accounting, figures and the model-card tables, all written under RESULTS.
#
#   bash recipes/gpu_all.sh RESULTS [DATA_ROOT]
#
# DATA_ROOT: the folder holding tinystories/, gutenberg_children/ and core/ (shared/data; default: $HF_RBF_DATA_ROOT,
# else ../shared/data or shared/data next to / inside the checkout).  Environment knobs:
#   CONFIGS="tinystories_rbf ..."  recipes to train (default: all tinystories_* families, dot_sssl, gka_sssl)
#   CORE_MAX_PER_TASK=50           examples per CORE task after the seed-1337 shuffle (0 skips CORE)
#   WORK=/tmp/hf_rbf_gpu_all       checkpoints, data cache and HF caches (RESULTS gets only small files)
#   KEEP_MODELS=1                  also copy each run's final/ model into RESULTS
#   EXTRA_SET="k=v ..."          more --set overrides for every recipe (e.g. training.max_steps=500)
#   THROUGHPUT=0                   skip the throughput step (run recipes/throughput.py on its own)
#   SMOKE=1                        a CPU check of this script: tiny models, a few steps, 11 CORE examples per task
# A recipe whose family is not registered in this checkout is reported in RESULTS/failures.txt and skipped.
set -uo pipefail

RESULTS=${1:?usage: bash recipes/gpu_all.sh RESULTS [DATA_ROOT]}
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
WORK=${WORK:-/tmp/hf_rbf_gpu_all}
mkdir -p "$WORK"
export HF_HOME=${HF_HOME:-$WORK/hf_home}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
CORE_MAX_PER_TASK=${CORE_MAX_PER_TASK:-50}
CONFIGS=${CONFIGS:-"tinystories_llama tinystories_dot tinystories_rbf tinystories_gka tinystories_scalar_sort tinystories_hybrid_sort dot_sssl gka_sssl"}
LOG="$RESULTS/gpu_all.log"
: > "$RESULTS/failures.txt"
: > "$RESULTS/timings.txt"

# The GPU machine has no `datasets` / `evaluate`: wheels carried into ./wheels are installed from there.
if [ -d "$REPO/wheels" ] && ! python -c "import datasets, evaluate" 2>/dev/null; then
    python -m pip install --no-deps --no-index "$REPO"/wheels/*.whl >> "$LOG" 2>&1 || echo "pip install from wheels/ failed" | tee -a "$RESULTS/failures.txt"
fi

DATA_ROOT=${2:-${HF_RBF_DATA_ROOT:-}}
if [ -z "$DATA_ROOT" ]; then
    for c in "$REPO/../shared/data" "$REPO/shared/data"; do [ -d "$c" ] && DATA_ROOT=$(cd "$c" && pwd) && break; done
fi
[ -d "$DATA_ROOT/tinystories" ] || { echo "no data: pass DATA_ROOT (the folder with tinystories/ and core/)"; exit 2; }
export HF_RBF_DATA_ROOT="$DATA_ROOT"

DEVICE=cuda
CORE_ARGS=()
COMMON=(--set "data.root=$DATA_ROOT" "data.cache_dir=$WORK/data_cache")
# EXTRA_SET="training.max_steps=500 ...": more --set overrides for every recipe (e.g. a shorter GPU budget)
read -r -a EXTRA_SET_ARR <<< "${EXTRA_SET:-}"
COMMON+=("${EXTRA_SET_ARR[@]}")
if [ "${SMOKE:-0}" = "1" ]; then
    DEVICE=cpu
    CORE_MAX_PER_TASK=11   # the smallest that a 10-shot task accepts
    CORE_ARGS=(--max-seq-len 512)  # the smoke models' 64-token context cannot hold every scored answer
    COMMON+=(training.max_steps=4 training.eval_steps=2 training.save_steps=4 training.logging_steps=1 training.bf16=false
             training.optim=adamw_torch training.dataloader_num_workers=0 global_batch_size=4 data.block_size=64
             data.max_validation_blocks=4 model.config.max_position_embeddings=64 model.expected_num_parameters=null
             evaluation.bpb.max_chars=2000 evaluation.generation.max_new_tokens=8)
    THROUGHPUT_ARGS=(--device cpu --batch-size 2 --seq-len 32 --steps 1 --warmup 1
                     --model-set hidden_size=32 num_hidden_layers=1 num_attention_heads=2 intermediate_size=64 vocab_size=512)
else
    export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}   # one GPU: Trainer would use DataParallel over several
    THROUGHPUT_ARGS=()
fi

step() {  # step NAME COMMAND...: run, time, log; a failure is recorded and the script goes on
    local name=$1; shift
    local t0=$(date +%s)
    echo "=== $name: $*" | tee -a "$LOG"
    if "$@" >> "$LOG" 2>&1; then
        echo "$name $(( $(date +%s) - t0 ))s ok" | tee -a "$RESULTS/timings.txt"
        return 0
    fi
    echo "$name $(( $(date +%s) - t0 ))s FAILED (see gpu_all.log)" | tee -a "$RESULTS/timings.txt" "$RESULTS/failures.txt"
    return 1
}

T_START=$(date +%s)
python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0))" | tee -a "$LOG"

# 1. tokenizer and packed data, once for every run
step prepare python recipes/pretrain.py --config recipes/configs/tinystories_rbf.yaml --prepare-only \
    --output-dir "$WORK/prepare" "${COMMON[@]}" || exit 1
TOKENIZER="$WORK/prepare/tokenizer"

# 2. every recipe: train, evaluate, story, remote-code check; then CORE-20
for name in $CONFIGS; do
    out="$WORK/runs/$name"
    rm -rf "$out"
    if step "train:$name" python recipes/pretrain.py --config "recipes/configs/$name.yaml" --output-dir "$out" \
        "${COMMON[@]}" "tokenizer.path=$TOKENIZER"; then
        if [ "$CORE_MAX_PER_TASK" != "0" ] && [ -d "$DATA_ROOT/core" ]; then
            step "core:$name" python recipes/eval_core.py --model "$out/final" --bundle "$DATA_ROOT/core" \
                --max-per-task "$CORE_MAX_PER_TASK" --batch-size 64 --device "$DEVICE" --dtype float32 \
                --trust-remote-code --output "$out/core.json" "${CORE_ARGS[@]}"
        fi
    fi
    if [ -d "$out" ]; then
        mkdir -p "$RESULTS/$name"
        for f in summary.json metrics.json metrics.csv loss_curve.png recipe.yaml core.json; do
            [ -f "$out/$f" ] && cp "$out/$f" "$RESULTS/$name/"
        done
        [ "${KEEP_MODELS:-0}" = "1" ] && [ -d "$out/final" ] && cp -r "$out/final" "$RESULTS/$name/final"
    fi
done

# 3. throughput of every family against Llama (SDPA), one run
[ "${THROUGHPUT:-1}" != "0" ] && step throughput python recipes/throughput.py --output "$RESULTS/throughput" "${THROUGHPUT_ARGS[@]}"

# 4. parameter / FLOP accounting, figures, model-card tables
step accounting python recipes/accounting.py --output "$RESULTS/accounting"
runs=()
for name in $CONFIGS; do [ -f "$RESULTS/$name/metrics.json" ] && runs+=("$name=$RESULTS/$name"); done
if [ ${#runs[@]} -gt 0 ]; then
    step loss-curves python recipes/compare_runs.py --runs "${runs[@]}" --output "$RESULTS/compare" --x tokens \
        --title "TinyStories recipes: loss against training tokens"
fi
for name in tinystories_rbf tinystories_gka tinystories_dot tinystories_llama gka_sssl; do
    [ -d "$WORK/runs/$name/final" ] && step "attention:$name" python recipes/visualize.py attention \
        --model "$WORK/runs/$name/final" --output "$RESULTS/figures/$name"
done
sig=()
for name in tinystories_gka gka_sssl; do [ -d "$WORK/runs/$name/final" ] && sig+=(--model "$name=$WORK/runs/$name/final"); done
[ ${#sig[@]} -gt 0 ] && step sigma python recipes/visualize.py sigma "${sig[@]}" --output "$RESULTS/figures/gka_sigma"
for name in tinystories_scalar_sort tinystories_hybrid_sort; do
    [ -d "$WORK/runs/$name/final" ] && step "sorted-keys:$name" python recipes/visualize.py sorted-keys \
        --model "$WORK/runs/$name/final" --output "$RESULTS/figures/$name"
done
rm -rf "$RESULTS/model_cards" && cp -r model_cards "$RESULTS/model_cards"
step model-cards python recipes/fill_model_cards.py --results "$RESULTS" --cards "$RESULTS/model_cards" \
    --accounting "$RESULTS/accounting.json"

echo "total $(( $(date +%s) - T_START ))s" | tee -a "$RESULTS/timings.txt"
echo "results in $RESULTS (failures: $(wc -l < "$RESULTS/failures.txt"))"
