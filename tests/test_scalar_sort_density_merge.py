"""Density compression of the sorted cache (``cache_eviction="density"``): groups of ``density_merge_size`` entries
adjacent in the first order merge into one, weighted by multiplicity (the earlier pair merge, kept selectable) or by
the attention of the recent queries (the gist's "replace k adjacent tokens with one representative, value = weighted
average"); checked against merges computed by hand in float64."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import build_model
from sorted_cache_helpers import PAD, left_padded

from hf_rbf import ScalarSortConfig, SortedScalarCache, SortedScalarCacheLayer
from hf_rbf.cache_names import CACHE_NAME

F64 = torch.float64
# One head, one group; sorted order is the slot order.  The densest group of three is the first one.
KEYS = [0.0, 0.05, 0.1, 3.0, 6.0, 9.0]


def _layer(weighting, size=3, **kwargs):
    return SortedScalarCacheLayer(
        num_heads=1,
        num_value_groups=1,
        max_cache_tokens=5,
        eviction_batch=1,  # after the step: cut to 5 - 1 = 4 entries, i.e. one group of three merges into one
        cache_eviction="density",
        density_merge_weighting=weighting,
        density_merge_size=size,
        **kwargs,
    )


def _values():
    return torch.tensor([[1.0, 10.0], [2.0, 20.0], [3.0, 30.0], [4.0, 40.0], [5.0, 50.0], [6.0, 60.0]], dtype=F64)


def _held(layer):
    """``{token index: (key, value row, vector key or None, log-weight, multiplicity)}`` of the valid entries."""
    ks, v, vk, valid, lw = layer.slot_view()
    out = {}
    for slot in valid[0].nonzero().flatten().tolist():
        out[int(layer.token_index[0, slot])] = (
            ks[0, 0, slot].item(),
            v[0, 0, slot].tolist(),
            None if vk is None else vk[0, 0, slot].tolist(),
            lw[0, 0, slot].item(),
            layer.multiplicity[0, slot].item(),
        )
    return out


@pytest.mark.parametrize("hybrid", [False, True], ids=["scalar", "hybrid"])
def test_attention_weighted_merge_of_three_adjacent_keys_by_hand(hybrid):
    layer = _layer("attention")
    ks = torch.tensor(KEYS, dtype=F64).view(1, 1, 6)
    v = _values().view(1, 1, 6, 2)
    vk = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0], [2.0, 0.0], [0.0, 2.0]], dtype=F64)
    layer.append(ks, v, vk.view(1, 1, 6, 2) if hybrid else None)
    # One query counts (the others are marked invalid): qs = -0.1, tau = 0.05, at the last token (it sees every key)
    qs = torch.full((1, 1, 6), -0.1, dtype=F64)
    q = torch.tensor([0.3, -0.2], dtype=F64).expand(1, 1, 6, 2) if hybrid else None
    only_last = torch.tensor([[False] * 5 + [True]])
    layer.end_step(qs, only_last, tau=torch.tensor([0.05], dtype=F64), q=q, scale=0.5 if hybrid else None)

    # by hand: the attention of that query on keys 0, 1, 2 (its normaliser cancels inside the group)
    scores = [-((-0.1 - k) ** 2) / 0.05 for k in KEYS[:3]]
    if hybrid:
        scores = [s + 0.5 * (0.3 * a - 0.2 * b) for s, (a, b) in zip(scores, vk[:3].tolist())]
    e = [math.exp(s) for s in scores]
    w = [x / sum(e) for x in e]
    held = _held(layer)
    assert sorted(held) == [2, 3, 4, 5]  # the merged entry keeps the newest token's index
    key, value, vector_key, log_weight, multiplicity = held[2]
    assert key == pytest.approx(sum(wi * k for wi, k in zip(w, KEYS[:3])), abs=1e-12)
    mean_value = sum(wi * (i + 1) for i, wi in enumerate(w))
    assert value == pytest.approx([mean_value, 10 * mean_value], abs=1e-12)
    if hybrid:
        assert vector_key == pytest.approx([w[0] + w[2], w[1] + w[2]], abs=1e-12)
    assert log_weight == pytest.approx(math.log(3.0), abs=1e-12)  # carries the kernel mass of three tokens
    assert multiplicity == 3.0
    for token in (3, 4, 5):  # the rest untouched
        assert held[token][0] == KEYS[token] and held[token][3] == 0.0 and held[token][4] == 1.0
    # the weights are not the plain mean: the merge really is attention-weighted
    assert abs(key - sum(KEYS[:3]) / 3) > 5e-3


def test_multiplicity_weighted_merge_of_three_by_hand():
    layer = _layer("multiplicity")
    layer.append(torch.tensor(KEYS, dtype=F64).view(1, 1, 6), _values().view(1, 1, 6, 2))
    layer.end_step(torch.zeros(1, 1, 6, dtype=F64))
    held = _held(layer)
    assert sorted(held) == [2, 3, 4, 5]
    key, value, _, log_weight, multiplicity = held[2]
    assert key == pytest.approx(0.05, abs=1e-12) and value == pytest.approx([2.0, 20.0], abs=1e-12)
    assert log_weight == pytest.approx(math.log(3.0), abs=1e-12) and multiplicity == 3.0


def test_pairs_by_multiplicity_merge_the_closest_pairs_as_before():
    """``density_merge_size=2`` with multiplicities is the earlier pair merge: the closest adjacent pairs become their
    multiplicity-weighted centroids, the closest first, as many as the excess; a merged entry then weighs double."""
    layer = SortedScalarCacheLayer(num_heads=1, num_value_groups=1, max_cache_tokens=4, eviction_batch=1,
                                   cache_eviction="density")  # fmt: skip
    keys = [0.0, 0.1, 5.0, 20.0, 20.5]
    layer.append(torch.tensor(keys, dtype=F64).view(1, 1, 5), torch.arange(5, dtype=F64).view(1, 1, 5, 1))
    layer.end_step(torch.zeros(1, 1, 5, dtype=F64))  # 5 > 4: cut to 3, i.e. two merges of the pairs (0, 1), (2, 3)
    held = _held(layer)
    assert sorted(held) == [1, 3, 4]
    assert held[1][0] == pytest.approx(0.05, abs=1e-12) and held[1][1] == [0.5] and held[1][4] == 2.0
    assert held[3][0] == pytest.approx(12.5, abs=1e-12) and held[3][1] == [2.5]
    assert held[1][3] == pytest.approx(math.log(2.0), abs=1e-12) and held[4] == (20.5, [4.0], None, 0.0, 1.0)
    # a later merge weighs the merged entry by its multiplicity 2: (2 * 0.05 + 1 * x) / 3
    layer.append(torch.tensor([[[0.2]]], dtype=F64), torch.tensor([[[[5.0]]]], dtype=F64))
    layer.end_step(torch.zeros(1, 1, 1, dtype=F64))  # 4 > 4? no: nothing happens yet
    layer.append(torch.tensor([[[30.0]]], dtype=F64), torch.tensor([[[[6.0]]]], dtype=F64))
    layer.end_step(torch.zeros(1, 1, 1, dtype=F64))  # 5 > 4: cut to 3: pairs (0.05 x2, 0.2), (12.5 x2, 20.5)
    held = _held(layer)
    low = [v for v in held.values() if v[0] < 1.0]
    assert len(held) == 3 and len(low) == 1 and low[0][4] == 3.0
    assert low[0][0] == pytest.approx((2 * 0.05 + 0.2) / 3, abs=1e-12)
    assert low[0][1] == pytest.approx([(2 * 0.5 + 5.0) / 3], abs=1e-12)


def test_a_group_no_query_sees_falls_back_to_multiplicities():
    layer = _layer("attention")
    layer.append(torch.tensor(KEYS, dtype=F64).view(1, 1, 6), _values().view(1, 1, 6, 2))
    # the only valid query is the first token: it sees key 0 alone, so keys 1 and 2 get no attention at all
    layer.end_step(torch.zeros(1, 1, 6, dtype=F64), torch.tensor([[True] + [False] * 5]), tau=0.1)
    key = _held(layer)[2][0]
    assert key == pytest.approx(0.0, abs=1e-12)  # all of the group's attention is on key 0
    layer = _layer("attention")
    layer.append(torch.tensor(KEYS, dtype=F64).view(1, 1, 6), _values().view(1, 1, 6, 2))
    layer.end_step(torch.zeros(1, 1, 6, dtype=F64), torch.zeros(1, 6, dtype=torch.bool), tau=0.1)  # no query at all
    assert _held(layer)[2][0] == pytest.approx(0.05, abs=1e-12) and not torch.isnan(layer.values).any()


def test_attention_weighting_needs_the_temperature():
    layer = _layer("attention")
    layer.append(torch.tensor(KEYS, dtype=F64).view(1, 1, 6), _values().view(1, 1, 6, 2))
    with pytest.raises(ValueError, match="density_merge_weighting='attention'.*tau"):
        layer.end_step(torch.zeros(1, 1, 6, dtype=F64))


def test_bad_settings_name_the_argument():
    with pytest.raises(ValueError, match="density_merge_weighting.*'multiplicity', 'attention'"):
        ScalarSortConfig(density_merge_weighting="mean")
    with pytest.raises(ValueError, match="density_merge_size.*>= 2"):
        ScalarSortConfig(density_merge_size=1)
    with pytest.raises(ValueError, match="density_merge_size"):
        SortedScalarCache(density_merge_size=0)
    with pytest.raises(ValueError, match="density_merge_weighting"):
        SortedScalarCacheLayer(num_heads=1, num_value_groups=1, density_merge_weighting="x")


@pytest.mark.parametrize("family", ["scalar_sort", "hybrid_sort"])
def test_generation_with_attention_weighted_groups_keeps_the_bound(family):
    overrides = dict(decode_window=4, max_cache_tokens=8, cache_eviction="density", density_merge_weighting="attention",
                     density_merge_size=3, tau_mode="per_token")  # fmt: skip
    if family == "hybrid_sort":
        overrides["head_kinds"] = ["hybrid", "scalar", "dot", "hybrid"]
    model = build_model(family, overrides)
    ids, mask = left_padded(model.config.vocab_size, [6, 4])
    cache = model.make_cache()
    assert cache.layers[0].density_merge_weighting == "attention" and cache.layers[0].density_merge_size == 3
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=PAD,
                             **{CACHE_NAME: cache})  # fmt: skip
    assert out.shape == (2, 16)
    for layer in cache.layers:
        if isinstance(layer, SortedScalarCacheLayer):
            assert (layer.valid_counts() <= 8).all()
            assert layer.multiplicity is not None and layer.multiplicity.max() > 2  # groups of three were merged
            assert torch.isfinite(layer.keys).all() and torch.isfinite(layer.values).all()
