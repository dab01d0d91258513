"""Fused Triton kernels of Gaussian kernel attention (GKA):
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

FAMILY = "gka"
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


def test_features_as_a_transposed_view_match_contiguous_features():
    """The GKA layer hands the kernels its features as a transposed view of ``[B, N, H, d]`` (no copy): the output and
    the gradients (features, per-head log-bandwidth) equal those of the same features made contiguous, and the float64
    naive reference to float32 rounding."""
    from hf_rbf.attention_gka import gka_attention

    g = torch.Generator().manual_seed(0)
    b, n, h, d = 2, 37, 2, 16
    base = torch.randn(b, n, h * d, generator=g, dtype=torch.float64)
    upstream = torch.randn(b, h, n, d, generator=g, dtype=torch.float64)
    results = {}
    for name, backend, dtype, layout in [
        ("view", "triton", torch.float32, lambda t: t.unflatten(-1, (h, d)).transpose(1, 2)),
        ("contiguous", "triton", torch.float32, lambda t: t.unflatten(-1, (h, d)).transpose(1, 2).contiguous()),
        ("reference", "naive", torch.float64, lambda t: t.unflatten(-1, (h, d)).transpose(1, 2)),
    ]:
        x = base.to(DEVICE, dtype).requires_grad_()
        log_sigma = torch.tensor([0.1, -0.2], device=DEVICE, dtype=torch.float64).requires_grad_()
        features = layout(x)
        assert features.is_contiguous() == (name == "contiguous")
        out = gka_attention(features, log_sigma, causal=True, eps=1e-6, backend=backend)
        (out.double() * upstream.to(DEVICE)).sum().backward()
        results[name] = [out.detach().double().cpu(), x.grad.double().cpu(), log_sigma.grad.double().cpu()]
    for got, same, ref in zip(results["view"], results["contiguous"], results["reference"]):
        torch.testing.assert_close(got, same, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-3 * ref.abs().max().item())
