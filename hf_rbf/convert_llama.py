"""Convert a trained Llama-architecture causal LM (transformers' Llama, Mistral, Qwen2: RMSNorm, RoPE, SwiGLU, GQA)
into hf_rbf's own classes so that the converted model starts with exactly the original's logits.

Two targets:

* ``"hybrid_sort"``: :class:`~hf_rbf.HybridSortForCausalLM` with every layer and head ``"hybrid"``, score
  ``q.k / sqrt(d) - (qs - ks)^2 / tau``.  W_Q, W_K, W_V, W_O, the SwiGLU, the norms and the embeddings are copied;
  the scalar projections are new.  The value groups are the source's key/value heads (``num_value_groups =
  num_key_value_heads``: head ``h`` reads group ``h // (H / G)``, as Llama's ``repeat_kv``), W_K is repeated per query
  head (our vector keys have one head per query head).
* ``"dot"``: hf_rbf's plain backbone (``GkaConfig(attention_layers=["dot"])``, as the recipes' ``"dot"`` family), with
  W_K and W_V repeated per query head.

Why the hybrid can start exactly and still learn its scalar term
-----------------------------------------------------------------
With ``qs_proj = ks_proj = 0`` the scalar term is 0 and the logits are the original's, but that start is a stationary
point: ``d/d qs_i`` and ``d/d ks_j`` of ``-(qs_i - ks_j)^2 / tau`` are ``-/+ 2 (qs_i - ks_j) / tau = 0``, so both
projections get exactly zero gradient and stay zero for ever.  The converter instead starts ``qs_proj`` at small random
weights (``scalar_query_std``, default the config's ``initializer_range``) and ``ks_proj`` at zero.  Then the scalar
term is ``-qs_i^2 / tau``: a constant for each query, which the softmax removes, so the logits are still exactly the
original's (up to rounding); but ``d/d ks_j = 2 qs_i / tau`` is not zero, so the keys learn at once, and the queries as
soon as the keys have moved (``d/d qs_i = -2 sum_j g_ij (qs_i - ks_j) / tau``, zero only while every ``ks_j`` is 0,
because the softmax's score gradients ``g_ij`` sum to 0 over ``j``).  The scalar sink and register tokens are off (they
would be keys the original model never had) and so is every "scalar"-only head or layer.

What the backbones share, and what is refused
---------------------------------------------
Both use pre-norm RMSNorm in float32 with the same ``eps``, RoPE in the rotate-half layout with ``theta^(-2f/d)``
frequencies and logit scale ``1/sqrt(head_dim)``, SwiGLU with SiLU, tied or untied LM heads, sliding windows of the same
meaning (``t - W < s <= t``).  Biases: Qwen2 has biases on W_Q, W_K, W_V only; ours has ``attention_bias`` on every
attention projection, so the missing ones (W_O, and the scalar projections) start at zero.  Refused, naming the field:
another ``model_type``, ``hidden_act`` other than ``"silu"``, a ``head_dim`` other than ``hidden_size //
num_attention_heads``, a RoPE type other than ``"default"`` (``rope_parameters``: scaled RoPE has no counterpart
here) or a partial rotary factor, and overrides that would break the exact start.  ``attention_dropout`` is not
carried over (our attention has no dropout); it acts in training only, so the logits of an eval forward are unaffected.

Usage::

    from transformers import AutoModelForCausalLM
    from hf_rbf.convert_llama import convert_llama

    llama = AutoModelForCausalLM.from_pretrained(path)
    hybrid = convert_llama(llama, target="hybrid_sort")          # same logits; learns its scalar term when trained
    hybrid.save_pretrained(out)                                  # an ordinary hybrid_sort checkpoint
"""

from __future__ import annotations

import inspect

import torch

from .configuration_decoder import DecoderConfig
from .configuration_gka import GkaConfig
from .configuration_hybrid_sort import HybridSortConfig

CONVERSION_TARGETS = ("hybrid_sort", "dot")
SOURCE_MODEL_TYPES = ("llama", "mistral", "qwen2")

# Fields the converter derives from the source; an override of one would no longer describe the copied weights.
DERIVED_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "head_dim",
    "max_position_embeddings",
    "rms_norm_eps",
    "tie_word_embeddings",
    "rope_theta",
    "attention_bias",
    "mlp_bias",
    "sliding_window",
    "window_pattern",
    "layer_types",
    "num_value_groups",
    "value_head_dim",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
)
# Overrides that must keep these values, or the converted model would not start from the original's logits.
EXACT_START_VALUES = {
    "num_register_tokens": 0,
    "scalar_sink": False,
    "qk_norm": False,
    "position_embedding_type": "rope",
}
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def _source_rope_theta(config) -> float:
    """RoPE base of the source, refusing the RoPE variants our backbone does not implement."""
    params = getattr(config, "rope_parameters", None)
    if params is None:
        # transformers < 5 layout (rope_theta / rope_scaling)
        scaling = getattr(config, "rope_scaling", None)
        if scaling:
            raise ValueError(
                f"`rope_scaling` must be None for a conversion (only plain RoPE is implemented); got {scaling!r}"
            )
        return float(getattr(config, "rope_theta", 10000.0))
    if "full_attention" in params and isinstance(params.get("full_attention"), dict):
        raise ValueError(f"`rope_parameters` must be one setting for every layer; got per-layer-type {params!r}")
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(
            f"`rope_parameters['rope_type']` must be 'default' for a conversion (our backbone implements plain RoPE, "
            f"not scaled variants); got {rope_type!r}"
        )
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    if factor not in (None, 1, 1.0):
        raise ValueError(
            f"`partial_rotary_factor` must be 1.0 for a conversion (RoPE on every dimension); got {factor!r}"
        )
    return float(params.get("rope_theta", 10000.0))


def _source_layer_types(config) -> list[str]:
    """Full or sliding attention per layer: ``layer_types`` (Qwen2), else ``sliding_window`` on every layer
    (Mistral), else full attention (Llama)."""
    n = config.num_hidden_layers
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        bad = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if bad:
            raise ValueError(
                f"`layer_types` must hold 'full_attention' / 'sliding_attention' for a conversion; got {bad}"
            )
        return list(layer_types)
    if getattr(config, "sliding_window", None) is not None:
        return ["sliding_attention"] * n
    return ["full_attention"] * n


def check_source_config(config) -> None:
    """Raise ValueError, naming the field, when ``config`` (a transformers config) cannot be converted exactly."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SOURCE_MODEL_TYPES:
        raise ValueError(
            f"`model_type` must be one of {', '.join(repr(t) for t in SOURCE_MODEL_TYPES)} (Llama-architecture models "
            f"with RMSNorm, RoPE and SwiGLU); got {model_type!r}"
        )
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"`hidden_act` must be 'silu' for a conversion (our SwiGLU uses SiLU); got {act!r}")
    heads, hidden = config.num_attention_heads, config.hidden_size
    if hidden % heads != 0:
        raise ValueError(f"`num_attention_heads` ({heads}) must divide `hidden_size` ({hidden}) for a conversion")
    head_dim = getattr(config, "head_dim", None)
    if head_dim is not None and head_dim != hidden // heads:
        raise ValueError(
            f"`head_dim` must be `hidden_size // num_attention_heads` = {hidden // heads} for a conversion (our backbone "
            f"derives it); got {head_dim}"
        )
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % kv_heads != 0:
        raise ValueError(
            f"`num_key_value_heads` ({kv_heads}) must divide `num_attention_heads` ({heads}) for a conversion"
        )
    _source_rope_theta(config)
    _source_layer_types(config)


def hf_rbf_config_from_llama(source_config, target: str = "hybrid_sort", **overrides) -> DecoderConfig:
    """The hf_rbf config of ``target`` that mirrors ``source_config``.

    ``overrides`` set the target's own fields (e.g. ``tau_mode``, ``tau_init_range``, ``decode_window``, the
    regularizer weights, ``attention_backend``).  Fields derived from the source (:data:`DERIVED_FIELDS`) and values
    that would break the exact start (:data:`EXACT_START_VALUES`, "scalar" heads or layers) are refused by name.
    """
    if target not in CONVERSION_TARGETS:
        raise ValueError(f"`target` must be one of {', '.join(repr(t) for t in CONVERSION_TARGETS)}; got {target!r}")
    check_source_config(source_config)
    config_class = HybridSortConfig if target == "hybrid_sort" else GkaConfig
    unknown = sorted(set(overrides) - _init_fields(config_class))
    if unknown:
        # PreTrainedConfig would keep them as plain attributes that nothing reads: a typo would pass silently
        raise ValueError(f"{unknown} are not fields of {config_class.__name__} (the config of target {target!r})")
    derived = sorted(set(overrides) & set(DERIVED_FIELDS))
    if derived:
        raise ValueError(f"{derived} come from the source model's config and cannot be overridden in a conversion")
    for field, value in overrides.items():
        if field in EXACT_START_VALUES and value != EXACT_START_VALUES[field]:
            raise ValueError(
                f"`{field}` must be {EXACT_START_VALUES[field]!r} in a conversion (anything else changes the converted "
                f"model's logits: the original has no such component); got {value!r}"
            )
    kinds = ("hybrid", "dot") if target == "hybrid_sort" else ("dot",)
    for field in ("attention_layers", "head_kinds"):
        if field in overrides:
            bad = sorted(set(overrides[field]) - set(kinds))
            if bad or target == "dot" and field == "head_kinds":
                raise ValueError(
                    f"`{field}` may only hold {list(kinds)} in a conversion to {target!r} (a head without the dot "
                    f"product would not reproduce the original); got {overrides[field]!r}"
                )
    layer_types = _source_layer_types(source_config)
    sliding = "sliding_attention" in layer_types
    fields = dict(
        vocab_size=source_config.vocab_size,
        hidden_size=source_config.hidden_size,
        intermediate_size=source_config.intermediate_size,
        num_hidden_layers=source_config.num_hidden_layers,
        num_attention_heads=source_config.num_attention_heads,
        max_position_embeddings=source_config.max_position_embeddings,
        rms_norm_eps=float(source_config.rms_norm_eps),
        initializer_range=float(getattr(source_config, "initializer_range", 0.02)),
        tie_word_embeddings=bool(getattr(source_config, "tie_word_embeddings", False)),
        rope_theta=_source_rope_theta(source_config),
        # Qwen2 has biases on W_Q, W_K, W_V without the field (see ``_attention_bias``)
        attention_bias=_attention_bias(source_config),
        mlp_bias=bool(getattr(source_config, "mlp_bias", False)),
        layer_types=layer_types,
        sliding_window=source_config.sliding_window if sliding else None,
        pad_token_id=getattr(source_config, "pad_token_id", None),
        bos_token_id=getattr(source_config, "bos_token_id", None),
        eos_token_id=getattr(source_config, "eos_token_id", None),
        num_register_tokens=0,
        qk_norm=False,
    )
    if target == "dot":
        fields["attention_layers"] = ["dot"]
        fields.update(overrides)
        return GkaConfig(**fields)
    fields.update(
        attention_layers=["hybrid"],
        head_kinds=["hybrid"],
        num_value_groups=getattr(source_config, "num_key_value_heads", None) or source_config.num_attention_heads,
        scalar_sink=False,
        position_embedding_type="rope",
    )
    fields.update(overrides)
    return HybridSortConfig(**fields)


def _init_fields(config_class) -> set[str]:
    """The named ``__init__`` arguments of ``config_class`` and its hf_rbf bases."""
    fields = set()
    for cls in config_class.__mro__:
        if issubclass(cls, DecoderConfig) and "__init__" in vars(cls):
            fields |= set(inspect.signature(cls.__init__).parameters) - {"self", "kwargs"}
    return fields


def _attention_bias(source_config) -> bool:
    return bool(getattr(source_config, "attention_bias", False)) or source_config.model_type == "qwen2"


def _repeat_heads(t: torch.Tensor, kv_heads: int, repeats: int) -> torch.Tensor:
    """``[kv_heads * d, ...]`` -> ``[kv_heads * repeats * d, ...]``: key/value head ``j`` serves query heads ``j *
    repeats ... (j + 1) * repeats - 1`` (transformers' ``repeat_kv``)."""
    if repeats == 1:
        return t
    return t.reshape(kv_heads, -1, *t.shape[1:]).repeat_interleave(repeats, dim=0).reshape(-1, *t.shape[1:])


def hf_rbf_state_dict_from_llama(
    state_dict: dict,
    source_config,
    model,
    *,
    scalar_query_std: float | None = None,
    seed: int = 0,
) -> dict:
    """The state dict of ``model`` (an hf_rbf causal LM built from :func:`hf_rbf_config_from_llama`) filled from the
    source's ``state_dict``.  Every source tensor must be used (an unknown one raises, naming it).

    ``scalar_query_std``: std of the normal init of ``qs_proj`` (default ``initializer_range``; ``ks_proj`` starts at
    0; see the module docstring for why not both at 0).  ``seed`` makes that init reproducible."""
    config = model.config
    heads = source_config.num_attention_heads
    kv_heads = getattr(source_config, "num_key_value_heads", None) or heads
    repeats = heads // kv_heads
    is_hybrid = isinstance(config, HybridSortConfig)
    out = {name: t.detach().clone() for name, t in model.state_dict().items()}
    used = set()

    def take(name: str) -> torch.Tensor:
        used.add(name)
        return state_dict[name]

    def put(name: str, value: torch.Tensor) -> None:
        if name not in out:
            raise ValueError(f"the converted model has no parameter {name!r} for the source's tensor")
        if tuple(out[name].shape) != tuple(value.shape):
            raise ValueError(
                f"{name}: the source's tensor has shape {tuple(value.shape)}, the converted model needs "
                f"{tuple(out[name].shape)}"
            )
        out[name] = value.detach().to(out[name].dtype).clone()

    embed = take("model.embed_tokens.weight")
    put("model.embed_tokens.weight", embed)
    put("model.norm.weight", take("model.norm.weight"))
    if config.tie_word_embeddings:
        used.add("lm_head.weight")  # the same tensor as the embedding (listed by some state dicts)
        if "lm_head.weight" in out:  # listed by ours too: loading must not put the fresh init back into the pair
            put("lm_head.weight", embed)
    else:
        put("lm_head.weight", take("lm_head.weight"))
    generator = torch.Generator().manual_seed(seed)
    std = config.initializer_range if scalar_query_std is None else float(scalar_query_std)
    if std <= 0 and is_hybrid:
        raise ValueError(
            f"`scalar_query_std` must be positive: with zero scalar queries and keys the scalar projections get zero "
            f"gradient for ever; got {scalar_query_std!r}"
        )
    for i in range(config.num_hidden_layers):
        src, dst = f"model.layers.{i}.", f"model.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            put(dst + f"{norm}.weight", take(src + f"{norm}.weight"))
        for proj in ("gate_proj", "up_proj", "down_proj"):
            for kind in ("weight", "bias"):
                if src + f"mlp.{proj}.{kind}" in state_dict:
                    put(dst + f"mlp.{proj}.{kind}", take(src + f"mlp.{proj}.{kind}"))
        for proj in ATTENTION_PROJECTIONS:
            for kind in ("weight", "bias"):
                name = src + f"self_attn.{proj}.{kind}"
                target = dst + f"self_attn.{proj}.{kind}"
                if name not in state_dict:
                    if target in out:  # a bias the source does not have (Qwen2's W_O): zero is the same map
                        out[target].zero_()
                    continue
                value = take(name)
                # keys always, values only where our values have one head per query head (the "dot" kind)
                if proj == "k_proj" or proj == "v_proj" and not is_hybrid:
                    value = _repeat_heads(value, kv_heads, repeats)
                put(target, value)
        if is_hybrid:
            qs, ks = dst + "self_attn.qs_proj.weight", dst + "self_attn.ks_proj.weight"
            out[qs] = torch.randn(out[qs].shape, generator=generator, dtype=torch.float32).mul_(std).to(out[qs].dtype)
            out[ks].zero_()
            for name in (dst + "self_attn.qs_proj.bias", dst + "self_attn.ks_proj.bias"):
                if name in out:
                    out[name].zero_()
    unused = sorted(set(state_dict) - used - {n for n in state_dict if n.endswith("rotary_emb.inv_freq")})
    if unused:
        raise ValueError(
            f"the source has tensors the conversion does not map (not a plain Llama-architecture model?): {unused[:8]}"
        )
    return out


def convert_llama(
    source,
    target: str = "hybrid_sort",
    *,
    scalar_query_std: float | None = None,
    seed: int = 0,
    **overrides,
):
    """A trained Llama-architecture causal LM (a transformers model, or a path / hub name loaded with
    ``AutoModelForCausalLM``) as an hf_rbf model of ``target`` (``"hybrid_sort"`` or ``"dot"``) with the same logits.

    Returns the converted model in the source's dtype and device, in eval mode.  ``overrides``: target config fields
    (see :func:`hf_rbf_config_from_llama`); ``scalar_query_std`` / ``seed``: the hybrid's scalar start (see
    :func:`hf_rbf_state_dict_from_llama`)."""
    from transformers import AutoModelForCausalLM

    if isinstance(source, str):
        source = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    source_config = source.config
    config = hf_rbf_config_from_llama(source_config, target, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = hf_rbf_state_dict_from_llama(
        source.state_dict(), source_config, model, scalar_query_std=scalar_query_std, seed=seed
    )
    model.load_state_dict(state, strict=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    first = next(source.parameters())
    return model.to(device=first.device, dtype=first.dtype).eval()


__all__ = [
    "CONVERSION_TARGETS",
    "check_source_config",
    "convert_llama",
    "hf_rbf_config_from_llama",
    "hf_rbf_state_dict_from_llama",
]
