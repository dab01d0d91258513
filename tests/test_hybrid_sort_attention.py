"""Hybrid layers: per-head kinds reduce to the pure kinds (all-"scalar" heads = a scalar sort layer, all-"dot" heads
without sink = a "dot" layer); at decode time "dot" heads read every cached key while scalar / hybrid heads read
their window."""

from __future__ import annotations

import torch
from conftest import build_model
from sorted_cache_helpers import TOL, left_padded

from hf_rbf import SortedScalarCache


def _copy_weights(src, dst, extra: set[str]):
    """Load ``src``'s weights into ``dst``; the only weights ``dst`` lacks are those named in ``extra``."""
    missing, unexpected = dst.load_state_dict(src.state_dict(), strict=False)
    assert not missing, missing
    assert {name.rsplit(".", 1)[0].rsplit(".", 1)[-1] if name.endswith((".weight", ".bias")) else name.rsplit(".", 1)[-1]
            for name in unexpected} <= extra, unexpected  # fmt: skip


def test_all_scalar_heads_equal_a_scalar_sort_layer():
    overrides = dict(num_value_groups=2, num_register_tokens=1, tau_mode="per_token")
    hybrid = build_model("hybrid_sort", dict(overrides, head_kinds=["scalar"]))
    scalar = build_model("scalar_sort", overrides)
    _copy_weights(hybrid, scalar, {"q_proj", "k_proj", "register_position"})
    ids, mask = left_padded(128, [8, 5])
    with torch.no_grad():
        a = hybrid(ids, attention_mask=mask).logits
        b = scalar(ids, attention_mask=mask).logits
    assert (a - b)[mask.bool()].abs().max().item() < TOL


def test_all_dot_heads_equal_a_dot_layer():
    hybrid = build_model("hybrid_sort", dict(head_kinds=["dot"], scalar_sink=False, num_register_tokens=2))
    dot = build_model("hybrid_sort", dict(attention_layers=["dot"], scalar_sink=False, num_register_tokens=2))
    _copy_weights(hybrid, dot, {"qs_proj", "ks_proj", "tau_bias", "register_scalar_position"})
    ids, mask = left_padded(128, [8, 5])
    with torch.no_grad():
        a = hybrid(ids, attention_mask=mask).logits
        b = dot(ids, attention_mask=mask).logits
    assert (a - b)[mask.bool()].abs().max().item() < TOL


def _head_outputs(model, ids, mask, cache, chunks):
    """Per-head attention outputs (the input of o_proj) of layer 0 for every chunk."""
    seen = []
    attn = model.model.layers[0].self_attn
    hook = attn.o_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    try:
        start = 0
        with torch.no_grad():
            for size in chunks:
                model(ids[:, start : start + size], attention_mask=mask[:, : start + size], past_key_values=cache)
                start += size
    finally:
        hook.remove()
    b = ids.shape[0]
    # o_proj takes the flat rows [B * N + R, H * Dv] of each chunk (text rows first, then the registers')
    assert len(seen) == len(chunks)
    text = [rows[: b * size].view(b, size, -1) for rows, size in zip(seen, chunks)]
    return torch.cat(text, 1).view(b, ids.shape[1], attn.num_heads, -1)


def test_dot_heads_read_every_key_at_decode_time():
    model = build_model(
        "hybrid_sort", dict(head_kinds=["hybrid", "dot", "scalar", "dot"], num_register_tokens=1, num_value_groups=4)
    )
    ids, mask = left_padded(128, [16, 12])
    chunks = [6] + [1] * 10
    exact = _head_outputs(model, ids, mask, SortedScalarCache(decode_window=None), chunks)
    windowed = _head_outputs(model, ids, mask, SortedScalarCache(decode_window=2), chunks)
    real = mask.bool()[:, 6:]
    diff = (windowed - exact)[:, 6:][real]  # [tokens, H, Dv]
    per_head = diff.abs().amax(dim=(0, 2))
    assert per_head[1] < 1e-6 and per_head[3] < 1e-6  # dot heads: exact
    assert per_head[0] > 1e-4 and per_head[2] > 1e-4  # hybrid / scalar heads: their 2-key window
    assert (windowed - exact)[:, :6][mask.bool()[:, :6]].abs().max() < 1e-6  # the prompt is exact
