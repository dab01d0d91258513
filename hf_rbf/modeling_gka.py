"""Gaussian Kernel Attention decoder (``model_type="gka"``, arXiv:2605.02144): the shared backbone with
:class:`GkaAttention` layers, the paper's nanochat language-model setup (RoPE + per-head RMS norm on the features,
causal masking, optional sliding windows such as ``"SSSL"``), optionally mixed with "dot" layers and the paper's VLT
ablation ("vlt" layers: W_Q, W_K, W_O, no W_V).

PEFT LoRA target modules: ``o_proj`` (every kind), ``q_proj``, ``k_proj`` (dot and vlt layers), ``v_proj`` (dot layers only),
``gate_proj``, ``up_proj``, ``down_proj``.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import GenerationMixin
from transformers import initialization as init
from transformers.cache_utils import Cache

from .attention_gka import gka_attention
from .attention_utils import tensors_keepable
from .attention_gka_approx import (
    gaussian_orthogonal_projection,
    gka_attention_random_features,
)
from .configuration_gka import GkaConfig
from .modeling_decoder import (
    DecoderAttention,
    DecoderForCausalLM,
    DecoderModel,
    DecoderPreTrainedModel,
    DotAttention,
    apply_rotary,
    rms_normalize,
)


# zero-width value tensors by (shape, dtype, device): they hold no data, so one serves every layer and step (an
# allocation op per layer and decode step otherwise); bounded like `attention_utils.constant_vector`'s constants
_ZERO_WIDTH: dict = {}


def _zero_width(feats: torch.Tensor) -> torch.Tensor:
    """``feats.new_empty(*feats.shape[:-1], 0)``: what a cache stores as GKA's values (its keys are its values)."""
    shape = (*feats.shape[:-1], 0)
    if torch.compiler.is_compiling() or not tensors_keepable(feats.device):
        return feats.new_empty(shape)
    key = (shape, feats.dtype, feats.device, torch.is_inference_mode_enabled())
    t = _ZERO_WIDTH.get(key)
    if t is None:
        if len(_ZERO_WIDTH) >= 64:
            _ZERO_WIDTH.clear()
        t = _ZERO_WIDTH[key] = feats.new_empty(shape)
    return t


class GkaAttention(DecoderAttention):
    """Projection-free Gaussian kernel attention: the parameters are ``o_proj`` (W_O) and ``log_sigma`` ``[H]``.

    Features ``x`` = the pre-norm hidden state split into heads, RMS-normalised per head without a weight
    (``gka_feature_norm``) and RoPE-rotated (``position_embedding_type="rope"``); they are query, key and value at once,
    so the KV cache stores them once (keys = features, values a zero-width tensor).  Register features skip the norm
    and RoPE and get ``register_position`` added instead (zero-init: the origin, equidistant from all normalised text
    features).
    """

    kind = "gka"

    def __init__(self, config: GkaConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        d = config.hidden_size
        self.o_proj = nn.Linear(d, d, bias=config.attention_bias)
        self.log_sigma_init = config.resolved_log_sigma_init
        self.log_sigma = nn.Parameter(torch.full((self.num_heads,), self.log_sigma_init))
        self.feature_norm = config.gka_feature_norm
        self.norm_eps = config.rms_norm_eps
        self.use_rope = config.position_embedding_type == "rope"
        self.eps = config.gka_eps
        self.approximation = config.gka_approximation
        if self.approximation == "random_features":
            # Fixed Gaussian rows of the random features: drawn from the seed, so not saved (recomputed at init).
            self.register_buffer("feature_projection", self._draw_projection(), persistent=False)
        else:
            self.feature_projection = None

    def _draw_projection(self) -> torch.Tensor:
        seed = self.config.gka_approximation_seed * 1000 + self.layer_idx
        return gaussian_orthogonal_projection(
            self.config.gka_approximation_size, self.head_dim, self.num_heads, seed=seed
        )

    def _init_own_parameters(self) -> None:
        super()._init_own_parameters()
        init.constant_(self.log_sigma, self.log_sigma_init)
        if self.feature_projection is not None:
            init.copy_(self.feature_projection, self._draw_projection().to(self.feature_projection.device))

    def output_attentions_error(self, cache) -> str | None:
        if self.approximation != "exact":
            return (
                f"GKA layer {self.layer_idx}: `output_attentions` is not available with "
                f"`gka_approximation={self.approximation!r}` (the approximation never forms the attention matrix); "
                "load the model with gka_approximation='exact' to inspect weights"
            )
        return super().output_attentions_error(cache)

    def _approximate_attention(self, keys, **mask_args) -> torch.Tensor:
        if self.backend not in ("auto", "naive"):
            raise ValueError(
                f"GKA layer {self.layer_idx}: `gka_approximation={self.approximation!r}` runs its own plain-PyTorch "
                f"implementation; the backend {self.backend!r} cannot serve it (set `attention_backend` to 'auto')"
            )
        self.last_backend = self.approximation
        return gka_attention_random_features(keys, self.log_sigma, self.feature_projection, eps=self.eps, **mask_args)

    def features(self, hidden_states: torch.Tensor, position_embeddings) -> torch.Tensor:
        """Text features ``[B, H, N, head_dim]`` (a transposed view) from the normalised hidden states ``[B, N, D]``.

        The norm and RoPE run in the ``[B, N, H, head_dim]`` layout of the hidden states, where memory is contiguous:
        on the head-major view every elementwise kernel took PyTorch's strided path (an H100 profile of the 1B recipe,
        benchmarks/results/h100x4-2026-11-26c: 24 strided elementwise kernels per GKA layer and step against Llama's
        12).  The fused kernels read the transposed view as it is."""
        x = hidden_states.unflatten(-1, (self.num_heads, -1))
        if self.feature_norm:
            x = rms_normalize(x, self.norm_eps)
        if self.use_rope:
            cos, sin = position_embeddings
            x = apply_rotary(x, cos, sin, head_dim=2)
        return x.transpose(1, 2)

    def register_forward(self, register_states: torch.Tensor):
        """The register rows' attention (over the registers, causally): ``(out [1, R, D] after o_proj, prefix)``, with
        ``prefix = (features,)`` ``[1, H, R, head_dim]`` (the register states with their positions: keys and values),
        what the text rows see in front of their keys."""
        reg = self._split_heads(register_states) + self.register_position.to(register_states.dtype)
        register_out = gka_attention(reg, self.log_sigma, causal=True, eps=self.eps, backend=self.register_backend)
        return self.o_proj(self._merge_heads(register_out)), (reg,)

    def forward(
        self,
        hidden_states: torch.Tensor,
        register_states: torch.Tensor | None,
        *,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        cache: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        key_log_weights: torch.Tensor | None = None,
        output_attentions: bool = False,
        register_prefix: tuple | None = None,
    ):
        b = hidden_states.shape[0]
        feats = self.features(hidden_states, position_embeddings)
        keys = feats
        if cache is not None:
            # One copy per token: the features are the keys; the value slot holds a zero-width tensor.
            keys, _ = cache.update(feats, _zero_width(feats), self.layer_idx)
        am, klw = self._key_arguments(keys.shape[2], attention_mask, key_log_weights, cache)

        register_out = reg = None
        query = None if keys is feats else feats
        if self.num_registers > 0:
            if register_prefix is None:
                register_out, register_prefix = self.register_forward(register_states)
            (reg,) = register_prefix

        mask_args = dict(
            causal=True,
            window=self.window,
            key_log_weights=klw,
            attention_mask=am,
            num_prefix_keys=self.num_registers,
            query=query,
        )
        if self.approximation != "exact":
            if reg is not None:
                keys = torch.cat([reg.expand(b, -1, -1, -1), keys], dim=2)
                mask_args["query"] = feats
            return self.o_proj(self._merge_heads(self._approximate_attention(keys, **mask_args))), register_out, None
        # the registers as separate prefix features: the fused kernels read them where they are, so no copy of the
        # text features (or of a cache's every feature, at every decode step) with the registers in front
        out = gka_attention(
            keys,
            self.log_sigma,
            eps=self.eps,
            prefix_features=reg,
            **mask_args,
            **self._text_call_options(self.backend, output_attentions),
        )
        self._note_backend("gka_attention")
        weights = None
        if output_attentions:
            out, weights = out
            weights = self._weights_over_all_text_keys(weights, self.num_registers, cache)
        return self.o_proj(self._merge_heads(out)), register_out, weights


class ValueLessAttention(DotAttention):
    """The GKA paper's VLT ablation (Value-Less Transformer, Table 5): learned W_Q, W_K and W_O with softmax dot-product
    attention (RoPE, ``1 / sqrt(head_dim)``, ``qk_norm`` when set), but no W_V: the values are the pre-norm hidden
    state split into heads, as GKA's.  It sits between the "dot" kind (all four projections) and "gka" (W_O only), so
    one can tell which removed projection costs what.  Attention parameters: ``3 * hidden_size^2`` (+ biases).

    Runs ``dot_attention`` like the "dot" kind (``attention_backend`` "naive" -> "naive", anything else -> "sdpa").
    """

    kind = "vlt"

    def __init__(self, config: GkaConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        del self.v_proj  # the values are the layer's input rows (`projects_values`, see DecoderAttention._project)

    projects_values = False


class GkaPreTrainedModel(DecoderPreTrainedModel):
    """Base class of the GKA family: its config class and its layer kinds ("gka", "vlt", "dot")."""

    config_class = GkaConfig
    attention_classes = {"gka": GkaAttention, "vlt": ValueLessAttention, "dot": DotAttention}
    # PEFT LoRA ``target_modules``: GKA layers have only ``o_proj``; "dot" layers add q/k/v (ignored when absent).
    lora_target_modules = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class GkaModel(GkaPreTrainedModel, DecoderModel):
    """The GKA decoder without the LM head (``AutoModel``)."""


class GkaForCausalLM(GkaPreTrainedModel, DecoderForCausalLM, GenerationMixin):
    """The GKA decoder with its LM head (``AutoModelForCausalLM``)."""

    base_model_class = GkaModel


# Remote code: save_pretrained writes these classes into config.json's auto_map and copies this file and its
# relative imports next to the weights.
GkaConfig.register_for_auto_class()
GkaModel.register_for_auto_class("AutoModel")
GkaForCausalLM.register_for_auto_class("AutoModelForCausalLM")


__all__ = ["GkaAttention", "GkaForCausalLM", "GkaModel", "GkaPreTrainedModel", "ValueLessAttention"]
