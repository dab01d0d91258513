"""The GKA paper's ablation and speed-up options: the VLT attention type ("vlt": W_Q, W_K, W_O, no W_V) in the decoder
and the ViT, and the kernel approximations (gka_approximation: random features, Nystrom)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from conftest import build_model, generate_with_logits, make_config

from hf_rbf.attention_gka import gka_attention
from hf_rbf.attention_gka_approx import (
    gaussian_orthogonal_projection,
    gka_attention_nystrom,
    gka_attention_random_features,
    segment_means,
)
from hf_rbf.configuration_gka_vit import GkaVitConfig
from hf_rbf.modeling_gka_vit import (
    GkaVitForImageClassification,
    attention_parameter_count,
)

pytestmark = pytest.mark.contract


# ------------------------------------------------------------------------------------------------------------------
# VLT
# ------------------------------------------------------------------------------------------------------------------


def test_vlt_layer_has_q_k_o_only_and_equals_the_float64_reference():
    model = build_model("gka", dict(attention_layers=["vlt", "gka"], num_register_tokens=0))
    attn = model.model.layers[0].self_attn
    assert attn.kind == "vlt" and not hasattr(attn, "v_proj")
    d = model.config.hidden_size
    assert sum(p.numel() for p in attn.parameters()) == 3 * d * d
    captured = {}

    def hook(module, args, kwargs, output):
        captured["x"], captured["pe"], captured["out"] = args[0], kwargs["position_embeddings"], output[0]

    handle = attn.register_forward_hook(hook, with_kwargs=True)
    with torch.no_grad():
        model(torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(0)), use_cache=False)
    handle.remove()
    f64 = torch.float64
    x = captured["x"].to(f64)
    b, n, _ = x.shape
    h, hd = attn.num_heads, attn.head_dim
    cos, sin = (t.to(f64)[:, None] for t in captured["pe"])

    def heads(t):
        return t.view(b, n, h, hd).transpose(1, 2)

    def rope(t):
        t1, t2 = t.chunk(2, dim=-1)
        return torch.cat((t1 * cos - t2 * sin, t2 * cos + t1 * sin), dim=-1)

    q, k = rope(heads(x @ attn.q_proj.weight.to(f64).T)), rope(heads(x @ attn.k_proj.weight.to(f64).T))
    scores = (q @ k.transpose(-1, -2) / math.sqrt(hd)).masked_fill(
        torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf
    )
    ref = (scores.softmax(-1) @ heads(x)).transpose(1, 2).reshape(b, n, -1) @ attn.o_proj.weight.to(f64).T
    torch.testing.assert_close(captured["out"].to(f64), ref, rtol=1e-5, atol=1e-5)


def test_vlt_trains_and_generates_with_cache_as_without(tmp_path):
    model = build_model(
        "gka",
        dict(num_hidden_layers=3, attention_layers=["gka", "vlt", "dot"], num_register_tokens=2, qk_norm=True),
    )
    ids = torch.randint(1, 128, (2, 6), generator=torch.Generator().manual_seed(1))
    model.train()
    model(ids, labels=ids).loss.backward()
    vlt = model.model.layers[1].self_attn
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in vlt.parameters())
    model.eval()
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    a = generate_with_logits(model, ids, mask, use_cache=True, max_new_tokens=4, do_sample=False)
    b = generate_with_logits(model, ids, mask, use_cache=False, max_new_tokens=4, do_sample=False)
    assert torch.equal(a.sequences, b.sequences)
    for x, y in zip(a.logits, b.logits):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)
    model.save_pretrained(tmp_path)
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.config.attention_layers == ["gka", "vlt", "dot"]
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits)


def test_vlt_vit_matches_the_paper_parameter_accounting_and_its_weights():
    """Per block, VLT has W_Q, W_K (+ biases) and W_O (+ bias): 3 d^2 + 3 d; DeiT has 4 d^2 + 4 d, GKA d^2 + d + H."""
    sizes = {}
    for kind in ("dot", "vlt", "gka"):
        config = GkaVitConfig.from_preset("mnist-tiny", attention_type=kind)
        model = GkaVitForImageClassification(config).eval()
        sizes[kind] = attention_parameter_count(model)
        pixels = torch.randn(2, 1, 28, 28, generator=torch.Generator().manual_seed(0))
        out = model(pixels, output_attentions=True)
        plain = model(pixels)
        torch.testing.assert_close(out.logits, plain.logits, rtol=1e-5, atol=1e-5)
        model.train()
        model(pixels, labels=torch.tensor([1, 2])).loss.backward()
        assert all(p.grad is not None for p in model.parameters())
    d, L, h = 32, 2, 2
    assert sizes == {"dot": L * (4 * d * d + 4 * d), "vlt": L * (3 * d * d + 3 * d), "gka": L * (d * d + d + h)}


def test_vlt_vit_uses_the_features_as_values():
    config = GkaVitConfig.from_preset("mnist-tiny", attention_type="vlt")
    attn = GkaVitForImageClassification(config).vit.layers[0].attention
    x = torch.randn(2, 5, 32, dtype=torch.float32)
    out, weights = attn(x, output_attentions=True)
    v = x.view(2, 5, 2, 16).transpose(1, 2)
    ref = attn.o_proj((weights @ v).transpose(1, 2).reshape(2, 5, 32))
    torch.testing.assert_close(out, ref)


# ------------------------------------------------------------------------------------------------------------------
# approximations: the functions
# ------------------------------------------------------------------------------------------------------------------


def _features(seed: int, b=2, h=2, n=24, d=8, scale=0.35):
    return torch.randn(b, h, n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_random_feature_error_falls_as_the_feature_count_grows(causal):
    """Mean relative error over 4 feature draws against the exact float64 kernel attention, with key log-weights,
    two prefix keys and left padding: it falls at each 16x step in m (measured 0.298, 0.126, 0.051 causal and
    0.366, 0.150, 0.070 bidirectional for 8, 128, 2048 directions: 2.1x to 2.5x per step, slower than 1 / sqrt(m)'s
    4x because the estimator is heavy-tailed; required: 1.5x) to under 10%."""
    x = _features(0)
    log_sigma = torch.tensor([0.0, 0.4], dtype=torch.float64)
    klw = torch.randn(2, 24, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 0.5
    am = torch.ones(2, 24, dtype=torch.bool)
    am[0, 2:5] = False
    kw = dict(causal=causal, key_log_weights=klw, attention_mask=am, num_prefix_keys=2, eps=1e-6)
    ref = gka_attention(x, log_sigma, backend="naive", **kw)
    errors = []
    for m in (8, 128, 2048):
        projections = [gaussian_orthogonal_projection(m, 8, 2, seed=s, dtype=torch.float64) for s in range(4)]
        errs = [_rel(gka_attention_random_features(x, log_sigma, p, chunk_size=5, **kw), ref) for p in projections]
        errors.append(sum(errs) / len(errs))
    assert all(a > 1.5 * b for a, b in itertools.pairwise(errors)), errors
    assert errors[-1] < 0.1, errors


def test_orthogonal_projection_rows_are_gaussian_orthogonal_blocks_and_reproducible():
    p = gaussian_orthogonal_projection(20, 8, 3, seed=1, dtype=torch.float64)
    assert p.shape == (3, 20, 8)
    for block in (p[:, :8], p[:, 8:16]):
        gram = block @ block.transpose(-1, -2)
        torch.testing.assert_close(gram - torch.diag_embed(torch.diagonal(gram, dim1=-2, dim2=-1)),
                                   torch.zeros_like(gram), atol=1e-12, rtol=0)  # fmt: skip
    assert torch.equal(p, gaussian_orthogonal_projection(20, 8, 3, seed=1, dtype=torch.float64))
    assert not torch.equal(p, gaussian_orthogonal_projection(20, 8, 3, seed=2, dtype=torch.float64))
    big = gaussian_orthogonal_projection(4096, 8, 2, seed=0, dtype=torch.float64)
    assert big.square().sum(-1).mean().item() == pytest.approx(8.0, rel=0.05)  # E||w||^2 = d for w ~ N(0, I)


def test_random_features_cache_step_and_chunking_agree_with_one_pass():
    """Queries as the last Nq positions (a cache step) give the rows of the full pass; chunk size changes nothing."""
    x = _features(2)
    proj = gaussian_orthogonal_projection(32, 8, 2, seed=0, dtype=torch.float64)
    full = gka_attention_random_features(x, 0.3, proj, chunk_size=7, num_prefix_keys=1)
    for chunk in (1, 24, 100):
        torch.testing.assert_close(
            gka_attention_random_features(x, 0.3, proj, chunk_size=chunk, num_prefix_keys=1),
            full,
            rtol=1e-12,
            atol=1e-12,
        )
    step = gka_attention_random_features(x, 0.3, proj, query=x[:, :, -3:], num_prefix_keys=1)
    torch.testing.assert_close(step, full[:, :, -3:], rtol=1e-12, atol=1e-12)


def test_random_features_stay_finite_for_large_norms_and_half_precision():
    x = _features(3, scale=6.0).float()
    proj = gaussian_orthogonal_projection(16, 8, 2, seed=0)
    out = gka_attention_random_features(x, 0.0, proj)
    assert torch.isfinite(out).all()
    out16 = gka_attention_random_features(x.bfloat16(), 0.0, proj)
    assert out16.dtype == torch.bfloat16 and torch.isfinite(out16).all()
    # a fully masked row gives zeros, as the exact reference
    am = torch.zeros(2, 24, dtype=torch.bool)
    assert gka_attention_random_features(x, 0.0, proj, attention_mask=am).abs().max() == 0


def test_nystrom_error_falls_with_the_landmarks_and_is_exact_with_every_token():
    x = _features(4, n=32)
    log_sigma = torch.tensor([0.2, 0.5], dtype=torch.float64)
    klw = torch.randn(1, 2, 32, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * 0.3
    ref = gka_attention(x, log_sigma, causal=False, key_log_weights=klw, backend="naive")
    # measured 0.46, 0.33, 0.19, 0.055 with 2, 4, 8, 16 landmarks for 32 tokens
    errors = [_rel(gka_attention_nystrom(x, log_sigma, m, key_log_weights=klw), ref) for m in (2, 4, 8, 16)]
    assert all(a > 1.3 * b for a, b in itertools.pairwise(errors)), errors
    exact = gka_attention_nystrom(x, log_sigma, 32, key_log_weights=klw, rcond=1e-12)
    assert _rel(exact, ref) < 1e-8
    torch.testing.assert_close(segment_means(x, 32), x)


def test_approximations_refuse_what_they_cannot_serve():
    x = _features(5).float()
    proj = gaussian_orthogonal_projection(8, 8, 2, seed=0)
    with pytest.raises(ValueError, match="sliding windows are not supported"):
        gka_attention_random_features(x, 0.0, proj, window=4)
    with pytest.raises(ValueError, match=r"`causal=True` is not supported"):
        gka_attention_nystrom(x, 0.0, 4, causal=True)
    with pytest.raises(ValueError, match="`attention_mask`"):
        gka_attention_nystrom(x, 0.0, 4, attention_mask=torch.ones(2, 24))
    with pytest.raises(ValueError, match=r"`projection` must be \[H, m, d\]"):
        gka_attention_random_features(x, 0.0, proj[:1])


# ------------------------------------------------------------------------------------------------------------------
# approximations: the config option in the decoder and the ViT
# ------------------------------------------------------------------------------------------------------------------


def test_decoder_random_features_config_is_validated_by_name():
    with pytest.raises(ValueError, match="`gka_approximation` must be one of 'exact', 'random_features', 'nystrom'"):
        make_config("gka", gka_approximation="fast")
    with pytest.raises(ValueError, match="needs bidirectional attention"):
        make_config("gka", gka_approximation="nystrom")
    with pytest.raises(ValueError, match=r"cannot serve sliding windows.*\[0, 1, 2\]"):
        make_config(
            "gka", gka_approximation="random_features", window_pattern="SSSL", sliding_window=3, num_hidden_layers=4
        )
    with pytest.raises(ValueError, match="`attention_backend` must be 'auto' or 'naive'; got 'triton'"):
        make_config("gka", gka_approximation="random_features", attention_backend="triton")
    with pytest.raises(ValueError, match="`gka_approximation_size` must be an int >= 1"):
        make_config("gka", gka_approximation="random_features", gka_approximation_size=0)
    # windows on "dot" layers only are fine
    make_config(
        "gka",
        gka_approximation="random_features",
        attention_layers=["gka", "dot"],
        window_pattern="LS",
        sliding_window=3,
    )


def test_decoder_random_features_track_exact_gka_and_cache_generate_and_reload(tmp_path):
    """More features: the approximate model's logits approach the exact model's (same weights; a wide kernel,
    sigma^2 = e^2 against squared feature norms of about head_dim = 8, where the estimator's variance is moderate); a
    cached generate (dynamic or static cache) equals an uncached one; a reload draws the same features."""
    overrides = dict(
        attention_layers=["gka", "dot"],
        num_register_tokens=1,
        position_embedding_type="none",
        gka_feature_norm=False,
        gka_log_sigma_init=1.0,
    )
    exact = build_model("gka", overrides)
    ids = torch.randint(1, 128, (2, 8), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ref = exact(ids).logits
    errors = []
    for m in (4096, 16):
        approx = build_model("gka", dict(overrides, gka_approximation="random_features", gka_approximation_size=m))
        approx.load_state_dict(exact.state_dict())
        with torch.no_grad():
            errors.append(_rel(approx(ids).logits.double(), ref.double()))
    assert errors[0] < errors[1] / 2.5, errors  # measured 0.11 (4096) against 0.37 (16): relative error of logits
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    a = generate_with_logits(approx, ids, mask, use_cache=True, max_new_tokens=3, do_sample=False)
    b = generate_with_logits(approx, ids, mask, use_cache=False, max_new_tokens=3, do_sample=False)
    assert torch.equal(a.sequences, b.sequences)
    for x, y in zip(a.logits, b.logits):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)
    static = generate_with_logits(
        approx, ids, mask, use_cache=True, max_new_tokens=3, do_sample=False, cache_implementation="static"
    )
    assert torch.equal(static.sequences, a.sequences)
    assert approx.model.layers[0].self_attn.last_backend == "random_features"
    approx.save_pretrained(tmp_path)
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, approx(ids).logits)
    with pytest.raises(ValueError, match="`output_attentions` is not available"):
        approx(ids, output_attentions=True)
    approx.config.attention_backend = "sdpa"  # what set_attn_implementation("sdpa") would do
    with pytest.raises(ValueError, match="the backend 'sdpa' cannot serve it"):
        approx(ids)


@pytest.mark.parametrize("approximation", ["random_features", "nystrom"])
def test_vit_approximations_train_reload_and_refuse_backends(approximation, tmp_path):
    config = GkaVitConfig.from_preset("mnist-tiny", gka_approximation=approximation, gka_approximation_size=17)
    model = GkaVitForImageClassification(config)
    pixels = torch.randn(2, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    model(pixels, labels=torch.tensor([3, 4])).loss.backward()
    assert all(layer.attention.log_sigma.grad.abs().sum() > 0 for layer in model.vit.layers)
    model.eval()
    model.save_pretrained(tmp_path)
    reloaded = GkaVitForImageClassification.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(pixels).logits, model(pixels).logits)
    with pytest.raises(ValueError, match="`output_attentions` is not available"):
        model(pixels, output_attentions=True)
    with pytest.raises(ValueError, match="`gka_backend` must be 'auto' or 'naive'; got 'sdpa'"):
        GkaVitConfig.from_preset("mnist-tiny", gka_approximation=approximation, gka_backend="sdpa")
    with pytest.raises(ValueError, match="`gka_approximation` must be one of"):
        GkaVitConfig.from_preset("mnist-tiny", gka_approximation="fft")


def test_remote_code_without_hf_rbf_serves_vlt_qk_norm_and_random_features(tmp_path, hf_home):
    """The new options travel with the checkpoint: a process where hf_rbf cannot be imported loads it with
    trust_remote_code (attention_gka_approx.py copied beside modeling_gka.py) and reproduces logits and tokens."""
    import json
    import os
    import subprocess
    import sys

    from test_model_auto import _REMOTE_SCRIPT, _inputs

    model = build_model(
        "gka",
        dict(
            num_hidden_layers=3,
            attention_layers=["gka", "vlt", "dot"],
            qk_norm=True,
            num_register_tokens=1,
            gka_approximation="random_features",
            gka_approximation_size=16,
        ),
    )
    ids, mask = _inputs(model.config.vocab_size)
    with torch.no_grad():
        ref = {
            "ids": ids,
            "mask": mask,
            "logits": model(ids, attention_mask=mask).logits,
            "hidden": model.model(ids, attention_mask=mask).last_hidden_state,
            "tokens": model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0),
        }
    model.save_pretrained(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "attention_gka_approx.py").exists()
    torch.save(ref, tmp_path / "ref.pt")
    (tmp_path / "load_remote.py").write_text(_REMOTE_SCRIPT)
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env["HF_HOME"] = hf_home
    env["HF_MODULES_CACHE"] = os.path.join(str(tmp_path), "modules")
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "load_remote.py"), str(tmp_path / "ckpt"), str(tmp_path / "ref.pt")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["logits_equal"] and result["hidden_equal"] and result["tokens_equal"], result
    assert not result["hf_rbf_loaded"]
