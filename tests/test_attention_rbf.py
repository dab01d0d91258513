"""rbf_attention: every backend against a float64 reference of our own, gradcheck of the naive reference."""

import pytest
import torch

import hf_rbf
from attention_testing import (
    backend_params,
    check_backend,
    extreme_log_weights,
    flex_backward_on_cpu,  # noqa: F401  (fixture)
    padding_mask,
    rand,
    randn,
    rbf_ref,
)


# Each case covers a few of: odd lengths, head dims, causal or not, windows, prefix keys, log-weights of both
# layouts (with -inf and -1e9), padding (batch row 0 fully padded), Nq != Nk, per-head gamma, normalize=False.
CASES = {
    "causal-n7-d24": dict(b=2, h=2, nq=7, nk=7, d=24, dv=24),
    "n1-d16": dict(b=1, h=2, nq=1, nk=1, d=16, dv=8, gamma="head"),
    "full-window3-prefix2-n33-d40": dict(b=2, h=2, nq=33, nk=33, d=40, dv=16, causal=False, window=3, prefix=2),
    "window1-prefix1-padded-klw-bn-d64": dict(
        b=2, h=2, nq=7, nk=7, d=64, dv=32, window=1, prefix=1, pad=True, klw="bn"
    ),
    "decode3of33-window40-prefix1-klw-bhn-d100": dict(
        b=2, h=3, nq=3, nk=33, d=100, dv=20, window=40, prefix=1, klw="bhn", gamma="head"
    ),
    "extreme-log-weights": dict(b=2, h=2, nq=7, nk=7, d=16, dv=16, klw="extreme"),
    "unnormalized-padded-window3": dict(
        b=2, h=2, nq=7, nk=7, d=24, dv=24, normalize=False, window=3, pad=True, gamma="head"
    ),
    "unnormalized-decode-full-klw": dict(
        b=2, h=2, nq=2, nk=33, d=16, dv=16, causal=False, normalize=False, klw="bhn", gamma=0.2
    ),
}


def make_inputs(case: dict, seed: int = 0, scale: float = 1.0):
    b, h, nq, nk, d, dv = (case[n] for n in ("b", "h", "nq", "nk", "d", "dv"))
    inputs = {
        "q": randn(b, h, nq, d, seed=seed, scale=scale),
        "k": randn(b, h, nk, d, seed=seed + 1, scale=scale),
        "v": randn(b, h, nk, dv, seed=seed + 2),
    }
    gamma = case.get("gamma")
    if gamma == "head":
        inputs["gamma"] = rand(h, seed=seed + 3, low=0.5 / d**0.5, high=1.5 / d**0.5)
    elif gamma is not None:
        inputs["gamma"] = gamma
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
        "normalize": case.get("normalize", True),
        "attention_mask": padding_mask(b, nk, seed + 5, case.get("prefix", 0)) if case.get("pad") else None,
    }
    return inputs, kwargs


def _serves(backend, dtype, case) -> bool:
    # sdpa refuses normalize=False in float16 (tested below)
    return not (backend == "sdpa" and dtype == torch.float16 and not case.get("normalize", True))


FLEX_HALF_CASES = ("extreme-log-weights", "unnormalized-padded-window3", "decode3of33-window40-prefix1-klw-bhn-d100")
PARAMS = backend_params(CASES, FLEX_HALF_CASES, _serves)


@pytest.mark.parametrize("backend, dtype, name", PARAMS)
def test_backend_matches_reference(backend, dtype, name, request):
    if backend == "flex":
        request.getfixturevalue("flex_backward_on_cpu")
    inputs, kwargs = make_inputs(CASES[name], seed=len(name))
    check_backend(rbf_ref, hf_rbf.rbf_attention, inputs, kwargs, backend, dtype)


@pytest.mark.parametrize("name", list(CASES))
def test_naive_float64_matches_reference(name):
    inputs, kwargs = make_inputs(CASES[name], seed=7)
    check_backend(rbf_ref, hf_rbf.rbf_attention, inputs, kwargs, "naive", torch.float64)


@pytest.mark.parametrize("name", list(CASES))
def test_sdpa_float64_is_exact(name):
    inputs, kwargs = make_inputs(CASES[name], seed=11)
    check_backend(rbf_ref, hf_rbf.rbf_attention, inputs, kwargs, "sdpa", torch.float64)


@pytest.mark.parametrize("backend", ["naive", "sdpa"])
@pytest.mark.parametrize("normalize", [True, False])
def test_gradcheck(backend, normalize):
    """Every differentiable input (q, k, v, per-head gamma, key_log_weights), with a window, prefix and padding."""
    b, h, n, d = 2, 2, 4, 3
    q, k, v = randn(b, h, n, d, seed=1), randn(b, h, n, d, seed=2), randn(b, h, n, 3, seed=3)
    gamma = rand(h, seed=4, low=0.2, high=0.6)
    klw = randn(b, h, n, seed=5, scale=0.3)
    mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
    args = [t.requires_grad_() for t in (q, k, v, gamma, klw)]

    def fn(q, k, v, gamma, klw):
        return hf_rbf.rbf_attention(
            q,
            k,
            v,
            gamma=gamma,
            key_log_weights=klw,
            window=3,
            num_prefix_keys=1,
            attention_mask=mask,
            normalize=normalize,
            backend=backend,
        )

    # full gradcheck of the reference; sdpa (also matched to float64 above) in gradcheck's fast mode
    assert torch.autograd.gradcheck(fn, args, fast_mode=backend != "naive")


def test_sdpa_refuses_unnormalized_float16():
    q = torch.randn(1, 1, 4, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"backend='sdpa' cannot serve this call: sdpa cannot compute normalize=False"):
        hf_rbf.rbf_attention(q, q, q, normalize=False, backend="sdpa")
    # "auto" skips it (and flex, CUDA only) and lands on naive
    hf_rbf.rbf_attention(q, q, q, normalize=False)
    assert hf_rbf.last_backend("rbf_attention") == "naive"


def test_decode_rows_equal_last_rows_of_full_call():
    """Bottom-right alignment: the last Nq queries against all keys are the last Nq rows of the full call."""
    q, k, v = randn(2, 2, 9, 16, seed=1), randn(2, 2, 9, 16, seed=2), randn(2, 2, 9, 16, seed=3)
    for backend in ("naive", "sdpa", "flex"):
        with torch.no_grad():
            full = hf_rbf.rbf_attention(q.float(), k.float(), v.float(), window=4, backend=backend)
            step = hf_rbf.rbf_attention(q[:, :, -2:].float(), k.float(), v.float(), window=4, backend=backend)
        torch.testing.assert_close(step, full[:, :, -2:], rtol=1e-5, atol=1e-6)
