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
