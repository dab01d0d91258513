"""RBF-attention decoder (``model_type="rbf"``): the shared backbone with :class:`RbfAttention` layers.

``softmax_j(-gamma * ||q_i - k_j||^2 + log w_j)`` over learned projections, SuSiE / RoPE / no positions, register
tokens as the "origin sink" (the RBF blog).  Layers of kind "dot" (:class:`~hf_rbf.modeling_decoder.DotAttention`)
can be mixed in through ``config.attention_layers``.

PEFT LoRA target modules: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import GenerationMixin
from transformers import initialization as init
from transformers.cache_utils import Cache

from .attention_rbf import rbf_attention
from .configuration_rbf import RbfConfig
from .modeling_decoder import (
    DecoderAttention,
    DecoderForCausalLM,
    DecoderModel,
    DecoderPreTrainedModel,
    DotAttention,
    apply_rotary_pair,
    project_together,
    susie_embedding,
)


class RbfAttention(DecoderAttention):
    """Scaled RBF attention with learned W_Q, W_K, W_V, W_O (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``).

    Positions (``config.position_embedding_type``): "susie" adds ``susie_weight``-scaled sinusoids to q and k,
    "rope" rotates them, "none" leaves them.  Register rows get ``register_position`` added instead.  ``gamma`` is
    ``config.rbf_gamma`` (default ``1 / sqrt(head_dim)``), or ``exp(log_gamma)`` per head when learnable.
    """

    kind = "rbf"

    def __init__(self, config: RbfConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        d, hd = config.hidden_size, self.num_heads * self.head_dim
        self.q_proj = nn.Linear(d, hd, bias=config.attention_bias)
        self.k_proj = nn.Linear(d, hd, bias=config.attention_bias)
        self.v_proj = nn.Linear(d, hd, bias=config.attention_bias)
        self.o_proj = nn.Linear(hd, d, bias=config.attention_bias)
        self.position_embedding_type = config.position_embedding_type
        self.normalize = config.rbf_normalize
        self.gamma_init = config.rbf_gamma if config.rbf_gamma is not None else 1.0 / math.sqrt(self.head_dim)
        if config.rbf_learnable_gamma:
            self.log_gamma = nn.Parameter(torch.full((self.num_heads,), math.log(self.gamma_init)))
        else:
            self.log_gamma = None
        if self.position_embedding_type == "susie":
            self.susie_weight = nn.Parameter(torch.full((self.num_heads, self.head_dim // 2), config.susie_init))
        else:
            self.susie_weight = None

    def _init_own_parameters(self) -> None:
        super()._init_own_parameters()
        if self.log_gamma is not None:
            init.constant_(self.log_gamma, math.log(self.gamma_init))
        if self.susie_weight is not None:
            init.constant_(self.susie_weight, self.config.susie_init)

    def _project(self, x: torch.Tensor):
        projections = (self.q_proj, self.k_proj, self.v_proj)
        return tuple(self._split_heads(t) for t in project_together(x, projections, keep_copy=True))

    def _gamma(self):
        return self.gamma_init if self.log_gamma is None else self.log_gamma.exp()

    takes_rows = True

    def register_forward(self, register_states: torch.Tensor):
        """The register rows' attention (over the registers, causally): ``(out [1, R, D] after o_proj, prefix)``, with
        ``prefix = (keys, values)`` ``[1, H, R, head_dim]``, what the text rows see in front of their keys."""
        qr, kr, vr = self._project(register_states)
        register_out, kr, vr = self._register_attention(qr, kr, vr)
        return self.o_proj(self._merge_heads(register_out)), (kr, vr)

    def _register_attention(self, qr, kr, vr):
        """``(out [1, H, R, Dv], keys, values)`` of the register rows' projections: their positions added, then their
        attention over the registers (causal)."""
        qr, kr = qr + self.register_position.to(qr.dtype), kr + self.register_position.to(kr.dtype)
        if self.num_registers == 1 and self.normalize:
            # One register attends (causally) to itself alone: its softmax weight is exactly 1.
            return vr, kr, vr
        out = rbf_attention(
            qr, kr, vr, gamma=self._gamma(), causal=True, normalize=self.normalize, backend=self.register_backend
        )
        return out, kr, vr

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
        rows: torch.Tensor | None = None,
        register_prefix: tuple | None = None,
    ):
        """Text ``[B, N, D]`` and register ``[1, R, D]`` rows -> ``(text out, register out or None, weights)``.

        With ``rows`` (the flat ``[B * N + R, D]`` buffer the two are views of; what ``DecoderLayer`` passes), one
        projection and one ``o_proj`` matmul serve text and registers together and the result is ``(out rows
        [B * N + R, D], None, weights)``.  With ``register_prefix`` (``register_forward``'s prefix, computed by the
        register stream) the registers are not computed here: ``rows`` / ``register_states`` hold no register rows.
        """
        if rows is not None:
            text_shape = tuple(hidden_states.shape[:2])
            projected = project_together(rows, (self.q_proj, self.k_proj, self.v_proj), keep_copy=True)
            (q, qr), (k, kr), (v, vr) = (self._row_heads(t, text_shape) for t in projected)
            out, register_out, weights = self._attend(
                q, k, v, qr, kr, vr, position_embeddings, cache, attention_mask, key_log_weights, output_attentions,
                register_prefix,
            )
            return self.o_proj(self._heads_to_rows(out, register_out)), None, weights
        q, k, v = self._project(hidden_states)
        register_out = None
        if self.num_registers > 0 and register_prefix is None:
            register_out, register_prefix = self.register_forward(register_states)
        out, _, weights = self._attend(
            q, k, v, None, None, None, position_embeddings, cache, attention_mask, key_log_weights, output_attentions,
            register_prefix,
        )
        return self.o_proj(self._merge_heads(out)), register_out, weights

    def _attend(
        self,
        q,
        k,
        v,
        qr,
        kr,
        vr,
        position_embeddings,
        cache,
        attention_mask,
        key_log_weights,
        output_attentions,
        register_prefix=None,
    ):
        """Positions, cache, the register rows' attention (unless ``register_prefix`` brings their keys and values)
        and the text call: ``(out [B, H, N, Dv], register out [1, H, R, Dv] or None, weights or None)``."""
        cos, sin = position_embeddings
        if self.position_embedding_type == "susie":
            pos = susie_embedding(cos, sin, self.susie_weight, q.dtype)
            q, k = q + pos, k + pos
        elif self.position_embedding_type == "rope":
            q, k = apply_rotary_pair(q, k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        am, klw = self._key_arguments(k.shape[2], attention_mask, key_log_weights, cache)
        gamma = self._gamma()

        register_out = None
        prefix = {}
        if self.num_registers > 0:
            if register_prefix is None:
                register_out, kr, vr = self._register_attention(qr, kr, vr)
            else:
                kr, vr = register_prefix
            # the registers reach the kernels as separate prefix tensors (no copy of k / v per layer)
            prefix = {"prefix_keys": kr, "prefix_values": vr}

        out = rbf_attention(
            q,
            k,
            v,
            gamma=gamma,
            causal=True,
            window=self.window,
            normalize=self.normalize,
            key_log_weights=klw,
            attention_mask=am,
            num_prefix_keys=self.num_registers,
            **prefix,
            **self._text_call_options(self.backend, output_attentions),
        )
        self._note_backend("rbf_attention")
        weights = None
        if output_attentions:
            out, weights = out
            weights = self._weights_over_all_text_keys(weights, self.num_registers, cache)
        return out, register_out, weights


class RbfPreTrainedModel(DecoderPreTrainedModel):
    """Base class of the RBF family: its config class and its layer kinds ("rbf", "dot")."""

    config_class = RbfConfig
    attention_classes = {"rbf": RbfAttention, "dot": DotAttention}
    # PEFT LoRA ``target_modules`` covering every projection of the family (attention of both kinds, SwiGLU MLP).
    lora_target_modules = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class RbfModel(RbfPreTrainedModel, DecoderModel):
    """The RBF decoder without the LM head (``AutoModel``)."""


class RbfForCausalLM(RbfPreTrainedModel, DecoderForCausalLM, GenerationMixin):
    """The RBF decoder with its LM head (``AutoModelForCausalLM``)."""

    base_model_class = RbfModel


# Remote code: save_pretrained writes these classes into config.json's auto_map and copies this file and its
# relative imports next to the weights.
RbfConfig.register_for_auto_class()
RbfModel.register_for_auto_class("AutoModel")
RbfForCausalLM.register_for_auto_class("AutoModelForCausalLM")


__all__ = ["RbfAttention", "RbfForCausalLM", "RbfModel", "RbfPreTrainedModel"]
