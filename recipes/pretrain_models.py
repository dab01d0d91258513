"""Model families for the recipes: hf_rbf's registered families, the "dot" baseline and transformers' Llama.

* Any ``model_type`` registered with ``AutoConfig`` by hf_rbf (a subclass of
  :class:`~hf_rbf.configuration_decoder.DecoderConfig`: ``rbf``, ``gka``, and whatever families are added later, such
  as ``scalar_sort`` / ``hybrid_sort``) is built with ``AutoConfig.for_model(family, **config)``: nothing here lists
  them, so a new family needs no edit.
* ``"dot"``: hf_rbf's own backbone with softmax dot-product attention in every layer, i.e.
  ``GkaConfig(attention_layers=["dot"], ...)``.  The GKA config is used because its defaults (RoPE, no registers) are
  those of a plain pre-norm decoder and an all-"dot" model creates no GKA parameter; the checkpoint's ``model_type``
  is therefore ``"gka"`` with ``attention_layers`` all ``"dot"``.  It has exactly the parameters of the ``"llama"``
  model of the same size (registers aside, if asked for).
* ``"llama"``: ``transformers.LlamaForCausalLM`` with SDPA attention, built from the same shared sizes (width, layers,
  heads with as many KV heads, SwiGLU width, vocabulary, tying, RMSNorm eps, RoPE theta).

Parameter matching (``model.match_parameters``): a family with fewer parameters by construction (GKA has no W_Q, W_K,
W_V) can be widened to the budget of a reference model: the SwiGLU width is solved so that the total parameter count
is as close as possible to the reference's (each unit of ``intermediate_size`` adds ``3 * hidden_size`` parameters per
layer without MLP biases), rounded to a multiple of ``match_parameters.multiple_of`` (default 8: an unaligned width
makes every MLP GEMM several times slower on tensor cores; 1 matches exactly).
"""

from __future__ import annotations

import torch

# match_parameters rounds the SwiGLU width to a multiple of this: bf16 / fp16 GEMMs run on tensor cores only with
# 16-byte aligned rows, and cuBLAS falls back to "align1" kernels for any other width.  Measured on an H100 (1B
# scaling run, benchmarks/results/h100x4-2026-11-26c): widths 10,059 and 8,181 made every MLP GEMM of scalar_sort /
# hybrid_sort a cutlass sm75 align1 kernel, 340 ms of a 490 ms step against 60 ms for Llama's aligned 8,192.
DEFAULT_MULTIPLE_OF = 8

# The keys that every model of the recipes shares (and that the "llama" family maps onto LlamaConfig).
SHARED_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
    "rms_norm_eps",
    "initializer_range",
    "tie_word_embeddings",
    "rope_theta",
    "attention_bias",
    "mlp_bias",
    "use_cache",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)
BUILTIN_FAMILIES = ("dot", "llama")


def hf_rbf_families() -> dict[str, type]:
    """``{model_type: config class}`` of every hf_rbf decoder family registered with ``AutoConfig``."""
    from transformers import AutoConfig

    import hf_rbf  # noqa: F401  (registers the families)
    from hf_rbf.configuration_decoder import DecoderConfig

    out = {}
    stack = list(DecoderConfig.__subclasses__())
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        model_type = getattr(cls, "model_type", "")
        if not model_type:
            continue
        try:
            registered = type(AutoConfig.for_model(model_type))
        except (ValueError, KeyError):
            continue
        if registered is cls:
            out[model_type] = cls
    return dict(sorted(out.items()))


def available_families() -> list[str]:
    return list(hf_rbf_families()) + list(BUILTIN_FAMILIES)


def build_config(family: str, config_kwargs: dict):
    """The transformers config of ``family`` with ``config_kwargs``."""
    from transformers import AutoConfig, LlamaConfig

    families = hf_rbf_families()
    kwargs = dict(config_kwargs)
    if family == "llama":
        unknown = sorted(set(kwargs) - set(SHARED_KEYS))
        if unknown:
            raise ValueError(
                f"model.config for family 'llama' has keys that LlamaForCausalLM does not have: {unknown}; allowed: "
                f"{list(SHARED_KEYS)}"
            )
        theta = float(kwargs.pop("rope_theta", 10000.0))
        kwargs.setdefault("tie_word_embeddings", True)
        kwargs.setdefault("rms_norm_eps", 1e-6)
        return LlamaConfig(
            num_key_value_heads=kwargs["num_attention_heads"],
            rope_parameters={"rope_type": "default", "rope_theta": theta},
            **kwargs,
        )
    if family == "dot":
        if "attention_layers" in kwargs and set(kwargs["attention_layers"]) != {"dot"}:
            raise ValueError("family 'dot' means attention_layers=['dot']; use family 'gka' or 'rbf' to mix kinds")
        kwargs["attention_layers"] = ["dot"]
        return families["gka"](**kwargs)
    if family not in families:
        raise ValueError(
            f"model.family {family!r} is not a registered hf_rbf family; available: {', '.join(available_families())}"
        )
    return AutoConfig.for_model(family, **kwargs)


def build_model(config, device=None):
    """``AutoModelForCausalLM.from_config`` (Llama with ``attn_implementation="sdpa"``), initialised by transformers."""
    from transformers import AutoModelForCausalLM

    import hf_rbf  # noqa: F401

    kwargs = {"attn_implementation": "sdpa"} if config.model_type == "llama" else {}
    if device is not None:
        with torch.device(device):
            return AutoModelForCausalLM.from_config(config, **kwargs)
    return AutoModelForCausalLM.from_config(config, **kwargs)


def attention_backends(model) -> list[str]:
    """``"kind:backend"`` of every attention module's last call (``module.last_backend``; Llama: its
    ``attn_implementation``), one entry per layer."""
    out = []
    for module in model.modules():
        if hasattr(module, "last_backend") and hasattr(module, "kind"):
            out.append(f"{module.kind}:{module.last_backend}")
    if not out and getattr(model.config, "model_type", "") == "llama":
        out = [f"dot:{model.config._attn_implementation}"] * model.config.num_hidden_layers
    return out


def count_parameters(model) -> dict:
    """``total`` (each tied tensor once), ``embedding`` (token embedding, plus the LM head when untied) and
    ``non_embedding``."""
    total = sum(p.numel() for p in model.parameters())
    emb = model.get_input_embeddings().weight
    embedding = emb.numel()
    head = model.get_output_embeddings()
    if head is not None and head.weight is not emb:
        embedding += head.weight.numel()
    return {"total": int(total), "embedding": int(embedding), "non_embedding": int(total - embedding)}


def parameter_count(family: str, config_kwargs: dict) -> dict:
    """:func:`count_parameters` of a model built on the meta device (no memory, no init cost)."""
    return count_parameters(build_model(build_config(family, config_kwargs), device="meta"))


def match_intermediate_size(
    family: str, config_kwargs: dict, reference: dict, multiple_of: int = DEFAULT_MULTIPLE_OF
) -> dict:
    """The ``intermediate_size`` (a multiple of ``multiple_of``) that brings ``family`` closest to the parameter count
    of ``reference = {"family": ..., "config": {...}}`` (its config defaults to the shared keys of ``config_kwargs``).

    Returns ``{"intermediate_size", "num_parameters", "reference_num_parameters", "reference_family"}``.
    """
    if int(multiple_of) != multiple_of or multiple_of < 1:
        raise ValueError(f"match_parameters.multiple_of must be a positive int; got {multiple_of!r}")
    ref_family = reference.get("family", "dot")
    ref_kwargs = {k: v for k, v in config_kwargs.items() if k in SHARED_KEYS}
    ref_kwargs.update(reference.get("config") or {})
    target = parameter_count(ref_family, ref_kwargs)["total"]
    base = dict(config_kwargs)
    i0 = int(base.get("intermediate_size", ref_kwargs.get("intermediate_size", 4 * base["hidden_size"])))
    p0 = parameter_count(family, dict(base, intermediate_size=i0))["total"]
    per_unit = parameter_count(family, dict(base, intermediate_size=i0 + 1))["total"] - p0
    if per_unit <= 0:
        raise ValueError(f"{family}: intermediate_size does not change the parameter count; cannot match")
    size = round((i0 + (target - p0) / per_unit) / multiple_of) * multiple_of
    if size < multiple_of:
        raise ValueError(f"{family}: matching {ref_family}'s {target} parameters needs intermediate_size {size} < 1")
    got = parameter_count(family, dict(base, intermediate_size=size))["total"]
    return {
        "intermediate_size": int(size),
        "num_parameters": int(got),
        "reference_num_parameters": int(target),
        "reference_family": ref_family,
    }


def resolve_model_config(model_cfg: dict, vocab_size: int, block_size: int, special_ids: dict) -> tuple[dict, dict]:
    """The final config kwargs of a recipe's ``model`` section: the tokenizer's vocabulary size and special ids, the
    block size as ``max_position_embeddings`` unless given, and the matched ``intermediate_size`` when
    ``match_parameters`` is set.  Returns ``(kwargs, matching info or {})``."""
    kwargs = dict(model_cfg["config"])
    kwargs.setdefault("vocab_size", vocab_size)
    kwargs.setdefault("max_position_embeddings", block_size)
    for key, value in special_ids.items():
        kwargs.setdefault(key, value)
    match = {}
    if model_cfg.get("match_parameters"):
        spec = dict(model_cfg["match_parameters"])
        multiple_of = spec.pop("multiple_of", DEFAULT_MULTIPLE_OF)
        match = match_intermediate_size(model_cfg["family"], kwargs, spec, multiple_of)
        kwargs["intermediate_size"] = match["intermediate_size"]
    return kwargs, match


__all__ = [
    "BUILTIN_FAMILIES",
    "SHARED_KEYS",
    "attention_backends",
    "available_families",
    "build_config",
    "build_model",
    "count_parameters",
    "hf_rbf_families",
    "match_intermediate_size",
    "parameter_count",
    "resolve_model_config",
]
