#!/usr/bin/env bash
# Download the wheels that the lent GPU machines' image lacks into .whl/ (ignored by .gitignore, so it travels only
# when carried: `run(..., carry=[".whl", ...])`), for benchmarks/gpu_session.sh, which installs them.
# The image (2026-11): Python 3.12, torch 2.11, torchvision 0.26, pyarrow 25, huggingface_hub 1.33, no datasets /
# evaluate.  datasets 5.2 (not 4.x): 4.x's torch formatter imports torchvision.io.VideoReader, which torchvision 0.26
# no longer has, and every DataLoader worker then fails (benchmarks/results/h200x4-2026-11-26/README.md, section 6).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
    -d .whl datasets==5.2.0 evaluate==0.4.6 dill==0.4.0 multiprocess==0.70.18 xxhash==3.6.0
ls -la .whl
