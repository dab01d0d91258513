"""The tests every fused-kernel family shares (``tests/test_kernels_<family>.py`` import them and set ``FAMILY``):
the output and every gradient against the float64 naive reference for the family's cases in
``benchmarks/kernel_checks.py`` (small shapes here, full shapes in the ``gpu``-marked test).

On a machine without CUDA the kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``) at small shapes:
odd lengths, head dims 8..64, float32 / bfloat16 / float16, causal and bidirectional, windows, prefix keys, padding
with fully masked rows, key log-weights of every broadcast form, fewer queries than keys, learnable parameters and
the split-K decode path.  The case list and tolerances live in ``benchmarks/kernel_checks.py``, shared with the GPU
script ``benchmarks/check_kernels_gpu.py``.

Where they run (the CPU interpreter or CUDA) is decided by ``kernel_env``, imported first; a test file imports this
module before anything else that imports triton."""

import os
import subprocess
import sys

import pytest

from kernel_env import DEVICE, IN_PROCESS, ON_GPU  # noqa: F401 (first: sets TRITON_INTERPRET before triton loads)

import kernel_checks as kc  # noqa: E402


@pytest.fixture(autouse=True)
def _kernels_runnable(request):
    if not IN_PROCESS and request.function.__name__ != "test_in_interpreter_subprocess":
        pytest.skip(
            "triton was imported without TRITON_INTERPRET=1 in this process; test_in_interpreter_subprocess "
            "runs these checks"
        )


def pytest_generate_tests(metafunc):
    """``case``: the kernel cases of the test module's ``FAMILY`` (small shapes, or full shapes for the GPU test)."""
    if "case" not in metafunc.fixturenames or not hasattr(metafunc.module, "FAMILY"):
        return
    family = metafunc.module.FAMILY
    if metafunc.function.__name__ == "test_matches_float64_reference":
        cases = kc.small_cases()[family]
    elif metafunc.function.__name__ == "test_full_shapes_on_gpu":
        cases = [c for c in kc.full_cases() if c.family == family]
    else:
        return
    metafunc.parametrize("case", cases, ids=lambda c: c.name)


def test_in_interpreter_subprocess(request):
    if IN_PROCESS:
        pytest.skip("the kernels run in this process")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", request.module.__file__],
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]


def test_matches_float64_reference(case):
    res = kc.check_case(case, DEVICE)
    assert res.ok, f"{case.name}: {res.summary()} {res.errors}"


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
def test_full_shapes_on_gpu(case):
    res = kc.check_case(case, "cuda")
    assert res.ok, f"{case.name}: {res.summary()} {res.errors}"
