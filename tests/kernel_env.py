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


def check_compiled_matches_eager(loss_fn, t: dict) -> None:
    """``torch.compile(loss_fn, fullgraph=True)`` on leaves made from the tensors ``t`` gives eager's loss and
    gradients (aot_eager on the CPU: the interpreter's kernels cannot go through Inductor; Inductor on the GPU)."""

    def grads(fn):
        leaves = {n: x.detach().clone().to(DEVICE).requires_grad_(True) for n, x in t.items()}
        loss = fn(leaves)
        loss.backward()
        return loss.detach(), {n: x.grad for n, x in leaves.items()}

    torch._dynamo.reset()
    compiled = torch.compile(loss_fn, backend="inductor" if ON_GPU else "aot_eager", fullgraph=True)
    loss_c, grads_c = grads(compiled)
    loss_e, grads_e = grads(loss_fn)
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-5)
    for name in grads_e:
        torch.testing.assert_close(grads_c[name], grads_e[name], rtol=1e-5, atol=1e-5, msg=name)
