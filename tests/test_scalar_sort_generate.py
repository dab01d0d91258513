"""``generate`` of both sort families through the SortedScalarCache gives the tokens, and logits within 1e-5, of a
no-cache run at full window (``decode_window=None`` or >= the cache length): greedy, sampling, beam search
(``reorder_cache``), prompt-lookup decoding (``crop`` with a negative count), left-padded batches; a user's
``past_key_values=SortedScalarCache(...)`` continues across calls."""

from __future__ import annotations

import pytest
import torch
from hf_rbf.cache_names import CACHE_NAME, output_cache
from conftest import build_model
from sorted_cache_helpers import CORE_SORT_CASES, PAD, SORT_CASES, TOL, check_layer_invariants, left_padded

from hf_rbf import SortedScalarCache, SortedScalarCacheLayer


# transformers contract: CI also runs this module against the oldest supported versions (.ci/run)
pytestmark = pytest.mark.contract

MODES = {
    "greedy": dict(do_sample=False),
    "sample": dict(do_sample=True, top_k=0, temperature=1.0),
    "beam": dict(do_sample=False, num_beams=3, num_return_sequences=2, early_stopping=False),
}


def _generate(model, ids, mask, seed: int = 0, **kwargs):
    torch.manual_seed(seed)
    with torch.no_grad():
        return model.generate(
            input_ids=ids,
            attention_mask=mask,
            pad_token_id=PAD,
            return_dict_in_generate=True,
            output_logits=True,
            **kwargs,
        )


def _max_logit_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a.logits, b.logits))


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("window", ["none", "full"])
def test_generate_at_full_window_equals_no_cache(mode, window):
    cases = SORT_CASES if mode == "greedy" else CORE_SORT_CASES
    for _, family, overrides in cases:
        model = build_model(family, overrides)
        ids, mask = left_padded(model.config.vocab_size, [7, 4, 5])
        kwargs = dict(MODES[mode], max_new_tokens=6, min_new_tokens=6)
        uncached = _generate(model, ids, mask, use_cache=False, **kwargs)
        cache = SortedScalarCache(decode_window=None if window == "none" else 64, cache_buffer_size=2)
        cached = _generate(model, ids, mask, **{CACHE_NAME: cache}, **kwargs)
        assert torch.equal(cached.sequences, uncached.sequences), family
        assert _max_logit_diff(cached, uncached) < TOL, family
        for layer in cache.layers:
            if isinstance(layer, SortedScalarCacheLayer):
                check_layer_invariants(layer)
        if window == "none" and mode == "greedy":
            # the default cache (built by generate) is the exact sorted cache too
            default = _generate(model, ids, mask, **kwargs)
            assert isinstance(output_cache(default), SortedScalarCache)
            assert torch.equal(default.sequences, uncached.sequences)


@pytest.mark.parametrize("window", [None, 64])
def test_prompt_lookup_decoding_equals_greedy(window):
    for _, family, overrides in CORE_SORT_CASES:
        model = build_model(family, dict(overrides, decode_window=window))
        gen = torch.Generator().manual_seed(1)
        motif = torch.randint(1, model.config.vocab_size, (4,), generator=gen)
        ids = torch.cat([motif, motif, motif[:2]]).unsqueeze(0)
        mask = torch.ones_like(ids)
        crops = []
        original_crop = SortedScalarCacheLayer.crop

        def spy(self, n):
            crops.append(n)
            return original_crop(self, n)

        SortedScalarCacheLayer.crop = spy
        try:
            lookup = _generate(model, ids, mask, do_sample=False, max_new_tokens=8, prompt_lookup_num_tokens=3)
        finally:
            SortedScalarCacheLayer.crop = original_crop
        greedy = _generate(model, ids, mask, use_cache=False, do_sample=False, max_new_tokens=8)
        assert torch.equal(lookup.sequences, greedy.sequences), family
        assert _max_logit_diff(lookup, greedy) < TOL
        assert crops and any(n < 0 for n in crops)  # rejected candidates were cropped away
        for layer in output_cache(lookup).layers:
            check_layer_invariants(layer)


def test_user_cache_continues_across_generate_calls():
    model = build_model(
        "hybrid_sort", dict(num_hidden_layers=2, attention_layers=["hybrid", "dot"], num_register_tokens=2)
    )
    ids, mask = left_padded(model.config.vocab_size, [5, 3])
    cache = SortedScalarCache(decode_window=32)
    with torch.no_grad():
        first = model.generate(
            input_ids=ids,
            attention_mask=mask,
            **{CACHE_NAME: cache},
            max_new_tokens=3,
            do_sample=False,
            pad_token_id=PAD,
        )
        mask2 = torch.cat([mask, torch.ones(2, 3, dtype=mask.dtype)], 1)
        second = model.generate(
            input_ids=first,
            attention_mask=mask2,
            **{CACHE_NAME: cache},
            max_new_tokens=3,
            do_sample=False,
            pad_token_id=PAD,
        )
        reference = model.generate(
            input_ids=ids, attention_mask=mask, use_cache=False, max_new_tokens=6, do_sample=False, pad_token_id=PAD
        )
    assert torch.equal(second, reference)
    assert cache.get_seq_length() == second.shape[1] - 1


def test_windowed_generation_runs_every_mode():
    """A small window is approximate but every decoding mode runs through it, with the invariants kept."""
    model = build_model("scalar_sort", dict(decode_window=2, cache_buffer_size=1, tau_mode="per_token"))
    ids, mask = left_padded(model.config.vocab_size, [9, 6])
    for mode in MODES.values():
        cache = SortedScalarCache()
        out = _generate(model, ids, mask, **{CACHE_NAME: cache}, max_new_tokens=5, min_new_tokens=5, **mode)
        assert out.sequences.shape[1] == ids.shape[1] + 5
        for layer in cache.layers:
            check_layer_invariants(layer)
        assert any(attn.self_attn.last_backend == "sorted_window" for attn in model.model.layers)


def test_unsupported_cache_implementation_is_rejected():
    # "static" is supported (tests/test_model_static_cache.py); quantized caches are not
    model = build_model("scalar_sort", {})
    with pytest.raises(ValueError, match="cache_implementation"):
        model.generate(
            torch.randint(1, 128, (1, 4)), max_new_tokens=2, cache_implementation="quantized", pad_token_id=PAD
        )
