"""hf_rbf/eval/logit_stats.py: the per-layer, per-head maximum attention logit (the RBF blog's capped-logit claim)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import build_model

from hf_rbf import modeling_decoder, modeling_gka
from hf_rbf.eval.logit_stats import (
    attention_logit_stats,
    call_logits,
    format_stats,
    record_attention_logits,
)


def _signed_embeddings(batch: int, n: int, width: int, seed: int) -> torch.Tensor:
    """Entries +-1: RMS norm leaves them (almost) unchanged, so every head's slice has squared norm head_dim."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (batch, n, width), generator=gen).float() * 2 - 1


def test_dot_layer_max_logit_is_the_constructed_one():
    """W_Q = c_h I (per head), W_K = I, input norm weight 1, no registers: q_i . k_j = c_h x_i . x_j after the same
    rotation at i = j, and |x_i . x_j| <= ||x_i|| ||x_j|| = head_dim on these +-1 inputs, so the maximum logit of head
    h is c_h * head_dim / sqrt(head_dim) = c_h * sqrt(head_dim), reached on the diagonal."""
    model = build_model(
        "gka", dict(attention_layers=["dot"], num_hidden_layers=1, num_register_tokens=0), randomize=False
    )
    attn = model.model.layers[0].self_attn
    h, hd, width = attn.num_heads, attn.head_dim, attn.num_heads * attn.head_dim
    scales = torch.tensor([0.5, 1.0, 2.0, 3.0])[:h]
    with torch.no_grad():
        attn.q_proj.weight.copy_(torch.diag(scales.repeat_interleave(hd)))
        attn.k_proj.weight.copy_(torch.eye(width))
    stats = attention_logit_stats(model, inputs_embeds=_signed_embeddings(2, 6, width, 0))
    expected = (scales * math.sqrt(hd)).tolist()
    assert stats[0]["kind"] == "dot" and stats[0]["calls"] == 1
    assert stats[0]["max_logit_per_head"] == pytest.approx(expected, rel=1e-5)
    assert stats[0]["max_logit"] == pytest.approx(max(expected), rel=1e-5)
    # the spread: a row's own logit minus its smallest, brute-forced from the same q and k in float64
    x = torch.nn.functional.rms_norm(_signed_embeddings(2, 6, width, 0).double(), (width,), eps=1e-6)
    cos, sin = (t.double() for t in model.model.position_frequencies(torch.arange(6)[None]))
    q = x.view(2, 6, h, hd).transpose(1, 2) * scales.double()[None, :, None, None]
    k = x.view(2, 6, h, hd).transpose(1, 2)
    rot = lambda t: torch.cat(
        (t[..., : hd // 2] * cos[:, None] - t[..., hd // 2 :] * sin[:, None],
         t[..., hd // 2 :] * cos[:, None] + t[..., : hd // 2] * sin[:, None]), dim=-1)  # fmt: skip
    s = rot(q) @ rot(k).transpose(-1, -2) / math.sqrt(hd)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    spread = s.masked_fill(~causal, -math.inf).amax(-1) - s.masked_fill(~causal, math.inf).amin(-1)
    assert stats[0]["max_spread_per_head"] == pytest.approx(spread.amax(dim=(0, 2)).tolist(), rel=1e-5)


def test_distance_layers_are_capped_at_zero_and_reach_it_on_their_own_key():
    """RBF with W_Q = W_K and no positions: q_i = k_i, so the maximum of -gamma ||q_i - k_j||^2 is exactly 0 (the
    blog's cap); GKA always sees its own feature at distance 0.  With W_K = -W_Q the RBF maximum is
    -gamma * min ||q_i - k_j||^2 < 0, checked against a brute-force float64 computation."""
    model = build_model("rbf", dict(position_embedding_type="none", num_register_tokens=0, attention_layers=["rbf"]))
    for layer in model.model.layers:
        with torch.no_grad():
            layer.self_attn.k_proj.weight.copy_(layer.self_attn.q_proj.weight)
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    for s in attention_logit_stats(model, input_ids=ids):
        assert s["max_logit_per_head"] == pytest.approx([0.0] * 4, abs=1e-9)
    gka = build_model("gka", dict(num_register_tokens=2))
    for s in attention_logit_stats(gka, input_ids=ids):
        assert s["max_logit"] == pytest.approx(0.0, abs=1e-9) and s["calls"] == 2

    captured = {}
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        attn.k_proj.weight.copy_(-attn.q_proj.weight)
    handle = attn.q_proj.register_forward_hook(lambda m, a, o: captured.setdefault("q", o))
    stats = attention_logit_stats(model, input_ids=ids)
    handle.remove()
    q = captured["q"].double().view(2, 7, 4, -1).transpose(1, 2)
    dist = torch.cdist(q, -q) ** 2  # [B, H, N, N]
    dist = dist.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("inf"))
    expected = -(1.0 / math.sqrt(q.shape[-1])) * dist.amin(dim=(0, 2, 3))
    assert stats[0]["max_logit_per_head"] == pytest.approx(expected.tolist(), rel=1e-5)
    assert max(expected) < 0


def test_masks_and_key_log_weights_enter_the_maximum():
    """Disallowed pairs never count (a causal mask hides a large future logit); key log-weights are part of the
    logit."""
    q = torch.zeros(1, 1, 2, 2, dtype=torch.float64)
    k = torch.tensor([[[[1.0, 0.0], [10.0, 0.0]]]], dtype=torch.float64)
    q[..., 0] = 1.0
    logits, allowed = call_logits("dot_attention", {"q": q, "k": k, "v": k, "scale": 1.0, "causal": True})
    assert logits.masked_fill(~allowed, float("-inf")).max().item() == 10.0
    allowed_row0 = logits[0, 0, 0][allowed[0, 0, 0]]
    assert allowed_row0.tolist() == [1.0]
    klw = torch.tensor([[0.5, -0.5]], dtype=torch.float64)
    logits, _ = call_logits("dot_attention", {"q": q, "k": k, "v": k, "scale": 1.0, "key_log_weights": klw})
    assert logits[0, 0, 0].tolist() == [1.5, 9.5]


@pytest.mark.parametrize(
    "family,overrides",
    [
        ("scalar_sort", dict(attention_layers=["scalar", "dot"])),
        ("hybrid_sort", dict(attention_layers=["hybrid", "dot"], num_value_groups=2)),
        ("gka", dict(attention_layers=["gka", "vlt"], gka_approximation="random_features", gka_approximation_size=8)),
    ],
    ids=["scalar_sort", "hybrid_sort", "gka-vlt-random-features"],
)
def test_every_kind_is_recorded_and_nothing_stays_wrapped(family, overrides):
    model = build_model(family, overrides)
    before = (modeling_decoder.dot_attention, modeling_gka.gka_attention_random_features)
    stats = attention_logit_stats(model, input_ids=torch.randint(0, 128, (2, 5)))
    assert all(s["calls"] >= 1 and s["max_logit"] is not None for s in stats), stats
    assert (modeling_decoder.dot_attention, modeling_gka.gka_attention_random_features) == before
    assert "max logit" in format_stats(stats)
    assert model.training is False


def test_nothing_is_recorded_outside_a_layer_and_the_recorder_unwraps_on_error():
    model = build_model("gka", dict(attention_layers=["dot"], num_register_tokens=0))
    original = modeling_decoder.dot_attention
    with pytest.raises(RuntimeError, match="boom"), record_attention_logits(model) as rec:
        assert modeling_decoder.dot_attention is not original
        q = torch.randn(1, 1, 2, 4)
        modeling_decoder.dot_attention(q, q, q)  # a call outside any attention layer: not recorded
        raise RuntimeError("boom")
    assert modeling_decoder.dot_attention is original
    assert all(s["calls"] == 0 and s["max_logit"] is None for s in rec.stats)
    with pytest.raises(ValueError, match="no hf_rbf attention layers"):
        record_attention_logits(torch.nn.Linear(2, 2))


def test_gka_logits_with_prefix_features_equal_the_concatenated_call():
    """A GKA call with its registers as ``prefix_features`` (read in place by the fused kernels) has the logits and
    allowed pairs of the same call on the features concatenated by hand: prefix keys in front, the sequence as the
    queries."""
    from hf_rbf.eval.logit_stats import call_logits

    g = torch.Generator().manual_seed(3)
    x, prefix = torch.randn(2, 2, 5, 4, generator=g), torch.randn(1, 2, 2, 4, generator=g)
    common = dict(log_sigma=torch.tensor([0.1, -0.3]), causal=True, window=3, num_prefix_keys=2)
    got = call_logits("gka_attention", dict(x=x, prefix_features=prefix, query=None, **common))
    full = torch.cat([prefix.expand(2, -1, -1, -1), x], dim=2)
    ref = call_logits("gka_attention", dict(x=full, query=x, **common))
    assert got[0].shape == (2, 2, 5, 7)
    torch.testing.assert_close(got[0], ref[0])
    assert torch.equal(got[1], ref[1])
