"""The GKA paper's section 7 pictures for one image, from one forward pass of a trained model.

    PYTHONPATH=$PWD python recipes/vit_pictures.py MODEL_DIR --image-index 0 \\
        --data-dir /work/shared/data/images/mnist --output-dir outputs/vit_pictures

Writes into ``--output-dir`` (all PNG):

* ``sigma_heatmap.png``: learned bandwidth sigma (heads x layers, YlOrRd) and ``sigma_lines.png``: per-head sigma
  against depth (section 7.3; GKA models only: a dot-product model has no sigma).
* ``cls_attention_layerXX.png``: per layer, every head's [CLS] -> patch attention, bilinearly upscaled and overlaid
  on the input (alpha 0.6, inferno; section 7.4).
* ``rollout.png``: attention rollout (Abnar & Zuidema) of the [CLS] row with discard ratios 0, 0.5 and 0.9
  (section 7.2: head mean, ``0.5 A + 0.5 I``, row-normalised, multiplied over the layers).
* ``patch_to_patch_layerXX.png``: head-averaged attention of the four canonical query patches (P/4, P/4),
  (P/2, P/2), (3P/4, 3P/4), (P/4, 3P/4), raw P x P and overlaid, query patch boxed (section 7.5).
* ``kernel_evolution.png``: one row per layer: head-averaged full matrix, [CLS] map, [CLS] overlay (section 7.6).
* ``raw_attention/layerXX_headYY.png``: each layer-head matrix with the diagonal masked (set to zero before the
  colour map), subsampled uniformly to at most 50 tokens (section 7.7).
* ``pictures.json``: the image index, label, prediction, sigma table and the list of files.

The model is loaded with ``AutoModelForImageClassification`` (hf_rbf registers it; ``--trust-remote-code`` loads
the checkpoint's own code instead), the attention weights come from ``output_attentions=True``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import matplotlib  # noqa: E402


matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402
from vit_data import read_idx, split_files  # noqa: E402


# ----------------------------------------------------------------------------------------------------------------
# the quantities (pure functions of the attention tensors; tested separately)
# ----------------------------------------------------------------------------------------------------------------


def attention_rollout(attentions: list[torch.Tensor], discard_ratio: float = 0.0) -> torch.Tensor:
    """Rollout ``R = prod_l normalize(0.5 * A_l + 0.5 I)`` of head-averaged maps ``[N, N]`` (one image).

    With ``discard_ratio > 0`` the lowest ``discard_ratio`` fraction of each layer's head-averaged entries is set to
    zero first (the [CLS] -> [CLS] entry is always kept), as in Abnar & Zuidema's reference implementation.
    """
    n = attentions[0].shape[-1]
    eye = torch.eye(n, dtype=torch.float64)
    result = eye.clone()
    for a in attentions:
        a = a.double().mean(0) if a.dim() == 3 else a.double()
        if discard_ratio > 0:
            flat = a.flatten().clone()
            k = int(flat.numel() * discard_ratio)
            if k > 0:
                idx = flat.topk(k, largest=False).indices
                idx = idx[idx != 0]
                flat[idx] = 0
            a = flat.view(n, n)
        a = 0.5 * a + 0.5 * eye
        a = a / a.sum(-1, keepdim=True)
        result = a @ result
    return result


def canonical_query_patches(p: int) -> list[tuple[int, int]]:
    """(row, col) of the four query patches of section 7.5 on a ``p x p`` grid."""
    return [(p // 4, p // 4), (p // 2, p // 2), ((3 * p) // 4, (3 * p) // 4), (p // 4, (3 * p) // 4)]


def subsample_indices(n: int, max_tokens: int = 50) -> np.ndarray:
    """Uniformly spaced token indices (at most ``max_tokens``) for displaying a large matrix."""
    if n <= max_tokens:
        return np.arange(n)
    return np.unique(np.linspace(0, n - 1, max_tokens).round().astype(int))


def upscale(m: np.ndarray, size: int) -> np.ndarray:
    """Bilinear upscaling of a ``p x p`` map to ``size x size``."""
    t = torch.as_tensor(m, dtype=torch.float32)[None, None]
    return F.interpolate(t, size=(size, size), mode="bilinear", align_corners=False)[0, 0].numpy()


# ----------------------------------------------------------------------------------------------------------------
# plotting helpers
# ----------------------------------------------------------------------------------------------------------------


def _show_image(ax, image: np.ndarray):
    ax.imshow(image, cmap="gray", interpolation="nearest")
    ax.set_xticks([])
    ax.set_yticks([])


def _overlay(ax, image: np.ndarray, patch_map: np.ndarray, title: str | None = None):
    _show_image(ax, image)
    up = upscale(patch_map, image.shape[0])
    ax.imshow(up, cmap="inferno", alpha=0.6, interpolation="nearest")
    if title:
        ax.set_title(title, fontsize=8)


def _save(fig, path: str, files: list[str]):
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    files.append(path)


# ----------------------------------------------------------------------------------------------------------------


def load_image(data_dir: str, split: str, index: int) -> tuple[np.ndarray, int]:
    images_path, labels_path = split_files(data_dir, split)
    images, labels = read_idx(images_path), read_idx(labels_path)
    if not 0 <= index < images.shape[0]:
        raise ValueError(f"--image-index must be in [0, {images.shape[0]}); got {index}")
    return images[index], int(labels[index])


def make_pictures(model, processor, image: np.ndarray, label: int | None, out_dir: str, image_index=None) -> dict:
    """Every section-7 figure for ``image`` (a uint8 ``[H, W]`` or ``[H, W, C]`` array) into ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    os.makedirs(os.path.join(out_dir, "raw_attention"), exist_ok=True)
    cfg = model.config
    p = cfg.grid_size
    model.eval()
    pixel_values = processor(image, return_tensors="pt")["pixel_values"].to(model.device)
    with torch.no_grad():
        out = model(pixel_values=pixel_values, output_attentions=True)
    attentions = [a[0].float().cpu() for a in out.attentions]  # L x [H, N, N]
    num_layers, num_heads = len(attentions), attentions[0].shape[0]
    probs = out.logits.softmax(-1)[0].cpu()
    disp = image if image.ndim == 2 else image.mean(-1)
    disp = upscale(disp.astype(np.float32), cfg.image_size) if disp.shape[0] != cfg.image_size else disp
    files: list[str] = []

    # 7.3 learned bandwidth
    sigma = None
    if cfg.attention_type == "gka":
        sigma = np.array([layer.attention.log_sigma.detach().float().exp().cpu().numpy() for layer in model.vit.layers])
        fig, ax = plt.subplots(figsize=(1.0 + 0.6 * num_layers, 1.0 + 0.5 * num_heads))
        im = ax.imshow(sigma.T, cmap="YlOrRd", aspect="auto")
        for (layer, head), v in np.ndenumerate(sigma):
            ax.text(layer, head, f"{v:.2f}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(num_layers), [str(i + 1) for i in range(num_layers)])
        ax.set_yticks(range(num_heads), [str(h + 1) for h in range(num_heads)])
        ax.set_xlabel("layer")
        ax.set_ylabel("head")
        ax.set_title("learned sigma (heads x layers)")
        fig.colorbar(im, ax=ax)
        _save(fig, os.path.join(out_dir, "sigma_heatmap.png"), files)
        fig, ax = plt.subplots(figsize=(5, 3.2))
        for h in range(num_heads):
            ax.plot(range(1, num_layers + 1), sigma[:, h], "o-", label=f"head {h + 1}")
        ax.set_xlabel("layer")
        ax.set_ylabel("sigma")
        ax.set_title("learned sigma per head across depth")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        _save(fig, os.path.join(out_dir, "sigma_lines.png"), files)

    # 7.4 per-head CLS attention maps, one figure per layer
    for li, a in enumerate(attentions):
        fig, axes = plt.subplots(1, num_heads + 1, figsize=(2.0 * (num_heads + 1), 2.3))
        _show_image(axes[0], disp)
        axes[0].set_title("input", fontsize=8)
        for h in range(num_heads):
            cls_map = a[h, 0, 1:].reshape(p, p).numpy()
            sig = f", sigma {sigma[li, h]:.2f}" if sigma is not None else ""
            _overlay(axes[h + 1], disp, cls_map, f"head {h + 1}{sig}")
        fig.suptitle(f"layer {li + 1}: [CLS] -> patch attention", fontsize=9)
        _save(fig, os.path.join(out_dir, f"cls_attention_layer{li + 1:02d}.png"), files)

    # 7.2 rollout
    ratios = (0.0, 0.5, 0.9)
    fig, axes = plt.subplots(1, len(ratios) + 1, figsize=(2.4 * (len(ratios) + 1), 2.6))
    _show_image(axes[0], disp)
    axes[0].set_title("input", fontsize=8)
    rollouts = {}
    for ax, r in zip(axes[1:], ratios):
        roll = attention_rollout(attentions, r)[0, 1:].reshape(p, p).numpy()
        top = roll.max()
        # a high discard ratio can remove every path from [CLS] to the patches: show the empty map as such
        roll = roll / top if top > 0 else roll
        rollouts[r] = roll
        _overlay(ax, disp, roll, f"rollout, discard {r:g}" + ("" if top > 0 else " (no path left)"))
    _save(fig, os.path.join(out_dir, "rollout.png"), files)

    # 7.5 patch-to-patch, one figure per layer
    queries = canonical_query_patches(p)
    for li, a in enumerate(attentions):
        mean = a.mean(0)
        fig, axes = plt.subplots(2, len(queries), figsize=(2.3 * len(queries), 4.6))
        for qi, (r, c) in enumerate(queries):
            token = 1 + r * p + c
            m = mean[token, 1:].reshape(p, p).numpy()
            axes[0, qi].imshow(m, cmap="inferno", interpolation="nearest")
            axes[0, qi].add_patch(Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, edgecolor="cyan", linewidth=2))
            axes[0, qi].set_title(f"query patch ({r}, {c})", fontsize=8)
            axes[0, qi].set_xticks([])
            axes[0, qi].set_yticks([])
            _overlay(axes[1, qi], disp, m)
            s = disp.shape[0] / p
            box = Rectangle((c * s - 0.5, r * s - 0.5), s, s, fill=False, edgecolor="cyan", linewidth=2)
            axes[1, qi].add_patch(box)
        fig.suptitle(f"layer {li + 1}: head-averaged patch-to-patch attention", fontsize=9)
        _save(fig, os.path.join(out_dir, f"patch_to_patch_layer{li + 1:02d}.png"), files)

    # 7.6 layer-wise kernel evolution
    fig, axes = plt.subplots(num_layers, 3, figsize=(7.5, 2.4 * num_layers), squeeze=False)
    for li, a in enumerate(attentions):
        mean = a.mean(0)
        axes[li, 0].imshow(mean.numpy(), cmap="viridis", interpolation="nearest")
        axes[li, 0].set_ylabel(f"layer {li + 1}", fontsize=8)
        cls_map = mean[0, 1:].reshape(p, p).numpy()
        axes[li, 1].imshow(cls_map, cmap="inferno", interpolation="nearest")
        _overlay(axes[li, 2], disp, cls_map)
        for ax in axes[li, :2]:
            ax.set_xticks([])
            ax.set_yticks([])
    axes[0, 0].set_title("head-mean attention", fontsize=8)
    axes[0, 1].set_title("[CLS] -> patches", fontsize=8)
    axes[0, 2].set_title("[CLS] overlay", fontsize=8)
    _save(fig, os.path.join(out_dir, "kernel_evolution.png"), files)

    # 7.7 raw matrices, diagonal masked
    idx = subsample_indices(attentions[0].shape[-1], 50)
    for li, a in enumerate(attentions):
        for h in range(num_heads):
            m = a[h].numpy()[np.ix_(idx, idx)].copy()
            np.fill_diagonal(m, 0.0)
            fig, ax = plt.subplots(figsize=(3.6, 3.2))
            im = ax.imshow(m, cmap="viridis", interpolation="nearest")
            ax.set_title(f"layer {li + 1} head {h + 1} (diagonal masked)", fontsize=8)
            fig.colorbar(im, ax=ax, fraction=0.046)
            _save(fig, os.path.join(out_dir, "raw_attention", f"layer{li + 1:02d}_head{h + 1:02d}.png"), files)

    summary = {
        "image_index": image_index,
        "label": label,
        "prediction": int(probs.argmax()),
        "probabilities": [round(float(v), 5) for v in probs],
        "attention_type": cfg.attention_type,
        "sigma": None if sigma is None else sigma.tolist(),
        "files": [os.path.relpath(f, out_dir) for f in files],
    }
    with open(os.path.join(out_dir, "pictures.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary


def load_model(model_dir: str, trust_remote_code: bool = False):
    from transformers import AutoModelForImageClassification

    if not trust_remote_code:
        import hf_rbf  # noqa: F401  (registers the GKA ViT with the Auto classes)
        from hf_rbf.image_processing_gka_vit import GkaVitImageProcessor

        processor = GkaVitImageProcessor.from_pretrained(model_dir)
    else:
        from transformers import AutoImageProcessor
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        try:
            processor = AutoImageProcessor.from_pretrained(model_dir, trust_remote_code=True)
        except ImportError:  # transformers 5.17 without torchvision: AutoImageProcessor is unusable, the class is not
            cls = get_class_from_dynamic_module("image_processing_gka_vit.GkaVitImageProcessor", model_dir)
            processor = cls.from_pretrained(model_dir)
    model = AutoModelForImageClassification.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    return model, processor


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model_dir", help="a saved GkaVitForImageClassification (with its preprocessor_config.json)")
    ap.add_argument("--image-index", type=int, default=0)
    ap.add_argument("--data-dir", default=os.environ.get("MNIST_DIR"), help="folder with the MNIST IDX files")
    ap.add_argument("--split", default="test", choices=["train", "test"])
    ap.add_argument("--output-dir", default="outputs/vit_pictures")
    ap.add_argument("--trust-remote-code", action="store_true")
    args = ap.parse_args(argv)
    if args.data_dir is None:
        ap.error("--data-dir (or $MNIST_DIR) is required")
    model, processor = load_model(args.model_dir, args.trust_remote_code)
    image, label = load_image(args.data_dir, args.split, args.image_index)
    summary = make_pictures(model, processor, image, label, args.output_dir, args.image_index)
    print(f"label {label}, prediction {summary['prediction']}; wrote {len(summary['files'])} PNGs to {args.output_dir}")
    return summary


if __name__ == "__main__":
    main()
