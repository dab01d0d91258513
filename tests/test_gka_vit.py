"""GKA vision transformer: shapes, parameter accounting, attention paths, key_log_weights, save/load, remote code,
image processor, Trainer, the section-7 pictures and the MNIST IDX loader.

Small models (the "mnist-tiny" preset) on the CPU; the ImageNet sizes are built on the meta device only.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from pathlib import Path
import torch


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = os.path.join(REPO, "recipes")
sys.path.insert(0, RECIPES)

import vit_accounting  # noqa: E402
from conftest import enable_activation_checkpointing  # noqa: E402
import vit_data  # noqa: E402
import vit_pictures  # noqa: E402

from hf_rbf import GkaVitConfig, GkaVitForImageClassification, GkaVitImageProcessor, GkaVitModel, gka_attention  # noqa: E402
from hf_rbf.modeling_gka_vit import (  # noqa: E402
    GkaVitDotProductAttention,
    GkaVitGaussianKernelAttention,
    attention_parameter_count,
    drop_path,
    gka_attention_probs,
    mlp_parameter_count,
)


MNIST_DIR = os.environ.get("MNIST_DIR", "/work/shared/data/images/mnist")
KINDS = ["gka", "dot"]


def auto_image_processor_available() -> bool:
    """transformers 5.17 without torchvision exposes AutoImageProcessor as a dummy that raises on any use."""
    from transformers import AutoImageProcessor

    try:
        AutoImageProcessor.from_pretrained  # noqa: B018
        return True
    except ImportError:
        return False


@pytest.fixture(autouse=True)
def _isolated_hf_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "hf_modules"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))


def tiny_model(kind="gka", seed=0, **overrides):
    torch.manual_seed(seed)
    cfg = GkaVitConfig.from_preset("mnist-tiny", attention_type=kind, **overrides)
    return GkaVitForImageClassification(cfg).eval()


def images(b=3, seed=0):
    return torch.randn(b, 1, 28, 28, generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------------------------------------------
# config
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(attention_type="flash"), "attention_type"),
        (dict(hidden_size=30, num_attention_heads=4), "multiple of `num_attention_heads`"),
        (dict(image_size=30, patch_size=4), "multiple of `patch_size`"),
        (dict(num_attention_heads=2, gka_log_sigma_init=[0.0, 1.0, 2.0]), "one value per head"),
        (dict(gka_log_sigma_init="wide"), "gka_log_sigma_init"),
        (dict(drop_path_rate=1.0), "drop_path_rate"),
        (dict(gka_eps=-1.0), "gka_eps"),
        (dict(patch_size=0), "patch_size"),
    ],
)
def test_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GkaVitConfig(**kwargs)


def test_config_presets_and_log_sigma_init():
    cfg = GkaVitConfig.from_preset("tiny")
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_patches, cfg.intermediate_size) == (192, 3, 196, 768)
    assert cfg.initial_log_sigma() == pytest.approx([0.5 * math.log(64)] * 3)
    assert GkaVitConfig(num_attention_heads=3, gka_log_sigma_init=0.25).initial_log_sigma() == [0.25] * 3
    m = tiny_model(gka_log_sigma_init=[0.1, -0.2])
    assert m.vit.layers[1].attention.log_sigma.tolist() == pytest.approx([0.1, -0.2])
    with pytest.raises(ValueError, match="unknown preset"):
        GkaVitConfig.from_preset("huge")


# ----------------------------------------------------------------------------------------------------------------
# shapes, parameters, attention paths
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_forward_shapes_and_outputs(kind):
    m = tiny_model(kind)
    cfg = m.config
    n = cfg.num_patches + 1
    out = m(pixel_values=images(3), labels=torch.tensor([0, 3, 9]), output_attentions=True, output_hidden_states=True)
    assert out.logits.shape == (3, 10)
    assert out.loss.ndim == 0 and torch.isfinite(out.loss)
    assert len(out.hidden_states) == cfg.num_hidden_layers + 1
    assert all(h.shape == (3, n, cfg.hidden_size) for h in out.hidden_states)
    assert len(out.attentions) == cfg.num_hidden_layers
    for a in out.attentions:
        assert a.shape == (3, cfg.num_attention_heads, n, n)
        assert bool((a >= 0).all())
        torch.testing.assert_close(a.sum(-1), torch.ones(3, cfg.num_attention_heads, n), atol=2e-6, rtol=0)
    base = GkaVitModel(cfg).eval()
    o = base(pixel_values=images(2))
    assert o.last_hidden_state.shape == (2, n, cfg.hidden_size)
    torch.testing.assert_close(o.pooler_output, o.last_hidden_state[:, 0])
    tup = m(pixel_values=images(2), return_dict=False)
    assert isinstance(tup, tuple) and tup[0].shape == (2, 10)


def test_gka_attention_parameters_are_w_o_bias_and_one_sigma_per_head():
    m = tiny_model("gka")
    d, h = m.config.hidden_size, m.config.num_attention_heads
    for layer in m.vit.layers:
        attn = layer.attention
        assert isinstance(attn, GkaVitGaussianKernelAttention)
        names = {n: p.shape for n, p in attn.named_parameters()}
        assert names == {"log_sigma": (h,), "o_proj.weight": (d, d), "o_proj.bias": (d,)}
        assert sum(p.numel() for p in attn.parameters()) == d * d + d + h
    dot = tiny_model("dot")
    for layer in dot.vit.layers:
        assert isinstance(layer.attention, GkaVitDotProductAttention)
        assert sum(p.numel() for p in layer.attention.parameters()) == 4 * d * d + 4 * d
    # everything but attention is the same in both
    total = lambda mod: sum(p.numel() for p in mod.parameters())  # noqa: E731
    assert total(dot) - attention_parameter_count(dot) == total(m) - attention_parameter_count(m)
    assert mlp_parameter_count(m) == mlp_parameter_count(dot) == m.config.num_hidden_layers * (
        2 * d * m.config.intermediate_size + m.config.intermediate_size + d
    )


@pytest.mark.parametrize("preset", ["tiny", "small", "base"])
def test_accounting_matches_the_paper(preset):
    for kind in KINDS:
        row = vit_accounting.account(preset, kind)  # raises if the FLOP counter and the closed form disagree
        paper = row["paper"]
        assert round(row["total"] / 1e6, 2) == paper["total_m"]
        assert round(row["attention"] / 1e6, 2) == paper["attn_m"]
        assert round(row["mlp"] / 1e6, 2) == paper["mlp_m"]
        assert row["sigma"] == paper["sigma"]
        if (preset, kind) != ("small", "dot"):  # the paper's 9.22 (Table 3) vs 9.20 (Table 2): see NOTES
            assert round(row["flops"] / 1e9, 2) == paper["gflops"]
        else:
            assert round(row["flops"] / 1e9, 2) == 9.20


@pytest.mark.parametrize("kind", KINDS)
def test_materialised_attention_path_matches_the_fused_path(kind):
    m = tiny_model(kind)
    x = images(2)
    klw = torch.randn(2, m.config.num_patches)
    for w in (None, klw):
        a = m(pixel_values=x, key_log_weights=w).logits
        b = m(pixel_values=x, key_log_weights=w, output_attentions=True).logits
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_gka_attention_probs_matches_gka_attention_float64():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 11, 5, dtype=torch.float64)
    log_sigma = torch.tensor([0.3, 1.0, -0.2], dtype=torch.float64)
    klw = torch.randn(2, 1, 11, dtype=torch.float64)
    for eps in (0.0, 1e-3):
        w = gka_attention_probs(x, log_sigma, eps, klw)
        ref = gka_attention(x, log_sigma, causal=False, eps=eps, key_log_weights=klw, backend="naive")
        torch.testing.assert_close(w @ x, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_key_log_weights_reweight_every_key(kind):
    m = tiny_model(kind)
    cfg = m.config
    x = images(2)
    w = torch.rand(2, cfg.num_patches) + 0.2
    klw = torch.log(w)
    plain = m(pixel_values=x, output_attentions=True)
    weighted = m(pixel_values=x, key_log_weights=klw, output_attentions=True)
    # layer 0 sees the same features: its weighted rows are the plain rows times w_j, renormalised ([CLS] w = 1)
    wf = torch.cat([torch.ones(2, 1), w], dim=1)[:, None, None, :]
    expect = plain.attentions[0] * wf
    expect = expect / expect.sum(-1, keepdim=True)
    torch.testing.assert_close(weighted.attentions[0], expect, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(plain.logits, weighted.logits, atol=1e-4)
    # N patches (the [CLS] key gets 0) == N + 1 tokens with a zero [CLS] column; per-head weights broadcast
    full = torch.cat([torch.zeros(2, 1), klw], dim=1)
    torch.testing.assert_close(m(pixel_values=x, key_log_weights=full).logits, weighted.logits)
    per_head = klw[:, None, :].expand(2, cfg.num_attention_heads, -1)
    torch.testing.assert_close(m(pixel_values=x, key_log_weights=per_head).logits, weighted.logits)
    # equal areas (a constant) change nothing: only ratios matter
    const = m(pixel_values=x, key_log_weights=torch.full((1, cfg.num_patches), 0.0)).logits
    torch.testing.assert_close(const, plain.logits, atol=1e-5, rtol=1e-5)


def test_key_log_weights_errors():
    m = tiny_model("gka")
    with pytest.raises(ValueError, match="key_log_weights"):
        m(pixel_values=images(2), key_log_weights=torch.zeros(2, 7))
    with pytest.raises(ValueError, match="key_log_weights"):
        m(pixel_values=images(2), key_log_weights=torch.zeros(3, m.config.num_patches))
    with pytest.raises(TypeError, match="key_log_weights"):
        m(pixel_values=images(2), key_log_weights=torch.zeros(2, m.config.num_patches, dtype=torch.long))
    with pytest.raises(ValueError, match="pixel_values"):
        m(pixel_values=torch.zeros(2, 3, 28, 28))
    with pytest.raises(ValueError, match="28x28"):
        m(pixel_values=torch.zeros(2, 1, 32, 32))


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_forward_is_finite(kind):
    m = tiny_model(kind).to(torch.bfloat16)
    out = m(pixel_values=images(2).bfloat16() * 30, output_attentions=True)
    assert out.logits.dtype == torch.bfloat16 and bool(torch.isfinite(out.logits).all())
    ref = tiny_model(kind)(pixel_values=images(2) * 30).logits
    assert (out.logits.float() - ref).abs().max() < 0.1 * ref.abs().max() + 0.05


def test_stochastic_depth_and_gradient_checkpointing():
    x = torch.randn(64, 5, 4)
    assert torch.equal(drop_path(x, 0.3, training=False), x)
    y = drop_path(x, 0.5, training=True)
    per_sample = (y == 0).flatten(1).all(1)
    assert 10 < int(per_sample.sum()) < 54  # whole samples dropped
    torch.testing.assert_close(y[~per_sample], x[~per_sample] * 2)
    m = tiny_model("gka", drop_path_rate=0.5)
    assert [round(layer.drop_path.drop_prob, 3) for layer in m.vit.layers] == [0.0, 0.5]
    m.train()
    torch.manual_seed(1)
    a = m(pixel_values=images(8)).logits
    torch.manual_seed(2)
    b = m(pixel_values=images(8)).logits
    assert not torch.allclose(a, b)

    ref = tiny_model("gka").train()
    ck = tiny_model("gka").train()
    enable_activation_checkpointing(ck)
    assert all(layer.gradient_checkpointing for layer in ck.vit.layers)
    for model in (ref, ck):
        model(pixel_values=images(4), labels=torch.tensor([1, 2, 3, 4])).loss.backward()
    for (n, p), (_, q) in zip(ref.named_parameters(), ck.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5, msg=n)
    assert ref.vit.layers[0].attention.log_sigma.grad.abs().sum() > 0


def test_no_weight_decay_names(tmp_path):
    from transformers import TrainingArguments

    from hf_rbf.trainer import HfRbfTrainer

    model = tiny_model("gka")
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], weight_decay=0.05)
    decayed = set(HfRbfTrainer(model=model, args=args).get_decay_parameter_names(model))
    exempt = {n for n, _ in model.named_parameters()} - decayed
    assert {"vit.embeddings.cls_token", "vit.embeddings.position_embeddings"} <= exempt
    assert "vit.layers.0.attention.log_sigma" in exempt
    assert "vit.layers.0.attention.o_proj.weight" in decayed and "vit.layers.0.mlp.fc1.weight" in decayed


# ----------------------------------------------------------------------------------------------------------------
# save / load, Auto classes, remote code
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_save_load_round_trip(kind, tmp_path):
    from transformers import AutoConfig, AutoModel, AutoModelForImageClassification

    m = tiny_model(kind, gka_log_sigma_init=[0.3, 0.9])
    with torch.no_grad():
        for layer in m.vit.layers:  # move off the init so that a silently re-initialised sigma would show
            if kind == "gka":
                layer.attention.log_sigma.add_(torch.tensor([0.11, -0.07]))
    x = images(2)
    ref = m(pixel_values=x).logits
    m.save_pretrained(tmp_path / "ckpt")
    for loader in (GkaVitForImageClassification, AutoModelForImageClassification):
        again = loader.from_pretrained(tmp_path / "ckpt").eval()
        assert type(again) is GkaVitForImageClassification
        assert torch.equal(again(pixel_values=x).logits, ref)
    base = AutoModel.from_pretrained(tmp_path / "ckpt").eval()
    assert type(base) is GkaVitModel
    torch.testing.assert_close(base(pixel_values=x).pooler_output, m.vit(pixel_values=x).pooler_output)
    cfg = AutoConfig.from_pretrained(tmp_path / "ckpt")
    assert isinstance(cfg, GkaVitConfig) and cfg.attention_type == kind
    saved = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert saved["auto_map"] == {
        "AutoConfig": "configuration_gka_vit.GkaVitConfig",
        "AutoModel": "modeling_gka_vit.GkaVitModel",
        "AutoModelForImageClassification": "modeling_gka_vit.GkaVitForImageClassification",
    }


REMOTE_SCRIPT = textwrap.dedent(
    """
    import importlib.abc, json, sys
    class BlockHfRbf(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "hf_rbf" or name.startswith("hf_rbf."):
                raise ImportError("hf_rbf is not installed here")
    sys.meta_path.insert(0, BlockHfRbf())
    try:
        import hf_rbf  # noqa
        raise SystemExit("the import block did not work")
    except ImportError:
        pass
    import numpy as np, torch
    from transformers import AutoImageProcessor, AutoModel, AutoModelForImageClassification
    from transformers.dynamic_module_utils import get_class_from_dynamic_module
    try:
        AutoImageProcessor.from_pretrained
        auto_proc = True
    except ImportError:  # transformers 5.17 without torchvision: load the processor's remote class directly
        auto_proc = False
    img = np.load(sys.argv[1])
    results = {}
    for d in sys.argv[2:]:
        model = AutoModelForImageClassification.from_pretrained(d, trust_remote_code=True).eval()
        base = AutoModel.from_pretrained(d, trust_remote_code=True)
        if auto_proc:
            proc = AutoImageProcessor.from_pretrained(d, trust_remote_code=True)
        else:
            cls = get_class_from_dynamic_module("image_processing_gka_vit.GkaVitImageProcessor", d)
            proc = cls.from_pretrained(d)
        x = proc(img, return_tensors="pt")["pixel_values"]
        out = model(pixel_values=x, output_attentions=True)
        results[d] = {"model": type(model).__module__, "base": type(base).__name__, "proc": type(proc).__module__,
                      "logits": out.logits.tolist(), "attn_rows": out.attentions[0].sum(-1).mean().item()}
    print(json.dumps(results))
    """
)


def test_remote_code_loads_without_hf_rbf(tmp_path):
    """Both kinds load through the Auto classes with trust_remote_code in a process where `import hf_rbf` fails."""
    img = (np.random.default_rng(0).random((2, 28, 28)) * 255).astype(np.uint8)
    np.save(tmp_path / "img.npy", img)
    refs = {}
    for kind in KINDS:
        m = tiny_model(kind)
        proc = GkaVitImageProcessor()
        ckpt = tmp_path / f"ckpt_{kind}"
        m.save_pretrained(ckpt)
        proc.save_pretrained(ckpt)
        files = set(os.listdir(ckpt))
        assert {"modeling_gka_vit.py", "configuration_gka_vit.py", "attention_gka.py", "attention_utils.py",
                "image_processing_gka_vit.py", "preprocessor_config.json"} <= files
        assert json.loads((ckpt / "preprocessor_config.json").read_text())["auto_map"] == {
            "AutoImageProcessor": "image_processing_gka_vit.GkaVitImageProcessor"
        }
        refs[str(ckpt)] = m(pixel_values=proc(img, return_tensors="pt")["pixel_values"]).logits
    script = tmp_path / "load.py"
    script.write_text(REMOTE_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run([sys.executable, str(script), str(tmp_path / "img.npy"), *refs], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got_all = json.loads(res.stdout.strip().splitlines()[-1])
    for ckpt, ref in refs.items():
        got = got_all[ckpt]
        assert got["model"].startswith("transformers_modules.") and got["proc"].startswith("transformers_modules.")
        assert got["base"] == "GkaVitModel"
        torch.testing.assert_close(torch.tensor(got["logits"]), ref, atol=1e-6, rtol=1e-6)
        assert got["attn_rows"] == pytest.approx(1.0, abs=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# image processor
# ----------------------------------------------------------------------------------------------------------------


def test_image_processor_values_and_inputs():
    from PIL import Image

    p = GkaVitImageProcessor()
    img = np.arange(28 * 28, dtype=np.uint8).reshape(28, 28)
    expect = ((img.astype(np.float32) / 255) - 0.1307) / 0.3081
    out = p(img, return_tensors="pt")["pixel_values"]
    assert out.shape == (1, 1, 28, 28) and out.dtype == torch.float32
    np.testing.assert_allclose(out[0, 0].numpy(), expect, rtol=1e-6, atol=1e-6)
    batch = np.stack([img, img[::-1]])
    assert p(batch, return_tensors="pt")["pixel_values"].shape == (2, 1, 28, 28)  # [B, 28, 28] is a batch
    assert p([img, img], return_tensors="np")["pixel_values"].shape == (2, 1, 28, 28)
    np.testing.assert_allclose(p(Image.fromarray(img), return_tensors="np")["pixel_values"][0, 0], expect, atol=1e-6)
    np.testing.assert_allclose(p(torch.from_numpy(img)[None], return_tensors="np")["pixel_values"][0, 0], expect,
                               atol=1e-6)
    # RGB -> grayscale (luma) and grayscale -> RGB
    rgb = np.stack([img, img, img], -1)
    np.testing.assert_allclose(p(rgb, return_tensors="np")["pixel_values"][0, 0], expect, atol=1e-5)
    p3 = GkaVitImageProcessor(num_channels=3, image_mean=[0.5, 0.4, 0.3], image_std=0.25, size=32)
    o3 = p3(img, return_tensors="np")["pixel_values"]
    assert o3.shape == (1, 3, 32, 32)
    np.testing.assert_allclose(o3[0, 0] * 0.25 + 0.5, o3[0, 2] * 0.25 + 0.3, atol=1e-6)  # same gray in R and B
    # resize of a constant image keeps the constant
    big = np.full((56, 56), 200, np.uint8)
    np.testing.assert_allclose(p(big, return_tensors="np")["pixel_values"], (200 / 255 - 0.1307) / 0.3081, atol=1e-5)
    assert p(big, do_resize=False, return_tensors="np")["pixel_values"].shape == (1, 1, 56, 56)
    with pytest.raises(ValueError, match="different sizes"):
        p([big, img], do_resize=False)
    with pytest.raises(ValueError, match="num_channels"):
        GkaVitImageProcessor(num_channels=2)
    with pytest.raises(ValueError, match="image_mean"):
        GkaVitImageProcessor(num_channels=3, image_mean=[0.1, 0.2])
    with pytest.raises(TypeError, match="unexpected"):
        p(img, do_center_crop=True)


def test_image_processor_round_trip(tmp_path):
    from transformers import AutoImageProcessor

    p = GkaVitImageProcessor(num_channels=3, size={"height": 32, "width": 32}, image_mean=[0.5, 0.4, 0.3],
                             image_std=[0.2, 0.2, 0.25], resample=3)
    p.save_pretrained(tmp_path)
    loaders = [GkaVitImageProcessor] + ([AutoImageProcessor] if auto_image_processor_available() else [])
    for loader in loaders:
        q = loader.from_pretrained(tmp_path)
        assert type(q) is GkaVitImageProcessor
        for k in ("size", "image_mean", "image_std", "num_channels", "resample", "rescale_factor", "do_normalize"):
            assert getattr(q, k) == getattr(p, k), k
    img = (np.random.default_rng(1).random((40, 40, 3)) * 255).astype(np.uint8)
    np.testing.assert_array_equal(p(img, return_tensors="np")["pixel_values"],
                                  q(img, return_tensors="np")["pixel_values"])


# ----------------------------------------------------------------------------------------------------------------
# data, Trainer recipe, pictures
# ----------------------------------------------------------------------------------------------------------------


def synthetic_mnist(folder, n_train=320, n_test=96, seed=0):
    """IDX files of a learnable 10-class toy problem: class c is a bright 10 x 4 bar at a class-specific place."""
    rng = np.random.default_rng(seed)
    os.makedirs(folder, exist_ok=True)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        labels = rng.integers(0, 10, size=n).astype(np.uint8)
        imgs = (rng.random((n, 28, 28)) * 40).astype(np.uint8)
        for i, c in enumerate(labels):
            r, col = 1 + 14 * (int(c) // 5), 1 + 5 * (int(c) % 5)
            imgs[i, r : r + 10, col : col + 4] = 255
        vit_data.write_idx(os.path.join(folder, f"{prefix}-images-idx3-ubyte.gz"), imgs)
        vit_data.write_idx(os.path.join(folder, f"{prefix}-labels-idx1-ubyte"), labels)
    return folder


def test_idx_reader_and_datasets_loader(tmp_path):
    arr = (np.random.default_rng(0).random((5, 4, 3)) * 255).astype(np.uint8)
    vit_data.write_idx(str(tmp_path / "x.gz"), arr)
    np.testing.assert_array_equal(vit_data.read_idx(str(tmp_path / "x.gz")), arr)
    (tmp_path / "bad").write_bytes(b"\x00\x00\x08\x01\x00\x00\x00\x05abc")
    with pytest.raises(ValueError, match="header says"):
        vit_data.read_idx(str(tmp_path / "bad"))
    d = synthetic_mnist(str(tmp_path / "mnist"), 40, 20)
    ds = vit_data.load_mnist(d, "train", cache_dir=str(tmp_path / "cache"))
    assert len(ds) == 40 and ds.features["label"].names[3] == "3"
    raw = vit_data.read_idx(os.path.join(d, "train-images-idx3-ubyte.gz"))
    np.testing.assert_array_equal(ds[7]["image"], raw[7])
    assert len(vit_data.load_mnist(d, "test", max_samples=8, cache_dir=str(tmp_path / "cache"))) == 8
    with pytest.raises(FileNotFoundError):
        vit_data.load_mnist(str(tmp_path), "train")
    for n in (6, 3, 1):  # a batch of 3 or 1 must not be read as one 3-channel or one 2-D image
        batch = vit_data.MnistCollator(GkaVitImageProcessor(), max_shift=2)([ds[i] for i in range(n)])
        assert batch["pixel_values"].shape == (n, 1, 28, 28) and batch["labels"].dtype == torch.long
    plain = vit_data.MnistCollator(GkaVitImageProcessor())([ds[i] for i in range(3)])["pixel_values"]
    np.testing.assert_allclose(plain[2, 0].numpy(), (raw[2] / 255 - 0.1307) / 0.3081, atol=1e-5)


@pytest.mark.skipif(not os.path.isdir(MNIST_DIR), reason="the shared MNIST copy is not on this machine")
def test_real_mnist_test_split(tmp_path):
    ds = vit_data.load_mnist(MNIST_DIR, "test", cache_dir=str(tmp_path / "cache"))
    assert len(ds) == 10000
    counts = np.bincount(np.asarray(ds["label"]), minlength=10)
    assert counts.tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


def test_random_shift_moves_content():
    img = np.zeros((1, 10, 10), np.uint8)
    img[0, 5, 5] = 255
    rng = np.random.default_rng(0)
    shifted = vit_data.random_shift(np.repeat(img, 50, 0), 2, rng)
    ys, xs = np.nonzero(shifted.reshape(50, 10, 10).max(0))
    assert shifted.shape == (50, 10, 10) and shifted.sum() == 50 * 255
    assert ys.min() >= 3 and ys.max() <= 7 and len(set(ys)) > 1 and len(set(xs)) > 1


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A few Trainer epochs of both kinds on the synthetic IDX set, through recipes/train_vit.py."""
    import train_vit

    root = tmp_path_factory.mktemp("vit_train")
    old = {k: os.environ.get(k) for k in ("HF_HOME", "HF_DATASETS_CACHE")}
    threads = torch.get_num_threads()
    os.environ["HF_HOME"] = str(root / "hf_home")
    os.environ["HF_DATASETS_CACHE"] = str(root / "hf_datasets")
    try:
        data = synthetic_mnist(str(root / "mnist"))
        results = train_vit.main([
            "--data-dir", data, "--output-dir", str(root / "out"), "--preset", "mnist-tiny", "--epochs", "5",
            "--batch-size", "16", "--lr", "3e-3", "--warmup-ratio", "0.05", "--drop-path", "0.0", "--max-shift", "0",
            "--throughput-batch-size", "16", "--logging-steps", "5", "--cpu", "--attention-type", "gka,dot",
            "--cache-dir", str(root / "cache"), "--threads", "1",  # one thread: the CI machine has two shared cores
        ])
    finally:
        torch.set_num_threads(threads)
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return root, data, results


def test_trainer_reduces_the_loss_and_writes_results(trained):
    root, _, results = trained
    assert [r["attention_type"] for r in results] == ["gka", "dot"]
    for r in results:
        losses = [h["loss"] for h in r["log_history"] if "loss" in h]
        assert len(losses) >= 4
        assert np.mean(losses[-2:]) < 0.75 * losses[0], losses
        assert r["test_accuracy"] > 0.3  # chance is 0.1
        assert r["parameters"]["total"] > 0 and r["inference"]["images_per_s"] > 0
        saved = json.loads(open(os.path.join(root, "out", r["attention_type"], "results.json")).read())
        assert saved["test_accuracy"] == r["test_accuracy"]
    gka = results[0]
    assert len(gka["learned_log_sigma"]) == 2 and gka["learned_log_sigma"][0] != pytest.approx(
        [0.5 * math.log(16)] * 2)  # sigma was trained
    assert os.path.exists(os.path.join(root, "out", "summary.md"))


def _png_std(path):
    from PIL import Image

    return float(np.asarray(Image.open(path).convert("L"), dtype=np.float32).std())


@pytest.mark.parametrize("kind", KINDS)
def test_pictures_are_produced_and_not_blank(trained, kind, tmp_path):
    root, data, _ = trained
    model_dir = os.path.join(root, "out", kind, "model")
    out = tmp_path / "pics"
    summary = vit_pictures.main([model_dir, "--image-index", "5", "--data-dir", data, "--output-dir", str(out)])
    cfg = GkaVitConfig.from_pretrained(model_dir)
    L, H = cfg.num_hidden_layers, cfg.num_attention_heads
    expected = {"rollout.png", "kernel_evolution.png"}
    expected |= {f"cls_attention_layer{i:02d}.png" for i in range(1, L + 1)}
    expected |= {f"patch_to_patch_layer{i:02d}.png" for i in range(1, L + 1)}
    expected |= {f"raw_attention/layer{i:02d}_head{h:02d}.png" for i in range(1, L + 1) for h in range(1, H + 1)}
    if kind == "gka":
        expected |= {"sigma_heatmap.png", "sigma_lines.png"}
    assert set(summary["files"]) == expected
    for f in expected:
        assert _png_std(out / f) > 1.0, f
    assert summary["label"] == int(vit_data.read_idx(os.path.join(data, "t10k-labels-idx1-ubyte"))[5])


def test_rollout_and_query_patches():
    n = 5
    eye = [torch.eye(n)[None].repeat(2, 1, 1) for _ in range(3)]
    torch.testing.assert_close(vit_pictures.attention_rollout(eye), torch.eye(n, dtype=torch.float64))
    a = [torch.softmax(torch.randn(2, n, n), -1) for _ in range(3)]
    r = vit_pictures.attention_rollout(a)
    torch.testing.assert_close(r.sum(-1), torch.ones(n, dtype=torch.float64))
    # one layer by hand: 0.5 * mean_h A + 0.5 I is already row-stochastic
    torch.testing.assert_close(vit_pictures.attention_rollout(a[:1]), 0.5 * a[0].double().mean(0) + 0.5 * torch.eye(
        n, dtype=torch.float64))
    r9 = vit_pictures.attention_rollout(a, discard_ratio=0.9)
    torch.testing.assert_close(r9.sum(-1), torch.ones(n, dtype=torch.float64))
    assert vit_pictures.canonical_query_patches(14) == [(3, 3), (7, 7), (10, 10), (3, 10)]
    assert len(vit_pictures.subsample_indices(197)) <= 50 and vit_pictures.subsample_indices(30).tolist() == list(
        range(30))


def test_gzip_helper_is_standard(tmp_path):
    """write_idx's .gz output is a plain gzip stream readable by the standard library."""
    vit_data.write_idx(str(tmp_path / "y.gz"), np.zeros((2, 3), np.uint8))
    with gzip.open(tmp_path / "y.gz") as f:
        assert f.read()[:4] == b"\x00\x00\x08\x02"


def test_model_card_is_filled_from_results_files(trained, tmp_path):
    import vit_fill_model_card

    root, _, results = trained
    out = tmp_path / "card.md"
    vit_fill_model_card.main(["--cpu-results", str(root / "out"), "--output", str(out), "--no-accounting",
                              "--summary", str(tmp_path / "summary.md")])
    text = out.read_text()
    block = text.split("<!-- mnist_cpu:start -->")[1].split("<!-- mnist_cpu:end -->")[0]
    for r in results:
        assert f"{100 * r['test_accuracy']:.2f}" in block
        assert f"{r['parameters']['total'] / 1e6:.3f}" in block
    # blocks without a source stay as they are
    card = (Path(vit_fill_model_card.__file__).parent.parent / "model_cards" / "gka_vit.md").read_text()
    gpu_block = text.split("<!-- mnist_gpu:start -->")[1].split("<!-- mnist_gpu:end -->")[0]
    assert gpu_block == card.split("<!-- mnist_gpu:start -->")[1].split("<!-- mnist_gpu:end -->")[0]
    assert (tmp_path / "summary.md").read_text().strip() == block.strip()
    with pytest.raises(ValueError, match="no <!-- nope:start -->"):
        vit_fill_model_card.replace_block("text", "nope", "x")
