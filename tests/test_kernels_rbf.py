"""Fused Triton kernels of RBF attention:
the output and every gradient against the float64 naive reference.

The shared cases (where they run, shapes, dtypes, masks, tolerances) are described in
``tests/kernel_family_checks.py``; this file adds the family's own tests.
"""

import pytest
import torch

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


def _far_keys_case(dtype, kind, gen):
    """q, k, v, key log-weights (or None) for the fixed row maximum's cases: "plain" random inputs, "far" keys
    (every key 190-300 log2 units from the query-norm bound: every probability is below 2^-150 under the fixed maximum,
    so the block must run again with the online one) and "heavy" key log-weights (+200 on some keys, beyond the bound:
    the fixed maximum overflows)."""
    b, h, n, d = 2, 2, 37, 16
    q, k, v = (torch.randn(b, h, n, d, generator=gen) for _ in range(3))
    weights = None
    if kind == "far":
        k = k + 8.0
    elif kind == "heavy":
        weights = torch.zeros(b, n)
        weights[:, ::5] = 200.0
    return q.to(DEVICE, dtype), k.to(DEVICE, dtype), v.to(DEVICE, dtype), weights


@pytest.mark.parametrize("kind", ["plain", "far", "heavy"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fixed_row_max_matches_the_reference_and_the_online_softmax(kind, dtype, monkeypatch):
    """The training forward of the distance form takes the fixed row maximum (``c ||q||^2`` minus a headroom) instead
    of a running one; where the guess does not hold (every key far away: underflow; key log-weights past the bound:
    overflow) the row block runs again with the online softmax.  Output and gradients against the float64 naive
    reference within the dtype's tolerance, the fixed path chosen (recorded at the launch), and the same output as
    with ``FIXED_ROW_MAX = False`` to the dtype's rounding."""
    import hf_rbf.attention_distance_triton as adt
    from hf_rbf import kernels_flash_fwd
    from hf_rbf.attention_rbf import rbf_attention

    q, k, v, weights = _far_keys_case(dtype, kind, torch.Generator().manual_seed(3))
    gamma = torch.tensor([0.125, 0.2], device=DEVICE)
    seen = []
    launch = adt.distance_forward
    monkeypatch.setattr(adt, "distance_forward", lambda *a, **kw: seen.append(kw["fixed_max"]) or launch(*a, **kw))

    def run(backend, cast):
        leaves = [t.detach().to(cast).requires_grad_() for t in (q, k, v)]
        w = None if weights is None else weights.to(DEVICE, cast)
        out = rbf_attention(*leaves, gamma=gamma.to(cast), causal=True, key_log_weights=w, backend=backend)
        out.double().square().sum().backward()
        return [out.detach().double().cpu()] + [t.grad.double().cpu() for t in leaves]

    fixed = run("triton", dtype)
    assert seen == [True]
    monkeypatch.setattr(kernels_flash_fwd, "FIXED_ROW_MAX", False)
    online = run("triton", dtype)
    assert seen == [True, False]
    ref = run("naive", torch.float64)
    tol_out, tol_grad = kc.TOLERANCES[dtype]
    for i, (got, on, r) in enumerate(zip(fixed, online, ref)):
        assert torch.isfinite(got).all()
        tol = tol_out if i == 0 else tol_grad
        assert ((got - on).norm() / on.norm()).item() < tol, (i, kind)
        # the far keys' query / key gradients cancel a key offset 8x their spread: both maxima lose the same digits
        # there (fp32 4e-4, bf16 0.3 relative on dq), a limit of the expanded score, not of the row maximum
        if i == 0 or kind != "far":
            assert ((got - r).norm() / r.norm()).item() < tol, (i, kind)


def test_fixed_row_max_only_where_the_score_is_bounded():
    """The fixed row maximum needs the distance form with its key norms, a softmax, no scalar term and a dtype whose
    P @ V operand holds 2^40: float16 is refused by name, and the rule says no to the hybrid / float16 / no norms."""
    from hf_rbf.kernels_flash_fwd import distance_forward, fixed_max_applies

    a = torch.ones(2, device=DEVICE)
    assert fixed_max_applies(None, None, True, True, torch.bfloat16)
    assert not fixed_max_applies(None, None, True, True, torch.float16)
    assert not fixed_max_applies(a, None, True, True, torch.bfloat16)  # separate dot / norm coefficients
    assert not fixed_max_applies(None, a, True, True, torch.bfloat16)  # the hybrid's scalar term
    assert not fixed_max_applies(None, None, False, True, torch.bfloat16)  # softmax-free: its own fixed maximum
    assert not fixed_max_applies(None, None, True, False, torch.bfloat16)  # no key norms: no bound
    q = torch.randn(1, 2, 8, 16, device=DEVICE, dtype=torch.float16)
    with pytest.raises(ValueError, match="fixed_max=True .*float16"):
        distance_forward(q, q, q, None, None, None, None, a, None, causal=True, window=None, num_prefix_keys=0,
                         normalize=True, qnorm=False, kv_same=False, eps=0.0, knorm_inline=True, fixed_max=True)
