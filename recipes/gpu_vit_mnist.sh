#!/usr/bin/env bash
# GKA vs DeiT (dot-product) vision transformers on the full MNIST (60,000 train / 10,000 test) on one GPU:
# the same "mnist" size (D 192, 6 layers, 3 heads, patch 4, 50 tokens), the same schedule, bf16 autocast.
# Each model trains in its own process (so peak-memory numbers do not mix), then the section-7 pictures are drawn
# for test image 0 from both models, and the model card's tables are filled into OUT_DIR/gka_vit.md.
# Expected time on an H100: well under 10 minutes for both (each epoch is 234 steps of a 2-2.7 M parameter model).
#
# Usage:  recipes/gpu_vit_mnist.sh OUT_DIR [MNIST_DIR]
#   OUT_DIR    gets eight files (the device tool returns at most 8): summary.md (GKA vs DeiT table),
#              gka_results.json, dot_results.json (accuracy, parameters, throughput, peak memory, log history),
#              gka_vit.md (the model card with its tables filled), pictures.tar.gz (section-7 figures of both
#              models for test image 0), logs.tar.gz (env.txt, training logs), gka_model.tar.gz and dot_model.tar.gz
#              (the trained checkpoints with their image processor).  Work files go to $WORK (default a mktemp dir).
#   MNIST_DIR  folder with the MNIST IDX files; default $MNIST_DIR, else shared/data/images/mnist inside or next to
#              the repository
# Environment: PYTHON (default python3), EPOCHS (default 10), BATCH (default 256), LR (default 1e-3),
#              WORKERS (DataLoader workers, default 4), EXTRA_ARGS (more train_vit.py arguments, appended last so
#              they win, e.g. "--preset mnist-tiny --cpu" for a smoke test).
#              Needs torch, transformers, datasets, matplotlib, pillow.
set -euo pipefail

OUT=${1:?usage: recipes/gpu_vit_mnist.sh OUT_DIR [MNIST_DIR]}
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DATA=${2:-${MNIST_DIR:-}}
if [[ -z "$DATA" ]]; then
  for cand in "$REPO/shared/data/images/mnist" "$REPO/../shared/data/images/mnist" "$REPO/../../shared/data/images/mnist"; do
    if [[ -d "$cand" ]]; then DATA="$cand"; break; fi
  done
fi
if [[ -z "$DATA" || ! -d "$DATA" ]]; then
  echo "MNIST IDX folder not found; pass it as the second argument or set MNIST_DIR" >&2
  exit 2
fi
PY=${PYTHON:-python3}
EPOCHS=${EPOCHS:-10}
BATCH=${BATCH:-256}
LR=${LR:-1e-3}
WORKERS=${WORKERS:-4}
read -r -a EXTRA <<< "${EXTRA_ARGS:-}"

mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
WORK=${WORK:-$(mktemp -d /tmp/gka_vit_mnist.XXXXXX)}
mkdir -p "$WORK"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export HF_HOME="${HF_HOME:-$WORK/hf_home}"
export PYTHONUNBUFFERED=1

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "repo commit: $(git -C "$REPO" rev-parse HEAD 2>/dev/null || echo unknown)"
  echo "data: $DATA"
  echo "schedule: epochs=$EPOCHS batch=$BATCH lr=$LR workers=$WORKERS"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "nvidia-smi: not available"
  "$PY" -c "import torch, transformers, datasets; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| transformers', transformers.__version__, '| datasets', datasets.__version__)"
} > "$WORK/env.txt" 2>&1
cat "$WORK/env.txt"

for KIND in gka dot; do
  echo "=== training $KIND ==="
  "$PY" "$REPO/recipes/train_vit.py" \
    --data-dir "$DATA" --output-dir "$WORK/run" --attention-type "$KIND" --preset mnist \
    --epochs "$EPOCHS" --batch-size "$BATCH" --lr "$LR" --num-workers "$WORKERS" \
    --eval-every-epoch --throughput-batch-size 512 --logging-steps 50 \
    --cache-dir "$WORK/datasets_cache" ${EXTRA[@]+"${EXTRA[@]}"} 2>&1 | tee "$WORK/train_$KIND.log"
  cp "$WORK/run/$KIND/results.json" "$OUT/${KIND}_results.json"
done

for KIND in gka dot; do
  echo "=== pictures $KIND ==="
  "$PY" "$REPO/recipes/vit_pictures.py" "$WORK/run/$KIND/model" --image-index 0 --data-dir "$DATA" \
    --output-dir "$WORK/pictures/$KIND" 2>&1 | tee "$WORK/pictures_$KIND.log"
done

"$PY" "$REPO/recipes/vit_fill_model_card.py" --gpu-results "$WORK/run" --output "$OUT/gka_vit.md" \
  --summary "$OUT/summary.md"

tar -czf "$OUT/pictures.tar.gz" -C "$WORK" pictures
tar -czf "$OUT/logs.tar.gz" -C "$WORK" env.txt train_gka.log train_dot.log pictures_gka.log pictures_dot.log
tar -czf "$OUT/gka_model.tar.gz" -C "$WORK/run/gka" model
tar -czf "$OUT/dot_model.tar.gz" -C "$WORK/run/dot" model
ls -la "$OUT"
cat "$OUT/summary.md"
