#!/usr/bin/env bash
# The oldest end of the supported range (.ci/oldest-versions.txt) in its own venv, .venv-oldest:
#   bash .ci/oldest-env.sh install   # create it and install the pinned floors with the package
#   bash .ci/oldest-env.sh test      # run every `contract` test in it
# The newest end is the README's test command (what pip resolves today).  torch comes from the CPU wheel index where
# that index is reachable, else from the default index; `--retries 1` keeps an unreachable extra index from costing
# a retry cycle per package.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-oldest
case "${1:-}" in
  install)
    python -m venv "$venv"
    "$venv/bin/python" -m pip install --retries 1 -c .ci/oldest-versions.txt torch \
      --extra-index-url https://download.pytorch.org/whl/cpu
    "$venv/bin/python" -m pip install -c .ci/oldest-versions.txt -e ".[test,triton]"
    ;;
  test)
    "$venv/bin/python" -c "import torch, transformers, accelerate, peft, datasets; print('oldest versions: torch', torch.__version__, '| transformers', transformers.__version__, '| accelerate', accelerate.__version__, '| peft', peft.__version__, '| datasets', datasets.__version__)"
    "$venv/bin/python" -m pytest -q -n 2 -m "contract and not gpu"
    ;;
  *)
    echo "usage: bash .ci/oldest-env.sh install|test" >&2
    exit 2
    ;;
esac
