"""``attn_implementation="rbf"`` / ``"rbf_softmax_free"`` on stock transformers models (Llama, Qwen2, Mistral with a
sliding window), registered by ``import hf_rbf`` (hf_rbf/attention_interface.py)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import (
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    StaticCache,
)
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, and_masks, causal_mask_function
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import hf_rbf
from hf_rbf.attention_interface import rbf_padding_mask
from sorted_cache_helpers import PAD, left_padded


# transformers contract: CI also runs this module against the oldest supported versions (.ci/run)
pytestmark = pytest.mark.contract

COMMON = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # grouped-query attention, as these models use it
    max_position_embeddings=64,
)
MODELS = {
    "llama": (LlamaForCausalLM, LlamaConfig, {}),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config, {}),
    "mistral-window4": (MistralForCausalLM, MistralConfig, dict(sliding_window=4)),
}


def _model(name: str, implementation: str = "rbf", seed: int = 0, **extra):
    cls, config_cls, overrides = MODELS[name]
    torch.manual_seed(seed)
    config = config_cls(**{**COMMON, **overrides, **extra})
    return cls._from_config(config, attn_implementation=implementation).eval()


@pytest.fixture(params=list(MODELS))
def stock(request):
    return request.param


def test_both_names_are_registered_with_transformers():
    for name in hf_rbf.RBF_ATTENTION_IMPLEMENTATIONS:
        assert name in ALL_ATTENTION_FUNCTIONS.valid_keys()
        assert name in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping


@pytest.mark.parametrize("implementation, normalize", [("rbf", True), ("rbf_softmax_free", False)])
def test_the_registered_function_is_rbf_attention(implementation, normalize):
    """Same q, k, v and padding mask: the registered function equals hf_rbf.rbf_attention with gamma = scaling / 2
    (grouped key/value heads repeated), returned in transformers' [B, N, H, D] layout."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, 9, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, 2, 9, 8, generator=g, dtype=torch.float64)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, :3] = False
    module = torch.nn.Module()
    module.config = LlamaConfig(**COMMON)
    module.is_causal = True
    scaling = 1 / math.sqrt(8)
    out, weights = ALL_ATTENTION_FUNCTIONS[implementation](module, q, k, v, mask, scaling=scaling, sliding_window=6)
    want = hf_rbf.rbf_attention(
        q,
        k.repeat_interleave(2, dim=1),
        v.repeat_interleave(2, dim=1),
        gamma=scaling / 2,
        causal=True,
        window=6,
        normalize=normalize,
        attention_mask=mask,
        backend="naive",
    )
    assert weights is None and out.shape == (2, 5, 4, 8)
    assert torch.allclose(out, want.transpose(1, 2), rtol=1e-12, atol=1e-12)
    module.config.rbf_gamma = 0.7
    out, _ = ALL_ATTENTION_FUNCTIONS[implementation](module, q, k, v, mask, scaling=scaling)
    want = hf_rbf.rbf_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), gamma=0.7, normalize=normalize, attention_mask=mask
    )
    assert torch.allclose(out, want.transpose(1, 2), rtol=1e-10, atol=1e-10)


def test_with_equal_key_norms_rbf_is_the_dot_product_model():
    """gamma = scaling / 2 keeps the dot-product logits and adds -gamma ||k||^2: with every key of the same norm that
    term is a row constant, and "rbf" gives SDPA's output exactly."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 6, 8, generator=g, dtype=torch.float64)
    k = torch.nn.functional.normalize(torch.randn(1, 4, 6, 8, generator=g, dtype=torch.float64), dim=-1) * 3.0
    v = torch.randn(1, 4, 6, 8, generator=g, dtype=torch.float64)
    module = torch.nn.Module()
    module.config = LlamaConfig(**COMMON)
    module.is_causal = True
    scaling = 1 / math.sqrt(8)
    rbf, _ = ALL_ATTENTION_FUNCTIONS["rbf"](module, q, k, v, None, scaling=scaling)
    dot = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling)
    assert torch.allclose(rbf, dot.transpose(1, 2), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("implementation", hf_rbf.RBF_ATTENTION_IMPLEMENTATIONS)
def test_cached_generate_equals_recomputation_with_left_padding(stock, implementation):
    model = _model(stock, implementation)
    ids, mask = left_padded(COMMON["vocab_size"], [7, 3, 5])
    kwargs = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=PAD)
    with torch.no_grad():
        cached = model.generate(ids, attention_mask=mask, **kwargs)
        uncached = model.generate(ids, attention_mask=mask, use_cache=False, **kwargs)
        one = model.generate(ids[1:2, -3:], **kwargs)  # one unpadded prompt
        one_uncached = model.generate(ids[1:2, -3:], use_cache=False, **kwargs)
    assert torch.equal(cached, uncached)
    assert torch.equal(one, one_uncached)


def test_sliding_window_is_applied(stock):
    """Mistral's window of 4: a change to a token 4 or more positions back does not reach the last query of a
    one-layer model; without the window (Llama) it does."""
    model = _model(stock, num_hidden_layers=1)
    ids = torch.randint(1, COMMON["vocab_size"], (1, 9), generator=torch.Generator().manual_seed(3))
    changed = ids.clone()
    changed[0, 2] = (ids[0, 2] % (COMMON["vocab_size"] - 1)) + 1
    with torch.no_grad():
        a, b = model(ids).logits[0, -1], model(changed).logits[0, -1]
    windowed = getattr(model.config, "sliding_window", None) is not None
    assert torch.equal(a, b) == windowed


def test_training_step_and_reload(stock, tmp_path):
    model = _model(stock).train()
    ids = torch.randint(1, COMMON["vocab_size"], (2, 8))
    loss = model(ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
    model.save_pretrained(tmp_path)
    cls = MODELS[stock][0]
    reloaded = cls.from_pretrained(tmp_path, attn_implementation="rbf").eval()
    assert reloaded.config._attn_implementation == "rbf"
    with torch.no_grad():
        assert torch.allclose(reloaded(ids).logits, model.eval()(ids).logits, atol=1e-6)


def test_refusals_name_what_is_not_supported():
    model = _model("llama")
    ids = torch.randint(1, COMMON["vocab_size"], (1, 4))
    with torch.no_grad(), pytest.raises(NotImplementedError, match="static"):
        cache = StaticCache(config=model.config, max_cache_len=16)
        model(ids, **{hf_rbf.CACHE_NAME: cache}, use_cache=True)
    custom = and_masks(causal_mask_function, lambda b, h, q, kv: kv >= 0)
    with pytest.raises(NotImplementedError, match="another mask pattern"):
        rbf_padding_mask(1, 4, 4, mask_function=custom, attention_mask=torch.ones(1, 4, dtype=torch.bool))
    module = torch.nn.Module()
    module.config = LlamaConfig(**COMMON, rbf_gamma=-1.0)
    module.is_causal = True
    q = torch.randn(1, 4, 3, 8)
    with pytest.raises(ValueError, match="rbf_gamma"):
        ALL_ATTENTION_FUNCTIONS["rbf"](module, q, q, q, None, scaling=0.3)
    module.config.rbf_gamma = None
    with pytest.raises(ValueError, match="2-D padding mask"):
        ALL_ATTENTION_FUNCTIONS["rbf"](module, q, q, q, torch.zeros(1, 1, 3, 3), scaling=0.3)
    assert isinstance(DynamicCache(), DynamicCache)
