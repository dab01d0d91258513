"""Fused Triton kernels of Gaussian kernel attention (GKA):
the output and every gradient against the float64 naive reference.

The shared cases (where they run, shapes, dtypes, masks, tolerances) are described in
``tests/kernel_family_checks.py``; this file adds the family's own tests.
"""

import pytest  # noqa: F401
import torch  # noqa: F401

from kernel_family_checks import (  # noqa: F401 (the shared tests, collected here; imported before triton)
    DEVICE,
    ON_GPU,
    _kernels_runnable,
    kc,
    pytest_generate_tests,
    test_full_shapes_on_gpu,
    test_in_interpreter_subprocess,
    test_matches_float64_reference,
)

FAMILY = "gka"


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


@pytest.mark.parametrize("prefix_batch", [1, 2])
def test_prefix_features_read_where_they_are(prefix_batch):
    """``gka_attention(prefix_features=)`` on the fused kernels (the prefix read from its own tensor, no copy of the
    features): output and every gradient, the prefix's included, against the float64 naive call on the features
    concatenated by hand (float32: its rounding bounds the error)."""
    from test_attention_gka import prefix_features_case

    from hf_rbf.attention_gka import gka_attention

    out, grads, ref, ref_grads = prefix_features_case(gka_attention, "triton", torch.float32, DEVICE, prefix_batch)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    for g, rg in zip(grads, ref_grads):
        torch.testing.assert_close(g, rg, rtol=1e-4, atol=1e-4 * rg.abs().max().item())


def test_learnable_bandwidth_enters_the_fused_call_without_autograd_ops():
    """In eager training the learnable log-bandwidth goes into the fused call as it is: the call forms
    ``c = exp(-2 log sigma) / 2`` and its backward kernels write ``log sigma``'s gradient, so the graph of a GKA call
    holds the fused node and the leaves only (before: ``exp`` and two multiplications in front of it, three backward
    nodes and their ops per layer and step on the host; then three ops inside the call, now none: the kernels form
    ``c``).  The gradients match the float64 reference; without gradients (and under a ``query``-cache decode step)
    ``c`` is formed outside with torch's ``exp``, the same output to float32 rounding."""
    from attention_testing import autograd_node_names
    from hf_rbf.attention_gka import gka_attention

    g = torch.Generator().manual_seed(3)
    b, h, n, d = 2, 3, 29, 16
    x64 = torch.randn(b, h, n, d, generator=g, dtype=torch.float64)
    ls64 = 0.5 * torch.log(torch.tensor(float(d))) + 0.2 * torch.randn(h, generator=g, dtype=torch.float64)
    upstream = torch.randn(b, h, n, d, generator=g, dtype=torch.float64).to(DEVICE)
    results = {}
    for backend, dtype in (("triton", torch.float32), ("naive", torch.float64)):
        x = x64.to(DEVICE, dtype).requires_grad_()
        log_sigma = ls64.to(DEVICE, torch.float32 if dtype == torch.float32 else dtype).requires_grad_()
        out = gka_attention(x, log_sigma, causal=True, window=11, eps=1e-6, backend=backend)
        if backend == "triton":
            names = autograd_node_names(out.grad_fn)
            assert sorted(set(names)) == ["AccumulateGrad", "_DistanceFunctionBackward"], names
            behind = [fn for fn, _ in out.grad_fn.next_functions if fn is not None]
            assert any(getattr(fn, "variable", None) is log_sigma for fn in behind)
        (out.double() * upstream).sum().backward()
        results[backend] = [out.detach().double().cpu(), x.grad.double().cpu(), log_sigma.grad.double().cpu()]
        assert log_sigma.grad.dtype == log_sigma.dtype
    for got, ref in zip(results["triton"], results["naive"]):
        torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-5 * ref.abs().max().item())
    with torch.no_grad():  # the no-gradient path forms c with torch's exp (kept for decode steps): the kernel's exp
        x = x64.to(DEVICE, torch.float32)  # may differ in c's last bit, so the outputs agree to float32 rounding
        log_sigma = ls64.to(DEVICE, torch.float32).requires_grad_()
        out = gka_attention(x, log_sigma, causal=True, window=11, eps=1e-6, backend="triton")
    ref = results["naive"][0]
    torch.testing.assert_close(out.double().cpu(), ref, rtol=2e-5, atol=2e-5 * ref.abs().max().item())
    torch.testing.assert_close(out.double().cpu(), results["triton"][0], rtol=1e-6, atol=1e-6 * ref.abs().max().item())
