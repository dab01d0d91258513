"""The captured-mass metric of recipes/measure_captured_mass.py: its windows are the sorted cache's windows, and the
exact weights it weighs them with are the layer's attention weights."""

from __future__ import annotations

import pytest
import torch
from conftest import build_model
from sorted_cache_helpers import left_padded

from hf_rbf import hybrid_attention, scalar_attention
from hf_rbf.cache_sorted_scalar import SortedScalarCacheLayer
from hf_rbf.eval.captured_mass import captured_mass, order_keys_for, window_masks
from hf_rbf.sorted_decode import window_candidates


@pytest.mark.parametrize("scheme", ["per_head", "sort_head"])
@pytest.mark.parametrize("k", [1, 4, 7])
def test_windows_are_the_sorted_cache_windows(scheme, k):
    gen = torch.Generator().manual_seed(0)
    h, g, n = 4, 2, 23
    ks = torch.randn(h, n, generator=gen, dtype=torch.float64)
    qs = torch.randn(h, n, generator=gen, dtype=torch.float64)
    rows = torch.tensor([0, 3, 9, 15, 22])
    masks = window_masks(order_keys_for(ks, scheme, g, sort_head=1), qs[:, rows], rows, [k])[k]
    for qi, t in enumerate(rows.tolist()):
        layer = SortedScalarCacheLayer(num_heads=h, num_value_groups=g, sort_scheme=scheme, sort_head=1,
                                       cache_buffer_size=2)  # fmt: skip
        layer.append(ks[:, : t + 1].unsqueeze(0), torch.zeros(1, g, t + 1, 1, dtype=torch.float64))
        slots, ok = window_candidates(layer.state(), qs[:, t : t + 1].unsqueeze(0), k, torch.tensor([t]))
        for hi in range(h):
            expected = set(slots[0, hi, 0][ok[0, hi, 0]].tolist())
            assert set(masks[hi, qi].nonzero().flatten().tolist()) == expected


def test_full_window_captures_everything_and_mass_is_monotone():
    gen = torch.Generator().manual_seed(1)
    h, n, p = 3, 30, 2
    w = torch.softmax(torch.randn(h, 4, p + n, generator=gen), -1)
    rows = torch.tensor([n - 4, n - 3, n - 2, n - 1])
    w[..., p:] = w[..., p:] * (torch.arange(n).view(1, 1, n) <= rows.view(1, -1, 1))
    w = w / w.sum(-1, keepdim=True)
    ks, qs = torch.randn(h, n, generator=gen), torch.randn(h, 4, generator=gen)
    mass = captured_mass(w, p, ks, qs, rows, [2, 8, 16, 64])
    assert torch.allclose(mass[64], torch.ones(h, 4))
    assert (mass[2] <= mass[8] + 1e-7).all() and (mass[8] <= mass[16] + 1e-7).all()
    assert (mass[2] >= w[..., :p].sum(-1) - 1e-7).all()


@pytest.mark.parametrize(
    "family,overrides",
    [
        ("scalar_sort", dict(num_register_tokens=2, tau_mode="per_token", num_value_groups=2)),
        ("hybrid_sort", dict(head_kinds=["hybrid", "scalar", "dot", "hybrid"], num_register_tokens=1)),
    ],
)
def test_attention_weights_are_the_layer_weights(family, overrides):
    model = build_model(family, overrides)
    ids, mask = left_padded(model.config.vocab_size, [9, 6])
    captured = []
    hooks = [layer.register_forward_pre_hook(lambda m, a, kw: captured.append((m, a, kw)), with_kwargs=True)
             for layer in model.model.layers]  # fmt: skip
    with torch.no_grad():
        model(ids, attention_mask=mask)
    for hk in hooks:
        hk.remove()
    rows = torch.arange(9)
    for module, args, kwargs in captured:
        attn = module.self_attn
        x = module.input_layernorm(args[0])
        rx = module.input_layernorm.capped(args[1]) if args[1] is not None else None
        w, qs, ks, p = attn.attention_weights(x, rx, kwargs["position_embeddings"], rows, kwargs["attention_mask"])
        # reference: the attention function with identity values returns its weights
        proj = attn.project(x, kwargs["position_embeddings"])
        prefix, p2 = attn._prefix(attn.project_registers(rx) if rx is not None else None, x.dtype, x.device)
        keys = attn._cat_keys([prefix, proj], 2)
        nk = keys.ks.shape[-1]
        eye = torch.eye(nk).expand(2, attn.num_heads, nk, nk)
        am, _ = attn._mask_args(9, p2, kwargs["attention_mask"], None)
        common = dict(attention_mask=am, num_prefix_keys=p2, backend="naive")
        tau = attn.temperature(x)
        with torch.no_grad():
            if attn.has_vector_term:
                ref = hybrid_attention(
                    proj.q, keys.k, eye, proj.qs, keys.ks, tau, scale=attn._scale(x.device), **common
                )
            else:
                ref = scalar_attention(proj.qs, keys.ks, eye, tau, **common)
        real = mask.bool()
        assert p == p2 and (w - ref)[real.unsqueeze(1).expand_as(w[..., 0])].abs().max() < 1e-5
        assert torch.allclose(qs, proj.qs) and torch.allclose(ks, proj.ks)
