"""The windowed decode step (``sorted_window_attention``) against its brute-force definition, and exactness when the
window covers the cache (against the naive ``scalar_attention`` / ``hybrid_attention``)."""

from __future__ import annotations

import math

import pytest
import torch
from sorted_cache_helpers import check_layer_invariants

from hf_rbf import hybrid_attention, scalar_attention
from hf_rbf.cache_sorted_scalar import SortedScalarCacheLayer
from hf_rbf.sorted_decode import sorted_window_attention_reference


def _fill(layer, steps, *, dtype, hybrid=False, d=5, dv=3, seed=0, pad_prob=0.2, log_weights=False):
    """Append random tokens step by step; yield (qs, tau, q, n, prefix) after every append."""
    gen = torch.Generator().manual_seed(seed)
    b, h, g = 2, layer.num_heads, layer.num_value_groups

    def r(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    for n in steps:
        valid = torch.rand(b, n, generator=gen) > pad_prob
        lw = (0.3 * r(b, h, n)) if log_weights else None
        layer.append(r(b, h, n), r(b, g, n, dv), r(b, h, n, d) if hybrid else None, valid=valid, log_weight=lw)
        check_layer_invariants(layer)
        tau = (torch.rand(b, h, n, generator=gen, dtype=torch.float64) + 0.3).to(dtype)
        prefix = dict(prefix_ks=torch.zeros(1, h, 1, dtype=dtype), prefix_v=r(1, g, 1, dv))
        if hybrid:
            prefix["prefix_k"] = torch.zeros(1, h, 1, d, dtype=dtype)
        yield r(b, h, n), tau, (r(b, h, n, d) if hybrid else None), n, prefix


def _reference(layer, qs, tau, q, n, prefix, window, scale):
    s = layer.num_slots
    return sorted_window_attention_reference(
        layer.keys[:, :, :s],
        layer.values[:, :, :s],
        layer.valid[:, :s],
        layer.token_index[:, :s],
        qs,
        tau,
        window=window,
        query_token_index=torch.arange(layer.seen_tokens - n, layer.seen_tokens),
        order_head=layer._order_head,
        log_weight=None if layer.log_weight is None else layer.log_weight[:, :, :s],
        q=q,
        vector_keys=None if layer.vector_keys is None else layer.vector_keys[:, :, :s],
        scale=scale,
        **prefix,
    )


STEPS = [7, 1, 2, 1, 1, 3, 1, 1]


@pytest.mark.parametrize("scheme", ["per_head", "sort_head"])
@pytest.mark.parametrize("buffer", [1, 3, 64])
@pytest.mark.parametrize("window", [1, 2, 5, 8])
def test_window_matches_definition(scheme, buffer, window):
    """Every buffer size gives the same result: the definition's window over all visible keys (odd and even k,
    windows clipped at both ends, multi-token steps with causality inside the step, padding)."""
    layer = SortedScalarCacheLayer(
        num_heads=4, num_value_groups=2, decode_window=window, sort_scheme=scheme, sort_head=1, cache_buffer_size=buffer
    )
    for qs, tau, _, n, prefix in _fill(layer, STEPS, dtype=torch.float64):
        got = layer.attend(qs, tau, num_new=n, **prefix)
        ref = _reference(layer, qs, tau, None, n, prefix, window, None)
        assert (got - ref).abs().max().item() < 1e-12


@pytest.mark.parametrize("scheme", ["per_head", "sort_head"])
def test_hybrid_window_with_log_weights_and_per_head_scale(scheme):
    layer = SortedScalarCacheLayer(
        num_heads=4, num_value_groups=4, decode_window=3, sort_scheme=scheme, cache_buffer_size=2
    )
    scale = torch.tensor([0.4, 0.0, 0.3, 0.5], dtype=torch.float64)
    for qs, tau, q, n, prefix in _fill(layer, STEPS, dtype=torch.float64, hybrid=True, log_weights=True):
        got = layer.attend(qs, tau, num_new=n, q=q, scale=scale, **prefix)
        ref = _reference(layer, qs, tau, q, n, prefix, 3, scale)
        assert (got - ref).abs().max().item() < 1e-12


@pytest.mark.parametrize("hybrid", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_full_window_equals_exact_attention(hybrid, dtype):
    """``decode_window >= cache length`` (and None) reproduces the family's exact attention function."""
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for window in (64, None):
        layer = SortedScalarCacheLayer(num_heads=4, num_value_groups=2, decode_window=window, cache_buffer_size=3)
        for qs, tau, q, n, prefix in _fill(layer, STEPS, dtype=dtype, hybrid=hybrid, d=8):
            got = layer.attend(qs, tau, num_new=n, q=q, scale=0.35 if hybrid else None, **prefix)
            ks, v, k, valid, _ = layer.slot_view()
            b = ks.shape[0]
            keys = torch.cat([prefix["prefix_ks"].expand(b, -1, -1), ks], -1)
            values = torch.cat([prefix["prefix_v"].expand(b, -1, -1, -1), v], 2)
            am = torch.cat([torch.ones(b, 1, dtype=torch.bool), valid], 1)
            if hybrid:
                vk = torch.cat([prefix["prefix_k"].expand(b, -1, -1, -1), k], 2)
                ref = hybrid_attention(
                    q, vk, values, qs, keys, tau, scale=0.35, attention_mask=am, num_prefix_keys=1, backend="naive"
                )
            else:
                ref = scalar_attention(qs, keys, values, tau, attention_mask=am, num_prefix_keys=1, backend="naive")
            err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
            assert err < tol, (window, err)


def test_sink_is_always_in_the_window():
    """Queries far from every key and from the sink still attend to the sink (a prefix key, never windowed out)."""
    layer = SortedScalarCacheLayer(num_heads=1, num_value_groups=1, decode_window=2, cache_buffer_size=1)
    ks = torch.linspace(5.0, 10.0, 20, dtype=torch.float64).view(1, 1, 20)
    layer.append(ks, torch.zeros(1, 1, 20, 1, dtype=torch.float64))
    layer.append(torch.tensor([[[20.0]]], dtype=torch.float64), torch.zeros(1, 1, 1, 1, dtype=torch.float64))
    qs = torch.tensor([[[-1.0]]], dtype=torch.float64)  # nearest cached keys: 5.0, 5.26; the sink (key 0) is nearer
    sink_v = torch.ones(1, 1, 1, 1, dtype=torch.float64)
    out = layer.attend(qs, 1.0, num_new=1, prefix_ks=torch.zeros(1, 1, 1, dtype=torch.float64), prefix_v=sink_v)
    sink_score = -1.0  # -(qs - 0)^2 / tau
    window_scores = [-((qs.item() - k) ** 2) for k in (5.0, 5.0 + 5.0 / 19)]
    w_sink = 1.0 / (1.0 + sum(math.exp(sc - sink_score) for sc in window_scores))
    assert abs(out.item() - w_sink) < 1e-12 and out.item() > 0.99


def test_rows_with_nothing_visible_give_zeros():
    layer = SortedScalarCacheLayer(num_heads=2, num_value_groups=1, decode_window=4)
    layer.append(torch.randn(2, 2, 3), torch.randn(2, 1, 3, 4), valid=torch.tensor([[False] * 3, [True] * 3]))
    out = layer.attend(torch.randn(2, 2, 3), 0.5, num_new=3)
    assert torch.isfinite(out).all() and out[0].abs().max() == 0 and out[1].abs().max() > 0


def test_window_argument_is_checked():
    from hf_rbf import sorted_window_attention

    layer = SortedScalarCacheLayer(num_heads=1, num_value_groups=1, decode_window=2)
    layer.append(torch.randn(1, 1, 3), torch.randn(1, 1, 3, 2))
    with pytest.raises(ValueError, match="window"):
        sorted_window_attention(layer.state(), torch.randn(1, 1, 1), 1.0, window=0, query_token_index=torch.tensor([2]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("policy", [None, "geometric", "density"])
def test_decode_insert_merge_and_eviction_never_synchronise_with_the_host(policy):
    """With CUDA's sync debug mode set to "error", any device-to-host synchronisation raises: the whole step (insert,
    buffer merges, search, window, softmax, recent-query bookkeeping, eviction and compaction) must not need one."""
    dev = torch.device("cuda")
    settings = dict(num_heads=4, num_value_groups=2, decode_window=4, cache_buffer_size=3)
    if policy is not None:
        settings.update(max_cache_tokens=24, cache_eviction=policy, eviction_batch=4)
    layer = SortedScalarCacheLayer(**settings)
    layer.append(torch.randn(2, 4, 20, device=dev), torch.randn(2, 2, 20, 8, device=dev),
                 valid=torch.rand(2, 20, device=dev) > 0.2)  # fmt: skip
    tau = torch.full((4,), 0.5, device=dev)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(30):
            qs = torch.randn(2, 4, 1, device=dev)
            layer.append(torch.randn(2, 4, 1, device=dev), torch.randn(2, 2, 1, 8, device=dev))
            layer.attend(qs, tau, num_new=1)
            layer.end_step(qs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    check_layer_invariants(layer)
