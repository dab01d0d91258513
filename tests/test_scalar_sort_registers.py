"""One register in the sorted families: its attention over the sink and itself is the closed form
``v_sink + sigmoid(s_self - s_sink) (v_self - v_sink)`` (``v_self`` without a sink), not an attention call.  Checked
against the attention call it replaces (the path several registers take), on the layer and on whole models, outputs
and gradients, for every temperature form, value grouping and head kind."""

from __future__ import annotations

import pytest
import torch
from conftest import build_model

import hf_rbf.modeling_scalar_sort as scalar_sort

CASES = [
    ("scalar-per-head-sink-g2", "scalar_sort", dict(num_value_groups=2)),
    ("scalar-per-token-sink-g1", "scalar_sort", dict(num_value_groups=1, tau_mode="per_token")),
    ("scalar-global-nosink", "scalar_sort", dict(tau_mode="global", scalar_sink=False)),
    ("hybrid-sink", "hybrid_sort", dict()),
    ("hybrid-kinds-per-token", "hybrid_sort", dict(head_kinds=["hybrid", "scalar"], tau_mode="per_token")),
    ("hybrid-dot-heads-nosink", "hybrid_sort", dict(head_kinds=["dot", "hybrid"], scalar_sink=False)),
]


def _attention_call(self, registers, sink, tau):
    """The general path (an attention call over the sink and the registers), whatever the register count."""
    return self.attention_function(
        registers,
        self._cat_keys([sink, registers], 1),
        tau,
        backend="naive",
        causal=True,
        num_prefix_keys=self.num_sink,
    )


def _randomize_register_parameters(model):
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "register" in name or "sink_value" in name:  # zero-initialised: give them values that matter
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def _logits_and_grads(model, ids, **kwargs):
    """Logits and every parameter gradient of one LM-loss forward and backward."""
    model.zero_grad()
    out = model(ids, labels=ids, **kwargs)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(got, want, *, rtol_logits, atol_logits, atol_grads):
    (logits, grads), (ref_logits, ref_grads) = got, want
    torch.testing.assert_close(logits, ref_logits, rtol=rtol_logits, atol=atol_logits)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=atol_grads, msg=name)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_one_register_closed_form_equals_the_attention_call(case, monkeypatch):
    _, family, overrides = case
    model = build_model(family, dict(overrides, num_register_tokens=1))
    _randomize_register_parameters(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))

    got = _logits_and_grads(model, ids)
    monkeypatch.setattr(scalar_sort.ScalarSortAttention, "register_attention", _attention_call)
    _assert_same(got, _logits_and_grads(model, ids), rtol_logits=1e-5, atol_logits=1e-6, atol_grads=1e-6)
    grads = got[1]
    # the register rows' output depends on the sink value and the register's own projections
    assert any("register" in n for n in grads) and all(g.abs().sum() > 0 for n, g in grads.items() if "register" in n)


def test_one_register_needs_no_attention_call(monkeypatch):
    """With one register the layer makes a single attention call per forward (the text rows'); with two, two."""
    calls = []
    original = scalar_sort.ScalarSortAttention.attention_function

    def counting(self, *args, **kwargs):
        calls.append(self.layer_idx)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(scalar_sort.ScalarSortAttention, "attention_function", counting)
    ids = torch.randint(0, 100, (1, 6))
    for registers, per_layer in ((1, 1), (2, 2)):
        model = build_model("scalar_sort", dict(num_register_tokens=registers))
        calls.clear()
        with torch.no_grad():
            model(ids)
        assert len(calls) == per_layer * model.config.num_hidden_layers, (registers, calls)


ROW_CASES = [
    ("scalar-r2-per-token", "scalar_sort", dict(num_register_tokens=2, tau_mode="per_token", num_value_groups=2)),
    ("scalar-r0", "scalar_sort", dict(num_register_tokens=0)),
    ("hybrid-r1-rope", "hybrid_sort", dict(num_register_tokens=1, position_embedding_type="rope")),
    ("hybrid-r2-kinds", "hybrid_sort", dict(num_register_tokens=2, head_kinds=["hybrid", "dot"], tau_mode="per_token")),
]


@pytest.mark.parametrize("case", ROW_CASES, ids=[c[0] for c in ROW_CASES])
def test_flat_rows_path_equals_the_text_and_register_views(case, monkeypatch):
    """The layer's flat-rows path (one matmul per projection and one o_proj for text and register rows, what
    DecoderLayer uses) gives the outputs and gradients of projecting the text and register views apart."""
    _, family, overrides = case
    model = build_model(family, overrides)
    _randomize_register_parameters(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0

    got = _logits_and_grads(model, ids, attention_mask=mask)
    monkeypatch.setattr(scalar_sort.ScalarSortAttention, "takes_rows", False)
    # float32 rounding only: one matmul over all rows sums in another order than two (2.7e-6 seen)
    _assert_same(
        got, _logits_and_grads(model, ids, attention_mask=mask), rtol_logits=1e-4, atol_logits=1e-5, atol_grads=1e-5
    )


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_one_register_weights_are_those_of_the_attention_call(case):
    """``one_register_weights`` (what recipes/visualize.py draws for the register row) equals the weights of the
    attention call the closed form replaces."""
    _, family, overrides = case
    model = build_model(family, dict(overrides, num_register_tokens=1))
    _randomize_register_parameters(model)
    attn = next(layer.self_attn for layer in model.model.layers if layer.self_attn.kind != "dot")
    register_states = torch.randn(1, 1, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    registers = attn.project_registers(register_states)
    sink = attn.sink_entries(registers.qs.dtype, registers.qs.device)
    _, want = attn.attention_function(
        registers,
        attn._cat_keys([sink, registers], 1),
        attn.temperature(register_states),
        backend="naive",
        causal=True,
        num_prefix_keys=attn.num_sink,
        return_weights=True,
    )
    got = attn.one_register_weights(register_states)
    assert got.shape == want.shape == (1, attn.num_heads, 1, 1 + attn.num_sink)
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-6)
