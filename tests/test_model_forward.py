"""Forward API: output classes, hidden states (text only), tuples, inputs_embeds, half precision, and every backend the
config can name against the naive one."""

from __future__ import annotations

import pytest
import torch
from conftest import build_model
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

import hf_rbf


def _ids(vocab, b=2, n=6, seed=0):
    return torch.randint(1, vocab, (b, n), generator=torch.Generator().manual_seed(seed))


def test_outputs_and_hidden_states_count_text_tokens_only(core_case):
    _, family, overrides = core_case
    model = build_model(family, overrides)
    ids = _ids(model.config.vocab_size)
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        base = model.model(ids)
        as_tuple = model(ids, return_dict=False)
    assert isinstance(out, CausalLMOutputWithPast) and isinstance(base, BaseModelOutputWithPast)
    assert out.logits.shape == (2, 6, model.config.vocab_size)
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1
    assert all(h.shape == (2, 6, model.config.hidden_size) for h in out.hidden_states)
    assert torch.equal(out.hidden_states[-1], base.last_hidden_state)
    assert torch.equal(as_tuple[0], out.logits)
    with torch.no_grad():
        attentions = model(ids, output_attentions=True).attentions  # one materialised weight tensor per layer
    assert len(attentions) == model.config.num_hidden_layers


def test_inputs_embeds_equal_input_ids():
    model = build_model("gka", dict(num_register_tokens=1))
    ids = _ids(model.config.vocab_size)
    with torch.no_grad():
        a = model(ids).logits
        b = model(inputs_embeds=model.get_input_embeddings()(ids)).logits
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="exactly one of"):
        model(ids, inputs_embeds=model.get_input_embeddings()(ids))


def test_logits_to_keep():
    model = build_model("rbf", {})
    ids = _ids(model.config.vocab_size)
    with torch.no_grad():
        full = model(ids).logits
        last = model(ids, logits_to_keep=1).logits
    assert last.shape[1] == 1 and torch.allclose(last[:, 0], full[:, -1], atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_forward_backward_and_generate(core_case, dtype):
    _, family, overrides = core_case
    model = build_model(family, overrides)
    ids = _ids(model.config.vocab_size, n=9)
    with torch.no_grad():
        ref = model(ids).logits
    model.to(dtype)
    with torch.no_grad():
        half = model(ids).logits
    assert half.dtype == dtype and torch.isfinite(half).all()
    rel = ((half.float() - ref).norm() / ref.norm()).item()
    assert rel < (5e-2 if dtype == torch.bfloat16 else 1e-2)
    model.train()
    loss = model(ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    model.eval()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 12)


@pytest.mark.parametrize("backend", ["auto", "sdpa", "flex", "triton"])
def test_configured_backend_matches_naive(family_case, backend):
    """Whatever backend the config names either serves every call and matches "naive", or fails with the function's
    ValueError naming the backend; the backend that served each layer is recorded on the module."""
    _, family, overrides = family_case
    naive = build_model(family, overrides)
    other = build_model(family, dict(overrides, attention_backend=backend))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, naive.config.vocab_size, (2, 7), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    klw = 0.3 * torch.randn(2, 7, generator=gen)
    with torch.no_grad():
        ref = naive(ids, attention_mask=mask, key_log_weights=klw).logits
        try:
            got = other(ids, attention_mask=mask, key_log_weights=klw).logits
        except ValueError as err:
            assert backend != "auto", err
            assert f"backend={backend!r}" in str(err)
            return
    assert (got - ref)[mask.bool()].abs().max().item() < 1e-4
    ops = {"rbf": "rbf_attention", "gka": "gka_attention", "dot": "dot_attention"}
    for layer in other.model.layers:
        attn = layer.self_attn
        assert attn.last_backend is not None
        if attn.kind == "dot":
            assert attn.last_backend in ("sdpa", "naive")
        elif backend != "auto":
            assert attn.last_backend == backend
        assert attn.last_backend in hf_rbf.BACKENDS, ops[attn.kind]
