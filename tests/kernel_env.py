"""Where the fused-kernel tests run, decided before triton is first imported.

On a machine without CUDA the kernels run in Triton's CPU interpreter: ``TRITON_INTERPRET=1`` must be set before
triton is imported (the kernels are decorated as interpreted functions at import time), so the kernel test modules
import this module first.  ``IN_PROCESS`` is False where triton was imported earlier in the process without the
variable (by another test module): such a module then re-runs itself in a subprocess with it set.  The folder
``benchmarks/`` goes on ``sys.path`` for the shared case list (``kernel_checks``) and the host-work counters."""

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from hf_rbf import kernels_common  # noqa: E402

ON_GPU = torch.cuda.is_available() and not kernels_common.DEFINED_INTERPRETED
IN_PROCESS = ON_GPU or kernels_common.DEFINED_INTERPRETED
DEVICE = "cuda" if ON_GPU else "cpu"
