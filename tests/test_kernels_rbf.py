"""Fused Triton kernels of RBF attention:
the output and every gradient against the float64 naive reference.

The shared cases (where they run, shapes, dtypes, masks, tolerances) are described in
``tests/kernel_family_checks.py``; this file adds the family's own tests.
"""

from kernel_family_checks import (  # noqa: F401 (the shared tests, collected here; imported before triton)
    DEVICE,
    _kernels_runnable,
    kc,
    pytest_generate_tests,
    test_full_shapes_on_gpu,
    test_in_interpreter_subprocess,
    test_matches_float64_reference,
)

FAMILY = "rbf"


def test_norm_term_through_the_tensor_cores_matches_the_reference():
    """The forward's ``kx`` experiment (``benchmarks/probe_forward_variants.py``): the key norms as three parts of the
    input dtype in a 16-wide extra tensor-core step give the float64 reference's output within the dtype's tolerance,
    causal, at odd lengths, with large key norms (the split keeps ~24 bits where one bf16 value keeps 8)."""
    import math

    import torch

    from hf_rbf.attention_rbf import rbf_attention
    from hf_rbf.kernels_flash_fwd import distance_forward, norm_columns

    g = torch.Generator().manual_seed(5)
    common = dict(causal=True, window=None, num_prefix_keys=0, normalize=True, qnorm=False, kv_same=False, eps=0.0)
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (torch.randn(2, 2, 37, 16, generator=g) for _ in range(3))
        k = k * 3.0  # ||k||^2 ~ 150: a single bf16 value would miss it by ~0.5
        gamma = torch.tensor([0.5 / math.sqrt(16), 0.05])
        q, k, v = (t.to(DEVICE, dtype) for t in (q, k, v))
        kx = norm_columns(k)
        assert kx.shape == (2, 2, 37, 4) and kx.dtype == dtype
        assert torch.allclose(kx.float()[..., :3].sum(-1), -0.5 * k.float().square().sum(-1), rtol=1e-6)
        out = distance_forward(q, k, v, None, None, None, None, gamma.to(DEVICE), None, kx=kx, **common)[0]
        ref = rbf_attention(q.double(), k.double(), v.double(), gamma=gamma.double().to(DEVICE), backend="naive")
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert err < kc.TOLERANCES[dtype][0], (dtype, err)
