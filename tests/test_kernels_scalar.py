"""Fused Triton kernels of scalar (sort) attention:
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

FAMILY = "scalar"


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


def _grads_vs_float64(qs, ks, v, tau, dout, **kw):
    """Output and gradients of the triton backend against the float64 naive reference on the same inputs."""
    leaves = [t for t in (qs, ks, v, tau) if isinstance(t, torch.Tensor)]
    results = []
    for backend, cast in (("triton", lambda t: t), ("naive", lambda t: t.double())):
        xs = [cast(t.detach()).requires_grad_(True) for t in leaves]
        args = xs + ([tau] if not isinstance(tau, torch.Tensor) else [])
        out = hf_rbf_scalar(*args, backend=backend, **kw)
        out.backward(dout.to(out.dtype))
        results.append((out.detach(), [x.grad for x in xs]))
    (out, grads), (out_ref, grads_ref) = results
    return kc.rel_err(out, out_ref), [kc.rel_err(g, r) for g, r in zip(grads, grads_ref)]


def hf_rbf_scalar(qs, ks, v, tau, **kw):
    import hf_rbf

    return hf_rbf.scalar_attention(qs, ks, v, tau, **kw)


@pytest.mark.parametrize(
    "tau_shape, tau_dtype, dtype, heads_per_program, kw",
    [
        # a per-batch temperature [B, 1, 1] and a per-position one [1, 1, Nq]: broadcast strides read in-kernel
        ((2, 1, 1), torch.float32, torch.float32, 0, dict(window=6, prefix=2)),
        ((1, 1, 9), torch.float32, torch.bfloat16, 2, dict(klw=True)),
        # a bfloat16 temperature tensor: the kernels upcast it before the reciprocal, as 1 / tau.float() did
        ((1, 4, 1), torch.bfloat16, torch.float16, 4, dict(causal=False, prefix=1)),
        # a float temperature (no tensor: beta passed as a kernel argument) with stacked heads and key weights
        (None, None, torch.bfloat16, 2, dict(klw=True, window=5, prefix=3)),
        (None, None, torch.float32, 4, dict(causal=False, pad=True)),
    ],
)
def test_tau_forms_and_stacked_heads(tau_shape, tau_dtype, dtype, heads_per_program, kw, monkeypatch):
    """Temperature forms the shared case list does not cover, read by the kernels themselves (the op takes ``tau``,
    not ``beta = 1 / tau``), each with grouped values and the stacked-heads layout forced where given."""
    if heads_per_program:
        monkeypatch.setenv("HF_RBF_SCALAR_HEADS_PER_PROGRAM", str(heads_per_program))
    g = torch.Generator().manual_seed(5)
    b, h, groups, nq, nk, dv = 2, 4, 1, 9, 23, 16
    qs = torch.randn(b, h, nq, generator=g).to(DEVICE, dtype)
    ks = torch.randn(b, h, nk, generator=g).to(DEVICE, dtype)
    v = torch.randn(b, groups, nk, dv, generator=g).to(DEVICE, dtype)
    tau = 0.7 if tau_shape is None else (0.5 + torch.rand(*tau_shape, generator=g)).to(DEVICE, tau_dtype)
    dout = torch.randn(b, h, nq, dv, generator=g).to(DEVICE, torch.float64)
    call = dict(causal=kw.get("causal", True), window=kw.get("window"), num_prefix_keys=kw.get("prefix", 0))
    if kw.get("klw"):
        call["key_log_weights"] = (0.5 * torch.randn(b, h, nk, generator=g)).to(DEVICE)
    if kw.get("pad"):
        am = torch.ones(b, nk, dtype=torch.long, device=DEVICE)
        am[1, :4] = 0
        call["attention_mask"] = am
    err_out, err_grads = _grads_vs_float64(qs, ks, v, tau, dout, **call)
    tol_out, tol_grad = kc.TOLERANCES[dtype]
    if tau_dtype == torch.bfloat16:
        tol_grad = max(tol_grad, kc.TOLERANCES[torch.bfloat16][1])  # tau's own gradient is rounded to bfloat16
    assert err_out <= tol_out, err_out
    assert len(err_grads) == (3 if tau_shape is None else 4)
    assert all(e <= tol_grad for e in err_grads), err_grads


def test_host_path_has_no_temperature_ops():
    """A forward+backward with a learnable per-head tau: three launches and, besides allocations and views, only the
    sum that reduces tau's per-row gradient (no reciprocal, no elementwise ops for its gradient, no casts of the
    query / key gradients: the kernels write them in the inputs' dtype)."""
    import count_host_ops  # benchmarks/: counts aten ops outside the triton launches (the interpreter's own work)

    import hf_rbf

    count_host_ops._patch_triton_run()
    g = torch.Generator().manual_seed(0)
    qs, ks = (torch.randn(1, 4, 20, generator=g).to(DEVICE, torch.bfloat16).requires_grad_(True) for _ in range(2))
    v = torch.randn(1, 2, 20, 16, generator=g).to(DEVICE, torch.bfloat16).requires_grad_(True)
    tau = torch.full((4,), 0.3, device=DEVICE, requires_grad=True)
    hf_rbf.scalar_attention(qs, ks, v, tau, backend="triton").float().sum().backward()  # warm-up (autotune)
    out = hf_rbf.scalar_attention(qs, ks, v, tau, backend="triton")
    dout = torch.ones_like(out)
    for t in (qs, ks, v, tau):
        t.grad = None  # a fresh gradient, not an accumulation (add_)
    with count_host_ops.counting() as counter:
        out = hf_rbf.scalar_attention(qs, ks, v, tau, backend="triton")
        out.backward(dout)
    assert sum(counter.launches.values()) == 3, counter.launches
    compute = {op: n for op, n in counter.ops.items() if op not in count_host_ops.NO_KERNEL_OPS}
    assert compute == {"sum": 1}, dict(counter.ops)
    assert qs.grad.dtype == torch.bfloat16 and ks.grad.dtype == torch.bfloat16 and tau.grad.shape == (4,)
