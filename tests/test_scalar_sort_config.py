"""Scalar-sort and hybrid-sort configs: defaults, JSON round trip, errors naming the argument; the temperature stays
positive (and capped) under every mode."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import TINY, build_model, make_config

from hf_rbf import HybridSortConfig, ScalarSortConfig


def test_defaults():
    cfg = ScalarSortConfig()
    assert cfg.model_type == "scalar_sort" and cfg.num_attention_heads == 12
    assert cfg.num_value_groups == 3 and cfg.num_value_groups < cfg.num_attention_heads  # G < H by default
    assert cfg.value_head_dim == cfg.head_dim
    assert cfg.tau_mode == "per_head" and cfg.tau_init_range == [0.03, 0.1]
    assert cfg.scalar_sink and cfg.sink_key == 0.0 and cfg.num_register_tokens == 0
    assert cfg.decode_window is None and cfg.sort_scheme == "per_head" and cfg.max_cache_tokens is None
    assert cfg.attention_layers == ["scalar"] * cfg.num_hidden_layers
    assert not cfg.regularizers_enabled
    hyb = HybridSortConfig(num_attention_heads=8, hidden_size=64, head_kinds=["hybrid", "scalar"])
    assert hyb.model_type == "hybrid_sort" and hyb.num_value_groups == 8
    assert hyb.head_kinds == ["hybrid", "scalar"] * 4
    assert hyb.scalar_heads == [True] * 8 and hyb.dot_heads == [True, False] * 4
    assert ScalarSortConfig(num_attention_heads=6, hidden_size=24).num_value_groups == 1
    assert ScalarSortConfig(num_attention_heads=16, hidden_size=64).num_value_groups == 4


@pytest.mark.parametrize("family", ["scalar_sort", "hybrid_sort"])
def test_json_round_trip(family, tmp_path):
    from transformers import AutoConfig

    cfg = make_config(
        family,
        tau_mode="per_token",
        tau_max=0.5,
        spread_range="adaptive",
        decode_window=16,
        sort_scheme="sort_head",
        max_cache_tokens=64,
        cache_eviction="density",
        sink_zone=[-0.1, 0.1],
        align_loss_weight=0.1,
        num_value_groups=2,
        scalar_sink=False,
        align_gradient="scalar_projections",
        spread_loss_start_step=100,
        spread_loss_warmup_steps=50,
        align_loss_warmup_steps=10,
        tau_loss_start_step=7,
        density_merge_weighting="attention",
        density_merge_size=4,
    )
    cfg.save_pretrained(tmp_path)
    back = AutoConfig.from_pretrained(tmp_path)
    assert type(back) is type(cfg)
    for key in ("tau_mode", "tau_max", "spread_range", "decode_window", "sort_scheme", "max_cache_tokens",
                "cache_eviction", "sink_zone", "align_loss_weight", "num_value_groups", "value_head_dim",
                "tau_init_range", "attention_layers", "scalar_sink", "align_gradient", "spread_loss_start_step",
                "spread_loss_warmup_steps", "align_loss_warmup_steps", "tau_loss_start_step",
                "density_merge_weighting", "density_merge_size"):  # fmt: skip
        assert getattr(back, key) == getattr(cfg, key), key
    if family == "hybrid_sort":
        assert back.head_kinds == cfg.head_kinds
    assert back.sorted_cache_settings()["density_merge_size"] == 4
    assert back.regularizer_weight("align", 5) == pytest.approx(0.05)


def test_gist_option_defaults():
    cfg = ScalarSortConfig()
    assert cfg.align_gradient == "upstream"  # the gist's code
    assert cfg.density_merge_weighting == "multiplicity" and cfg.density_merge_size == 2  # the earlier pair merge
    assert not cfg.regularizer_schedule_enabled
    assert all(
        getattr(cfg, f"{n}_loss_{w}") == 0 for n in ("align", "spread", "tau") for w in ("start_step", "warmup_steps")
    )


BAD = [
    (dict(align_gradient="none"), "align_gradient.*'upstream', 'scalar_projections'"),
    (dict(num_value_groups=3), "num_value_groups.*must divide.*num_attention_heads"),
    (dict(num_value_groups=0), "num_value_groups"),
    (dict(decode_window=0), "decode_window.*>= 1"),
    (dict(decode_window=-2), "decode_window"),
    (dict(tau_mode="per_layer"), "tau_mode.*'global', 'per_head', 'per_token'"),
    (dict(eviction_radius=-0.5), "eviction_radius.*>= 0"),
    (dict(tau_init_range=[0.1, 0.03]), "tau_init_range"),
    (dict(tau_init_range=[0.0, 0.1]), "tau_init_range"),
    (dict(tau_min=0.0), "tau_min.*positive"),
    (dict(tau_min=0.05), "tau_min.*below"),
    (dict(tau_max=0.05), "tau_max.*at least"),
    (dict(sort_scheme="global"), "sort_scheme.*'per_head', 'sort_head'"),
    (dict(num_value_groups=2, sort_head=2), "sort_head.*\\[0, 2\\)"),
    (dict(cache_eviction="lru"), "cache_eviction.*'oldest', 'geometric', 'density'"),
    (dict(max_cache_tokens=0), "max_cache_tokens"),
    (dict(cache_buffer_size=0), "cache_buffer_size"),
    (dict(max_cache_tokens=8, eviction_batch=9), "eviction_batch"),
    (dict(sink_zone=[0.2, 0.1]), "sink_zone"),
    (dict(spread_range="uniform"), "spread_range.*'adaptive'"),
    (dict(spread_range=[1.0, 1.0]), "spread_range"),
    (dict(align_loss_weight=-1.0), "align_loss_weight"),
    (dict(scalar_sink="yes"), "scalar_sink"),
    (dict(attention_layers=["scalar", "rbf"]), "unknown layer kind 'rbf'"),
]


@pytest.mark.parametrize("overrides,pattern", BAD, ids=[p.split(".")[0] for _, p in BAD])
def test_bad_configs_raise_naming_the_argument(overrides, pattern):
    with pytest.raises(ValueError, match=pattern):
        make_config("scalar_sort", **overrides)


@pytest.mark.parametrize(
    "overrides,pattern",
    [
        (dict(head_kinds=["hybrid", "softmax"]), "head_kinds.*'hybrid', 'scalar', 'dot'"),
        (dict(head_kinds="hybrid"), "head_kinds"),
        (dict(head_kinds=["dot"] * 5), "head_kinds.*5 entries"),
        (dict(position_embedding_type="susie"), "position_embedding_type.*'rope', 'none'"),
        (dict(attention_layers=["hybrid", "gka"]), "unknown layer kind 'gka'.*'hybrid', 'scalar', 'dot'"),
    ],
)
def test_bad_hybrid_configs(overrides, pattern):
    with pytest.raises(ValueError, match=pattern):
        make_config("hybrid_sort", **overrides)


@pytest.mark.parametrize("mode", ["global", "per_head", "per_token"])
@pytest.mark.parametrize("cap", [None, 0.2])
def test_tau_stays_positive_and_capped_under_every_mode(mode, cap):
    model = build_model("scalar_sort", dict(tau_mode=mode, tau_max=cap, num_hidden_layers=1), randomize=False)
    attn = model.model.layers[0].self_attn
    lo, hi = model.config.tau_init_range
    x = torch.randn(2, 5, TINY["hidden_size"])
    tau = attn.temperature(x)
    assert tau.shape == ((2, TINY["num_attention_heads"], 5) if mode == "per_token" else (TINY["num_attention_heads"],))
    # initialised inside the configured range (per token: for a zero input)
    init = attn.temperature(torch.zeros(1, 1, TINY["hidden_size"])).flatten().detach()
    assert (init >= lo * (1 - 1e-5)).all() and (init <= hi * (1 + 1e-5)).all()
    if mode == "per_head":
        assert init[0] == pytest.approx(lo, rel=1e-5) and init[-1] == pytest.approx(hi, rel=1e-5)
    if mode == "global":
        assert torch.allclose(init, torch.full_like(init, math.sqrt(lo * hi)))
    with torch.no_grad():
        for p in attn.parameters():
            p.fill_(-1e4)  # raw parameters / projections driven far negative
        assert (attn.temperature(x) >= model.config.tau_min).all()
        assert (attn.temperature(x) > 0).all()
        for p in attn.parameters():
            p.fill_(1e4)
        t = attn.temperature(torch.ones_like(x))
        assert torch.isfinite(t).all() and (t > 0).all()
        if cap is not None:
            assert (t <= cap).all()


def test_every_registered_family_round_trips_auto_classes():
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    import hf_rbf

    for family, base, lm in (
        ("scalar_sort", hf_rbf.ScalarSortModel, hf_rbf.ScalarSortForCausalLM),
        ("hybrid_sort", hf_rbf.HybridSortModel, hf_rbf.HybridSortForCausalLM),
    ):
        cfg = AutoConfig.for_model(family, **TINY)
        assert type(AutoModel.from_config(cfg)) is base
        assert type(AutoModelForCausalLM.from_config(cfg)) is lm
