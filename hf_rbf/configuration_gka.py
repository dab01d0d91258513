"""Configuration of the Gaussian Kernel Attention decoder (``model_type="gka"``, arXiv:2605.02144)."""

from __future__ import annotations

import math

from .configuration_decoder import DecoderConfig, check_bool, check_choice, check_float, check_int


GKA_POSITION_TYPES = ("rope", "none")
# "nystrom" is bidirectional only (GkaVitConfig); the decoder refuses it with an explanation.
GKA_APPROXIMATIONS = ("exact", "random_features", "nystrom")


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
        gka_approximation (`str`, defaults to "exact"): how "gka" layers compute the kernel: ``"exact"`` (every pair,
            on the backend of ``attention_backend``) or ``"random_features"`` (the paper's speed-up direction:
            positive random features of the Gaussian kernel, linear time and memory in the sequence length, causal
            through chunked prefix sums; see :mod:`hf_rbf.attention_gka_approx`).  ``"nystrom"`` serves
            bidirectional attention only (its landmarks would see future tokens) and is refused here: see
            ``GkaVitConfig``.  The approximation is one plain-PyTorch implementation: ``attention_backend`` must be
            "auto" or "naive", every "gka" layer full ("L" in ``window_pattern``), and ``output_attentions`` is
            refused (no attention matrix is formed).  KV caches work (each step re-reads the cached features:
            ``O(past * m)`` per step).
        gka_approximation_size (`int`, defaults to 256): the number of random features ``m`` (the cost is
            ``O(N m head_dim)``; the error falls like ``1 / sqrt(m)`` for moderate ``||x|| / sigma``).
        gka_approximation_seed (`int`, defaults to 0): seed of the random features; layer ``i`` uses
            ``seed * 1000 + i``, drawn on the CPU, so a reloaded model has the same features.
        num_register_tokens (`int`, defaults to 0): optional register tokens.  Their features skip the per-head norm
            (so they can sit at the origin, equidistant from every normalised text feature) and get their own
            learnable, zero-initialised position embedding instead of RoPE.

    Layer kinds (``attention_layers``): ``"gka"``, ``"dot"`` (learned projections, RoPE, softmax dot product: the
    paper's "hybrid designs that interleave GKA with projected attention") and ``"vlt"`` (the paper's Table 5
    Value-Less Transformer ablation: W_Q, W_K, W_O and softmax dot product, no W_V; the values are the per-head
    hidden state).  ``attention_layers=["vlt"]`` is VLT, ``["dot"]`` the standard model, ``["gka"]`` GKA.

    PEFT LoRA target modules: ``o_proj`` (every kind), ``q_proj``, ``k_proj`` (dot and vlt layers), ``v_proj`` (dot
    layers only)
    and ``gate_proj``, ``up_proj``, ``down_proj`` (SwiGLU MLP).
    """

    model_type = "gka"
    family_kind = "gka"
    allowed_layer_kinds = ("gka", "dot", "vlt")
    default_num_register_tokens = 0

    def __init__(
        self,
        position_embedding_type: str = "rope",
        gka_feature_norm: bool = True,
        gka_log_sigma_init: float | None = None,
        gka_eps: float = 1e-6,
        gka_approximation: str = "exact",
        gka_approximation_size: int = 256,
        gka_approximation_seed: int = 0,
        **kwargs,
    ):
        name = type(self).__name__
        check_choice(name, "position_embedding_type", position_embedding_type, GKA_POSITION_TYPES)
        check_choice(name, "gka_approximation", gka_approximation, GKA_APPROXIMATIONS)
        if gka_approximation == "nystrom":
            raise ValueError(
                f"{name}: `gka_approximation='nystrom'` needs bidirectional attention (its landmarks are means over the "
                "whole sequence, so causal outputs would see future tokens); the decoder is causal: use "
                "'random_features' or 'exact' (GkaVitConfig offers 'nystrom')"
            )
        check_int(name, "gka_approximation_size", gka_approximation_size, minimum=1)
        check_int(name, "gka_approximation_seed", gka_approximation_seed, minimum=0)
        check_bool(name, "gka_feature_norm", gka_feature_norm)
        if gka_log_sigma_init is not None:
            check_float(name, "gka_log_sigma_init", gka_log_sigma_init)
        check_float(name, "gka_eps", gka_eps, minimum=0.0)
        self.position_embedding_type = position_embedding_type
        self.gka_feature_norm = gka_feature_norm
        self.gka_log_sigma_init = None if gka_log_sigma_init is None else float(gka_log_sigma_init)
        self.gka_eps = float(gka_eps)
        self.gka_approximation = gka_approximation
        self.gka_approximation_size = gka_approximation_size
        self.gka_approximation_seed = gka_approximation_seed
        super().__init__(**kwargs)
        if gka_approximation != "exact":
            if self.attention_backend not in ("auto", "naive"):
                raise ValueError(
                    f"{name}: `gka_approximation={gka_approximation!r}` has one plain-PyTorch implementation; "
                    f"`attention_backend` must be 'auto' or 'naive'; got {self.attention_backend!r}"
                )
            windowed = [
                i for i in range(self.num_hidden_layers) if self.layer_kind(i) == "gka" and self.layer_window(i)
            ]
            if windowed:
                raise ValueError(
                    f"{name}: `gka_approximation={gka_approximation!r}` cannot serve sliding windows, but the 'gka' "
                    f"layers {windowed} are 'S' in `window_pattern` {self.window_pattern!r}; make them 'L' or use "
                    "'exact'"
                )

    @property
    def resolved_log_sigma_init(self) -> float:
        """``gka_log_sigma_init``, or its default ``0.25 * log(head_dim)`` when it is ``None``."""
        if self.gka_log_sigma_init is not None:
            return self.gka_log_sigma_init
        return 0.25 * math.log(self.hidden_size // self.num_attention_heads)


__all__ = ["GkaConfig"]
