"""Both sort families with their SortedScalarCache: chunked prefill + decode equals one no-cache forward (exact mode
and a window covering the cache), left padding, user caches, finite windows (chunked = token by token), the bound
through whole generations, wrong caches rejected."""

from __future__ import annotations

import pytest
import torch
from hf_rbf.cache_names import output_cache
from conftest import build_model
from sorted_cache_helpers import CORE_SORT_CASES, PAD, SORT_CASES, TOL, check_layer_invariants, left_padded
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from hf_rbf import SortedScalarCache, SortedScalarCacheLayer


# transformers contract: CI also runs this module against the oldest supported versions (.ci/run)
pytestmark = pytest.mark.contract


@pytest.fixture(params=SORT_CASES, ids=[c[0] for c in SORT_CASES])
def sort_case(request):
    return request.param


@pytest.fixture(params=CORE_SORT_CASES, ids=[c[0] for c in CORE_SORT_CASES])
def core_sort_case(request):
    return request.param


@torch.no_grad()
def _chunked(model, ids, mask, chunks, cache):
    logits, start = [], 0
    for size in chunks:
        end = start + size
        out = model(ids[:, start:end], attention_mask=mask[:, :end], cache=cache, use_cache=True)
        logits.append(out.logits)
        for layer in output_cache(out).layers:
            if isinstance(layer, SortedScalarCacheLayer):
                check_layer_invariants(layer)
        start = end
    return torch.cat(logits, dim=1), output_cache(out)


@pytest.mark.parametrize("window", [None, 64])
def test_chunked_prefill_then_decode_equals_full_forward(sort_case, window):
    """decode_window None (exact functions over the cache) or >= the cache length (the windowed step, which then
    covers every key) both reproduce the no-cache forward; left-padded rows included."""
    _, family, overrides = sort_case
    model = build_model(family, overrides)
    ids, mask = left_padded(model.config.vocab_size, [11, 7, 4])
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False).logits
    chunked, cache = _chunked(model, ids, mask, [4, 2, 1, 1, 1, 1, 1], SortedScalarCache(decode_window=window))
    assert (chunked - full)[mask.bool()].abs().max().item() < TOL
    assert cache.get_seq_length() == ids.shape[1]
    kinds = [layer.self_attn.kind for layer in model.model.layers]
    for kind, attn_layer, layer in zip(kinds, model.model.layers, cache.layers):
        if attn_layer.self_attn.window is not None:
            assert isinstance(layer, DynamicSlidingWindowLayer)
        elif kind == "dot":
            assert type(layer) is DynamicLayer
        else:
            assert isinstance(layer, SortedScalarCacheLayer) and layer.decode_window == window


def test_cache_created_in_forward_and_by_generate(core_sort_case):
    _, family, overrides = core_sort_case
    model = build_model(family, dict(overrides, decode_window=8))
    ids = torch.randint(1, 128, (2, 5))
    with torch.no_grad():
        out = model(ids, use_cache=True)
        gen = model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=PAD, return_dict_in_generate=True)
    for cache in (output_cache(out), output_cache(gen)):
        assert isinstance(cache, SortedScalarCache)
        assert all(isinstance(layer, SortedScalarCacheLayer) and layer.decode_window == 8 for layer in cache.layers)
    model.train()
    assert output_cache(model(ids)) is None


@pytest.mark.parametrize("kind", ["sorted", "dynamic", "dynamic-config"])
def test_user_caches_are_completed_layer_by_layer(core_sort_case, kind):
    _, family, overrides = core_sort_case
    model = build_model(family, overrides)
    ids, mask = left_padded(model.config.vocab_size, [7, 5])
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
    cache = {
        "sorted": SortedScalarCache(),
        "dynamic": DynamicCache(),
        "dynamic-config": DynamicCache(config=model.config),
    }[kind]
    chunked, cache = _chunked(model, ids, mask, [5, 1, 1], cache)
    assert (chunked - full)[mask.bool()].abs().max().item() < TOL
    assert all(isinstance(layer, SortedScalarCacheLayer) for layer in cache.layers)


def test_wrong_cache_layers_are_rejected():
    model = build_model("scalar_sort", {})
    ids = torch.randint(1, 128, (1, 4))
    cache = DynamicCache()
    with torch.no_grad():
        build_model("rbf", {})(ids, past_key_values=cache)  # fills DynamicLayers with RBF keys
        with pytest.raises(TypeError, match="cannot serve a 'scalar'"):
            model(ids, past_key_values=cache)
        with pytest.raises(TypeError, match="past_key_values"):
            model(ids, past_key_values=[(torch.zeros(1), torch.zeros(1))])


@pytest.mark.parametrize("scheme", ["per_head", "sort_head"])
def test_finite_window_chunked_equals_token_by_token(core_sort_case, scheme):
    """After the prompt, a multi-token step over the sorted cache gives the logits of feeding its tokens one by one
    (the window is a function of the cached keys, not of merge timing or step size), for any buffer size."""
    _, family, overrides = core_sort_case
    model = build_model(family, dict(overrides, decode_window=3, sort_scheme=scheme))
    ids, mask = left_padded(model.config.vocab_size, [14, 10])
    results = []
    for chunks, buffer in (([6, 1, 1, 1, 1, 1, 1, 1, 1], 1), ([6, 3, 1, 4], 2), ([6, 8], 64)):
        logits, _ = _chunked(model, ids, mask, chunks, SortedScalarCache(cache_buffer_size=buffer))
        results.append(logits)
    real = mask.bool()
    for other in results[1:]:
        assert (other - results[0])[real].abs().max().item() < TOL
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False).logits
    # the window really is approximate here (so the comparison above is not trivially the exact path)
    assert (results[0] - full)[:, 7:][real[:, 7:]].abs().max().item() > 1e-3


@pytest.mark.parametrize("policy", ["oldest", "geometric", "density"])
def test_generation_never_exceeds_the_bound(policy):
    model = build_model(
        "hybrid_sort",
        dict(
            num_hidden_layers=3,
            attention_layers=["hybrid", "dot", "scalar"],
            max_cache_tokens=10,
            cache_eviction=policy,
            decode_window=4,
            eviction_batch=2,
        ),
    )
    ids, mask = left_padded(model.config.vocab_size, [6, 4])
    seen = []

    def record(module, args, kwargs, output):
        cache = output_cache(output)
        for layer in cache.layers:
            if isinstance(layer, SortedScalarCacheLayer):
                check_layer_invariants(layer)
                seen.append(int(layer.valid_counts().max()))
            else:
                seen.append(layer.keys.shape[-2])

    hook = model.register_forward_hook(record, with_kwargs=True)
    try:
        with torch.no_grad():
            out = model.generate(
                ids, attention_mask=mask, max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=PAD
            )
    finally:
        hook.remove()
    assert out.shape[1] == 26 and max(seen) <= 10 and len(seen) == 3 * 20


def test_a_prompt_longer_than_the_bound_is_exact_then_reduced():
    model = build_model("scalar_sort", dict(max_cache_tokens=6, cache_eviction="oldest", eviction_batch=1))
    ids = torch.randint(1, 128, (1, 12))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        out = model(ids, use_cache=True)
    assert (out.logits - full).abs().max().item() < TOL
    for layer in output_cache(out).layers:
        check_layer_invariants(layer)
        assert int(layer.valid_counts().max()) <= 6 and layer.get_seq_length() == 12
