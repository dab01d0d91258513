"""Fused Triton kernels of scalar (sort) attention:
the output and every gradient against the float64 naive reference.

On a machine without CUDA the kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``) at small shapes:
odd lengths, head dims 8..64, float32 / bfloat16 / float16, causal and bidirectional, windows, prefix keys, padding
with fully masked rows, key log-weights of every broadcast form, fewer queries than keys, learnable parameters and
the split-K decode path.  The case list and tolerances live in ``benchmarks/kernel_checks.py``, shared with the GPU
script ``benchmarks/check_kernels_gpu.py``; the ``gpu``-marked test runs the full-shape cases.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # must happen before triton is imported: the kernels are decorated as interpreted functions at import time
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import kernel_checks as kc  # noqa: E402

from hf_rbf import kernels_common  # noqa: E402

FAMILY = "scalar"
ON_GPU = torch.cuda.is_available() and not kernels_common.DEFINED_INTERPRETED
# False when triton was imported (by an earlier test module) before TRITON_INTERPRET could be set: then this file
# re-runs itself in a subprocess with the variable set (test_in_interpreter_subprocess).
IN_PROCESS = ON_GPU or kernels_common.DEFINED_INTERPRETED
DEVICE = "cuda" if ON_GPU else "cpu"


@pytest.fixture(autouse=True)
def _kernels_runnable(request):
    if not IN_PROCESS and request.function.__name__ != "test_in_interpreter_subprocess":
        pytest.skip(
            "triton was imported without TRITON_INTERPRET=1 in this process; test_in_interpreter_subprocess "
            "runs these checks"
        )


def test_in_interpreter_subprocess():
    if IN_PROCESS:
        pytest.skip("the kernels run in this process")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]


@pytest.mark.parametrize("case", kc.small_cases()[FAMILY], ids=lambda c: c.name)
def test_matches_float64_reference(case):
    res = kc.check_case(case, DEVICE)
    assert res.ok, f"{case.name}: {res.summary()} {res.errors}"


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("case", [c for c in kc.full_cases() if c.family == FAMILY], ids=lambda c: c.name)
def test_full_shapes_on_gpu(case):
    res = kc.check_case(case, "cuda")
    assert res.ok, f"{case.name}: {res.summary()} {res.errors}"


@pytest.mark.parametrize("heads_per_program", [2, 4])
def test_stacked_heads_of_a_value_group(heads_per_program, monkeypatch):
    """The stacked layout (several heads of a value group per program, each value tile read once) against float64;
    the autotuner may prefer one head per program, so this path is forced here."""
    from hf_rbf import kernels_scalar_bwd, kernels_scalar_fwd

    monkeypatch.setenv("HF_RBF_SCALAR_HEADS_PER_PROGRAM", str(heads_per_program))
    case = kc.Case("scalar", h=4, groups=1, tau="token", klw="bh", window=7, prefix=2, pad=3, seed=21)
    res = kc.check_case(case, DEVICE)
    assert res.ok, f"{case.name}: {res.summary()} {res.errors}"
    for tuner in (
        kernels_scalar_fwd._scalar_fwd,
        kernels_scalar_bwd._scalar_bwd_dkv,
        kernels_scalar_bwd._scalar_bwd_dq,
    ):
        assert tuner.best_config.kwargs["HP"] == heads_per_program
