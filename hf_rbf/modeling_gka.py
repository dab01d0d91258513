"""Gaussian Kernel Attention decoder (``model_type="gka"``, arXiv:2605.02144): the shared backbone with
:class:`GkaAttention` layers, the paper's nanochat language-model setup (RoPE + per-head RMS norm on the features,
causal masking, optional sliding windows such as ``"SSSL"``), optionally mixed with "dot" layers.

PEFT LoRA target modules: ``o_proj`` (GKA and dot layers), ``q_proj``, ``k_proj``, ``v_proj`` (dot layers only),
``gate_proj``, ``up_proj``, ``down_proj``.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import GenerationMixin
from transformers import initialization as init
from transformers.cache_utils import Cache

from .attention_gka import gka_attention
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

    def _init_own_parameters(self) -> None:
        super()._init_own_parameters()
        init.constant_(self.log_sigma, self.log_sigma_init)

    def features(self, hidden_states: torch.Tensor, position_embeddings) -> torch.Tensor:
        """Text features ``[B, H, N, head_dim]`` from the normalised hidden states ``[B, N, D]``."""
        x = self._split_heads(hidden_states)
        if self.feature_norm:
            x = rms_normalize(x, self.norm_eps)
        if self.use_rope:
            cos, sin = position_embeddings
            x = apply_rotary(x, cos, sin)
        return x

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
    ):
        b = hidden_states.shape[0]
        feats = self.features(hidden_states, position_embeddings)
        keys = feats
        if cache is not None:
            # One copy per token: the features are the keys; the value slot holds a zero-width tensor.
            keys, _ = cache.update(feats, feats.new_empty(*feats.shape[:-1], 0), self.layer_idx)
        am, klw = self._key_arguments(keys.shape[2], attention_mask, key_log_weights)

        register_out = None
        query = None if keys is feats else feats
        if self.num_registers > 0:
            reg = self._split_heads(register_states) + self.register_position.to(register_states.dtype)
            register_out = gka_attention(reg, self.log_sigma, causal=True, eps=self.eps, backend=self.register_backend)
            register_out = self.o_proj(self._merge_heads(register_out))
            keys = torch.cat([reg.expand(b, -1, -1, -1), keys], dim=2)
            query = feats

        out = gka_attention(
            keys,
            self.log_sigma,
            causal=True,
            window=self.window,
            eps=self.eps,
            key_log_weights=klw,
            attention_mask=am,
            num_prefix_keys=self.num_registers,
            query=query,
            **self._text_call_options(self.backend, output_attentions),
        )
        self._note_backend("gka_attention")
        weights = None
        if output_attentions:
            out, weights = out
            weights = self._weights_over_all_text_keys(weights, self.num_registers, cache)
        return self.o_proj(self._merge_heads(out)), register_out, weights


class GkaPreTrainedModel(DecoderPreTrainedModel):
    """Base class of the GKA family: its config class and its layer kinds ("gka", "dot")."""

    config_class = GkaConfig
    attention_classes = {"gka": GkaAttention, "dot": DotAttention}
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


__all__ = ["GkaAttention", "GkaForCausalLM", "GkaModel", "GkaPreTrainedModel"]
