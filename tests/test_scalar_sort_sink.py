"""The sink switch (``scalar_sink``) for the ablation the gist's experiment 5 asks for: with ``scalar_sink=False``
there is no sink parameter and no sink key anywhere: in every attention backend, in the prompt and windowed decode
through the sorted cache (eviction included), in the attention weights, and after save / load.

"Truly off" is checked against the model with the sink switched on but placed where no query can reach it
(``sink_key=1e3``): the two must agree, so the off model is the on model minus the sink's mass."""

from __future__ import annotations

import pytest
import torch
from conftest import build_model
from sorted_cache_helpers import PAD, left_padded

from hf_rbf.cache_names import CACHE_NAME


# transformers contract (generate, caches, save / load): CI also runs this module against the oldest versions
pytestmark = pytest.mark.contract

CASES = [
    ("scalar-r1-g2", "scalar_sort", dict(num_register_tokens=1, num_value_groups=2, tau_mode="per_token")),
    ("hybrid-kinds-r0", "hybrid_sort", dict(head_kinds=["hybrid", "scalar"], num_value_groups=2)),
    ("hybrid-mixed-layers", "hybrid_sort", dict(num_hidden_layers=3, attention_layers=["hybrid", "scalar", "dot"],
                                                num_register_tokens=2)),
]  # fmt: skip


def _pair(family, overrides, **extra):
    """``(off, far)``: the sink switched off, and switched on with a sink no query reaches, sharing every weight."""
    off = build_model(family, dict(overrides, scalar_sink=False, **extra))
    far = build_model(family, dict(overrides, scalar_sink=True, sink_key=1e3, **extra), randomize=False)
    missing, unexpected = far.load_state_dict(off.state_dict(), strict=False)
    assert not unexpected and missing and all(name.endswith("sink_value") for name in missing), missing
    with torch.no_grad():
        for name in missing:
            far.get_parameter(name).normal_()  # a non-trivial sink value: it must get no mass
    return off, far.eval()


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_no_sink_parameter_and_no_sink_column(case):
    _, family, overrides = case
    model = build_model(family, dict(overrides, scalar_sink=False))
    assert not any("sink" in name for name, _ in model.named_parameters())
    ids, mask = left_padded(model.config.vocab_size, [7, 5])
    with torch.no_grad():
        out = model(ids, attention_mask=mask, output_attentions=True)
    registers = model.config.num_register_tokens
    for layer, weights in zip(model.model.layers, out.attentions):
        attn = layer.self_attn
        if attn.kind == "dot":
            continue
        assert attn.num_sink == 0 and attn.sink_entries(torch.float32, "cpu") is None
        assert weights.shape[-1] == registers + 7  # keys: registers and text only
        real = mask.bool().view(2, 1, 7)
        assert torch.allclose(weights.sum(-1)[real.expand(-1, weights.shape[1], -1)], torch.ones(()), atol=1e-5)


@pytest.mark.parametrize("backend", ["naive", "sdpa", "flex", "triton"])
@pytest.mark.parametrize("case", CASES[:2], ids=[c[0] for c in CASES[:2]])
def test_every_backend_has_no_sink(case, backend):
    _, family, overrides = case
    off, far = _pair(family, overrides, attention_backend=backend)
    ids, mask = left_padded(off.config.vocab_size, [7, 5])
    with torch.no_grad():
        try:
            got = off(ids, attention_mask=mask).logits
        except ValueError as err:  # a backend that cannot serve this configuration names itself
            assert f"backend={backend!r}" in str(err)
            return
        ref = far(ids, attention_mask=mask).logits
        on = build_model(family, dict(overrides, attention_backend=backend))(ids, attention_mask=mask).logits
    assert all(layer.self_attn.last_backend == backend for layer in off.model.layers)
    real = mask.bool()
    assert (got - ref)[real].abs().max() < 1e-4
    assert (got - on)[real].abs().max() > 1e-3  # the sink at 0 does change the output: the comparison can fail


@pytest.mark.parametrize("settings", [dict(decode_window=3), dict(decode_window=None),
                                      dict(decode_window=3, max_cache_tokens=6, cache_eviction="density",
                                           density_merge_weighting="attention")],
                         ids=["window", "exact", "window-density"])  # fmt: skip
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_sorted_cache_decode_has_no_sink(case, settings):
    _, family, overrides = case
    off, far = _pair(family, overrides, **settings)
    ids, mask = left_padded(off.config.vocab_size, [6, 4])
    outs = []
    for model in (off, far):
        cache = model.make_cache()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=PAD,
                                 return_dict_in_generate=True, output_logits=True, **{CACHE_NAME: cache})  # fmt: skip
        outs.append(out)
        if settings["decode_window"] is not None:
            assert any(getattr(layer, "last_decode_backend", None) for layer in cache.layers)  # windowed steps ran
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    for a, b in zip(outs[0].logits, outs[1].logits):
        assert (a - b).abs().max() < 1e-4


@pytest.mark.parametrize("case", CASES[:2], ids=[c[0] for c in CASES[:2]])
def test_save_load_keeps_the_sink_off(case, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    _, family, overrides = case
    model = build_model(family, dict(overrides, scalar_sink=False))
    model.save_pretrained(tmp_path)
    assert AutoConfig.from_pretrained(tmp_path).scalar_sink is False
    back, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert back.config.scalar_sink is False
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert not any("sink" in name for name in back.state_dict())
    ids, mask = left_padded(model.config.vocab_size, [7, 5])
    with torch.no_grad():
        # equal up to float rounding: the loaded weights are memory-mapped at addresses that are not 64-byte
        # aligned (safetensors 0.8), and the CPU matmul kernels round differently on them (1e-8 after the first
        # projection, 2e-6 in the logits); the sink's absence itself is checked on the config and state dict above
        torch.testing.assert_close(
            model(ids, attention_mask=mask).logits, back.eval()(ids, attention_mask=mask).logits, rtol=1e-5, atol=1e-5
        )


@pytest.mark.parametrize("family", ["scalar_sort", "hybrid_sort"])
def test_the_sink_alone_is_the_prefix_without_a_copy(family):
    """Without registers the prefix of every layer call is the sink itself: its key and value tensors, not copies
    (a one-part concatenation would be three copy ops per layer and step, forward and backward); with registers the
    two parts are concatenated."""
    model = build_model(family, {"num_hidden_layers": 1})
    attn = model.model.layers[0].self_attn
    sink = attn.sink_entries(torch.float32, torch.device("cpu"))
    assert sink is not None
    prefix, count = attn._prefix_of(sink, None)
    assert count == 1
    for name in ("ks", "v", "k"):
        assert getattr(prefix, name) is getattr(sink, name)
    joined, count = attn._prefix_of(sink, sink)
    assert count == 2 and joined.ks.shape[-1] == 2
    torch.testing.assert_close(joined.v[:, :, :1], sink.v)
