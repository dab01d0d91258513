"""Per-token key log-measures ``key_log_weights`` ([B, N] or [B, H, N], past + current) reach every layer's attention
in every family; registers get log-weight 0."""

from __future__ import annotations

import pytest
import torch
from conftest import build_model


TOL = 1e-5


def _batch(vocab, b=2, n=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (b, n), generator=gen)
    klw = 0.7 * torch.randn(b, n, generator=gen)
    return ids, klw


def test_zero_log_weights_change_nothing_and_nonzero_ones_do(family_case):
    _, family, overrides = family_case
    model = build_model(family, overrides)
    ids, klw = _batch(model.config.vocab_size)
    with torch.no_grad():
        plain = model(ids).logits
        zeros = model(ids, key_log_weights=torch.zeros_like(klw)).logits
        weighted = model(ids, key_log_weights=klw).logits
    assert (zeros - plain).abs().max().item() < TOL
    assert (weighted - plain).abs().max().item() > 1e-3


def test_per_head_weights_broadcast(core_case):
    _, family, overrides = core_case
    model = build_model(family, overrides)
    ids, klw = _batch(model.config.vocab_size)
    heads = model.config.num_attention_heads
    with torch.no_grad():
        a = model(ids, key_log_weights=klw).logits
        b = model(ids, key_log_weights=klw[:, None, :].expand(-1, heads, -1).contiguous()).logits
        c = model(ids[:1], key_log_weights=klw[:1]).logits
    assert (a - b).abs().max().item() < TOL
    assert (a[:1] - c).abs().max().item() < TOL


def test_minus_infinity_like_weight_equals_masking_the_key(core_case):
    """A log-weight of -1e4 removes a key exactly as ``attention_mask = 0`` does (positions held fixed)."""
    _, family, overrides = core_case
    model = build_model(family, overrides)
    ids, _ = _batch(model.config.vocab_size, n=9)
    drop = torch.zeros(2, 9, dtype=torch.bool)
    drop[0, 4] = drop[1, 2] = drop[1, 6] = True
    positions = torch.arange(9).unsqueeze(0).expand(2, -1)
    with torch.no_grad():
        masked = model(ids, attention_mask=(~drop).long(), position_ids=positions).logits
        weighted = model(ids, key_log_weights=torch.where(drop, -1e4, 0.0), position_ids=positions).logits
    keep = ~drop
    assert (masked - weighted)[keep].abs().max().item() < TOL


def test_key_log_weights_through_the_cache(core_case):
    _, family, overrides = core_case
    model = build_model(family, overrides)
    ids, klw = _batch(model.config.vocab_size, n=9)
    with torch.no_grad():
        full = model(ids, key_log_weights=klw).logits
        cache = model.make_cache()
        parts = []
        for start, end in ((0, 5), (5, 6), (6, 7), (7, 9)):
            out = model(ids[:, start:end], past_key_values=cache, key_log_weights=klw[:, :end], use_cache=True)
            parts.append(out.logits)
    assert (torch.cat(parts, 1) - full).abs().max().item() < TOL


def test_bad_key_log_weights_shape_names_the_argument():
    model = build_model("gka", {})
    ids, klw = _batch(model.config.vocab_size)
    with pytest.raises(ValueError, match="key_log_weights"):
        model(ids, key_log_weights=klw[:, :-1])
    with pytest.raises(ValueError, match="key_log_weights"):
        model(ids, key_log_weights=klw[:, None, None, :])
    with pytest.raises(TypeError, match="key_log_weights"):
        model(ids, key_log_weights=[0.0] * 8)
