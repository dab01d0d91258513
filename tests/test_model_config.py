"""Configs: the usual HF fields, the window pattern / layer_types, tiling, JSON round trip and validation errors that
name the field and the allowed values."""

from __future__ import annotations

import math

import pytest
from conftest import TINY, make_config

import hf_rbf
from hf_rbf import GkaConfig, RbfConfig


def test_auto_config_for_model_gives_family_classes():
    from transformers import AutoConfig

    assert isinstance(AutoConfig.for_model("rbf"), RbfConfig)
    assert isinstance(AutoConfig.for_model("gka"), GkaConfig)
    cfg = AutoConfig.for_model("gka", hidden_size=64, num_attention_heads=4)
    assert cfg.head_dim == 16 and cfg.model_type == "gka"


def test_defaults():
    rbf, gka = RbfConfig(), GkaConfig()
    assert rbf.num_register_tokens == 1 and gka.num_register_tokens == 0
    assert rbf.position_embedding_type == "susie" and gka.position_embedding_type == "rope"
    assert rbf.attention_layers == ["rbf"] * rbf.num_hidden_layers
    assert gka.attention_layers == ["gka"] * gka.num_hidden_layers
    assert rbf.layer_types == ["full_attention"] * rbf.num_hidden_layers
    assert rbf.tie_word_embeddings is True
    assert gka.resolved_log_sigma_init == pytest.approx(0.25 * math.log(gka.head_dim))


def test_window_pattern_is_tiled_into_layer_types():
    cfg = make_config("gka", num_hidden_layers=6, window_pattern="SSSL", sliding_window=16)
    assert cfg.layer_types == ["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 2
    assert [cfg.layer_window(i) for i in range(6)] == [16, 16, 16, None, 16, 16]
    # sliding_window alone means every layer slides (as Mistral-style configs)
    cfg = make_config("rbf", sliding_window=8)
    assert cfg.window_pattern == "S" and cfg.layer_types == ["sliding_attention"] * cfg.num_hidden_layers


def test_attention_layers_are_tiled_and_stored_expanded():
    cfg = make_config("gka", num_hidden_layers=4, attention_layers=["gka", "dot"])
    assert cfg.attention_layers == ["gka", "dot", "gka", "dot"]
    assert [cfg.layer_kind(i) for i in range(4)] == ["gka", "dot", "gka", "dot"]


def test_layer_types_define_the_pattern_when_given_alone():
    cfg = make_config("rbf", layer_types=["sliding_attention", "full_attention"], sliding_window=4)
    assert cfg.window_pattern == "SL"


def test_json_round_trip(tmp_path):
    cfg = make_config(
        "gka",
        num_hidden_layers=4,
        attention_layers=["gka", "gka", "gka", "dot"],
        window_pattern="SSSL",
        sliding_window=5,
    )
    cfg.save_pretrained(tmp_path)
    from transformers import AutoConfig

    back = AutoConfig.from_pretrained(tmp_path)
    assert type(back) is GkaConfig
    for key in ("attention_layers", "window_pattern", "sliding_window", "layer_types", "attention_backend", "gka_eps"):
        assert getattr(back, key) == getattr(cfg, key)


BAD = [
    ("rbf", dict(position_embedding_type="alibi"), "position_embedding_type.*'susie', 'rope', 'none'"),
    ("gka", dict(position_embedding_type="susie"), "position_embedding_type.*'rope', 'none'"),
    ("rbf", dict(hidden_size=30, num_attention_heads=4), "num_attention_heads.*must divide.*hidden_size"),
    ("rbf", dict(hidden_size=36, num_attention_heads=12), "head dim.*even"),
    ("gka", dict(attention_layers=["gka", "rbf"]), "unknown layer kind 'rbf'.*'gka', 'dot'"),
    ("rbf", dict(attention_layers=["rbf", "gka"]), "unknown layer kind 'gka'.*'rbf', 'dot'"),
    ("rbf", dict(attention_layers="rbf"), "attention_layers"),
    ("rbf", dict(attention_layers=["rbf"] * 3), "attention_layers.*3 entries"),
    ("gka", dict(window_pattern="SXL", sliding_window=4), "window_pattern.*'X'.*'S'.*'L'"),
    ("gka", dict(window_pattern="SSSL"), "sliding_window.*positive int"),
    ("gka", dict(window_pattern="S", sliding_window=0), "sliding_window.*>= 1"),
    ("gka", dict(window_pattern="S", sliding_window=-3), "sliding_window.*>= 1"),
    ("rbf", dict(num_register_tokens=-1), "num_register_tokens.*>= 0"),
    ("rbf", dict(attention_backend="cuda"), "attention_backend.*'auto', 'naive', 'sdpa', 'flex', 'triton'"),
    ("rbf", dict(rbf_gamma=0.0), "rbf_gamma.*positive"),
    ("rbf", dict(rbf_normalize="yes"), "rbf_normalize.*True or False"),
    ("gka", dict(gka_eps=-1.0), "gka_eps"),
    ("gka", dict(gka_log_sigma_init=float("nan")), "gka_log_sigma_init"),
    ("rbf", dict(vocab_size=0), "vocab_size.*>= 1"),
    ("rbf", dict(num_hidden_layers=0), "num_hidden_layers.*>= 1"),
    ("rbf", dict(intermediate_size=2.5), "intermediate_size"),
    ("rbf", dict(rms_norm_eps=0.0), "rms_norm_eps.*positive"),
    ("rbf", dict(layer_types=["full_attention", "moe"]), "layer_types.*'sliding_attention', 'full_attention'.*'moe'"),
    (
        "rbf",
        dict(layer_types=["full_attention", "full_attention"], window_pattern="S", sliding_window=2),
        "layer_types.*disagrees.*window_pattern",
    ),
    ("rbf", dict(head_dim=16), "head_dim"),
]


@pytest.mark.parametrize("family,overrides,pattern", BAD, ids=[f"{b[0]}-{'-'.join(b[1])}" for b in BAD])
def test_bad_configs_raise_naming_field_and_allowed_values(family, overrides, pattern):
    with pytest.raises(ValueError, match=pattern):
        make_config(family, **overrides)


def test_every_registered_family_is_exported():
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    for config_class, base, lm in hf_rbf._FAMILIES:
        cfg = AutoConfig.for_model(config_class.model_type, **TINY)
        assert type(cfg) is config_class
        assert type(AutoModel.from_config(cfg)) is base
        assert type(AutoModelForCausalLM.from_config(cfg)) is lm
        for cls in (config_class, base, lm):
            assert getattr(hf_rbf, cls.__name__) is cls
