"""Configuration of the GKA vision transformer: a DeiT-style ViT with Gaussian Kernel Attention or dot products."""

from __future__ import annotations

import math

from transformers import PretrainedConfig


# Sizes of the GKA paper (arXiv:2605.02144, Tables 2 and 3: DeiT-Ti/S/B on ImageNet-1K at 224 x 224, patch 16) and
# two small sizes for MNIST (28 x 28 grayscale).  Any field can be overridden in `GkaVitConfig.from_preset`.
PRESETS: dict[str, dict] = {
    "tiny": dict(image_size=224, patch_size=16, num_channels=3, hidden_size=192, num_hidden_layers=12,
                 num_attention_heads=3, intermediate_size=768, num_labels=1000, drop_path_rate=0.1),
    "small": dict(image_size=224, patch_size=16, num_channels=3, hidden_size=384, num_hidden_layers=12,
                  num_attention_heads=6, intermediate_size=1536, num_labels=1000, drop_path_rate=0.1),
    "base": dict(image_size=224, patch_size=16, num_channels=3, hidden_size=768, num_hidden_layers=12,
                 num_attention_heads=12, intermediate_size=3072, num_labels=1000, drop_path_rate=0.2),
    # 7 x 7 = 49 patches of 4 x 4 pixels + CLS; head dim 64 as in DeiT-Ti.
    "mnist": dict(image_size=28, patch_size=4, num_channels=1, hidden_size=192, num_hidden_layers=6,
                  num_attention_heads=3, intermediate_size=768, num_labels=10, drop_path_rate=0.1),
    # for tests and CPU smoke runs
    "mnist-tiny": dict(image_size=28, patch_size=7, num_channels=1, hidden_size=32, num_hidden_layers=2,
                       num_attention_heads=2, intermediate_size=64, num_labels=10, drop_path_rate=0.0),
}

ATTENTION_TYPES = ("gka", "vlt", "dot")
GKA_APPROXIMATIONS = ("exact", "random_features", "nystrom")


class GkaVitConfig(PretrainedConfig):
    r"""Configuration of :class:`GkaVitModel` / :class:`GkaVitForImageClassification`.

    Architecture (DeiT): a patch embedding (a ``patch_size`` convolution), a learned [CLS] token, learned absolute
    position embeddings, ``num_hidden_layers`` pre-norm blocks ``x + DropPath(Attn(LN(x)))``,
    ``x + DropPath(MLP(LN(x)))``, a final LayerNorm and a linear classifier on the [CLS] state.

    Args:
        image_size, patch_size: square input side and patch side in pixels (``image_size % patch_size == 0``).
        num_channels: input channels (1 for MNIST, 3 for RGB).
        hidden_size, num_hidden_layers, num_attention_heads: width ``D``, depth ``L`` and heads ``H``
            (``D % H == 0``; head dim ``d = D / H``).
        intermediate_size: MLP hidden width; default ``4 * hidden_size``.
        hidden_act: MLP activation (a key of ``transformers.activations.ACT2FN``).
        layer_norm_eps: LayerNorm epsilon (1e-6 as in DeiT / timm).
        hidden_dropout_prob: dropout after the embeddings, inside the MLP and after the attention projection.
        drop_path_rate: stochastic depth; block ``i`` drops its residual branches with probability
            ``drop_path_rate * i / (L - 1)`` (linear rule of DeiT).
        attention_type: "gka" (Gaussian Kernel Attention, no W_Q/W_K/W_V: per-head kernel smoothing of the
            normalised residual features with a learnable bandwidth, then W_O), "dot" (the DeiT baseline:
            learned q/k/v, scaled dot-product softmax, W_O) or "vlt" (the paper's Table 5 ablation, Value-Less
            Transformer: learned q/k, scaled dot-product softmax over the normalised residual features as values,
            W_O; no W_V).
        gka_log_sigma_init: initial per-head ``log sigma`` for "gka": a float for every head, a list of ``H``
            floats, or None for ``0.5 * log(head_dim)`` (``sigma^2 = d``: the kernel
            ``exp(-|x_i - x_j|^2 / (2 d))`` of unit-variance features is then neither the identity nor uniform).
        gka_eps: the epsilon of GKA's denominator (paper eq. 4).
        gka_backend: backend of :func:`hf_rbf.gka_attention` ("auto", "naive", "sdpa", "flex", "triton").
        gka_approximation: how "gka" layers compute the kernel: "exact" (every pair, on ``gka_backend``),
            "random_features" (positive random features, linear in the token count) or "nystrom" (segment-mean
            landmarks): the paper's speed-up directions, see :mod:`hf_rbf.attention_gka_approx`.  The approximations
            are plain PyTorch: ``gka_backend`` must then be "auto" or "naive"; ``output_attentions`` is refused.
        gka_approximation_size: the number of random features, or of Nystrom landmarks (capped at the token count).
        gka_approximation_seed: seed of the random features (layer ``i`` uses ``seed * 1000 + i``).
        qkv_bias: bias of the q/k/v projection of "dot" (q/k of "vlt").
        initializer_range: std of the truncated-normal init of linear/conv weights, [CLS] and positions.
    """

    model_type = "gka_vit"

    def __init__(
        self,
        image_size: int = 28,
        patch_size: int = 4,
        num_channels: int = 1,
        hidden_size: int = 192,
        num_hidden_layers: int = 6,
        num_attention_heads: int = 3,
        intermediate_size: int | None = None,
        hidden_act: str = "gelu",
        layer_norm_eps: float = 1e-6,
        hidden_dropout_prob: float = 0.0,
        drop_path_rate: float = 0.1,
        attention_type: str = "gka",
        gka_log_sigma_init=None,
        gka_eps: float = 1e-6,
        gka_backend: str = "auto",
        gka_approximation: str = "exact",
        gka_approximation_size: int = 256,
        gka_approximation_seed: int = 0,
        qkv_bias: bool = True,
        initializer_range: float = 0.02,
        **kwargs,
    ):
        if attention_type not in ATTENTION_TYPES:
            raise ValueError(f"GkaVitConfig: `attention_type` must be one of {ATTENTION_TYPES}; got {attention_type!r}")
        for name, value in (("image_size", image_size), ("patch_size", patch_size), ("num_channels", num_channels),
                            ("hidden_size", hidden_size), ("num_hidden_layers", num_hidden_layers),
                            ("num_attention_heads", num_attention_heads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GkaVitConfig: `{name}` must be a positive int; got {value!r}")
        if image_size % patch_size:
            raise ValueError(
                f"GkaVitConfig: `image_size` ({image_size}) must be a multiple of `patch_size` ({patch_size})"
            )
        if hidden_size % num_attention_heads:
            raise ValueError(
                f"GkaVitConfig: `hidden_size` ({hidden_size}) must be a multiple of `num_attention_heads` "
                f"({num_attention_heads})"
            )
        if not 0.0 <= float(drop_path_rate) < 1.0:
            raise ValueError(f"GkaVitConfig: `drop_path_rate` must be in [0, 1); got {drop_path_rate!r}")
        if gka_log_sigma_init is not None:
            if isinstance(gka_log_sigma_init, (list, tuple)):
                if len(gka_log_sigma_init) != num_attention_heads:
                    raise ValueError(
                        f"GkaVitConfig: a list `gka_log_sigma_init` needs one value per head ({num_attention_heads}); "
                        f"got {len(gka_log_sigma_init)}"
                    )
                gka_log_sigma_init = [float(v) for v in gka_log_sigma_init]
            elif isinstance(gka_log_sigma_init, bool) or not isinstance(gka_log_sigma_init, (int, float)):
                raise ValueError(
                    f"GkaVitConfig: `gka_log_sigma_init` must be None, a float or a list of {num_attention_heads} "
                    f"floats; got {gka_log_sigma_init!r}"
                )
            else:
                gka_log_sigma_init = float(gka_log_sigma_init)
        if isinstance(gka_eps, bool) or not isinstance(gka_eps, (int, float)) or gka_eps < 0:
            raise ValueError(f"GkaVitConfig: `gka_eps` must be a float >= 0; got {gka_eps!r}")
        if gka_approximation not in GKA_APPROXIMATIONS:
            raise ValueError(
                f"GkaVitConfig: `gka_approximation` must be one of {GKA_APPROXIMATIONS}; got {gka_approximation!r}"
            )
        for name, value in (("gka_approximation_size", gka_approximation_size),
                            ("gka_approximation_seed", gka_approximation_seed)):
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name.endswith("size") else 0):
                raise ValueError(f"GkaVitConfig: `{name}` must be an int >= {1 if name.endswith('size') else 0}; "
                                 f"got {value!r}")
        if gka_approximation != "exact" and gka_backend not in ("auto", "naive"):
            raise ValueError(
                f"GkaVitConfig: `gka_approximation={gka_approximation!r}` has one plain-PyTorch implementation; "
                f"`gka_backend` must be 'auto' or 'naive'; got {gka_backend!r}"
            )
        self.image_size = image_size
        self.patch_size = patch_size
        self.num_channels = num_channels
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = 4 * hidden_size if intermediate_size is None else intermediate_size
        self.hidden_act = hidden_act
        self.layer_norm_eps = layer_norm_eps
        self.hidden_dropout_prob = hidden_dropout_prob
        self.drop_path_rate = float(drop_path_rate)
        self.attention_type = attention_type
        self.gka_log_sigma_init = gka_log_sigma_init
        self.gka_eps = float(gka_eps)
        self.gka_backend = gka_backend
        self.gka_approximation = gka_approximation
        self.gka_approximation_size = gka_approximation_size
        self.gka_approximation_seed = gka_approximation_seed
        self.qkv_bias = qkv_bias
        self.initializer_range = initializer_range
        super().__init__(**kwargs)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def grid_size(self) -> int:
        """Patches per side."""
        return self.image_size // self.patch_size

    def initial_log_sigma(self) -> list[float]:
        """The per-head initial ``log sigma`` (see ``gka_log_sigma_init``)."""
        init = self.gka_log_sigma_init
        if init is None:
            return [0.5 * math.log(self.head_dim)] * self.num_attention_heads
        if isinstance(init, list):
            return list(init)
        return [float(init)] * self.num_attention_heads

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "GkaVitConfig":
        """A config of a named size: "tiny", "small", "base" (the paper's ImageNet sizes), "mnist", "mnist-tiny"."""
        if name not in PRESETS:
            raise ValueError(f"GkaVitConfig.from_preset: unknown preset {name!r}; choose from {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})


__all__ = ["GkaVitConfig", "PRESETS"]
