"""Fused Triton kernels of hybrid scalar + dot-product attention:
the output and every gradient against the float64 naive reference.

On a machine without CUDA the kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``) at small shapes:
odd lengths, head dims 8..64, float32 / bfloat16 / float16, causal and bidirectional, windows, prefix keys, padding
with fully masked rows, key log-weights of every broadcast form, fewer queries than keys, learnable parameters and
the split-K decode path.  The case list and tolerances live in ``benchmarks/kernel_checks.py``, shared with the GPU
script ``benchmarks/check_kernels_gpu.py``; the ``gpu``-marked test runs the full-shape cases.  The tests every
family shares live in ``tests/kernel_family_checks.py``.
"""

from kernel_family_checks import (  # noqa: F401 (the shared tests, collected here; imported before triton)
    _kernels_runnable,
    pytest_generate_tests,
    test_full_shapes_on_gpu,
    test_in_interpreter_subprocess,
    test_matches_float64_reference,
)

FAMILY = "hybrid"
