"""SortedScalarCacheLayer: invariants after every insert (order kept, bound respected), eviction policies, crop,
beam reordering and batch selection, deferred eviction while recording, bad settings."""

from __future__ import annotations

import pytest
import torch
from sorted_cache_helpers import check_layer_invariants

from hf_rbf import SortedScalarCache
from hf_rbf.cache_sorted_scalar import SortedScalarCacheLayer
from hf_rbf.sorted_decode import sorted_window_attention

F64 = torch.float64


def _tokens(gen, b, h, g, n, dv=2, scale=1.0):
    return (
        scale * torch.randn(b, h, n, generator=gen, dtype=F64),
        torch.randn(b, g, n, dv, generator=gen, dtype=F64),
    )


def _exact(layer, qs, tau=0.7):
    """Attention of a query ``qs [B, H, 1]`` placed after every cached token, over all of them (no prefix)."""
    return sorted_window_attention(
        layer.state(), qs, tau, window=max(1, layer.num_slots), query_token_index=torch.tensor([layer.seen_tokens])
    )


@pytest.mark.parametrize("scheme", ["per_head", "sort_head"])
@pytest.mark.parametrize("buffer", [1, 4, 16])
def test_invariants_after_every_insert(scheme, buffer):
    gen = torch.Generator().manual_seed(0)
    layer = SortedScalarCacheLayer(
        num_heads=4, num_value_groups=2, decode_window=3, sort_scheme=scheme, cache_buffer_size=buffer
    )
    for n in [5, 1, 1, 3, 1, 7, 1, 1, 1, 2, 20, 1]:
        ks, v = _tokens(gen, 3, 4, 2, n)
        layer.append(ks, v, valid=torch.rand(3, n, generator=gen) > 0.25)
        check_layer_invariants(layer)
        layer.end_step(torch.randn(3, 4, n, generator=gen, dtype=F64))
        check_layer_invariants(layer)
    assert layer.seen_tokens == layer.num_slots == 44


@pytest.mark.parametrize("policy", ["oldest", "geometric", "density"])
@pytest.mark.parametrize("scheme", ["per_head", "sort_head"])
def test_bound_respected_after_every_step(policy, scheme):
    """max_cache_tokens holds after every insert (also a prompt longer than the bound, once its step ends)."""
    gen = torch.Generator().manual_seed(1)
    limit = 12
    layer = SortedScalarCacheLayer(
        num_heads=4, num_value_groups=2, decode_window=4, sort_scheme=scheme, max_cache_tokens=limit,
        cache_eviction=policy, cache_buffer_size=3, eviction_batch=3, sink_zone=[-0.05, 0.05],
    )  # fmt: skip
    for step, n in enumerate([30] + [1] * 40 + [3, 2, 1]):
        ks, v = _tokens(gen, 2, 4, 2, n)
        layer.append(ks, v)
        if step > 0:
            check_layer_invariants(layer)
        layer.attend(torch.randn(2, 4, n, generator=gen, dtype=F64), 0.5, num_new=n)
        layer.end_step(torch.randn(2, 4, n, generator=gen, dtype=F64))
        check_layer_invariants(layer)
        assert int(layer.valid_counts().max()) <= limit and layer.num_slots <= limit
    assert layer.seen_tokens == 30 + 40 + 6


def test_oldest_eviction_keeps_the_most_recent_tokens():
    gen = torch.Generator().manual_seed(2)
    layer = SortedScalarCacheLayer(
        num_heads=2, num_value_groups=1, max_cache_tokens=8, cache_eviction="oldest", eviction_batch=2
    )
    for _ in range(25):
        layer.append(*_tokens(gen, 1, 2, 1, 1))
        layer.end_step(torch.zeros(1, 2, 1, dtype=F64))
        kept = sorted(layer.token_index[0, : layer.num_slots][layer.valid[0, : layer.num_slots]].tolist())
        assert kept == list(range(layer.seen_tokens - len(kept), layer.seen_tokens))
        assert len(kept) <= 8


def test_geometric_eviction_drops_keys_outside_the_recent_query_range_first():
    """Recent queries lie in [-1, 1] and r = 0.5: the tokens with keys far outside go first, however recent."""
    layer = SortedScalarCacheLayer(
        num_heads=1,
        num_value_groups=1,
        max_cache_tokens=6,
        cache_eviction="geometric",
        eviction_radius=0.5,
        eviction_batch=1,
    )
    keys = [0.1, 9.0, -0.2, 0.3, -8.0, 0.0, 7.0]  # token 6 (7.0) arrives last and forces an eviction
    for i, k in enumerate(keys):
        layer.append(torch.tensor([[[k]]], dtype=F64), torch.zeros(1, 1, 1, 1, dtype=F64))
        layer.end_step(torch.tensor([[[(-1.0) ** i]]], dtype=F64))
        check_layer_invariants(layer)
    kept = sorted(layer.keys[0, 0, : layer.num_slots][layer.valid[0, : layer.num_slots]].tolist())
    # 7 tokens, bound 6, batch 1 -> 5 kept before the last insert: 9.0 (farthest) went first, then -8.0
    assert kept == sorted([0.1, -0.2, 0.3, 0.0, 7.0]), kept


def test_sink_zone_tokens_outlive_the_oldest_policy():
    layer = SortedScalarCacheLayer(
        num_heads=1,
        num_value_groups=1,
        max_cache_tokens=4,
        cache_eviction="oldest",
        eviction_batch=1,
        sink_zone=[-0.1, 0.1],
    )
    keys = [0.0, 1.0, 0.05, 2.0, 3.0, 4.0, 5.0, 6.0]
    for k in keys:
        layer.append(torch.tensor([[[k]]], dtype=F64), torch.zeros(1, 1, 1, 1, dtype=F64))
        layer.end_step(torch.zeros(1, 1, 1, dtype=F64))
    kept = sorted(layer.keys[0, 0, : layer.num_slots][layer.valid[0, : layer.num_slots]].tolist())
    assert 0.0 in kept and 0.05 in kept and 6.0 in kept and len(kept) <= 4


def test_density_merging_keeps_the_attention_of_duplicate_keys_exact():
    """Pairs of identical tokens merge into one entry of double weight: the attention over the cache is unchanged."""
    gen = torch.Generator().manual_seed(3)
    layer = SortedScalarCacheLayer(
        num_heads=2, num_value_groups=1, max_cache_tokens=40, cache_eviction="density", eviction_batch=1
    )
    ks, v = _tokens(gen, 2, 2, 1, 12, scale=3.0)
    twice_k = torch.stack([ks, ks], -1).flatten(-2)  # every token twice in a row
    twice_v = torch.stack([v, v], -2).flatten(-3, -2)
    layer.append(twice_k, twice_v)
    qs = torch.randn(2, 2, 1, generator=gen, dtype=F64)
    before = _exact(layer, qs)
    layer._evict_to(12)
    check_layer_invariants(layer)
    assert int(layer.valid_counts().max()) == 12 and layer.num_slots == 12
    after = _exact(layer, qs)
    assert (after - before).abs().max().item() < 1e-12
    assert torch.allclose(layer.multiplicity[:, :12], torch.full((2, 12), 2.0, dtype=F64))


def test_density_merging_merges_the_closest_pairs():
    layer = SortedScalarCacheLayer(num_heads=1, num_value_groups=1, max_cache_tokens=10, cache_eviction="density")
    keys = torch.tensor([[[0.0, 0.01, 5.0, 6.0, 10.0, 12.0]]], dtype=F64)
    values = torch.arange(6, dtype=F64).view(1, 1, 6, 1)
    layer.append(keys, values)
    layer._evict_to(5)
    kept = layer.keys[0, 0, : layer.num_slots][layer.valid[0, : layer.num_slots]]
    assert sorted(kept.tolist()) == pytest.approx([0.005, 5.0, 6.0, 10.0, 12.0])
    merged = layer.values[0, 0, : layer.num_slots, 0][layer.valid[0, : layer.num_slots]]
    assert 0.5 in merged.tolist()


@pytest.mark.parametrize("buffer", [1, 5])
@pytest.mark.parametrize("evict", [False, True])
def test_crop_equals_never_having_seen_the_tokens(buffer, evict):
    """crop(-n) after any sequence of steps gives the attention of a cache that only saw the first tokens (tail
    truncation and, after an eviction compaction, the masked path)."""
    gen = torch.Generator().manual_seed(4)
    steps = [6, 1, 3, 1, 2]
    data = [_tokens(gen, 2, 4, 2, n) for n in steps]
    settings = dict(num_heads=4, num_value_groups=2, decode_window=3, cache_buffer_size=buffer)
    if evict:
        settings.update(max_cache_tokens=9, cache_eviction="oldest", eviction_batch=1)
    full = SortedScalarCacheLayer(**settings)
    for ks, v in data:
        full.append(ks, v)
        full.end_step(torch.zeros(2, 4, ks.shape[-1], dtype=F64))
    full.crop(-3)  # the last step (2 tokens) and one token of the step before
    check_layer_invariants(full)
    assert full.seen_tokens == sum(steps) - 3
    ref = SortedScalarCacheLayer(**settings)
    for ks, v in data[:-2]:
        ref.append(ks, v)
        ref.end_step(torch.zeros(2, 4, ks.shape[-1], dtype=F64))
    ref.append(data[-2][0][..., :0], data[-2][1][..., :0, :])  # nothing: the cropped step
    qs = torch.randn(2, 4, 1, generator=gen, dtype=F64)
    if not evict:
        assert (_exact(full, qs) - _exact(ref, qs)).abs().max().item() < 1e-12
    # continuing after the crop: the windowed step sees exactly the kept tokens plus the new one
    new_k, new_v = _tokens(gen, 2, 4, 2, 1)
    for layer in (full, ref):
        layer.append(new_k, new_v)
        check_layer_invariants(layer)
    kept_full = set(full.token_index[0, : full.num_slots][full.valid[0, : full.num_slots]].tolist())
    assert full.seen_tokens - 1 in kept_full and kept_full <= set(range(full.seen_tokens))
    if not evict:
        assert kept_full == set(range(full.seen_tokens))
    if not evict:
        a = full.attend(qs, 0.5, num_new=1)
        b = ref.attend(qs, 0.5, num_new=1)
        assert (a - b).abs().max().item() < 1e-12


def test_crop_legacy_positive_size():
    layer = SortedScalarCacheLayer(num_heads=1, num_value_groups=1)
    layer.append(torch.randn(1, 1, 5, dtype=F64), torch.randn(1, 1, 5, 1, dtype=F64))
    layer.crop(7)  # keep 7 >= 5 tokens: nothing to do
    assert layer.seen_tokens == 5
    layer.crop(3)
    assert layer.seen_tokens == 3 and int(layer.valid_counts()) == 3
    check_layer_invariants(layer)


def test_recording_the_past_defers_eviction_until_crop():
    gen = torch.Generator().manual_seed(5)
    layer = SortedScalarCacheLayer(
        num_heads=2, num_value_groups=1, max_cache_tokens=6, cache_eviction="oldest", eviction_batch=1
    )
    layer.append(*_tokens(gen, 1, 2, 1, 5))
    layer.activate_past_recording()
    layer.append(*_tokens(gen, 1, 2, 1, 4))  # candidates of an assisted step: no eviction yet
    layer.end_step(torch.zeros(1, 2, 4, dtype=F64))
    assert int(layer.valid_counts()) == 9
    layer.crop(-2)  # two candidates rejected; then the bound applies again
    assert layer.seen_tokens == 7 and int(layer.valid_counts()) <= 6
    check_layer_invariants(layer)


def test_reorder_select_and_repeat_rows():
    gen = torch.Generator().manual_seed(6)
    layer = SortedScalarCacheLayer(num_heads=2, num_value_groups=2, decode_window=2, cache_buffer_size=2)
    rows = [_tokens(gen, 1, 2, 2, 7) for _ in range(3)]
    layer.append(torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows]))
    layer.append(*_tokens(gen, 3, 2, 2, 1))
    qs = torch.randn(3, 2, 1, generator=gen, dtype=F64)
    before = layer.attend(qs, 0.6, num_new=1)
    layer.reorder_cache(torch.tensor([2, 0, 1]))
    check_layer_invariants(layer)
    after = layer.attend(qs[[2, 0, 1]], 0.6, num_new=1)
    assert torch.equal(after, before[[2, 0, 1]])
    layer.batch_select_indices(torch.tensor([0, 2]))
    layer.batch_repeat_interleave(2)
    check_layer_invariants(layer)
    out = layer.attend(qs[[2, 2, 1, 1]], 0.6, num_new=1)
    assert torch.equal(out, before[[2, 2, 1, 1]])
    layer.reset()
    assert layer.get_seq_length() == 0 and not layer.is_initialized


BAD_SETTINGS = [
    (dict(decode_window=0), "decode_window"),
    (dict(decode_window=-4), "decode_window"),
    (dict(eviction_radius=-1.0), "eviction_radius"),
    (dict(sort_scheme="random"), "sort_scheme.*'per_head', 'sort_head'"),
    (dict(cache_eviction="lru"), "cache_eviction.*'oldest', 'geometric', 'density'"),
    (dict(sort_head=2), "sort_head"),
    (dict(cache_buffer_size=0), "cache_buffer_size"),
    (dict(max_cache_tokens=0), "max_cache_tokens"),
    (dict(max_cache_tokens=4, eviction_batch=5), "eviction_batch"),
    (dict(sink_zone=[1.0, -1.0]), "sink_zone"),
    (dict(num_value_groups=3), "num_value_groups"),
]


@pytest.mark.parametrize("overrides,pattern", BAD_SETTINGS, ids=[p for _, p in BAD_SETTINGS])
def test_bad_settings_raise_naming_the_argument(overrides, pattern):
    kwargs = dict(num_heads=4, num_value_groups=2)
    kwargs.update(overrides)
    with pytest.raises(ValueError, match=pattern):
        SortedScalarCacheLayer(**kwargs)
    cache_kwargs = {k: v for k, v in overrides.items() if k not in ("num_value_groups", "sort_head")}
    if cache_kwargs:
        with pytest.raises(ValueError, match=pattern):
            SortedScalarCache(**cache_kwargs)


def test_queries_are_recorded_only_under_a_bound():
    """The recent queries serve eviction alone: an unbounded layer skips recording them (a decode step's dozen ops
    per layer), a bounded one keeps the last ``eviction_recent_queries``."""
    free = SortedScalarCacheLayer(num_heads=1, num_value_groups=1)
    bounded = SortedScalarCacheLayer(num_heads=1, num_value_groups=1, max_cache_tokens=100, eviction_recent_queries=3)
    for layer in (free, bounded):
        for i in range(5):
            layer.append(torch.tensor([[[float(i)]]], dtype=F64), torch.zeros(1, 1, 1, 1, dtype=F64))
            layer.end_step(torch.full((1, 1, 1), 10.0 + i, dtype=F64))
    assert not free.recent_valid.any()
    assert bounded.recent_qs[0, 0].tolist() == [12.0, 13.0, 14.0] and bounded.recent_valid.all()
