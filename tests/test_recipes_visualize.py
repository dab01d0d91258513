"""recipes/visualize.py: the materialised attention weights reproduce every attention call's output (W @ v), rows of
softmax attention sum to 1 and respect the mask, and every picture is written and not blank."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import FAMILY_CASES, build_model

from recipes.plotting import plot_loss_curves
from recipes.visualize import (
    attention_figures,
    attention_rollout,
    capture_attention,
    check_attention_capture,
    gka_sigmas,
    plot_sigma_heatmap,
    plot_sigma_lines,
    plot_sorted_keys,
    token_labels,
)


def _not_blank(path) -> bool:
    from PIL import Image

    img = np.asarray(Image.open(path).convert("L"), dtype=np.float32)
    return img.shape[0] > 100 and img.shape[1] > 100 and img.std() > 5.0 and len(np.unique(img)) > 20


@pytest.mark.parametrize("case", FAMILY_CASES, ids=[c[0] for c in FAMILY_CASES])
def test_captured_weights_reproduce_the_attention_outputs(case):
    _, family, overrides = case
    model = build_model(family, overrides)
    ids = torch.randint(1, model.config.vocab_size, (1, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids, use_cache=False).logits
    layers = capture_attention(model, ids)
    with torch.no_grad():
        after = model(ids, use_cache=False).logits
    assert torch.equal(before, after)  # the recording leaves the model unchanged
    r = model.config.num_register_tokens
    assert len(layers) == model.config.num_hidden_layers
    for layer, la in enumerate(layers):
        assert la.weights.shape == (4, r + 11, r + 11) and la.num_registers == r
        assert la.kind == model.config.attention_layers[layer]
        assert check_attention_capture(la.calls) < 1e-5
        w = la.weights
        # causal (and windowed) structure: no weight on later text keys, registers see only registers
        assert torch.all(w[:, :, r:].triu(1) == 0)
        if r:
            assert torch.all(w[:, :r, r:] == 0)
        window = model.config.layer_window(layer)
        if window is not None:
            t = torch.arange(11)
            too_far = (t[:, None] - t[None, :]) >= window
            assert torch.all(w[:, r:, r:][:, too_far] == 0)
        normalized = la.kind != "rbf" or model.config.rbf_normalize
        if normalized:
            torch.testing.assert_close(w.sum(-1), torch.ones(4, r + 11), atol=1e-5, rtol=0)


# Families with a scalar sink (a constant key before the registers) and mixed layer kinds; they run once the
# scalar_sort / hybrid_sort families are registered (they come with their own part of hf_rbf).
SINK_CASES = [
    ("scalar_sort", {"num_register_tokens": 1}),
    ("hybrid_sort", {"num_register_tokens": 2}),
    ("scalar_sort", {"num_hidden_layers": 2, "attention_layers": ["scalar", "dot"], "num_register_tokens": 1}),
]


@pytest.mark.parametrize(("family", "overrides"), SINK_CASES, ids=["scalar-r1", "hybrid-r2", "scalar-dot-r1"])
def test_captured_weights_with_a_sink(family, overrides):
    from recipes.pretrain_models import hf_rbf_families

    if family not in hf_rbf_families():
        pytest.skip(f"family {family!r} is not registered in this checkout")
    model = build_model(family, overrides)
    ids = torch.randint(1, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    layers = capture_attention(model, ids)
    r = model.config.num_register_tokens
    for la in layers:
        assert la.num_sinks == 1 and la.num_registers == r and la.weights.shape == (4, 1 + r + 9, 1 + r + 9)
        assert check_attention_capture(la.calls) < 1e-5
        torch.testing.assert_close(la.weights.sum(-1), torch.ones(4, 1 + r + 9), atol=1e-5, rtol=0)
        assert torch.all(la.weights[:, : 1 + r, 1 + r :] == 0)  # sink and registers never see text
    assert token_labels(None, [5], r, 1)[: 1 + r] == ["[SINK]"] + [f"[REG_{i}]" for i in range(r)]


def test_attention_maps_rollout_and_loss_pngs(tmp_path, core_case):
    _, family, overrides = core_case
    model = build_model(family, overrides)

    class CharTokenizer:
        bos_token_id = 1

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [3 + (ord(c) % 100) for c in text]}

        def decode(self, ids):
            return "".join(chr(97 + (i - 3) % 26) for i in ids)

    paths = attention_figures(model, CharTokenizer(), "hello world", str(tmp_path), name=family)
    for path in paths.values():
        assert _not_blank(path), path
    layers = capture_attention(model, torch.tensor([[1, 5, 6, 7]]))
    rollout = attention_rollout(layers)
    torch.testing.assert_close(rollout.sum(-1), torch.ones(rollout.shape[0]), atol=1e-5, rtol=0)
    assert token_labels(None, [5, 6], 2)[:2] == ["[REG_0]", "[REG_1]"]
    metrics = {
        "log_history": [{"step": s, "loss": 5.0 / s, "tokens_seen": 64 * s} for s in range(1, 20)]
        + [{"step": 10, "eval_loss": 0.6}]
    }
    curves = plot_loss_curves(
        {"a": metrics, "b": {"log_history": [dict(r, loss=r.get("loss", 1) * 1.1) for r in metrics["log_history"]]}},
        str(tmp_path / "loss.png"),
    )
    assert _not_blank(curves)


def test_sigma_heatmap_and_lines(tmp_path):
    model = build_model("gka", dict(num_hidden_layers=4, attention_layers=["gka", "gka", "gka", "dot"]))
    sigmas, kinds = gka_sigmas(model)
    assert sigmas.shape == (4, 4) and kinds == ["gka", "gka", "gka", "dot"] and np.isnan(sigmas[3]).all()
    torch.testing.assert_close(torch.tensor(sigmas[0]), model.model.layers[0].self_attn.log_sigma.exp().double())
    assert _not_blank(plot_sigma_heatmap(sigmas, kinds, str(tmp_path / "heat.png")))
    assert _not_blank(plot_sigma_lines({"a": sigmas, "b": sigmas * 1.5}, str(tmp_path / "lines.png")))
    with pytest.raises(ValueError, match="no GKA layer"):
        gka_sigmas(build_model("rbf", {}))


def test_sorted_key_layout(tmp_path):
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(3, 50, generator=gen)
    sorted_keys, order = keys.sort(dim=-1)
    positions = order - 1  # one register / sink entry at position -1
    path = plot_sorted_keys(
        sorted_keys, positions, str(tmp_path / "keys.png"), queries=torch.randn(3, 4, generator=gen)
    )
    assert _not_blank(path)
    assert _not_blank(plot_sorted_keys(sorted_keys, None, str(tmp_path / "keys_only.png")))
    with pytest.raises(ValueError, match="sorted ascending"):
        plot_sorted_keys(keys, positions, str(tmp_path / "bad.png"))
    with pytest.raises(ValueError, match=r"\[H, N\]"):
        plot_sorted_keys(sorted_keys[0], None, str(tmp_path / "bad.png"))


def test_sorted_scalar_keys_of_a_model(tmp_path):
    from recipes.pretrain_models import hf_rbf_families
    from recipes.visualize import sorted_scalar_keys

    if "scalar_sort" not in hf_rbf_families():
        pytest.skip("family 'scalar_sort' is not registered in this checkout")
    model = build_model("scalar_sort", {"num_register_tokens": 1})
    ids = torch.randint(1, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    entries = sorted_scalar_keys(model, ids)
    assert [e["layer"] for e in entries] == list(range(model.config.num_hidden_layers))
    for e in entries:
        keys, positions = e["keys"], e["positions"]
        assert keys.shape == positions.shape == (4, 2 + 12)  # sink + register + text
        assert torch.all(keys[:, 1:] >= keys[:, :-1])
        assert sorted(positions[0].tolist()) == list(range(-2, 12))
        assert e["queries"].shape == (4, 12)
    assert _not_blank(plot_sorted_keys(entries[0]["keys"], entries[0]["positions"], str(tmp_path / "k.png")))
