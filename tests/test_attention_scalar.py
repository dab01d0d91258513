"""scalar_attention: every backend against a float64 reference of our own, gradcheck of the naive reference."""

import pytest
import torch

import hf_rbf
from attention_testing import (
    backend_params,
    check_backend,
    extreme_log_weights,
    padding_mask,
    rand,
    randn,
    scalar_ref,
)


# tau: a float, per head [H] or per query token [B, H, Nq]; value groups G = 1, 2 or H.
CASES = {
    "causal-n7-g1-tau-float": dict(b=2, h=2, nq=7, nk=7, g=1, dv=16, tau="float"),
    "n1-g2-tau-head": dict(b=1, h=4, nq=1, nk=1, g=2, dv=8, tau="head"),
    "full-window3-prefix2-n33-gH-tau-token": dict(
        b=2, h=2, nq=33, nk=33, g=2, dv=24, causal=False, window=3, prefix=2, tau="token"
    ),
    "window1-prefix1-padded-klw-bn-g2": dict(
        b=2, h=4, nq=7, nk=7, g=2, dv=40, window=1, prefix=1, pad=True, klw="bn", tau="head"
    ),
    "decode3of33-window40-prefix1-klw-bhn-tau-token": dict(
        b=2, h=3, nq=3, nk=33, g=3, dv=20, window=40, prefix=1, klw="bhn", tau="token"
    ),
    "extreme-log-weights-g1": dict(b=2, h=2, nq=7, nk=7, g=1, dv=16, klw="extreme", tau="head"),
}


def make_inputs(case: dict, seed: int = 0, scale: float = 1.0):
    b, h, nq, nk, g, dv = (case[n] for n in ("b", "h", "nq", "nk", "g", "dv"))
    inputs = {
        "qs": randn(b, h, nq, seed=seed, scale=scale),
        "ks": randn(b, h, nk, seed=seed + 1, scale=scale),
        "v": randn(b, g, nk, dv, seed=seed + 2),
    }
    tau = case["tau"]
    if tau == "float":
        inputs["tau"] = 0.7
    elif tau == "head":
        inputs["tau"] = rand(h, seed=seed + 3, low=0.3, high=1.5)
    else:
        inputs["tau"] = rand(b, h, nq, seed=seed + 3, low=0.3, high=1.5)
    klw = case.get("klw")
    if klw == "bn":
        inputs["key_log_weights"] = randn(b, nk, seed=seed + 4, scale=0.5)
    elif klw == "bhn":
        inputs["key_log_weights"] = randn(b, h, nk, seed=seed + 4, scale=0.5)
    elif klw == "extreme":
        inputs["key_log_weights"] = extreme_log_weights(b, h, nk, seed=seed + 4)
    kwargs = {
        "causal": case.get("causal", True),
        "window": case.get("window"),
        "num_prefix_keys": case.get("prefix", 0),
        "attention_mask": padding_mask(b, nk, seed + 5, case.get("prefix", 0)) if case.get("pad") else None,
    }
    return inputs, kwargs


FLEX_HALF_CASES = (
    "full-window3-prefix2-n33-gH-tau-token",
    "window1-prefix1-padded-klw-bn-g2",
    "extreme-log-weights-g1",
)
PARAMS = backend_params(CASES, FLEX_HALF_CASES)


def _scalar(qs, ks, v, tau, **kwargs):
    return hf_rbf.scalar_attention(qs, ks, v, tau, **kwargs)


@pytest.mark.parametrize("backend, dtype, name", PARAMS)
def test_backend_matches_reference(backend, dtype, name):
    # flex serves this family only without gradients (its captured qs/ks/tau cannot be differentiated on CUDA,
    # and flex has no backward elsewhere), so flex is checked on outputs
    inputs, kwargs = make_inputs(CASES[name], seed=len(name))
    check_backend(scalar_ref, _scalar, inputs, kwargs, backend, dtype, grads="rule" if backend != "flex" else None)


@pytest.mark.parametrize("backend", ["naive", "sdpa"])
@pytest.mark.parametrize("name", list(CASES))
def test_float64_matches_reference(backend, name):
    inputs, kwargs = make_inputs(CASES[name], seed=7)
    check_backend(scalar_ref, _scalar, inputs, kwargs, backend, torch.float64)


@pytest.mark.parametrize("backend", ["naive", "sdpa"])
@pytest.mark.parametrize("tau_kind", ["head", "token"])
def test_gradcheck(backend, tau_kind):
    """Every differentiable input (qs, ks, grouped v, tau per head or per token, key_log_weights)."""
    b, h, n = 2, 2, 4
    qs, ks, v = randn(b, h, n, seed=1), randn(b, h, n, seed=2), randn(b, 1, n, 2, seed=3)
    tau = rand(h, seed=4, low=0.4, high=1.2) if tau_kind == "head" else rand(b, h, n, seed=4, low=0.4, high=1.2)
    klw = randn(b, n, seed=5, scale=0.3)
    mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
    args = [t.requires_grad_() for t in (qs, ks, v, tau, klw)]

    def fn(qs, ks, v, tau, klw):
        return hf_rbf.scalar_attention(
            qs, ks, v, tau, key_log_weights=klw, window=3, num_prefix_keys=1, attention_mask=mask, backend=backend
        )

    # full gradcheck of the reference; sdpa (also matched to float64 above) in gradcheck's fast mode
    assert torch.autograd.gradcheck(fn, args, fast_mode=backend != "naive")


@pytest.mark.parametrize("backend", ["naive", "sdpa", "triton"])
@pytest.mark.parametrize("prefix_batch, nq, grad", [(1, 1, False), (2, 3, False), (1, 9, True)])
def test_prefix_values_equal_the_concatenated_values(backend, prefix_batch, nq, grad):
    """``prefix_values`` (a sink / register values in front of ``v``, shared by the batch or per element): the
    output (and with ``grad`` every gradient) equals that of the values concatenated by hand, in float64 on the naive
    backend.  Decode rows without gradients on "triton" read them in place (the split-K decode kernel, in the
    interpreter here); the other calls concatenate."""
    import subprocess
    import sys

    if backend == "triton":
        # the interpreter must be set before triton is imported: run this case in a fresh process
        code = (
            "import sys; sys.path.insert(0, 'tests'); import test_attention_scalar as t; "
            f"t._prefix_values_case('triton', {prefix_batch}, {nq}, {grad})"
        )
        env = dict(__import__("os").environ, TRITON_INTERPRET="1")
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return
    _prefix_values_case(backend, prefix_batch, nq, grad)


def _prefix_values_case(backend, prefix_batch, nq, grad):
    b, h, g, nk, r, dv = 2, 4, 2, 13, 2, 16
    gen = torch.Generator().manual_seed(nq)
    qs = torch.randn(b, h, nq, generator=gen, dtype=torch.float64)
    ks = torch.randn(b, h, r + nk, generator=gen, dtype=torch.float64)
    v = torch.randn(b, g, nk, dv, generator=gen, dtype=torch.float64)
    pv = torch.randn(prefix_batch, g, r, dv, generator=gen, dtype=torch.float64)
    tau = 0.5 + torch.rand(b, h, nq, generator=gen, dtype=torch.float64)
    mask = torch.ones(b, r + nk, dtype=torch.bool)
    mask[1, r : r + 3] = False  # padding after the prefix
    dtype = torch.float32 if backend == "triton" else torch.float64
    kwargs = dict(window=6, attention_mask=mask, num_prefix_keys=r)

    def run(separate, backend, dtype):
        leaves = [t.to(dtype).requires_grad_(grad) for t in (qs, ks, v, pv, tau)]
        q_, k_, v_, p_, t_ = leaves
        with torch.set_grad_enabled(grad):
            if separate:
                out = hf_rbf.scalar_attention(q_, k_, v_, t_, prefix_values=p_, backend=backend, **kwargs)
            else:
                full = torch.cat([p_.expand(b, -1, -1, -1), v_], dim=2)
                out = hf_rbf.scalar_attention(q_, k_, full, t_, backend=backend, **kwargs)
            if grad:
                out.backward(torch.ones_like(out))
        grads = [t.grad.double() for t in leaves] if grad else []
        return out.detach().double(), grads

    (out, grads), (ref, ref_grads) = run(True, backend, dtype), run(False, "naive", torch.float64)
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    for gr, rg in zip(grads, ref_grads):
        torch.testing.assert_close(gr, rg, rtol=tol, atol=tol)


def test_prefix_values_errors_name_the_argument():
    qs, ks, v = torch.randn(2, 2, 3), torch.randn(2, 2, 6), torch.randn(2, 1, 5, 8)
    with pytest.raises(ValueError, match=r"`prefix_values` must have shape \[2 or 1, 1, R, 8\].*got \(2, 2, 1, 8\)"):
        hf_rbf.scalar_attention(qs, ks, v, 0.5, prefix_values=torch.randn(2, 2, 1, 8))
    with pytest.raises(ValueError, match=r"`num_prefix_keys` must be 0 or 1, got 2"):
        hf_rbf.scalar_attention(qs, ks, v, 0.5, prefix_values=torch.randn(1, 1, 1, 8), num_prefix_keys=2)
    with pytest.raises(ValueError, match=r"`v` has 5 keys|key length"):
        hf_rbf.scalar_attention(qs, torch.randn(2, 2, 7), v, 0.5, prefix_values=torch.randn(1, 1, 1, 8))
