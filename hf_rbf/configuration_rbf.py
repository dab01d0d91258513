"""Configuration of the RBF-attention decoder (``model_type="rbf"``)."""

from __future__ import annotations

from .configuration_decoder import DecoderConfig, check_bool, check_choice, check_float


RBF_POSITION_TYPES = ("susie", "rope", "none")


class RbfConfig(DecoderConfig):
    r"""Configuration of :class:`~hf_rbf.RbfModel` / :class:`~hf_rbf.RbfForCausalLM`: a pre-norm decoder whose
    attention is scaled RBF attention, ``softmax_j(-gamma * ||q_i - k_j||^2 + log w_j)`` with learned W_Q, W_K, W_V,
    W_O (the RBF blog; Kim et al. 2021's L2 attention).

    Takes every field of :class:`~hf_rbf.configuration_decoder.DecoderConfig` (``vocab_size``, ``hidden_size``,
    ``num_hidden_layers``, ``num_attention_heads``, ``intermediate_size``, ``max_position_embeddings``,
    ``tie_word_embeddings``, ``attention_layers``, ``window_pattern``, ``sliding_window``, ``attention_backend``, ...)
    plus:

    Args:
        position_embedding_type (`str`, defaults to "susie"): how text positions enter q and k:
            ``"susie"``: the blog's SuSiE, unrotated sinusoids ``[sin(t w_f), cos(t w_f)]``
            (``w_f = rope_theta^(-2f/d)``)
            *added* to q and k, scaled by a learnable weight per head and frequency (``[H, head_dim // 2]``, shared
            by the sin and cos of a frequency, initialised to ``susie_init``); since the same term is added to q and
            k, the distance gains ``||P_t - P_s||^2``, a learnable locality bias.
            ``"rope"``: rotary embeddings (rotate-half convention, as Llama).  ``"none"``: no positions.
        susie_init (`float`, defaults to 0.5): initial SuSiE weight (the blog's value): the positional part of
            ``||q - k||^2`` then starts at ``0.25 * sum_f 2 (1 - cos((t - s) w_f))``.
        rbf_normalize (`bool`, defaults to True): softmax over the keys (True) or the blog's softmax-free
            ``sum_j exp(-gamma ||q_i - k_j||^2) v_j`` (False).
        rbf_gamma (`float`, *optional*): kernel scale; ``None`` means ``1 / sqrt(head_dim)``.
        rbf_learnable_gamma (`bool`, defaults to False): learn ``gamma`` per head, parameterised as ``log_gamma``
            (``[H]``, initialised to ``log(rbf_gamma)``) so it stays positive.
        num_register_tokens (`int`, defaults to 1): register tokens, the "origin sink" RBF attention needs (the blog).

    Layer kinds (``attention_layers``): ``"rbf"`` and ``"dot"`` (learned projections, RoPE, softmax dot product).

    PEFT LoRA target modules: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` (attention, both kinds) and
    ``gate_proj``, ``up_proj``, ``down_proj`` (SwiGLU MLP).
    """

    model_type = "rbf"
    family_kind = "rbf"
    allowed_layer_kinds = ("rbf", "dot")
    default_num_register_tokens = 1

    def __init__(
        self,
        position_embedding_type: str = "susie",
        susie_init: float = 0.5,
        rbf_normalize: bool = True,
        rbf_gamma: float | None = None,
        rbf_learnable_gamma: bool = False,
        **kwargs,
    ):
        name = type(self).__name__
        check_choice(name, "position_embedding_type", position_embedding_type, RBF_POSITION_TYPES)
        check_float(name, "susie_init", susie_init)
        check_bool(name, "rbf_normalize", rbf_normalize)
        if rbf_gamma is not None:
            check_float(name, "rbf_gamma", rbf_gamma, positive=True)
        check_bool(name, "rbf_learnable_gamma", rbf_learnable_gamma)
        self.position_embedding_type = position_embedding_type
        self.susie_init = float(susie_init)
        self.rbf_normalize = rbf_normalize
        self.rbf_gamma = None if rbf_gamma is None else float(rbf_gamma)
        self.rbf_learnable_gamma = rbf_learnable_gamma
        super().__init__(**kwargs)


__all__ = ["RbfConfig"]
