"""Converting a trained dot-product model: hf_rbf/convert_llama.py (Llama / Mistral / Qwen2 onto our hybrid_sort and
"dot" classes with the same logits) and recipes/convert_to_rbf.py end to end at test size (train a tiny Llama, switch
it to attn_implementation="rbf" and convert it to the hybrid, recover with LoRA and full fine-tuning, write the
table)."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from sorted_cache_helpers import left_padded
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from hf_rbf import GkaForCausalLM, HybridSortForCausalLM
from hf_rbf.convert_llama import convert_llama, hf_rbf_config_from_llama
from recipes import convert_to_rbf

# transformers contract (Trainer, PEFT, AttentionInterface, generate, save/load): CI also runs this module against the
# oldest versions
pytestmark = pytest.mark.contract

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 96
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
    pad_token_id=0,
)
# Every difference between the backbones the converter handles: GQA (KV heads 2 and 1), untied and tied LM heads,
# a sliding window (Mistral), biases on W_Q / W_K / W_V but not W_O (Qwen2), another RMSNorm eps and RoPE theta.
SOURCES = {
    "llama-gqa-untied": (LlamaForCausalLM, LlamaConfig, dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "llama-mha-tied-eps": (
        LlamaForCausalLM,
        LlamaConfig,
        dict(num_key_value_heads=4, tie_word_embeddings=True, rms_norm_eps=1e-5, rope_parameters={"rope_theta": 500.0}),
    ),
    "mistral-window5": (MistralForCausalLM, MistralConfig, dict(num_key_value_heads=2, sliding_window=5)),
    "qwen2-biases-mqa": (Qwen2ForCausalLM, Qwen2Config, dict(num_key_value_heads=1)),
}
# fp32 logits of the converted model against the original's: the same operations up to the order of a few sums
FP32_TOLERANCE = 1e-5


def _source(name: str, seed: int = 0, dtype=torch.float32):
    """A stock model with random weights large enough for sharp attention (a fresh init is nearly uniform)."""
    cls, config_cls, extra = SOURCES[name]
    torch.manual_seed(seed)
    model = cls(config_cls(**{**COMMON, **extra}))
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.3 if "embed" in pname else 0.15)
    return model.to(dtype).eval()


@pytest.fixture(params=list(SOURCES))
def source(request):
    return request.param


def _tokens(n: int = 24, batch: int = 2, seed: int = 1):
    return torch.randint(1, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------------------------------------------
# the converter
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("target, cls", [("hybrid_sort", HybridSortForCausalLM), ("dot", GkaForCausalLM)])
def test_converted_model_gives_the_original_logits(source, target, cls):
    llama = _source(source)
    ids = _tokens()
    converted = convert_llama(llama, target)
    assert type(converted) is cls
    with torch.no_grad():
        ref = llama(ids).logits
        out = converted(ids, use_cache=False).logits
        spread = float(ref.std())
    assert spread > 0.5  # the logits are far from uniform, so a wrong map would show
    assert (out - ref).abs().max() < FP32_TOLERANCE


def _rope_tables_in_float64(llama) -> None:
    """Llama computes its RoPE tables in float32 whatever the model's dtype (ours follows the parameters' dtype, so in
    float64 they differ by float32 rounding, ~5e-7 in the logits); the float64 reference gets float64 tables."""
    rope = llama.model.rotary_emb

    def forward(x, position_ids, *args, **kwargs):
        angles = position_ids.to(torch.float64)[..., None] * rope.inv_freq.to(torch.float64)
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)

    rope.forward = forward


def test_conversion_is_exact_in_float64():
    """In float64 the map is exact to rounding: any structural difference (RoPE layout, GQA order, eps) would show as
    a difference far above 1e-10."""
    llama = _source("llama-gqa-untied", dtype=torch.float64)
    _rope_tables_in_float64(llama)
    ids = _tokens()
    for target in ("hybrid_sort", "dot"):
        converted = convert_llama(llama, target)
        assert next(converted.parameters()).dtype == torch.float64
        for backend in ("naive", "sdpa"):
            converted.config.attention_backend = backend
            with torch.no_grad():
                diff = (converted(ids, use_cache=False).logits - llama(ids).logits).abs().max()
            assert diff < 1e-10, (target, backend, float(diff))


def test_converted_hybrid_generates_the_same_greedy_tokens(source):
    llama = _source(source)
    hybrid = convert_llama(llama, "hybrid_sort")
    ids, mask = left_padded(VOCAB, [9, 5])
    settings = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    expected = llama.generate(ids, attention_mask=mask, **settings)
    got = hybrid.generate(ids, attention_mask=mask, **settings)
    assert torch.equal(got, expected)


def test_converted_hybrid_config_is_the_exact_start():
    llama = _source("llama-gqa-untied")
    hybrid = convert_llama(llama, "hybrid_sort")
    config = hybrid.config
    assert config.num_value_groups == 2 and config.scalar_sink is False and config.num_register_tokens == 0
    assert set(config.head_kinds) == {"hybrid"} and set(config.attention_layers) == {"hybrid"}
    assert config.tie_word_embeddings is False
    for layer in hybrid.model.layers:
        attn = layer.self_attn
        assert float(attn.ks_proj.weight.detach().abs().max()) == 0.0
        assert float(attn.qs_proj.weight.detach().std()) == pytest.approx(config.initializer_range, rel=0.3)
    # deterministic: the same seed gives the same scalar start
    again = convert_llama(llama, "hybrid_sort")
    assert torch.equal(again.model.layers[0].self_attn.qs_proj.weight, hybrid.model.layers[0].self_attn.qs_proj.weight)


def _scalar_gradients(model, ids):
    model.train()
    model.zero_grad()
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    qs = sum(float(layer.self_attn.qs_proj.weight.grad.abs().sum()) for layer in model.model.layers)
    ks = sum(float(layer.self_attn.ks_proj.weight.grad.abs().sum()) for layer in model.model.layers)
    return qs, ks


def test_scalar_projections_learn_from_the_converted_start_but_not_from_zero():
    """Both scalar projections at zero is a stationary point (d/dqs and d/dks of -(qs - ks)^2 / tau vanish): the
    converter's start (qs random, ks zero) keeps the logits and gives the keys a gradient, the queries one as soon as
    the keys have moved."""
    llama = _source("llama-gqa-untied")
    ids = _tokens(n=16, batch=4)
    hybrid = convert_llama(llama, "hybrid_sort")
    with torch.no_grad():
        for layer in hybrid.model.layers:
            layer.self_attn.qs_proj.weight.zero_()
    assert _scalar_gradients(hybrid, ids) == (0.0, 0.0)

    hybrid = convert_llama(llama, "hybrid_sort")
    qs_grad, ks_grad = _scalar_gradients(hybrid, ids)
    assert ks_grad > 1e-2  # the keys learn at once
    # the queries' gradient is -2 sum_j g_ij (qs_i - ks_j) / tau = 0 (up to rounding) while every ks_j is 0 ...
    assert qs_grad < 1e-4 * ks_grad
    optimizer = torch.optim.SGD([layer.self_attn.ks_proj.weight for layer in hybrid.model.layers], lr=0.1)
    optimizer.step()
    qs_grad_after, ks_grad = _scalar_gradients(hybrid, ids)
    assert qs_grad_after > 1e3 * qs_grad and ks_grad > 1e-2  # ... and learn once the keys have moved
    hybrid.eval()
    with torch.no_grad():
        moved = (hybrid(ids, use_cache=False).logits - llama(ids).logits).abs().max()
    assert moved > 1e-4  # the scalar term now changes the model


def test_converted_hybrid_round_trips_through_save_pretrained(tmp_path):
    llama = _source("qwen2-biases-mqa")
    hybrid = convert_llama(llama, "hybrid_sort", tau_mode="per_token")
    hybrid.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(loaded) is HybridSortForCausalLM and loaded.config.tau_mode == "per_token"
    ids = _tokens()
    with torch.no_grad():
        assert (loaded(ids, use_cache=False).logits - llama(ids).logits).abs().max() < FP32_TOLERANCE


def test_convert_llama_loads_a_checkpoint_path(tmp_path):
    llama = _source("llama-mha-tied-eps")
    llama.save_pretrained(tmp_path)
    dot = convert_llama(str(tmp_path), "dot")
    ids = _tokens()
    with torch.no_grad():
        assert (dot(ids, use_cache=False).logits - llama(ids).logits).abs().max() < FP32_TOLERANCE


@pytest.mark.parametrize(
    "extra, named",
    [
        (dict(hidden_act="gelu"), "`hidden_act`"),
        (dict(head_dim=16), "`head_dim`"),
        (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}), "rope_type"),
        (dict(num_key_value_heads=3), "num_attention_heads"),
    ],
)
def test_unconvertible_sources_are_refused_by_field(extra, named):
    config = LlamaConfig(**{**COMMON, **extra}) if "num_key_value_heads" not in extra else LlamaConfig(**COMMON)
    if "num_key_value_heads" in extra:
        config.num_key_value_heads = 3  # LlamaConfig itself accepts it; the converter must refuse it
    with pytest.raises(ValueError, match=named):
        hf_rbf_config_from_llama(config, "hybrid_sort")


def test_other_model_types_are_refused():
    from transformers import GPT2Config

    with pytest.raises(ValueError, match="`model_type` must be one of 'llama', 'mistral', 'qwen2'"):
        hf_rbf_config_from_llama(GPT2Config(), "hybrid_sort")


@pytest.mark.parametrize(
    "target, overrides, named",
    [
        ("rbf", {}, "`target` must be one of"),
        ("hybrid_sort", dict(scalar_sink=True), "`scalar_sink` must be False"),
        ("hybrid_sort", dict(num_register_tokens=2), "`num_register_tokens` must be 0"),
        ("hybrid_sort", dict(head_kinds=["hybrid", "scalar"]), "`head_kinds` may only hold"),
        ("hybrid_sort", dict(attention_layers=["hybrid", "scalar"]), "`attention_layers` may only hold"),
        ("dot", dict(attention_layers=["gka"]), "`attention_layers` may only hold"),
        ("hybrid_sort", dict(hidden_size=64), "come from the source model's config"),
        ("hybrid_sort", dict(num_value_groups=4), "come from the source model's config"),
        ("hybrid_sort", dict(tau_modes="global"), "are not fields of HybridSortConfig"),
        ("dot", dict(tau_mode="global"), "are not fields of GkaConfig"),
    ],
)
def test_overrides_that_break_the_exact_start_are_refused(target, overrides, named):
    with pytest.raises(ValueError, match=named):
        hf_rbf_config_from_llama(LlamaConfig(**COMMON), target, **overrides)


def test_allowed_overrides_keep_the_logits():
    llama = _source("llama-gqa-untied")
    hybrid = convert_llama(llama, "hybrid_sort", head_kinds=["hybrid", "dot"], tau_init_range=[0.2, 0.5])
    assert hybrid.config.head_kinds == ["hybrid", "dot", "hybrid", "dot"]
    ids = _tokens()
    with torch.no_grad():
        assert (hybrid(ids, use_cache=False).logits - llama(ids).logits).abs().max() < FP32_TOLERANCE
    with pytest.raises(ValueError, match="`scalar_query_std` must be positive"):
        convert_llama(llama, "hybrid_sort", scalar_query_std=0.0)


# ----------------------------------------------------------------------------------------------------------------
# the recipe
# ----------------------------------------------------------------------------------------------------------------


def test_conversion_recipe_runs_and_reports_every_stage(tmp_path):
    out = tmp_path / "out"
    config = os.path.join(REPO, "tests", "data", "convert_tiny.yaml")
    rc = convert_to_rbf.main(
        ["--config", config, "--set", f"output_dir={tmp_path / 'run'}", "--steps", "2", "--output", str(out)]
    )
    assert rc == 0
    result = json.loads((out / "conversion.json").read_text())
    assert set(result["targets"]) == {"rbf", "hybrid_sort"}
    losses = [result["loss_original"], result["loss_control_lora"], result["loss_control_full"]]
    assert 0 < result["control_lora_trainable_parameters"] < result["control_trainable_parameters"]
    for target in result["targets"].values():
        losses += [target[k] for k in ("loss_after_switch", "loss_after_lora", "loss_after_full")]
        assert 0 < target["lora_trainable_parameters"] < target["full_trainable_parameters"]
        assert target["backend"] in ("naive", "sdpa", "flex", "triton")
        assert target["tokens_per_s"] > 0
    for loss in losses:
        assert math.isfinite(loss) and 0 < loss < 10
    rbf, hybrid = result["targets"]["rbf"], result["targets"]["hybrid_sort"]
    # the rbf switch changes the attention (the key-norm penalty), so the loss moves; the hybrid starts exactly
    assert rbf["loss_after_switch"] != result["loss_original"]
    assert rbf["max_abs_logit_difference"] > 1e-4
    assert hybrid["max_abs_logit_difference"] < 1e-4
    assert hybrid["loss_after_switch"] == pytest.approx(result["loss_original"], abs=1e-5)
    # the hybrid's scalar term does nothing at the start and has been learned by both recoveries
    assert hybrid["scalar_term_share_after_switch"] < 1e-6
    assert hybrid["scalar_term_share_after_lora"] > 1e-3 and hybrid["scalar_term_share_after_full"] > 1e-3
    for stage in ("switch", "lora", "full"):
        mass = hybrid[f"captured_mass_after_{stage}"]
        assert set(mass) == {"16", "32"} and all(0 < m <= 1 + 1e-6 for m in mass.values())
    assert mass["32"] == pytest.approx(1.0, abs=1e-5)  # a window as long as the blocks reads every key
    # LoRA on the hybrid also trains the new scalar projections in full: 2 * H * D per layer more than rbf's LoRA
    assert hybrid["lora_trainable_parameters"] - rbf["lora_trainable_parameters"] == 2 * 2 * 2 * 32
    table = (out / "conversion.md").read_text()
    assert 'switched to `attn_implementation="rbf"`' in table and "HybridSortForCausalLM" in table

    # a second run reuses the trained model (no pretraining) and runs one target only
    rc = convert_to_rbf.main(
        ["--config", config, "--set", f"output_dir={tmp_path / 'run'}", "--steps", "1", "--output", str(out)]
        + ["--targets", "hybrid_sort", "--hybrid-set", "tau_init_range=[0.5, 1.0]"]
    )
    assert rc == 0
    again = json.loads((out / "conversion.json").read_text())
    assert set(again["targets"]) == {"hybrid_sort"}
    assert again["targets"]["hybrid_sort"]["config_overrides"] == {"tau_init_range": [0.5, 1.0]}
    assert again["targets"]["hybrid_sort"]["loss_after_switch"] == pytest.approx(result["loss_original"], abs=1e-5)
    assert again["loss_original"] == pytest.approx(result["loss_original"], abs=1e-6)


@pytest.mark.parametrize(
    "bad, named",
    [
        (["--steps", "0"], "--steps"),
        (["--lora-rank", "-1"], "--lora-rank"),
        (["--learning-rate", "0"], "--learning-rate"),
        (["--speed-rounds", "0"], "--speed-rounds"),
        (["--targets", "gka"], "--targets"),
        (["--targets", "rbf", "rbf"], "--targets"),
        (["--hybrid-set", "tau_init_range"], "--hybrid-set"),
        (["--hybrid-set", "scalar_sink=true"], "--hybrid-set"),
        (["--hybrid-set", "tau_mod=global"], "--hybrid-set"),
        (["--config", "no/such/recipe.yaml"], "--config"),
        (["--model", "no/such/checkpoint"], "--model"),
    ],
)
def test_bad_arguments_are_refused(bad, named, capsys):
    config = os.path.join(REPO, "tests", "data", "convert_tiny.yaml")
    with pytest.raises(SystemExit):
        convert_to_rbf.main(["--config", config, *bad])
    err = capsys.readouterr().err
    assert named in err and "must be" in err


def test_hybrid_target_refuses_a_non_llama_model(tmp_path, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(
        GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, bos_token_id=0, eos_token_id=0)
    ).save_pretrained(tmp_path)
    config = os.path.join(REPO, "tests", "data", "convert_tiny.yaml")
    with pytest.raises(SystemExit):
        convert_to_rbf.main(["--config", config, "--model", str(tmp_path), "--targets", "hybrid_sort"])
    err = capsys.readouterr().err
    assert "--targets hybrid_sort must have a Llama-architecture --model" in err and "`model_type`" in err
