"""``output_attentions=True``: the attention functions' ``return_weights`` and the models' per-layer weights.

Functions: ``return_weights=True`` gives ``(out, weights)`` from the materialised reference ("auto" serves it with
"naive"; another explicit backend is refused), ``weights @ v`` reproduces the output, the weights equal a float64
reference of the formulas (the reference run with identity values) and are 0 on disallowed keys.

Models (every family, with and without registers, left padding): ``attentions`` holds one ``[B, H, N, P + past + N]``
tensor per layer (prefix keys first), rows are normalised over the allowed keys, padded / future / out-of-window keys
get 0, and the logits equal those of the normal forward through the configured ("auto") backend.  After a cached
prefill through a ``DynamicCache`` the weights of a step equal the matching rows of a forward without cache; a decode
step through a ``SortedScalarCache`` is refused with a clear error and leaves the cache untouched.
"""

from __future__ import annotations

import math

import pytest
import torch
from attention_testing import (
    _klw4,
    _per_head,
    _sq_dist,
    allowed_ref,
    gka_ref,
    hybrid_ref,
    kernel_average_ref,
    rbf_ref,
    scalar_ref,
)
from conftest import build_model
from transformers import DynamicCache

import hf_rbf


# transformers contract: CI also runs this module against the oldest supported versions (.ci/run)
pytestmark = pytest.mark.contract


# ----------------------------------------------------------------------------------------------------------------
# the functions
# ----------------------------------------------------------------------------------------------------------------

B, H, NQ, NK, P, D, DV = 2, 4, 5, 9, 2, 8, 6
F64 = torch.float64


def _randn(*shape, seed, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64) * scale


def _mask_kwargs(window=None, klw=True, causal=True):
    am = torch.ones(B, NK, dtype=torch.long)
    am[0, P : P + 3] = 0  # left padding of row 0's sequence keys
    kw = dict(causal=causal, window=window, attention_mask=am, num_prefix_keys=P)
    if klw:
        kw["key_log_weights"] = _randn(B, H, NK, seed=99, scale=0.3)
    return kw


def _eye(groups=H):
    return torch.eye(NK, dtype=F64).expand(B, groups, NK, NK).contiguous()


def _rbf_case(normalize=True):
    q, k, v = _randn(B, H, NQ, D, seed=1), _randn(B, H, NK, D, seed=2), _randn(B, H, NK, DV, seed=3)
    gamma = torch.rand(H, generator=torch.Generator().manual_seed(4), dtype=F64) * 0.3 + 0.1

    def call(**kw):
        return hf_rbf.rbf_attention(q, k, v, gamma=gamma, normalize=normalize, **kw)

    def ref_weights(**kw):
        return rbf_ref(q, k, _eye(), gamma=gamma, normalize=normalize, **kw)

    return "rbf_attention", call, v, ref_weights


def _gka_case():
    x, query = _randn(B, H, NK, D, seed=5), _randn(B, H, NQ, D, seed=6)
    log_sigma = _randn(H, seed=7, scale=0.3) + 0.5
    eps = 0.05

    def call(**kw):
        return hf_rbf.gka_attention(x, log_sigma, eps=eps, query=query, **kw)

    def ref_weights(**kw):
        inv_two_var = 0.5 * torch.exp(-2.0 * _per_head(log_sigma, H))
        scores = -_sq_dist(query, x) * inv_two_var + _klw4(kw.get("key_log_weights"))
        allowed = allowed_ref(
            B, NQ, NK, kw["causal"], kw.get("window"), kw["num_prefix_keys"], kw.get("attention_mask")
        )
        # sanity of the reference itself: the same weights applied to x give gka_ref
        w = kernel_average_ref(scores, allowed, _eye(), eps=eps)
        assert torch.allclose(w @ x, gka_ref(x, log_sigma, query=query, eps=eps, **kw), atol=1e-12)
        return w

    return "gka_attention", call, x, ref_weights


def _scalar_case():
    qs, ks, v = _randn(B, H, NQ, seed=8), _randn(B, H, NK, seed=9), _randn(B, 2, NK, DV, seed=10)
    tau = torch.rand(H, generator=torch.Generator().manual_seed(11), dtype=F64) + 0.5

    def call(**kw):
        return hf_rbf.scalar_attention(qs, ks, v, tau, **kw)

    def ref_weights(**kw):
        return scalar_ref(qs, ks, _eye(), tau, **kw)

    return "scalar_attention", call, v, ref_weights


def _hybrid_case():
    q, k = _randn(B, H, NQ, D, seed=12), _randn(B, H, NK, D, seed=13)
    qs, ks, v = _randn(B, H, NQ, seed=14), _randn(B, H, NK, seed=15), _randn(B, 2, NK, DV, seed=16)
    tau = torch.rand(B, H, NQ, generator=torch.Generator().manual_seed(17), dtype=F64) + 0.5
    scale = torch.tensor([0.3, 0.0, 0.2, 0.35], dtype=F64)

    def call(**kw):
        return hf_rbf.hybrid_attention(q, k, v, qs, ks, tau, scale=scale, **kw)

    def ref_weights(**kw):
        return hybrid_ref(q, k, _eye(), qs, ks, tau, scale=scale, **kw)

    return "hybrid_attention", call, v, ref_weights


def _dot_case():
    q, k, v = _randn(B, H, NQ, D, seed=18), _randn(B, H, NK, D, seed=19), _randn(B, H, NK, DV, seed=20)

    def call(**kw):
        return hf_rbf.dot_attention(q, k, v, **kw)

    def ref_weights(**kw):
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(D) + _klw4(kw.get("key_log_weights"))
        allowed = allowed_ref(
            B, NQ, NK, kw["causal"], kw.get("window"), kw["num_prefix_keys"], kw.get("attention_mask")
        )
        return kernel_average_ref(scores, allowed, _eye())

    return "dot_attention", call, v, ref_weights


FUNCTION_CASES = {
    "rbf": _rbf_case,
    "rbf-nonorm": lambda: _rbf_case(normalize=False),
    "gka": _gka_case,
    "scalar": _scalar_case,
    "hybrid": _hybrid_case,
    "dot": _dot_case,
}
NORMALISED = {"rbf", "scalar", "hybrid", "dot"}  # rows sum to exactly 1 (gka: slightly less, rbf-nonorm: no)


def _grouped(v):
    """Values as ``[B, H, Nk, Dv]`` (a grouped ``[B, G, Nk, Dv]`` repeated per head)."""
    return v if v.shape[1] == H else v.repeat_interleave(H // v.shape[1], dim=1)


@pytest.mark.parametrize("name", list(FUNCTION_CASES))
@pytest.mark.parametrize("mask_case", ["causal-window-klw", "causal-plain", "bidirectional-window"])
def test_return_weights_reproduce_the_output(name, mask_case):
    op, call, values, ref_weights = FUNCTION_CASES[name]()
    kw = {
        "causal-window-klw": _mask_kwargs(window=3),
        "causal-plain": _mask_kwargs(klw=False),
        "bidirectional-window": _mask_kwargs(window=2, causal=False),
    }[mask_case]
    plain = call(backend="naive", **kw)
    assert isinstance(plain, torch.Tensor)
    out, weights = call(return_weights=True, **kw)
    assert hf_rbf.last_backend(op) == "naive"
    assert weights.shape == (B, H, NQ, NK) and weights.dtype == F64
    assert torch.equal(out, plain)
    # the weights applied to the values give the output
    assert torch.allclose(weights @ _grouped(values), out, atol=1e-12, rtol=0)
    # ... and equal the float64 reference of the formulas
    assert torch.allclose(weights, ref_weights(**kw), atol=1e-12, rtol=0)
    allowed = allowed_ref(B, NQ, NK, kw["causal"], kw["window"], P, kw["attention_mask"]).expand_as(weights)
    assert (weights[~allowed] == 0).all() and (weights >= 0).all()
    sums = weights.sum(-1)
    if name in NORMALISED:
        assert torch.allclose(sums, torch.ones_like(sums), atol=1e-12)
    elif name == "gka":
        assert (sums < 1).all() and (sums > 0).all()  # K / (sum K + eps)


@pytest.mark.parametrize("name", list(FUNCTION_CASES))
def test_return_weights_need_the_reference_backend(name):
    op, call, _, _ = FUNCTION_CASES[name]()
    kw = _mask_kwargs()
    _, w_auto = call(return_weights=True, backend="auto", **kw)
    _, w_naive = call(return_weights=True, backend="naive", **kw)
    assert torch.equal(w_auto, w_naive)
    for backend in ("sdpa", "flex", "triton"):
        with pytest.raises(ValueError, match=r"return_weights.*backend.*'auto', 'naive'"):
            call(return_weights=True, backend=backend, **kw)
        # without weights the backend choice is unchanged (sdpa serves the dot function on the CPU)
    if name == "dot":
        assert isinstance(call(backend="sdpa", **kw), torch.Tensor)
    with pytest.raises(TypeError, match="return_weights"):
        call(return_weights=1, **kw)
    with pytest.raises(TypeError, match="return_weights"):
        call(return_weights=None, **kw)


def test_return_weights_keep_the_input_dtype_and_gradients():
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    out, weights = hf_rbf.rbf_attention(q, k, v, return_weights=True)
    assert out.dtype == weights.dtype == torch.float32
    assert (weights[..., 0, 1:] == 0).all()
    (out.sum() + weights.sum()).backward()
    assert torch.isfinite(q.grad).all()
    qh = q.detach().bfloat16()
    _, wh = hf_rbf.rbf_attention(qh, k.bfloat16(), v.bfloat16(), return_weights=True)
    assert wh.dtype == torch.bfloat16


def test_masked_kernel_average_weights():
    from hf_rbf.attention_utils import masked_kernel_average

    scores = _randn(2, 3, 4, 5, seed=21)
    values = _randn(2, 3, 5, 6, seed=22)
    allowed = torch.rand(1, 1, 4, 5, generator=torch.Generator().manual_seed(23)) > 0.4
    allowed[..., 2, :] = False  # a row without any allowed key
    for kwargs in (dict(), dict(eps=0.1), dict(normalize=False)):
        plain = masked_kernel_average(scores, values, allowed, **kwargs)
        out, weights = masked_kernel_average(scores, values, allowed, return_weights=True, **kwargs)
        assert torch.equal(out, plain)
        assert torch.allclose(weights @ values, out, atol=1e-12)
        assert (weights[~allowed.expand_as(weights)] == 0).all() and (weights[..., 2, :] == 0).all()
    empty = torch.zeros(1, 1, 3, 0, dtype=F64)
    out, weights = masked_kernel_average(empty, torch.zeros(1, 1, 0, 2, dtype=F64), empty.bool(), return_weights=True)
    assert out.shape == (1, 1, 3, 2) and weights.shape == (1, 1, 3, 0)


# ----------------------------------------------------------------------------------------------------------------
# the models
# ----------------------------------------------------------------------------------------------------------------

# (id, family, overrides); attention_backend="auto" so that the normal forward runs the configured backends and the
# output_attentions forward (always "naive") is compared against them.
MODEL_CASES = [
    ("rbf-r0", "rbf", dict(position_embedding_type="rope", num_register_tokens=0)),
    (
        "rbf-r2-mixed-window",
        "rbf",
        dict(
            num_hidden_layers=4,
            attention_layers=["rbf", "dot"],
            window_pattern="SSL",
            sliding_window=3,
            num_register_tokens=2,
        ),
    ),
    ("rbf-nonorm-r1", "rbf", dict(rbf_normalize=False, num_register_tokens=1)),
    ("gka-r0", "gka", dict()),
    (
        "gka-r2-window-dot",
        "gka",
        dict(
            num_hidden_layers=4,
            attention_layers=["gka", "gka", "gka", "dot"],
            window_pattern="SSSL",
            sliding_window=3,
            num_register_tokens=2,
        ),
    ),
    ("scalar-sink-r0", "scalar_sort", dict()),
    ("scalar-r2-pertoken-g2", "scalar_sort", dict(tau_mode="per_token", num_register_tokens=2, num_value_groups=2)),
    (
        "scalar-nosink-r0-dot-window",
        "scalar_sort",
        dict(
            scalar_sink=False,
            num_hidden_layers=3,
            attention_layers=["scalar", "dot", "scalar"],
            window_pattern="LLS",
            sliding_window=3,
        ),
    ),
    ("hybrid-kinds-r0", "hybrid_sort", dict(head_kinds=["hybrid", "scalar", "dot", "hybrid"])),
    (
        "hybrid-r1-mixed-window",
        "hybrid_sort",
        dict(
            num_register_tokens=1,
            num_hidden_layers=3,
            attention_layers=["hybrid", "scalar", "dot"],
            window_pattern="SLL",
            sliding_window=3,
            num_value_groups=2,
        ),
    ),
]
LENGTHS = [8, 5]  # row 1 is left-padded by 3


def _left_padded(vocab, lengths=LENGTHS, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n = max(lengths)
    ids = torch.zeros(len(lengths), n, dtype=torch.long)
    mask = torch.zeros(len(lengths), n, dtype=torch.long)
    for b, length in enumerate(lengths):
        ids[b, n - length :] = torch.randint(1, vocab, (length,), generator=gen)
        mask[b, n - length :] = 1
    return ids, mask


def _num_prefix(model, idx) -> int:
    """P of layer ``idx``: the registers, plus the sink of scalar-sort / hybrid-sort layers."""
    attn = model.model.layers[idx].self_attn
    return model.config.num_register_tokens + getattr(attn, "num_sink", 0)


def _expected_allowed(model, idx, mask, n_query, n_text):
    """Bool ``[B, 1, Nq, P + n_text]`` for the last ``n_query`` of ``n_text`` text tokens."""
    p = _num_prefix(model, idx)
    window = model.config.layer_window(idx)
    key_mask = torch.cat([mask.new_ones(mask.shape[0], p), mask], 1)
    return allowed_ref(mask.shape[0], n_query, p + n_text, True, window, p, key_mask)


@pytest.fixture(params=MODEL_CASES, ids=[c[0] for c in MODEL_CASES])
def model_case(request):
    return request.param


def test_model_attentions_shape_rows_zeros_and_outputs(model_case):
    _, family, overrides = model_case
    model = build_model(family, dict(overrides, attention_backend="auto"))
    cfg = model.config
    ids, mask = _left_padded(cfg.vocab_size)
    b, n = ids.shape
    with torch.no_grad():
        ref = model(ids, attention_mask=mask, output_hidden_states=True)
        out = model(ids, attention_mask=mask, output_attentions=True, output_hidden_states=True)
        no_cache = model(ids, attention_mask=mask, output_attentions=True, use_cache=False)
    assert ref.attentions is None
    assert all(layer.self_attn.last_backend == "naive" for layer in model.model.layers)
    # the naive reference agrees with the configured backends to float32 rounding
    assert (out.logits - ref.logits).abs().max().item() < 1e-4
    for h_ref, h_out in zip(ref.hidden_states, out.hidden_states):
        assert (h_ref - h_out).abs().max().item() < 1e-4

    attentions = out.attentions
    assert isinstance(attentions, tuple) and len(attentions) == cfg.num_hidden_layers
    normalised = family != "rbf" or cfg.rbf_normalize
    for idx, weights in enumerate(attentions):
        p = _num_prefix(model, idx)
        assert weights.shape == (b, cfg.num_attention_heads, n, p + n), (idx, weights.shape)
        assert weights.dtype == out.logits.dtype and torch.isfinite(weights).all() and (weights >= 0).all()
        # with a cache the keys are the cache's contiguous copy, without one the features' transposed view: the same
        # weights up to float32 rounding of the matmuls
        torch.testing.assert_close(weights, no_cache.attentions[idx], rtol=0, atol=1e-6)
        allowed = _expected_allowed(model, idx, mask, n, n).expand_as(weights)
        assert (weights[~allowed] == 0).all(), f"layer {idx}: weight on a padded, future or out-of-window key"
        # padded keys in particular (row 1's first 3 text positions) and future keys
        assert (weights[1, :, :, p : p + 3] == 0).all()
        assert (weights[..., p:].triu(diagonal=1) == 0).all()
        if normalised:
            sums = weights.sum(-1)
            expect = allowed.any(-1).to(sums.dtype)  # rows without any key (padded queries, no prefix) are zeros
            # GKA's eps: K / (sum K + eps) sums to slightly less than 1 where the kernel values are small (a padded
            # query that sees only the registers); the other kinds are exact softmax rows
            gka_layer = model.model.layers[idx].self_attn.kind == "gka"
            assert torch.allclose(sums, expect, atol=1e-3 if gka_layer else 1e-5), (idx, (sums - expect).abs().max())
            assert (sums <= 1 + 1e-5).all()
        else:
            assert (weights[allowed] > 0).all()

    as_tuple = model(ids, attention_mask=mask, output_attentions=True, return_dict=False)
    tuples = [t for t in as_tuple if isinstance(t, tuple) and len(t) == cfg.num_hidden_layers]
    assert any(torch.equal(t[0], attentions[0]) for t in tuples)
    base = model.model(ids, attention_mask=mask, output_attentions=True)
    assert all(torch.equal(a, w) for a, w in zip(base.attentions, attentions))


@pytest.mark.parametrize("step", [1, 2])
def test_model_attentions_after_a_dynamic_cache_prefill(step):
    """rbf with sliding, dot and register layers: the weights of a cached step are the matching rows of a forward
    without cache (the keys a sliding layer's cache dropped appear as zeros)."""
    overrides = dict(
        num_hidden_layers=4,
        attention_layers=["rbf", "dot"],
        window_pattern="SSL",
        sliding_window=3,
        num_register_tokens=2,
        attention_backend="auto",
    )
    model = build_model("rbf", overrides)
    ids, mask = _left_padded(model.config.vocab_size)
    n = ids.shape[1]
    prompt = n - step
    with torch.no_grad():
        full = model(ids, attention_mask=mask, output_attentions=True, use_cache=False)
        cache = DynamicCache()
        model(ids[:, :prompt], attention_mask=mask[:, :prompt], cache=cache, use_cache=True)
        out = model(ids[:, prompt:], attention_mask=mask, cache=cache, output_attentions=True)
    assert cache.get_seq_length() == n
    assert (out.logits - full.logits[:, prompt:]).abs().max().item() < 1e-4
    r = model.config.num_register_tokens
    for idx, (weights, ref) in enumerate(zip(out.attentions, full.attentions)):
        assert weights.shape == (2, model.config.num_attention_heads, step, r + n), (idx, weights.shape)
        assert (weights - ref[:, :, prompt:]).abs().max().item() < 1e-5, idx


@pytest.mark.parametrize("family", ["scalar_sort", "hybrid_sort"])
def test_model_attentions_refused_in_a_sorted_cache_decode_step(family):
    model = build_model(family, dict(num_register_tokens=1, decode_window=2))
    ids, mask = _left_padded(model.config.vocab_size)
    with torch.no_grad():
        full = model(ids, attention_mask=mask, output_attentions=True, use_cache=False)
        # the prompt into an empty sorted cache is exact: its weights are available
        cache = model.make_cache()
        assert isinstance(cache, hf_rbf.SortedScalarCache)
        prefill = model(ids[:, :-1], attention_mask=mask[:, :-1], cache=cache, output_attentions=True)
        for weights, ref in zip(prefill.attentions, full.attentions):
            assert (weights - ref[:, :, :-1, :-1]).abs().max().item() < 1e-5
        seen = cache.get_seq_length()
        with pytest.raises(ValueError, match=r"output_attentions.*sorted cache during decoding.*use_cache=False"):
            model(ids[:, -1:], attention_mask=mask, cache=cache, output_attentions=True)
        assert cache.get_seq_length() == seen  # refused before any layer ran
        step = model(ids[:, -1:], attention_mask=mask, cache=cache)
    assert step.attentions is None and cache.get_seq_length() == seen + 1


SORT_MODEL_CASES = [c for c in MODEL_CASES if c[0] in ("scalar-r2-pertoken-g2", "hybrid-kinds-r0")]


@pytest.mark.parametrize("case", SORT_MODEL_CASES, ids=[c[0] for c in SORT_MODEL_CASES])
def test_sort_family_weights_match_the_analysis_helper(case):
    """``ScalarSortAttention.attention_weights`` (the analysis helper, written separately) gives the same weights."""
    _, family, overrides = case
    model = build_model(family, overrides)
    ids, mask = _left_padded(model.config.vocab_size)
    layer = model.model.layers[0]
    captured = []
    handle = layer.register_forward_pre_hook(lambda m, a, k: captured.append((a, k)), with_kwargs=True)
    try:
        with torch.no_grad():
            out = model(ids, attention_mask=mask, output_attentions=True, use_cache=False)
    finally:
        handle.remove()
    args, kwargs = captured[0]
    hidden = args[0]
    registers = args[1] if len(args) > 1 else kwargs.get("register_states")
    with torch.no_grad():
        x = layer.input_layernorm(hidden)
        rx = layer.input_layernorm.capped(registers) if registers is not None else None
        weights, _, _, p = layer.self_attn.attention_weights(
            x, rx, kwargs["position_embeddings"], torch.arange(ids.shape[1]), attention_mask=mask
        )
    assert p == _num_prefix(model, 0)
    real = mask.bool()[:, None, :, None].expand_as(weights)  # the helper's padded query rows are NaN or arbitrary
    assert (weights[real] - out.attentions[0][real]).abs().max().item() < 1e-5
