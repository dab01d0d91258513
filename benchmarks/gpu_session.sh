#!/usr/bin/env bash
# One device call of the project's GPU work: run the named jobs, each under its own time limit, and pack every
# job's results into one tarball under $OUT (the device tool returns at most 8 files, two folders deep).
#
#   bash benchmarks/gpu_session.sh OUT JOB[:SECONDS] [JOB[:SECONDS] ...]
#
# Jobs (default time limits in brackets):
#   env          versions, GPU, pip installs from ./wheels (datasets, evaluate: the GPU image lacks them)  [120]
#   gputests     pytest -m gpu over the whole suite (kernels, attention backends, sorted cache; GPUTESTS: the
#                files to run instead of tests/, split on spaces: files, node ids (file.py::test), options
#                without spaces (-rA); a quoted `-k "a or b"` breaks into words, so name node ids instead; only
#                tests marked `gpu` run: a CPU/interpreter test named here is deselected)                         [240]
#   kernelcheck  benchmarks/check_kernels_gpu.py (full-shape output and gradient checks, pass/fail table)     [240]
#   bench        benchmarks/bench_attention.py (training sweep and decode rows, ratios against SDPA-flash)    [300]
#   forward      benchmarks/probe_forward_variants.py (the rbf forward as shipped, with a key-bias pass, without
#                the norm term, SDPA flash / cuDNN; then its tile configs one by one; FORWARD_ARGS appended)   [300]
#   hopper       benchmarks/probe_hopper_forward.py (a tutorial-shaped rbf forward with TMA descriptors, warp
#                specialisation on/off and three forms of the norm term, vs the shipped kernel and SDPA;
#                HOPPER_ARGS appended)                                                                         [300]
#   keybias      benchmarks/probe_key_bias.py (the key-bias pass's configs one by one against a copy of the keys, the
#                rbf forward with inline norms / the pass / no norm term vs SDPA, CUDA-graph and stream timings;
#                KEYBIAS_ARGS appended)                                                                        [240]
#   decodekernel benchmarks/probe_decode_kernel.py (one decode step at 8k-512k keys: SDPA's backends, the split-K
#                kernel with inline / stored key norms / none, GKA's form, tiles and split counts one by one;
#                DECODEKERNEL_ARGS appended)                                                                   [240]
#   sorted       recipes/bench_sorted_decode.py --device cuda (sorted-window decode vs exact)               [120]
#   mass         recipes/measure_captured_mass.py --size gpu (captured attention mass, STEPS env)          [300]
#   vit          recipes/gpu_vit_mnist.sh (GKA vs DeiT on MNIST, EPOCHS env)                               [300]
#   scaling      benchmarks/bench_scaling.py (single GPU, DDP and FSDP2 on every GPU count here; SCALING_ARGS
#                appended, e.g. "--concurrent --configs ...")                                                    [540]
#   throughput   recipes/throughput.py (tokens/s of every family against LlamaForCausalLM with SDPA)          [150]
#   lm           recipes/gpu_all.sh (every family: train, val loss, bpb, CORE-20, throughput, cards)       [560]
#   multi        recipes/gpu_multi.sh (1 GPU vs DDP vs FSDP on 2 GPUs, STEPS env)                          [400]
#   hostops      benchmarks/probe_triton_launch.py (where a triton launch's host time goes) and
#                benchmarks/count_host_ops.py --time (launches, aten ops and host ms per fused call; twice: about
#                200 s for every call on an H100 host, 100 s gave five rows)                                       [240]
#   backwardhost benchmarks/probe_backward_host.py (host time of each phase of a fused call's backward: our
#                Python, the launches, autotuner fall-throughs, the autograd engine; torch.profiler per node)    [200]
#   firststeps   benchmarks/profile_training.py --first-steps twice, each in a fresh process: "cold" (this machine's first
#                compile and autotune of the d256 shapes, unless an earlier job compiled them) then "warm" (what a
#                user's second run pays: triton's and the autotuner's disk caches filled); FIRST_VARIANTS: the list [300]
#   profile      benchmarks/profile_training.py, the run-5 command (every family vs Llama, d256 and d768,
#                best of 3 interleaved rounds; PROFILE_ARGS replaces the defaults, PROFILE_VARIANTS the variants)                              [500]
#   staticdecode benchmarks/bench_sorted_static_decode.py (fused vs torch vs dense SDPA per layer step,
#                8k-1M; STATIC_ARGS appended)                                                                [400]
#   generate     benchmarks/bench_generate.py (ms per token of every family vs Llama, dynamic and static)      [500]
#   decodeprofile benchmarks/profile_decode.py (torch.profiler and cProfile of dynamic-cache decode steps, every
#                family vs Llama, per token: kernel ms, launches, syncs, top host ops; DECODEPROFILE_ARGS appended) [300]
#   diagnose     benchmarks/diagnose_static_decode.py (why the static cache does or does not pay: compile counters,
#                CUDA-graph skips, launches per static generate; DIAGNOSE_ARGS appended, DIAGNOSE_LOGS = TORCH_LOGS) [400]
#   nonfinite    benchmarks/find_nonfinite_grads.py (where a run's gradients first stop being finite; NONFINITE_ARGS,
#                default: the 1B rbf recipe, Triton with anomaly detection, then SDPA)                           [300]
#   deit         tests/test_seed_deit_recipe.py (the timm DeiT ingredients: the image has timm + torchvision)   [120]
#   science      recipes/science_table.py on SCIENCE_CONFIG (default science/tinystories.yaml), SCIENCE_WORKERS
#                processes at once (default 6), SCIENCE_ARGS appended (e.g. "--seeds 0 --max-minutes 5"); output in
#                ./outputs/science_tinystories (kept between calls while the machine is warm); every results.json,
#                worker log and failure.json packed; runs stored under SCIENCE_STORED (default
#                model_cards/results/science_tinystories) count as done                                                            [560]
# Wheels: every *.whl of ./.whl or ./wheels (what the image lacks: datasets, evaluate, dill, multiprocess, xxhash;
# `bash benchmarks/fetch_gpu_wheels.sh` downloads the tested set into .whl/) goes into /tmp/hf_rbf_site (on PYTHONPATH)
# before the first job, on every call.
# Data: DATA_ROOT (default ./gpu_data, a copy of shared/data carried with the call, else ../shared/data).
set -uo pipefail
OUT=${1:?usage: bash benchmarks/gpu_session.sh OUT JOB[:SECONDS] ...}
shift
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
export PYTHONUNBUFFERED=1 PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false
DATA_ROOT=${DATA_ROOT:-}
for c in "$REPO/gpu_data" "$REPO/../shared/data"; do
    [ -z "$DATA_ROOT" ] && [ -d "$c/tinystories" ] && DATA_ROOT=$(cd "$c" && pwd)
done
export HF_RBF_DATA_ROOT="$DATA_ROOT" DATA_ROOT
export WORK=${WORK:-/tmp/hf_rbf_gpu_session}
mkdir -p "$WORK" "$OUT"

# the image has no index: the wheels carried with the call, --no-deps (the image has their dependencies)
SITE=/tmp/hf_rbf_site
export PYTHONPATH="$SITE:$PYTHONPATH"
# Always (re)install what was carried: on a machine still warm from an earlier call the site folder may hold other
# versions, and "datasets imports" does not say which (a stale datasets 4.4 broke every training run of a session).
for d in .whl wheels; do
    ls "$d"/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target "$SITE" "$d"/*.whl 2>&1 | tail -3
done

declare -A LIMIT=([env]=120 [deit]=120 [science]=560 [hostops]=240 [backwardhost]=200 [firststeps]=300 [profile]=500 [staticdecode]=400 [generate]=500 [decodeprofile]=300 [diagnose]=400 [gputests]=240 [kernelcheck]=240 [bench]=300 [forward]=300 [hopper]=300 [keybias]=240 [decodekernel]=240 [sorted]=120 [mass]=300 [vit]=300
                  [lm]=560 [multi]=400 [throughput]=150 [scaling]=540 [nonfinite]=300)

job_env() {
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
    # --no-deps: the image has their dependencies (pyarrow, fsspec, xxhash, pandas, huggingface_hub) and no index;
    # datasets 5.x wants pyarrow >= 24: if the image's is older, the 4.4 wheel in wheels/fallback (pyarrow >= 21) goes in.
    if [ -d wheels ]; then
        python3 -m pip install -q --no-deps --no-index wheels/*.whl 2>&1 | tail -3
        python3 -c "import datasets" 2>/dev/null || python3 -m pip install -q --no-deps --no-index --force-reinstall wheels/fallback/*.whl
    fi
    python3 -c "import datasets, evaluate, pyarrow; print('datasets', datasets.__version__, 'evaluate', evaluate.__version__, 'pyarrow', pyarrow.__version__)"
}
# autotune off: a correctness run needs one config per kernel variant, not every config compiled and timed
job_gputests() { HF_RBF_TRITON_AUTOTUNE=0 python3 -m pytest -m gpu -q -p no:cacheprovider --durations=20 ${GPUTESTS:-tests}; }
job_kernelcheck() { python3 benchmarks/check_kernels_gpu.py --workers 14; }
job_bench() { python3 benchmarks/bench_attention.py --out "$1" ${BENCH_ARGS:-}; }
job_forward() { python3 benchmarks/probe_forward_variants.py --out "$1" ${FORWARD_ARGS:-}; }
job_hopper() { python3 benchmarks/probe_hopper_forward.py --out "$1" ${HOPPER_ARGS:-}; }
job_keybias() { python3 benchmarks/probe_key_bias.py --out "$1" ${KEYBIAS_ARGS:-}; }
job_decodekernel() { python3 benchmarks/probe_decode_kernel.py --out "$1" ${DECODEKERNEL_ARGS:-}; }
job_sorted() { python3 recipes/bench_sorted_decode.py --device cuda --output "$1" ${SORTED_ARGS:-}; }
job_mass() {
    python3 recipes/measure_captured_mass.py --size gpu --output "$1" ${MASS_STEPS:+--steps $MASS_STEPS} \
        ${MASS_ARGS:-}
}
job_vit() { EPOCHS=${EPOCHS:-4} WORK="$WORK/vit" bash recipes/gpu_vit_mnist.sh "$1" "$DATA_ROOT/images/mnist"; }
job_throughput() { python3 recipes/throughput.py --output "$1/throughput" ${THROUGHPUT_ARGS:-}; }
job_lm() { WORK="$WORK/lm" bash recipes/gpu_all.sh "$1" "$DATA_ROOT"; }
job_hostops() {
    python3 benchmarks/probe_triton_launch.py --json "$1/triton_launch.json"
    python3 benchmarks/count_host_ops.py --time --calls 300 --json "$1/host_ops_1.json"
    python3 benchmarks/count_host_ops.py --time --calls 300 --json "$1/host_ops_2.json"
}
job_backwardhost() { python3 benchmarks/probe_backward_host.py --out "$1" ${BACKWARDHOST_ARGS:-}; }
job_firststeps() {
    local variants=${FIRST_VARIANTS:-"llama;rbf (1 register, SuSiE);gka;hybrid_sort (1 register);scalar_sort (1 register)"}
    python3 benchmarks/profile_training.py --out "$1/cold" --first-steps --variants "$variants"
    python3 benchmarks/profile_training.py --out "$1/warm" --first-steps --variants "$variants"
}
job_profile() {
    # PROFILE_VARIANTS: the --variants list on its own (its names hold spaces, which PROFILE_ARGS would split)
    local variants=${PROFILE_VARIANTS:-"llama;rbf (1 register, SuSiE);rbf (no registers, RoPE);gka;hybrid_sort;scalar_sort"}
    # shellcheck disable=SC2086
    python3 benchmarks/profile_training.py --out "$1" ${PROFILE_ARGS:---sizes d256,d768 --no-host --no-kernels \
        --steps 10 --interleave 3} --variants "$variants"
}
job_staticdecode() { python3 benchmarks/bench_sorted_static_decode.py --out "$1" ${STATIC_ARGS:-}; }
# GENERATE_VARIANTS / DIAGNOSE_VARIANTS: a --variants list on its own (names such as "scalar_sort (window 64)" hold
# spaces, which the *_ARGS variables would split)
job_generate() {
    python3 benchmarks/bench_generate.py --out "$1" ${GENERATE_ARGS:-} ${GENERATE_VARIANTS:+--variants "$GENERATE_VARIANTS"}
}
job_decodeprofile() { python3 benchmarks/profile_decode.py --out "$1" ${DECODEPROFILE_ARGS:-}; }
job_diagnose() {
    TORCH_LOGS=${DIAGNOSE_LOGS:-recompiles,graph_breaks,cudagraphs,perf_hints} \
        python3 benchmarks/diagnose_static_decode.py --out "$1" ${DIAGNOSE_ARGS:-} \
        ${DIAGNOSE_VARIANTS:+--variants "$DIAGNOSE_VARIANTS"}
}
job_nonfinite() {
    if [ -n "${NONFINITE_ARGS:-}" ]; then
        # shellcheck disable=SC2086
        python3 benchmarks/find_nonfinite_grads.py --out "$1" $NONFINITE_ARGS
        return
    fi
    python3 benchmarks/find_nonfinite_grads.py --out "$1/anomaly" --config recipes/configs/scale_1b_rbf.yaml --steps 40 \
        --backends triton --anomaly
    python3 benchmarks/find_nonfinite_grads.py --out "$1" --config recipes/configs/scale_1b_rbf.yaml --steps 40 \
        --backends sdpa
}
job_deit() { python3 -m pytest -q -p no:cacheprovider -rs tests/test_seed_deit_recipe.py; }
job_science() {
    local out=${SCIENCE_OUTPUT:-outputs/science_tinystories} rc
    # the runs already stored in the repository are not redone on a fresh machine (a run with results.json is done)
    local stored=${SCIENCE_STORED:-model_cards/results/science_tinystories}
    [ -d "$stored/runs" ] && mkdir -p "$out" && cp -rn "$stored/runs" "$out/"
    OMP_NUM_THREADS=2 python3 recipes/science_table.py --config "${SCIENCE_CONFIG:-recipes/configs/science/tinystories.yaml}" \
        --output "$out" --workers "${SCIENCE_WORKERS:-6}" --no-report --store "$1/store" ${SCIENCE_ARGS:-}
    rc=$?
    (cd "$out" && find runs \( -name worker.log -o -name failure.json -o -name summary.json \) -print0 |
        tar --null -czf "$1/logs.tar.gz" -T - 2>/dev/null)
    return $rc
}
job_scaling() {
    python3 benchmarks/bench_scaling.py --output "$1" ${SCALING_ARGS:-}
    rm -rf "$1/prepared"  # the packed data: large, and rebuilt by any run
}
job_multi() { WORK="$WORK/multi" bash recipes/gpu_multi.sh "$1" "$DATA_ROOT"; }

summary="$OUT/session.txt"
: > "$summary"
for spec in "$@"; do
    name=${spec%%:*}
    secs=${spec#*:}
    [ "$secs" = "$spec" ] && secs=${LIMIT[$name]:-300}
    dir="$WORK/results/$name"
    rm -rf "$dir" && mkdir -p "$dir"
    t0=$(date +%s)
    echo "=== $name (limit ${secs}s)" | tee -a "$summary"
    timeout --signal=INT --kill-after=20 "$secs" bash -c "$(declare -f job_$name); job_$name '$dir'" > "$dir/log.txt" 2>&1
    rc=$?
    echo "$name rc=$rc $(( $(date +%s) - t0 ))s" | tee -a "$summary"
    tail -n 25 "$dir/log.txt" | tee -a "$summary"
    tar -czf "$OUT/$name.tar.gz" -C "$WORK/results" "$name"
done
ls -la "$OUT"
