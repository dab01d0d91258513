"""KV cache: chunked prefill + token-by-token decode equals one no-cache forward; registers and positions stay right;
GKA stores each feature once; user-supplied caches work; sliding layers keep only their window."""

from __future__ import annotations

import pytest
import torch
from hf_rbf.cache_names import output_cache
from conftest import build_model
from transformers import DynamicCache


# transformers contract: CI also runs this module against the oldest supported versions (.ci/run)
pytestmark = pytest.mark.contract


TOL = 1e-5


def _left_padded_batch(vocab: int, lengths: list[int], seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    n = max(lengths)
    ids = torch.zeros(len(lengths), n, dtype=torch.long)
    mask = torch.zeros(len(lengths), n, dtype=torch.long)
    for b, length in enumerate(lengths):
        ids[b, n - length :] = torch.randint(1, vocab, (length,), generator=gen)
        mask[b, n - length :] = 1
    return ids, mask


@torch.no_grad()
def _decode_in_chunks(model, ids, mask, chunks: list[int], cache=None):
    """Feed ``ids`` in chunks of the given sizes through one cache; return the concatenated logits."""
    cache = cache if cache is not None else model.make_cache()
    logits, start = [], 0
    for size in chunks:
        end = start + size
        out = model(ids[:, start:end], attention_mask=mask[:, :end], cache=cache, use_cache=True)
        logits.append(out.logits)
        cache = output_cache(out)
        start = end
    assert start == ids.shape[1]
    return torch.cat(logits, dim=1), cache


def test_chunked_prefill_then_decode_equals_full_forward(family_case):
    _, family, overrides = family_case
    model = build_model(family, overrides)
    ids, mask = _left_padded_batch(model.config.vocab_size, [9, 6, 4])
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False).logits
    chunked, cache = _decode_in_chunks(model, ids, mask, [4, 2, 1, 1, 1])
    real = mask.bool()
    assert (chunked - full)[real].abs().max().item() < TOL
    # The cache counts text tokens only: registers are never stored.
    assert cache.get_seq_length() == ids.shape[1]
    assert torch.isfinite(chunked).all()


def test_left_padding_equals_unpadded_rows(family_case):
    """Positions come from the attention mask, so a left-padded row gives the logits of the same row alone."""
    _, family, overrides = family_case
    model = build_model(family, overrides)
    ids, mask = _left_padded_batch(model.config.vocab_size, [8, 5])
    with torch.no_grad():
        batched = model(ids, attention_mask=mask).logits
        alone = model(ids[1:, 3:]).logits
    assert (batched[1, 3:] - alone[0]).abs().max().item() < TOL


def test_explicit_position_ids_match_mask_positions(core_case):
    _, family, overrides = core_case
    model = build_model(family, overrides)
    ids, mask = _left_padded_batch(model.config.vocab_size, [7, 4])
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        a = model(ids, attention_mask=mask).logits
        b = model(ids, attention_mask=mask, position_ids=pos).logits
        shifted = model(ids, attention_mask=mask, position_ids=pos + 5).logits
    assert torch.equal(a, b)
    uses_positions = overrides.get("position_embedding_type", "x") != "none"
    if uses_positions:
        assert (shifted - a)[mask.bool()].abs().max().item() > 1e-4


def test_registers_matter_and_are_recomputed_during_decode(core_case):
    """Registers change the logits (so the test above exercises them) and each decode step sees them."""
    _, family, overrides = core_case
    if overrides.get("num_register_tokens", 1) == 0:
        pytest.skip("configuration without registers")
    model = build_model(family, overrides)
    ids, mask = _left_padded_batch(model.config.vocab_size, [6, 6])
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        model.model.register_tokens.add_(1.0)
        moved = model(ids, attention_mask=mask).logits
        chunked, _ = _decode_in_chunks(model, ids, mask, [3, 1, 1, 1])
    assert (moved - full).abs().max().item() > 1e-3
    assert (chunked - moved).abs().max().item() < TOL


@pytest.mark.parametrize("kind", ["plain", "config"])
def test_user_dynamic_cache(core_case, kind):
    """``past_key_values=DynamicCache()`` (lazy layers) or ``DynamicCache(config=...)`` both work."""
    _, family, overrides = core_case
    model = build_model(family, overrides)
    ids, mask = _left_padded_batch(model.config.vocab_size, [7, 5])
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
    cache = DynamicCache() if kind == "plain" else DynamicCache(config=model.config)
    chunked, cache = _decode_in_chunks(model, ids, mask, [5, 1, 1], cache=cache)
    assert (chunked - full)[mask.bool()].abs().max().item() < TOL
    assert cache.get_seq_length() == ids.shape[1]


def test_cache_created_inside_forward():
    model = build_model("rbf", {})
    ids = torch.randint(1, 128, (2, 5))
    with torch.no_grad():
        out = model(ids, use_cache=True)
        nxt = model(ids[:, -1:], past_key_values=output_cache(out)).logits
        full = model(torch.cat([ids, ids[:, -1:]], 1)).logits
    assert isinstance(output_cache(out), DynamicCache)
    assert (nxt[:, -1] - full[:, -1]).abs().max().item() < TOL
    model.train()
    assert output_cache(model(ids)) is None  # no cache in training mode unless asked


def test_gka_cache_stores_features_once():
    model = build_model("gka", dict(num_register_tokens=2))
    ids = torch.randint(1, 128, (3, 6))
    with torch.no_grad():
        cache = output_cache(model(ids, use_cache=True))
    heads, head_dim = model.config.num_attention_heads, model.config.head_dim
    for layer in cache.layers:
        assert tuple(layer.keys.shape) == (3, heads, 6, head_dim)
        assert layer.values.numel() == 0 and tuple(layer.values.shape) == (3, heads, 6, 0)
    # an RBF layer stores keys and values
    rbf = build_model("rbf", {})
    with torch.no_grad():
        rbf_cache = output_cache(rbf(ids, use_cache=True))
    assert rbf_cache.layers[0].values.shape == rbf_cache.layers[0].keys.shape


def test_sliding_layers_keep_only_their_window():
    overrides = dict(
        num_hidden_layers=4, window_pattern="SSSL", sliding_window=3, attention_layers=["gka", "gka", "gka", "dot"]
    )
    model = build_model("gka", overrides)
    ids = torch.randint(1, 128, (1, 10))
    mask = torch.ones_like(ids)
    chunked, cache = _decode_in_chunks(model, ids, mask, [6, 1, 1, 1, 1])
    with torch.no_grad():
        full = model(ids).logits
    assert (chunked - full).abs().max().item() < TOL
    kept = [layer.keys.shape[2] for layer in cache.layers]
    assert kept == [2, 2, 2, 10]  # window - 1 for "S" layers, everything for "L"
    assert cache.get_seq_length() == 10


def test_bad_attention_mask_length_names_the_argument():
    model = build_model("rbf", {})
    ids = torch.randint(1, 128, (2, 4))
    with torch.no_grad():
        cache = output_cache(model(ids, use_cache=True))
        with pytest.raises(ValueError, match="attention_mask"):
            model(ids[:, :1], attention_mask=torch.ones(2, 1), past_key_values=cache)
        with pytest.raises(ValueError, match="attention_mask"):
            model(ids, attention_mask=torch.ones(2, 1, 4, 4))
