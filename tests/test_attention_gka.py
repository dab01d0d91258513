"""gka_attention: every backend against a float64 reference of our own, gradcheck of the naive reference."""

import math

import pytest
import torch

import hf_rbf
from attention_testing import (
    backend_params,
    check_backend,
    extreme_log_weights,
    flex_backward_on_cpu,  # noqa: F401  (fixture)
    gka_ref,
    padding_mask,
    randn,
)


# log_sigma is per head; eps spans 0 (a plain softmax), the default and a large value that matters.
CASES = {
    "causal-n7-d16": dict(b=2, h=2, nq=7, nk=7, d=16),
    "n1-d24-eps0": dict(b=1, h=2, nq=1, nk=1, d=24, eps=0.0),
    "full-window3-prefix2-n33-d40-eps0.5": dict(
        b=2, h=2, nq=33, nk=33, d=40, causal=False, window=3, prefix=2, eps=0.5
    ),
    "window1-prefix1-padded-klw-bn-d64": dict(
        b=2, h=2, nq=7, nk=7, d=64, window=1, prefix=1, pad=True, klw="bn", eps=1e-3
    ),
    "query-decode3of33-window40-prefix1-klw-bhn-d100": dict(
        b=2, h=3, nq=3, nk=33, d=100, window=40, prefix=1, klw="bhn", query=True, eps=0.1
    ),
    "extreme-log-weights-eps0.2": dict(b=2, h=2, nq=7, nk=7, d=16, klw="extreme", eps=0.2),
    "float-sigma-padded-eps0": dict(b=2, h=2, nq=7, nk=7, d=24, pad=True, sigma="float", eps=0.0),
}


def make_inputs(case: dict, seed: int = 0, scale: float = 1.0):
    b, h, nq, nk, d = (case[n] for n in ("b", "h", "nq", "nk", "d"))
    # features of norm about sqrt(d); sigma about sqrt(d) / 2 keeps the kernel neither flat nor one-hot
    inputs = {"x": randn(b, h, nk, d, seed=seed, scale=scale)}
    if case.get("sigma") == "float":
        inputs["log_sigma"] = math.log(0.5 * math.sqrt(d))
    else:
        inputs["log_sigma"] = math.log(0.5 * math.sqrt(d)) + randn(h, seed=seed + 1, scale=0.2)
    if case.get("query"):
        inputs["query"] = randn(b, h, nq, d, seed=seed + 2, scale=scale)
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
        "eps": case.get("eps", 1e-6),
        "attention_mask": padding_mask(b, nk, seed + 5, case.get("prefix", 0)) if case.get("pad") else None,
    }
    return inputs, kwargs


FLEX_HALF_CASES = (
    "full-window3-prefix2-n33-d40-eps0.5",
    "query-decode3of33-window40-prefix1-klw-bhn-d100",
    "extreme-log-weights-eps0.2",
)
PARAMS = backend_params(CASES, FLEX_HALF_CASES)


@pytest.mark.parametrize("backend, dtype, name", PARAMS)
def test_backend_matches_reference(backend, dtype, name, request):
    if backend == "flex":
        request.getfixturevalue("flex_backward_on_cpu")
    inputs, kwargs = make_inputs(CASES[name], seed=len(name))
    check_backend(gka_ref, hf_rbf.gka_attention, inputs, kwargs, backend, dtype)


@pytest.mark.parametrize("backend", ["naive", "sdpa"])
@pytest.mark.parametrize("name", list(CASES))
def test_float64_matches_reference(backend, name):
    inputs, kwargs = make_inputs(CASES[name], seed=7)
    check_backend(gka_ref, hf_rbf.gka_attention, inputs, kwargs, backend, torch.float64)


@pytest.mark.parametrize("backend", ["naive", "sdpa"])
@pytest.mark.parametrize("with_query", [False, True])
def test_gradcheck(backend, with_query):
    """Every differentiable input (x, per-head log_sigma, key_log_weights, query), eps > 0, window and padding."""
    b, h, n, d = 2, 2, 4, 3
    x, log_sigma, klw = randn(b, h, n, d, seed=1), randn(h, seed=2, scale=0.2), randn(b, h, n, seed=3, scale=0.3)
    query = randn(b, h, 2, d, seed=4) if with_query else None
    mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
    args = [t.requires_grad_() for t in (x, log_sigma, klw) + ((query,) if with_query else ())]

    def fn(x, log_sigma, klw, query=None):
        return hf_rbf.gka_attention(
            x,
            log_sigma,
            key_log_weights=klw,
            window=3,
            num_prefix_keys=1,
            attention_mask=mask,
            eps=0.3,
            query=query,
            backend=backend,
        )

    # full gradcheck of the reference; sdpa (also matched to float64 above) in gradcheck's fast mode
    assert torch.autograd.gradcheck(fn, args, fast_mode=backend != "naive")


def test_eps_is_the_papers_denominator():
    """W_ij = K_ij / (sum_j K_ij + eps): with one key, out = K / (K + eps) * x_0, written out by hand."""
    x = randn(1, 1, 1, 4, seed=3)
    query = randn(1, 1, 1, 4, seed=4)
    log_sigma = 0.3
    kern = math.exp(-((query - x) ** 2).sum().item() / (2 * math.exp(2 * log_sigma)))
    expected = kern / (kern + 0.25) * x
    for backend in ("naive", "sdpa", "flex"):
        with torch.no_grad():
            out = hf_rbf.gka_attention(x, log_sigma, query=query, eps=0.25, backend=backend)
        torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("feature_norm, rope", [(True, True), (True, False), (False, True)])
def test_layer_features_are_the_head_major_norm_and_rope_as_a_view(feature_norm, rope):
    """GKA's features (per-head RMS norm, then RoPE) are computed in the hidden states' ``[B, N, H, d]`` layout and
    returned as a transposed view (no copy for the fused kernel); they equal the head-major float64 computation."""
    from conftest import build_model

    from hf_rbf.modeling_decoder import SinusoidFrequencies

    model = build_model("gka", dict(gka_feature_norm=feature_norm, position_embedding_type="rope" if rope else "none"))
    attn = model.model.layers[0].self_attn
    assert attn.feature_norm == feature_norm and attn.use_rope == rope
    b, n, h = 2, 7, model.config.num_attention_heads
    hidden = torch.randn(b, n, model.config.hidden_size)
    cos, sin = SinusoidFrequencies(model.config.hidden_size // h, model.config.rope_theta)(torch.arange(n)[None])
    feats = attn.features(hidden, (cos, sin))
    assert feats.shape == (b, h, n, hidden.shape[-1] // h) and feats.transpose(1, 2).is_contiguous()
    x = hidden.double().view(b, n, h, -1).transpose(1, 2)
    if feature_norm:
        x = x / x.pow(2).mean(-1, keepdim=True).add(attn.norm_eps).sqrt()
    if rope:
        x1, x2 = x.chunk(2, dim=-1)
        c, s = cos.double()[:, None], sin.double()[:, None]
        x = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    torch.testing.assert_close(feats.double(), x, rtol=0, atol=1e-5)


@pytest.mark.parametrize("backend", ["naive", "sdpa"])
@pytest.mark.parametrize("prefix_batch", [1, 2])
def test_prefix_features_equal_the_concatenated_features(backend, prefix_batch):
    """``prefix_features`` (register tokens in front of the features, shared by the batch or per element): output and
    every gradient equal those of the features concatenated by hand with ``num_prefix_keys=R`` and the sequence as
    the query (float64; the fused backend's case is in tests/test_kernels_gka.py)."""
    out, grads, ref, ref_grads = prefix_features_case(hf_rbf.gka_attention, backend, torch.float64, "cpu", prefix_batch)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for g, rg in zip(grads, ref_grads):
        torch.testing.assert_close(g, rg, rtol=1e-12, atol=1e-12)


def prefix_features_case(gka_attention, backend, dtype, device, prefix_batch):
    """``(out, grads, reference out, reference grads)`` of a windowed, padded call with ``prefix_features`` and of
    the same call on the features concatenated by hand; the reference on the naive backend in float64."""
    b, h, n, r, d = 2, 2, 11, 2, 16
    gen = torch.Generator().manual_seed(prefix_batch)
    x = torch.randn(b, h, n, d, generator=gen, dtype=torch.float64)
    prefix = torch.randn(prefix_batch, h, r, d, generator=gen, dtype=torch.float64)
    log_sigma = torch.tensor([1.2, 1.5], dtype=torch.float64)
    mask = torch.ones(b, r + n, dtype=torch.bool)
    mask[1, r : r + 3] = False  # padding after the prefix
    dout = torch.randn(b, h, n, d, generator=gen, dtype=torch.float64)

    def run(separate, backend, dtype):
        leaves = [t.to(device, dtype).requires_grad_() for t in (x, prefix, log_sigma)]
        xs, ps, ls = leaves
        kwargs = dict(window=5, eps=0.1, attention_mask=mask.to(device), backend=backend)
        if separate:
            out = gka_attention(xs, ls, prefix_features=ps, **kwargs)
        else:
            full = torch.cat([ps.expand(b, -1, -1, -1), xs], dim=2)
            out = gka_attention(full, ls, query=xs, num_prefix_keys=r, **kwargs)
        out.backward(dout.to(device, dtype))
        return out.detach().double().cpu(), [t.grad.double().cpu() for t in leaves]

    return (*run(True, backend, dtype), *run(False, "naive", torch.float64))


def test_prefix_features_errors_name_the_argument():
    x = torch.randn(2, 2, 5, 8)
    with pytest.raises(ValueError, match=r"`prefix_features` must have shape \[2 or 1, 2, R, 8\].*got \(2, 3, 1, 8\)"):
        hf_rbf.gka_attention(x, 0.5, prefix_features=torch.randn(2, 3, 1, 8))
    with pytest.raises(ValueError, match=r"`num_prefix_keys` must be 0 or 1, got 2"):
        hf_rbf.gka_attention(x, 0.5, prefix_features=torch.randn(1, 2, 1, 8), num_prefix_keys=2)
