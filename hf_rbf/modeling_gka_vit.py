"""GKA vision transformer: DeiT with Gaussian Kernel Attention (arXiv:2605.02144, section 4), and the DeiT baseline.

One code path for both attention kinds (``config.attention_type``):

* "gka": per head, the LayerNorm'ed residual features ``x`` (no W_Q, W_K, W_V) are smoothed with a Gaussian kernel
  of learnable bandwidth, ``y_i = sum_j K_ij w_j x_j / (sum_j K_ij w_j + eps)``, ``K_ij = exp(-|x_i - x_j|^2 /
  (2 sigma_h^2))``, then ``W_O``.  Bidirectional: every token ([CLS] and patches) sees every token.  Parameters per
  block: ``W_O`` (+ bias) and ``H`` log-bandwidths.
* "dot": DeiT's multi-head attention, ``softmax(q k^T / sqrt(d) + log w) v`` then ``W_O``, through
  ``F.scaled_dot_product_attention``.
* "vlt": the paper's Value-Less Transformer ablation (Table 5): "dot" without W_V (the values are the per-head
  normalised features ``x``).

``w_j`` are optional per-token measures passed as ``key_log_weights`` (see :mod:`hf_rbf.geometry_measure`): for
patches of a non-uniform domain (a sphere, a warped image) each key is weighted by the area it stands for.

With ``output_attentions=True`` each layer computes its attention weights explicitly (a materialised ``[B, H, N, N]``
path with the same formula) and returns them; otherwise the fused/functional path runs and no matrix is kept.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPooling, ImageClassifierOutput
from transformers.utils import logging

from .attention_gka import gka_attention
from .attention_gka_approx import (
    gaussian_orthogonal_projection,
    gka_attention_nystrom,
    gka_attention_random_features,
)
from .configuration_gka_vit import GkaVitConfig


logger = logging.get_logger(__name__)


def gka_attention_probs(
    x: torch.Tensor,
    log_sigma: torch.Tensor,
    eps: float,
    key_log_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """GKA's mixing matrix, materialised: ``W_ij = K_ij w_j / (sum_j' K_ij' w_j' + eps)``, ``[B, H, N, N]`` float32.

    ``x``: features ``[B, H, N, d]``; ``log_sigma``: ``[H]``; ``key_log_weights``: ``[B|1, H|1, N]`` or ``None``.
    Computed as in :func:`hf_rbf.attention_gka.gka_attention_naive` (max-subtracted, ``eps`` rescaled by the
    shift) so that ``W @ x`` equals :func:`gka_attention` to round-off.
    """
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(ct)
    sq = (xf * xf).sum(-1)
    dist_sq = (sq.unsqueeze(-1) + sq.unsqueeze(-2) - 2.0 * (xf @ xf.transpose(-1, -2))).clamp_min(0.0)
    scores = -dist_sq * (0.5 * torch.exp(-2.0 * log_sigma.to(ct))).view(1, -1, 1, 1)
    if key_log_weights is not None:
        scores = scores + key_log_weights.to(ct).unsqueeze(-2)
    row_max = scores.amax(dim=-1, keepdim=True).detach()
    p = torch.exp(scores - row_max)
    denom = p.sum(dim=-1, keepdim=True)
    if eps:
        denom = denom + eps * torch.exp(-row_max)
    return p / denom


def drop_path(x: torch.Tensor, drop_prob: float, training: bool) -> torch.Tensor:
    """Stochastic depth: zero the whole residual branch of a sample with probability ``drop_prob`` (rescaled)."""
    if drop_prob == 0.0 or not training:
        return x
    keep = 1.0 - drop_prob
    mask = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(keep)
    return x * mask / keep


class GkaVitDropPath(nn.Module):
    def __init__(self, drop_prob: float = 0.0):
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return drop_path(x, self.drop_prob, self.training)

    def extra_repr(self) -> str:
        return f"p={self.drop_prob}"


class GkaVitPatchEmbeddings(nn.Module):
    """``[B, C, S, S]`` pixels -> ``[B, (S/p)^2, D]`` patch tokens (row-major patch order)."""

    def __init__(self, config: GkaVitConfig):
        super().__init__()
        self.image_size = config.image_size
        self.num_channels = config.num_channels
        self.projection = nn.Conv2d(
            config.num_channels, config.hidden_size, kernel_size=config.patch_size, stride=config.patch_size
        )

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        if pixel_values.dim() != 4 or pixel_values.shape[1] != self.num_channels:
            raise ValueError(
                f"GkaVit: `pixel_values` must be [batch, {self.num_channels}, {self.image_size}, {self.image_size}]; "
                f"got {tuple(pixel_values.shape)}"
            )
        if pixel_values.shape[-2:] != (self.image_size, self.image_size):
            raise ValueError(
                f"GkaVit: the model takes {self.image_size}x{self.image_size} images; got "
                f"{pixel_values.shape[-2]}x{pixel_values.shape[-1]} (use the image processor to resize)"
            )
        return self.projection(pixel_values).flatten(2).transpose(1, 2)


class GkaVitEmbeddings(nn.Module):
    """Patch embeddings, a learned [CLS] token in front, learned absolute position embeddings, dropout."""

    def __init__(self, config: GkaVitConfig):
        super().__init__()
        self.patch_embeddings = GkaVitPatchEmbeddings(config)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, config.hidden_size))
        self.position_embeddings = nn.Parameter(torch.zeros(1, config.num_patches + 1, config.hidden_size))
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embeddings(pixel_values)
        cls = self.cls_token.expand(patches.shape[0], -1, -1)
        return self.dropout(torch.cat((cls, patches), dim=1) + self.position_embeddings)


class GkaVitGaussianKernelAttention(nn.Module):
    """Projection-free Gaussian kernel attention over the heads of the (already normalised) hidden states."""

    def __init__(self, config: GkaVitConfig, layer_idx: int = 0):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.eps = config.gka_eps
        self.backend = config.gka_backend
        self.log_sigma = nn.Parameter(torch.tensor(config.initial_log_sigma(), dtype=torch.float32))
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.approximation = config.gka_approximation
        self.approximation_size = config.gka_approximation_size
        self.projection_seed = config.gka_approximation_seed * 1000 + layer_idx
        if self.approximation == "random_features":
            # fixed Gaussian rows of the random features, drawn from the seed (not saved; recomputed at init)
            self.register_buffer("feature_projection", self.draw_projection(), persistent=False)
        else:
            self.feature_projection = None

    def draw_projection(self) -> torch.Tensor:
        return gaussian_orthogonal_projection(
            self.approximation_size, self.head_dim, self.num_heads, seed=self.projection_seed
        )

    def _approximate(self, x, key_log_weights):
        if self.approximation == "random_features":
            return gka_attention_random_features(
                x, self.log_sigma, self.feature_projection, causal=False, eps=self.eps, key_log_weights=key_log_weights
            )
        return gka_attention_nystrom(
            x, self.log_sigma, self.approximation_size, eps=self.eps, key_log_weights=key_log_weights
        )

    def forward(self, hidden_states, key_log_weights=None, output_attentions=False):
        b, n, _ = hidden_states.shape
        x = hidden_states.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
        weights = None
        if self.approximation != "exact":
            if output_attentions:
                raise ValueError(
                    f"GkaVit: `output_attentions` is not available with `gka_approximation={self.approximation!r}` "
                    "(the approximation never forms the attention matrix)"
                )
            out = self._approximate(x, key_log_weights)
        elif output_attentions:
            weights = gka_attention_probs(x, self.log_sigma, self.eps, key_log_weights)
            out = (weights @ x.to(weights.dtype)).to(x.dtype)
        else:
            out = gka_attention(
                x, self.log_sigma, causal=False, eps=self.eps, key_log_weights=key_log_weights, backend=self.backend
            )
        out = out.transpose(1, 2).reshape(b, n, -1)
        return self.dropout(self.o_proj(out)), weights


class GkaVitDotProductAttention(nn.Module):
    """DeiT's multi-head attention (the baseline): learned q/k/v, scaled dot product, softmax, W_O."""

    def __init__(self, config: GkaVitConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states, key_log_weights=None, output_attentions=False):
        b, n, _ = hidden_states.shape
        q, k, v = self.qkv(hidden_states).view(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        bias = None if key_log_weights is None else key_log_weights.unsqueeze(-2)  # [B|1, H|1, 1, N]
        weights = None
        if output_attentions:
            scores = (q.float() @ k.float().transpose(-1, -2)) * self.scale
            if bias is not None:
                scores = scores + bias.float()
            weights = scores.softmax(dim=-1)
            out = (weights @ v.float()).to(v.dtype)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=None if bias is None else bias.to(q.dtype))
        out = out.transpose(1, 2).reshape(b, n, -1)
        return self.dropout(self.o_proj(out)), weights


class GkaVitValueLessAttention(nn.Module):
    """The GKA paper's VLT ablation (Table 5): DeiT's attention without W_V, i.e. learned q/k, scaled dot product,
    softmax, and the (already normalised) residual features of each head as the values, then W_O."""

    def __init__(self, config: GkaVitConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        self.qk = nn.Linear(config.hidden_size, 2 * config.hidden_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states, key_log_weights=None, output_attentions=False):
        b, n, _ = hidden_states.shape
        q, k = self.qk(hidden_states).view(b, n, 2, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        v = hidden_states.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
        bias = None if key_log_weights is None else key_log_weights.unsqueeze(-2)  # [B|1, H|1, 1, N]
        weights = None
        if output_attentions:
            scores = (q.float() @ k.float().transpose(-1, -2)) * self.scale
            if bias is not None:
                scores = scores + bias.float()
            weights = scores.softmax(dim=-1)
            out = (weights @ v.float()).to(v.dtype)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=None if bias is None else bias.to(q.dtype))
        out = out.transpose(1, 2).reshape(b, n, -1)
        return self.dropout(self.o_proj(out)), weights


class GkaVitMlp(nn.Module):
    def __init__(self, config: GkaVitConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = ACT2FN[config.hidden_act]
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc2(self.dropout(self.act(self.fc1(hidden_states)))))


ATTENTION_CLASSES = {
    "gka": GkaVitGaussianKernelAttention,
    "vlt": GkaVitValueLessAttention,
    "dot": GkaVitDotProductAttention,
}


class GkaVitLayer(GradientCheckpointingLayer):
    """Pre-norm block: ``x + DropPath(Attn(LN(x)))``, then ``x + DropPath(MLP(LN(x)))`` (paper eqs. 8-10)."""

    def __init__(self, config: GkaVitConfig, drop_path_rate: float = 0.0, layer_idx: int = 0):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        if config.attention_type == "gka":
            self.attention = GkaVitGaussianKernelAttention(config, layer_idx)
        else:
            self.attention = ATTENTION_CLASSES[config.attention_type](config)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = GkaVitMlp(config)
        self.drop_path = GkaVitDropPath(drop_path_rate)

    def forward(self, hidden_states, key_log_weights=None, output_attentions=False):
        attn_out, weights = self.attention(self.norm1(hidden_states), key_log_weights, output_attentions)
        hidden_states = hidden_states + self.drop_path(attn_out)
        hidden_states = hidden_states + self.drop_path(self.mlp(self.norm2(hidden_states)))
        return hidden_states, weights


class GkaVitPreTrainedModel(PreTrainedModel):
    config_class = GkaVitConfig
    base_model_prefix = "vit"
    main_input_name = "pixel_values"
    input_modalities = ("image",)
    supports_gradient_checkpointing = True
    _no_split_modules = ["GkaVitEmbeddings", "GkaVitLayer"]
    _supports_sdpa = True
    # No weight decay (read by hf_rbf.trainer.HfRbfTrainer) on what the GKA paper's DeiT recipe exempts: log sigma, the
    # CLS token and the learned position embeddings (biases and LayerNorms are exempt in Trainer already).
    _no_weight_decay_patterns = (r"log_sigma$", r"cls_token$", r"position_embeddings$")

    def __init__(self, config: GkaVitConfig, *inputs, **kwargs):
        super().__init__(config, *inputs, **kwargs)
        # save_pretrained writes only the saved class's own Auto entry; list the config and both model classes so
        # that a checkpoint of either class loads with AutoConfig, AutoModel and AutoModelForImageClassification.
        module = __name__.rsplit(".", 1)[-1]
        auto_map = dict(getattr(config, "auto_map", None) or {})
        auto_map.setdefault("AutoConfig", "configuration_gka_vit.GkaVitConfig")
        auto_map.setdefault("AutoModel", f"{module}.GkaVitModel")
        auto_map.setdefault("AutoModelForImageClassification", f"{module}.GkaVitForImageClassification")
        config.auto_map = auto_map

    @torch.no_grad()
    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Conv2d)):
            init.trunc_normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            init.ones_(module.weight)
            init.zeros_(module.bias)
        elif isinstance(module, GkaVitEmbeddings):
            init.trunc_normal_(module.cls_token, mean=0.0, std=std)
            init.trunc_normal_(module.position_embeddings, mean=0.0, std=std)
        elif isinstance(module, GkaVitGaussianKernelAttention):
            init.copy_(module.log_sigma, torch.tensor(self.config.initial_log_sigma(), dtype=module.log_sigma.dtype))
            if module.feature_projection is not None:
                init.copy_(module.feature_projection, module.draw_projection().to(module.feature_projection.device))


class GkaVitModel(GkaVitPreTrainedModel):
    """The encoder: embeddings, ``L`` blocks, final LayerNorm; the pooled output is the [CLS] state."""

    def __init__(self, config: GkaVitConfig):
        super().__init__(config)
        self.embeddings = GkaVitEmbeddings(config)
        L = config.num_hidden_layers
        rates = [config.drop_path_rate * i / (L - 1) if L > 1 else 0.0 for i in range(L)]
        self.layers = nn.ModuleList([GkaVitLayer(config, rates[i], layer_idx=i) for i in range(L)])
        self.layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.embeddings.patch_embeddings

    def _prepare_key_log_weights(self, key_log_weights, batch: int, device, dtype):
        """Validate ``key_log_weights`` and give it the [CLS] column: ``[B|1, H|1, N + 1]``."""
        if key_log_weights is None:
            return None
        cfg = self.config
        n_patch, h = cfg.num_patches, cfg.num_attention_heads
        layout = (
            f"[B, N] or [B, H, N] with N = {n_patch} patches (the [CLS] key then gets log-weight 0) or "
            f"N = {n_patch + 1} tokens ([CLS] first); B = {batch} or 1, H = {h} or 1"
        )
        if not isinstance(key_log_weights, torch.Tensor) or not key_log_weights.is_floating_point():
            raise TypeError(f"GkaVit: `key_log_weights` must be a floating-point tensor {layout}")
        klw = key_log_weights.to(device)
        if klw.dim() == 2:
            klw = klw.unsqueeze(1)
        if (
            klw.dim() != 3
            or klw.shape[0] not in (1, batch)
            or klw.shape[1] not in (1, h)
            or klw.shape[2] not in (n_patch, n_patch + 1)
        ):
            raise ValueError(f"GkaVit: `key_log_weights` must be {layout}; got {tuple(key_log_weights.shape)}")
        if klw.shape[2] == n_patch:
            klw = torch.cat((klw.new_zeros(klw.shape[:2] + (1,)), klw), dim=-1)
        return klw.to(dtype)

    def forward(
        self,
        pixel_values: torch.Tensor | None = None,
        key_log_weights: torch.Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ):
        r"""
        Args:
            pixel_values: ``[B, C, S, S]`` images, as made by :class:`GkaVitImageProcessor`.
            key_log_weights: optional per-token log-measures (``log`` of the area each patch stands for), see
                :mod:`hf_rbf.geometry_measure`; ``[B|1, N]`` or ``[B|1, H, N]`` over the ``N`` patches (row-major;
                the [CLS] key gets 0, the log of an average cell when the weights are mean-normalised) or over the
                ``N + 1`` tokens.  Every layer weights its keys by ``w_j``.
            output_attentions: return each layer's ``[B, H, N + 1, N + 1]`` attention weights (materialised).
            output_hidden_states: return the embeddings and every layer's output.
        """
        if pixel_values is None:
            raise ValueError("GkaVit: `pixel_values` is required")
        output_attentions = output_attentions if output_attentions is not None else self.config.output_attentions
        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        )
        return_dict = return_dict if return_dict is not None else getattr(self.config, "return_dict", True)
        weight_dtype = self.embeddings.patch_embeddings.projection.weight.dtype
        if pixel_values.dtype != weight_dtype:
            pixel_values = pixel_values.to(weight_dtype)

        hidden_states = self.embeddings(pixel_values)
        klw = self._prepare_key_log_weights(
            key_log_weights, hidden_states.shape[0], hidden_states.device, torch.float32
        )
        all_hidden = (hidden_states,) if output_hidden_states else None
        all_attn = () if output_attentions else None
        for layer in self.layers:
            hidden_states, weights = layer(hidden_states, klw, output_attentions)
            if output_hidden_states:
                all_hidden = all_hidden + (hidden_states,)
            if output_attentions:
                all_attn = all_attn + (weights,)
        sequence_output = self.layernorm(hidden_states)
        out = BaseModelOutputWithPooling(
            last_hidden_state=sequence_output,
            pooler_output=sequence_output[:, 0],
            hidden_states=all_hidden,
            attentions=all_attn,
        )
        return out if return_dict else out.to_tuple()


class GkaVitForImageClassification(GkaVitPreTrainedModel):
    """:class:`GkaVitModel` with a linear classifier on the final [CLS] state."""

    def __init__(self, config: GkaVitConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.vit = GkaVitModel(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels) if config.num_labels > 0 else nn.Identity()
        self.post_init()

    def forward(
        self,
        pixel_values: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        key_log_weights: torch.Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ):
        r"""
        Args:
            labels: ``[B]`` class indices (cross-entropy; ``config.problem_type`` selects regression or multi-label
                as in transformers' image classifiers).
            pixel_values, key_log_weights, output_attentions, output_hidden_states: see :meth:`GkaVitModel.forward`.
        """
        return_dict = return_dict if return_dict is not None else getattr(self.config, "return_dict", True)
        outputs = self.vit(
            pixel_values,
            key_log_weights=key_log_weights,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            return_dict=True,
        )
        logits = self.classifier(outputs.pooler_output)
        loss = None
        if labels is not None:
            loss = self.loss_function(labels, logits, self.config, **kwargs)
        out = ImageClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )
        return out if return_dict else out.to_tuple()


def attention_parameter_count(model: nn.Module) -> int:
    """Parameters inside the attention modules (W_Q/W_K/W_V/W_O and biases (VLT: no W_V); for GKA W_O, its bias and
    log-sigma)."""
    return sum(
        p.numel()
        for m in model.modules()
        if isinstance(m, (GkaVitGaussianKernelAttention, GkaVitValueLessAttention, GkaVitDotProductAttention))
        for p in m.parameters()
    )


def mlp_parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for m in model.modules() if isinstance(m, GkaVitMlp) for p in m.parameters())


GkaVitConfig.register_for_auto_class()
GkaVitModel.register_for_auto_class("AutoModel")
GkaVitForImageClassification.register_for_auto_class("AutoModelForImageClassification")


__all__ = [
    "GkaVitForImageClassification",
    "GkaVitModel",
    "GkaVitPreTrainedModel",
    "attention_parameter_count",
    "gka_attention_probs",
    "mlp_parameter_count",
]
