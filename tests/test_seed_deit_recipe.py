"""recipes/train_vit.py's DeiT ingredients (timm: EMA, RandAugment, random erasing, Mixup/CutMix, repeated
augmentation), its YAML config and the "vlt" kind.  The timm parts skip, saying why, where timm cannot be imported
(it is the ``deit`` extra, and it needs a torchvision built for the installed torch)."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.contract

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "recipes"))

import train_vit  # noqa: E402
import vit_data  # noqa: E402
import vit_deit  # noqa: E402
from vit_deit import DeitOptions  # noqa: E402

from hf_rbf.image_processing_gka_vit import GkaVitImageProcessor  # noqa: E402


def timm_or_skip():
    try:
        import timm  # noqa: F401
    except Exception as e:  # noqa: BLE001  (ImportError, or a RuntimeError from a CUDA-only torchvision)
        pytest.skip(f"timm is not importable here ({type(e).__name__}: {e}); install hf_rbf[deit]")


def synthetic_mnist(folder, n_train=48, n_test=16, seed=0):
    """IDX files of a 10-class toy problem (class c: a bright bar at a class-specific place)."""
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


def test_deit_options_are_validated_by_name():
    assert not DeitOptions().uses_timm
    with pytest.raises(ValueError, match="`random_erasing` must be a number in"):
        DeitOptions(random_erasing=1.5)
    with pytest.raises(ValueError, match="`ema_decay` must be < 1"):
        DeitOptions(ema_decay=1.0)
    with pytest.raises(ValueError, match="`rand_augment` must be None or a timm RandAugment string"):
        DeitOptions(rand_augment="m9")
    with pytest.raises(ValueError, match="`repeated_augmentation` must be an int >= 0"):
        DeitOptions(repeated_augmentation=2.5)


def test_yaml_config_sets_options_and_the_command_line_wins(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("attention_type: [gka, vlt]\nepochs: 4\nmixup_alpha: 0.8\nrand_augment: rand-m9-mstd0.5\n")
    args = train_vit.parse_args(["--config", str(path), "--data-dir", str(tmp_path), "--epochs", "2"])
    assert args.kinds == ["gka", "vlt"] and args.epochs == 2.0
    assert args.deit.mixup_alpha == 0.8 and args.deit.rand_augment == "rand-m9-mstd0.5" and args.deit.mixes
    shipped = train_vit.parse_args(
        ["--config", os.path.join(REPO, "recipes", "configs", "vit", "mnist_deit.yaml"), "--data-dir", str(tmp_path)]
    )
    assert shipped.kinds == ["gka", "vlt", "dot"]
    assert shipped.deit == DeitOptions(
        ema_decay=0.999,
        rand_augment="rand-m9-mstd0.5-inc1",
        random_erasing=0.25,
        mixup_alpha=0.8,
        cutmix_alpha=1.0,
        repeated_augmentation=3,
    )
    (tmp_path / "bad.yaml").write_text("mixup: 0.8\n")
    with pytest.raises(SystemExit):
        train_vit.parse_args(["--config", str(tmp_path / "bad.yaml"), "--data-dir", str(tmp_path)])
    with pytest.raises(SystemExit):
        train_vit.parse_args(["--data-dir", str(tmp_path), "--attention-type", "gka,vtl"])


def test_each_deit_transform_does_its_part(tmp_path):
    timm_or_skip()
    import random

    random.seed(0)
    torch.manual_seed(0)
    ds = vit_data.load_mnist(synthetic_mnist(str(tmp_path / "mnist")), "train", cache_dir=str(tmp_path / "cache"))
    examples = [ds[i] for i in range(8)]
    processor = GkaVitImageProcessor()
    plain = vit_data.MnistCollator(processor)(examples)
    options = DeitOptions(rand_augment="rand-m9-mstd0.5-inc1", random_erasing=1.0, mixup_alpha=0.8, cutmix_alpha=1.0)
    ra = vit_data.MnistCollator(processor, image_transform=vit_deit.rand_augment(options.rand_augment, 28))(examples)
    assert not torch.equal(ra["pixel_values"], plain["pixel_values"]) and torch.equal(ra["labels"], plain["labels"])
    erased = vit_deit.random_erasing(1.0)(plain["pixel_values"].clone())
    changed = (erased != plain["pixel_values"]).flatten(1).any(-1)
    assert changed.all()  # probability 1: every image has an erased box
    mixed = vit_data.MnistCollator(processor, batch_transform=vit_deit.MixupBatch(options, 10, 0.1))(examples)
    assert mixed["labels"].shape == (8, 10) and torch.allclose(mixed["labels"].sum(-1), torch.ones(8))
    assert mixed["labels"].max() < 1.0  # smoothed and mixed: no one-hot row
    odd = vit_data.MnistCollator(processor, batch_transform=vit_deit.MixupBatch(options, 10, 0.1))(examples[:7])
    assert odd["labels"].shape == (7, 10) and odd["labels"][-1].argmax() == plain["labels"][6]
    assert odd["labels"][-1].max() == pytest.approx(0.9 + 0.1 / 10)
    logits = torch.randn(8, 10)
    expected = -(mixed["labels"] * logits.log_softmax(-1)).sum(-1).mean()
    torch.testing.assert_close(vit_deit.soft_target_loss({"logits": logits}, mixed["labels"]), expected)
    torch.testing.assert_close(
        vit_deit.soft_target_loss({"logits": logits}, plain["labels"]),
        torch.nn.functional.cross_entropy(logits, plain["labels"]),
    )
    sampler = vit_deit.repeat_aug_sampler(list(range(12)), 3, seed=0)
    order = list(iter(sampler))
    assert len(order) == 12 and all(order.count(i) in (0, 3) for i in range(12)) and len(set(order)) == 4


def test_a_tiny_training_run_with_every_deit_option_on(tmp_path):
    """Every ingredient at once through the recipe: the run trains, the EMA is updated at every optimizer step and
    evaluated and saved, the repeated-augmentation epochs have the dataset's length (48 samples / batch 8 = 6 steps
    per epoch)."""
    timm_or_skip()
    data = synthetic_mnist(str(tmp_path / "mnist"))
    threads = torch.get_num_threads()
    try:
        results = train_vit.main([
            "--data-dir", data, "--output-dir", str(tmp_path / "out"), "--preset", "mnist-tiny", "--epochs", "2",
            "--batch-size", "8", "--drop-path", "0.0", "--max-shift", "0", "--throughput-batch-size", "8",
            "--logging-steps", "2", "--cpu", "--attention-type", "vlt", "--cache-dir", str(tmp_path / "cache"),
            "--threads", "1", "--label-smoothing", "0.1", "--ema-decay", "0.9", "--rand-augment",
            "rand-m9-mstd0.5-inc1", "--random-erasing", "0.25", "--mixup-alpha", "0.8", "--cutmix-alpha", "1.0",
            "--repeated-augmentation", "3",
        ])  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    (r,) = results
    assert r["attention_type"] == "vlt" and r["optimizer_steps"] == 12
    assert r["ema_updates"] == 12 and r["deit"]["repeated_augmentation"] == 3
    assert 0.0 <= r["ema_test_accuracy"] <= 1.0 and 0.0 <= r["test_accuracy"] <= 1.0
    losses = [h["loss"] for h in r["log_history"] if "loss" in h]
    assert losses and all(np.isfinite(losses))
    from hf_rbf.modeling_gka_vit import GkaVitForImageClassification

    raw = GkaVitForImageClassification.from_pretrained(os.path.join(tmp_path, "out", "vlt", "model"))
    ema = GkaVitForImageClassification.from_pretrained(os.path.join(tmp_path, "out", "vlt", "model_ema"))
    assert any(not torch.equal(a, b) for a, b in zip(raw.state_dict().values(), ema.state_dict().values()))
    saved = json.loads((tmp_path / "out" / "vlt" / "results.json").read_text())
    assert saved["ema_test_accuracy"] == r["ema_test_accuracy"]
