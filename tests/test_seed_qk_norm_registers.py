"""The RBF blog's comparison switches: the QK-norm dot-product baseline of its postscript (``qk_norm``) and runs
without register tokens (``num_register_tokens=0``), for every family."""

from __future__ import annotations

import math
import os

import pytest
import torch
from conftest import build_model, generate_with_logits, make_config

from hf_rbf.eval.logit_stats import record_attention_logits

pytestmark = pytest.mark.contract

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (family, overrides) with "dot" layers; "dot" alone is the recipes' plain dot backbone (GkaConfig, all "dot")
DOT_CASES = [
    ("rbf", dict(attention_layers=["rbf", "dot"])),
    ("gka", dict(attention_layers=["gka", "dot"])),
    ("gka", dict(attention_layers=["dot"], num_register_tokens=0)),
    ("scalar_sort", dict(attention_layers=["scalar", "dot"])),
    ("hybrid_sort", dict(attention_layers=["hybrid", "dot"], num_value_groups=2)),
]
DOT_IDS = ["rbf", "gka", "plain-dot", "scalar_sort", "hybrid_sort"]


def _rms(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rotate(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def test_qk_norm_is_a_validated_saved_config_field(tmp_path):
    cfg = make_config("rbf", qk_norm=True)
    cfg.save_pretrained(tmp_path)
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(tmp_path).qk_norm is True
    assert make_config("gka").qk_norm is False
    with pytest.raises(ValueError, match=r"`qk_norm` must be True or False; got 'yes'"):
        make_config("gka", qk_norm="yes")


@pytest.mark.parametrize("family,overrides", DOT_CASES, ids=DOT_IDS)
def test_qk_norm_dot_layer_equals_float64_reference(family, overrides):
    """The "dot" layer's output is softmax(rope(norm(q)) . rope(norm(k)) / sqrt(d)) v through W_O, computed here from
    the layer's weights in float64 (tolerance 1e-5, float32 model)."""
    model = build_model(family, dict(overrides, qk_norm=True, num_register_tokens=0))
    layer_idx = overrides["attention_layers"].index("dot")
    attn = model.model.layers[layer_idx].self_attn
    assert attn.q_norm is not None and attn.k_norm is not None and attn.q_norm.weight.shape == (attn.head_dim,)
    captured = {}

    def hook(module, args, kwargs, output):
        captured["x"], captured["pe"], captured["out"] = args[0], kwargs["position_embeddings"], output[0]

    handle = attn.register_forward_hook(hook, with_kwargs=True)
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(ids, use_cache=False)
    handle.remove()
    d = torch.float64
    x = captured["x"].to(d)
    cos, sin = (t.to(d) for t in captured["pe"])
    b, n, _ = x.shape
    h, hd = attn.num_heads, attn.head_dim

    def heads(t):
        return t.view(b, n, h, hd).transpose(1, 2)

    eps = attn.q_norm.variance_epsilon
    q = _rms(heads(x @ attn.q_proj.weight.to(d).T), eps) * attn.q_norm.weight.to(d)
    k = _rms(heads(x @ attn.k_proj.weight.to(d).T), eps) * attn.k_norm.weight.to(d)
    v = heads(x @ attn.v_proj.weight.to(d).T)
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    ref = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, -1) @ attn.o_proj.weight.to(d).T
    torch.testing.assert_close(captured["out"].to(d), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family,overrides", DOT_CASES, ids=DOT_IDS)
def test_qk_norm_makes_dot_layers_blind_to_the_scale_of_w_q_and_w_k(family, overrides):
    """QK-norm's point: the logits no longer grow with ||q|| and ||k||.  Multiplying W_Q and W_K of every "dot" layer
    by 50 changes nothing with qk_norm (registers included: they get the scale only, and are zero at init), and
    changes the output without it."""
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(2))
    for qk_norm in (True, False):
        model = build_model(family, dict(overrides, qk_norm=qk_norm), randomize=False)
        with torch.no_grad():
            before = model(ids, use_cache=False).logits
            for layer in model.model.layers:
                if layer.self_attn.kind == "dot":
                    layer.self_attn.q_proj.weight.mul_(50.0)
                    layer.self_attn.k_proj.weight.mul_(50.0)
            after = model(ids, use_cache=False).logits
        if qk_norm:
            torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-5)
        else:
            assert (after - before).abs().max() > 1e-3


@pytest.mark.parametrize("family,overrides", [DOT_CASES[0], DOT_CASES[1]], ids=DOT_IDS[:2])
def test_qk_norm_generate_with_cache_equals_without_and_reloads(family, overrides, tmp_path):
    """Registers on (rbf's default 1, gka 2): the register rows take the scale-only path; cache and reload agree."""
    model = build_model(family, dict(overrides, qk_norm=True, num_register_tokens=2 if family == "gka" else 1))
    ids = torch.randint(1, 128, (2, 5), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    with_cache = generate_with_logits(model, ids, mask, use_cache=True, max_new_tokens=4, do_sample=False)
    without = generate_with_logits(model, ids, mask, use_cache=False, max_new_tokens=4, do_sample=False)
    assert torch.equal(with_cache.sequences, without.sequences)
    for a, b in zip(with_cache.logits, without.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    model.save_pretrained(tmp_path)
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.config.qk_norm is True
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits)


REGISTER_FAMILIES = [
    ("rbf", dict(attention_layers=["rbf", "dot"])),
    ("gka", dict(attention_layers=["gka", "dot"])),
    ("scalar_sort", dict(attention_layers=["scalar", "dot"])),
    ("hybrid_sort", dict(attention_layers=["hybrid", "dot"], num_value_groups=2)),
]


@pytest.mark.parametrize("family,overrides", REGISTER_FAMILIES, ids=[f for f, _ in REGISTER_FAMILIES])
def test_no_registers_removes_every_register_path(family, overrides, tmp_path):
    """``num_register_tokens=0``: no register parameter or buffer, one attention call per layer (with registers each
    layer makes a second call for the register rows), no register columns in the weights, and cache, generate and
    save/load still agree."""
    for registers in (2, 0):
        model = build_model(family, dict(overrides, num_register_tokens=registers))
        names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
        has_register_state = any("register" in n for n in names)
        assert has_register_state == (registers > 0), names
        ids = torch.randint(1, 128, (2, 6), generator=torch.Generator().manual_seed(4))
        with record_attention_logits(model) as rec, torch.no_grad():
            out = model(ids, use_cache=False, output_attentions=True)
        assert [s["calls"] for s in rec.stats] == [2 if registers else 1] * len(model.model.layers)
        for layer, weights in zip(model.model.layers, out.attentions):
            sink = getattr(layer.self_attn, "num_sink", 0)
            prefix = weights.shape[-1] - ids.shape[1]
            assert prefix == registers + sink or (prefix == registers and layer.self_attn.kind == "dot"), prefix
    assert model.model.register_tokens is None
    assert all(layer.self_attn.register_position is None for layer in model.model.layers)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    a = generate_with_logits(model, ids, mask, use_cache=True, max_new_tokens=3, do_sample=False)
    b = generate_with_logits(model, ids, mask, use_cache=False, max_new_tokens=3, do_sample=False)
    assert torch.equal(a.sequences, b.sequences)
    model.save_pretrained(tmp_path)
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.config.num_register_tokens == 0 and reloaded.model.register_tokens is None
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits)


def test_recipes_without_registers_and_with_qk_norm_build_what_they_say():
    from recipes.pretrain_config import load_config
    from recipes.pretrain_models import build_config

    cfg = load_config(os.path.join(REPO, "recipes", "configs", "rbf_no_registers.yaml"))
    ref = load_config(os.path.join(REPO, "recipes", "configs", "tinystories_rbf.yaml"))
    own = ("model", "run_name", "output_dir", "config_file")
    assert {k: v for k, v in cfg.items() if k not in own} == {k: v for k, v in ref.items() if k not in own}
    config = build_config(cfg["model"]["family"], dict(cfg["model"]["config"]))
    assert config.model_type == "rbf" and config.num_register_tokens == 0
    qk = load_config(os.path.join(REPO, "recipes", "configs", "dot_qk_norm.yaml"))
    config = build_config(qk["model"]["family"], dict(qk["model"]["config"]))
    assert config.qk_norm is True and set(config.attention_layers) == {"dot"}
