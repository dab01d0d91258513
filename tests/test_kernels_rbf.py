"""Fused Triton kernels of RBF attention:
the output and every gradient against the float64 naive reference.

The shared cases (where they run, shapes, dtypes, masks, tolerances) are described in
``tests/kernel_family_checks.py``; this file adds the family's own tests.
"""

from kernel_family_checks import (  # noqa: F401 (the shared tests, collected here; imported before triton)
    _kernels_runnable,
    pytest_generate_tests,
    test_full_shapes_on_gpu,
    test_in_interpreter_subprocess,
    test_matches_float64_reference,
)

FAMILY = "rbf"
