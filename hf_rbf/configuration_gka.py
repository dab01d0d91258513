"""Configuration of the Gaussian Kernel Attention decoder (``model_type="gka"``, arXiv:2605.02144)."""

from __future__ import annotations

import math

from .configuration_decoder import DecoderConfig, check_bool, check_choice, check_float


GKA_POSITION_TYPES = ("rope", "none")


class GkaConfig(DecoderConfig):
    r"""Configuration of :class:`~hf_rbf.GkaModel` / :class:`~hf_rbf.GkaForCausalLM`: a pre-norm decoder whose
    attention is projection-free Gaussian kernel attention (the GKA paper's nanochat language-model setup).

    Each GKA layer splits the pre-norm hidden state into heads, ``x_i`` (optionally RoPE-rotated and RMS-normalised
    per head, without a learnable weight), and mixes them with
    ``y_i = sum_j K_ij x_j / (sum_j K_ij + eps)``, ``K_ij = exp(-||x_i - x_j||^2 / (2 sigma_h^2)) w_j`` over the causal
    (and windowed) keys, followed by W_O.  There is no W_Q, W_K or W_V: the attention parameters of a GKA layer are
    W_O (``hidden_size^2``, ``+ hidden_size`` with ``attention_bias``) and one ``log_sigma`` per head, plus
    ``num_register_tokens * head_dim`` for the registers' position embedding when there are registers.

    Takes every field of :class:`~hf_rbf.configuration_decoder.DecoderConfig` plus:

    Args:
        position_embedding_type (`str`, defaults to "rope"): ``"rope"`` (rotary, as nanochat) or ``"none"``.
        gka_feature_norm (`bool`, defaults to True): parameter-free per-head RMS norm of the features before the
            kernel (nanochat's QK norm); text features then have squared norm ``head_dim``.
        gka_log_sigma_init (`float`, *optional*): initial ``log sigma_h`` of every head.  ``None`` means
            ``0.25 * log(head_dim)``, i.e. ``sigma^2 = sqrt(head_dim)``: since
            ``-||x_i - x_j||^2 / (2 sigma^2) = x_i.x_j / sigma^2 - (row constant) - ||x_j||^2 / (2 sigma^2)`` and RMS-
            normed features all have the same norm, the kernel then starts as softmax attention with QK norm and the
            usual ``1 / sqrt(head_dim)`` temperature: logits span ``[-sqrt(d), sqrt(d)]`` (about +-8 for d = 64),
            wide enough to tell tokens apart, not so sharp that each token only sees itself.
        gka_eps (`float`, defaults to 1e-6): the ``eps`` of the row normalisation (paper eq. 4).
        attention_bias (`bool`, defaults to False): bias on W_O (the paper's ViT counts it: ``d^2 + d + H``).
        num_register_tokens (`int`, defaults to 0): optional register tokens.  Their features skip the per-head norm
            (so they can sit at the origin, equidistant from every normalised text feature) and get their own
            learnable, zero-initialised position embedding instead of RoPE.

    Layer kinds (``attention_layers``): ``"gka"`` and ``"dot"`` (learned projections, RoPE, softmax dot product): the
    paper's "hybrid designs that interleave GKA with projected attention".

    PEFT LoRA target modules: ``o_proj`` (GKA and dot layers), ``q_proj``, ``k_proj``, ``v_proj`` (dot layers only)
    and ``gate_proj``, ``up_proj``, ``down_proj`` (SwiGLU MLP).
    """

    model_type = "gka"
    family_kind = "gka"
    allowed_layer_kinds = ("gka", "dot")
    default_num_register_tokens = 0

    def __init__(
        self,
        position_embedding_type: str = "rope",
        gka_feature_norm: bool = True,
        gka_log_sigma_init: float | None = None,
        gka_eps: float = 1e-6,
        **kwargs,
    ):
        name = type(self).__name__
        check_choice(name, "position_embedding_type", position_embedding_type, GKA_POSITION_TYPES)
        check_bool(name, "gka_feature_norm", gka_feature_norm)
        if gka_log_sigma_init is not None:
            check_float(name, "gka_log_sigma_init", gka_log_sigma_init)
        check_float(name, "gka_eps", gka_eps, minimum=0.0)
        self.position_embedding_type = position_embedding_type
        self.gka_feature_norm = gka_feature_norm
        self.gka_log_sigma_init = None if gka_log_sigma_init is None else float(gka_log_sigma_init)
        self.gka_eps = float(gka_eps)
        super().__init__(**kwargs)

    @property
    def resolved_log_sigma_init(self) -> float:
        """``gka_log_sigma_init``, or its default ``0.25 * log(head_dim)`` when it is ``None``."""
        if self.gka_log_sigma_init is not None:
            return self.gka_log_sigma_init
        return 0.25 * math.log(self.hidden_size // self.num_attention_heads)


__all__ = ["GkaConfig"]
