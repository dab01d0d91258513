"""The token-disposal measurement (the gist's "emergent token disposal"): distances of keys to the queries that can
read them and the fraction outside the query range, per layer, head and token class, on cases whose answer is known."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import build_model

from hf_rbf.eval.token_disposal import disposal_stats, frequency_classes, punctuation_token_ids, token_disposal


def test_stats_by_hand():
    qs = torch.tensor([[0.0, 1.0, 0.5, 0.2]])
    ks = torch.tensor([[5.0, 0.4, -3.0, 0.2]])
    junk = torch.tensor([True, False, True, False])
    got = disposal_stats(qs, ks, {"junk": junk, "rest": ~junk}, tau=torch.tensor([0.25]))
    # key 0 is read by queries 0..3 (nearest 1.0: 4.0, above all); key 2 by queries 2, 3 (nearest 0.2: 3.2, below)
    assert got["junk"]["distance_mean"].item() == pytest.approx(3.6)
    assert got["junk"]["distance_median"].item() == pytest.approx(3.2)  # torch's median: the lower middle value
    assert got["junk"]["outside_fraction"].item() == 1.0 and got["junk"]["count"] == 2
    assert got["junk"]["scaled_distance_mean"].item() == pytest.approx(3.6 / 0.5)
    # key 1 (0.4) by queries 1..3 (nearest 0.5: 0.1, inside [0.2, 1]); key 3 (0.2) by query 3 alone (0, inside)
    assert got["rest"]["distance_mean"].item() == pytest.approx(0.05)
    assert got["rest"]["outside_fraction"].item() == 0.0
    # without causality every query reads every key; key 2 is then nearest to query 0 (0.0): 3.0
    both = disposal_stats(qs, ks, {"junk": junk}, causal=False)
    assert both["junk"]["distance_mean"].item() == pytest.approx((4.0 + 3.0) / 2)
    assert math.isnan(both["junk"]["scaled_distance_mean"].item())
    # padding: a padded query no longer counts, a padded key is no key
    valid = torch.tensor([True, False, True, True])
    padded = disposal_stats(qs, ks, {"junk": junk, "rest": ~junk}, valid=valid)
    assert padded["junk"]["distance_mean"].item() == pytest.approx((4.5 + 3.2) / 2)  # key 0's nearest is now 0.5
    assert padded["rest"]["count"] == 1
    # a sliding window of 2: key 0 is read by queries 0 and 1 only
    windowed = disposal_stats(qs, ks, {"junk": junk}, window=2)
    assert windowed["junk"]["distance_mean"].item() == pytest.approx((4.0 + 3.2) / 2)


@pytest.mark.parametrize("family", ["scalar_sort", "hybrid_sort"])
def test_a_model_that_parks_one_class_far_from_every_query(family):
    """One layer; class "parked" tokens have the embedding e_0 and class "content" tokens e_1, so after the RMSNorm the
    layer input is sqrt(D) e_0 or sqrt(D) e_1.  ks_proj reads coordinate 0 only (times 2 / sqrt(D)), qs_proj is zero:
    every query sits at 0, content keys at 0, parked keys at 2 in every scalar head."""
    overrides = dict(num_hidden_layers=1, attention_bias=False)
    if family == "hybrid_sort":
        overrides["head_kinds"] = ["hybrid", "dot"]
    model = build_model(family, overrides, randomize=False)
    attn = model.model.layers[0].self_attn
    d = model.config.hidden_size
    parked, content = [3, 7], [10, 11, 12]
    with torch.no_grad():
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[parked, 0] = 5.0
        model.model.embed_tokens.weight[content, 1] = 5.0
        model.model.layers[0].input_layernorm.weight.fill_(1.0)
        attn.qs_proj.weight.zero_()
        attn.ks_proj.weight.zero_()
        attn.ks_proj.weight[:, 0] = 2.0 / math.sqrt(d)
    ids = torch.tensor([[10, 3, 11, 12, 7, 10, 3, 11], [7, 7, 10, 12, 11, 3, 10, 12]])
    got = token_disposal(model, ids, {"parked": parked, "content": content})
    assert got["layers"] == [0] and got["classes"] == ["parked", "content", "rest"]
    layer = got["per_layer"][0]
    scalar = torch.tensor(attn.scalar_head_list)
    tau = attn.temperature(torch.zeros(1, 1, d)).double().flatten()
    assert layer["parked"]["count"] == 6 and layer["content"]["count"] == 10 and layer["rest"]["count"] == 0
    assert torch.allclose(layer["parked"]["distance_mean"][scalar], torch.tensor(2.0, dtype=torch.float64), atol=1e-5)
    assert (layer["parked"]["outside_fraction"][scalar] == 1.0).all()
    assert (layer["content"]["distance_mean"][scalar].abs() < 1e-6).all()
    assert (layer["content"]["outside_fraction"][scalar] == 0.0).all()
    scaled = layer["parked"]["scaled_distance_mean"][scalar]
    assert torch.allclose(scaled, 2.0 / tau[scalar].sqrt(), rtol=1e-4)
    if family == "hybrid_sort":
        assert layer["parked"]["distance_mean"][~scalar].isnan().all()  # the "dot" head has no scalar axis
    summary = got["summary"]
    assert summary["parked"]["outside_fraction"] == 1.0 and summary["content"]["outside_fraction"] == 0.0
    assert summary["parked"]["distance_mean"] == pytest.approx(2.0, abs=1e-5)
    assert math.isnan(summary["rest"]["distance_mean"])


def test_class_helpers_and_errors():
    ids = torch.tensor([[5, 5, 2, 9, 2, 5, 1]])
    assert frequency_classes(ids, 2) == {"frequent": [5, 2]}
    assert frequency_classes(ids, 1, attention_mask=torch.tensor([[0, 0, 1, 1, 1, 0, 1]])) == {"frequent": [2]}

    class Tok:
        vocab = ["a", ",", " .", "", "b!", "\n"]

        def __len__(self):
            return len(self.vocab)

        def decode(self, token_ids):
            return "".join(self.vocab[i] for i in token_ids)

    assert punctuation_token_ids(Tok()) == [1, 2, 5]
    model = build_model("scalar_sort", dict(num_hidden_layers=1))
    with pytest.raises(ValueError, match="token_classes"):
        token_disposal(model, ids, {})
    with pytest.raises(ValueError, match="'rest'"):
        token_disposal(model, ids, {"rest": [1]})
    with pytest.raises(ValueError, match="num_frequent"):
        frequency_classes(ids, 0)
